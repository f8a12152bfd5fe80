"""apc's host tier never changes the output: KV stored to the host and loaded back (the
`TierCopy` moves the executor applies) gives the tiny model's logits and greedy tokens of
each request run alone (docs/design.md §5; tolerance as tests/test_output_equivalence.py)."""

from __future__ import annotations

import pytest

from cachelib import create_cache
from tests.test_output_equivalence import alone, assert_same_through_two_rounds, model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("eviction, block_size", [("lru", 0), ("arc", 0), ("lru", 8)])
def test_kv_loaded_back_from_the_host_tier_gives_the_same_output(model, alone, eviction, block_size):  # noqa: F811
    """A GPU too small for the workload: prompts are stored on the host as they are
    computed, evicted from the GPU by the next ones, and loaded back; every output equal."""
    cache = create_cache(
        "apc", num_pages=24, page_size=4, host_capacity_tokens=256, host_eviction=eviction, host_block_size=block_size
    )
    assert_same_through_two_rounds(model, cache, alone)  # the second round finds its prefixes on the host
    traffic = cache.tier_traffic()
    assert traffic["loaded"] > 0 and traffic["backed_up"] > 0, traffic
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0
