"""apc-lmcache never changes the output: KV stored in LMCache's chunks (host, disk) and loaded
back (the `TierCopy` moves the executor applies) gives the tiny model's logits and greedy
tokens of each request run alone (docs/design.md §5; tolerance as tests/test_output_equivalence.py)."""

from __future__ import annotations

import pytest

from cachelib import create_cache
from tests.test_output_equivalence import alone, assert_same_through_two_rounds, model  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(
    "options",
    [
        {"host_capacity_tokens": 256},
        {"host_capacity_tokens": 32, "disk_capacity_tokens": 256, "save_unfull_chunk": True},
    ],
    ids=["host", "host+disk,unfull"],
)
def test_kv_loaded_back_from_lmcache_gives_the_same_output(model, alone, options):  # noqa: F811
    """A GPU too small for the workload: prompts are stored in chunks as they are computed,
    evicted from the GPU by the next ones, and loaded back (from disk too, when the host is
    small); every output equal."""
    cache = create_cache("apc-lmcache", num_pages=24, page_size=4, lmcache_chunk_size=8, **options)
    assert_same_through_two_rounds(model, cache, alone)  # the second round finds its prefixes in LMCache
    traffic = cache.tier_traffic()
    assert traffic["loaded"] > 0 and traffic["backed_up"] > 0, traffic
    if "disk_capacity_tokens" in options:
        assert traffic["storage_loaded_tokens"] > 0, traffic
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0
