"""Parallel sampling and beam search under the replay protocol, on every backend."""

from __future__ import annotations

import dataclasses

import pytest

from cachelib import available_backends, create_cache
from experiments.bench.sharing_memory import run as sharing_run
from experiments.engine import replay
from experiments.workloads import sampling


@pytest.mark.parametrize("mode, width", [("parallel", 4), ("beam", 4)])
@pytest.mark.parametrize("backend", available_backends())
def test_forks_match_the_sharing_benchmark_and_free_everything(backend, mode, width):
    reqs = sampling.generate("alpaca", mode, width, 12, seed=3)
    specs = [r.spec for r in reqs]  # each spec carries its plan (sample_lens or beam_parents)
    cache = create_cache(backend, num_pages=4000, page_size=16)
    result = replay(cache, specs)
    assert result["unschedulable"] == 0 and result["truncated"] == 0
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0
    # the same forks and releases as the sharing benchmark's own driver, one request at a time
    assert cache.stats().copied_pages == sharing_run(backend, reqs, page_size=16, concurrency=1)["copied_pages"]


def test_beam_search_under_pressure_truncates_cleanly():
    reqs = sampling.generate("sharegpt", "beam", 6, 6, seed=1)
    cache = create_cache("apc", num_pages=40, page_size=16)
    result = replay(cache, [r.spec for r in reqs])
    assert result["truncated"] + result["unschedulable"] > 0
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0


def test_beam_requests_need_a_schedule():
    reqs = sampling.generate("alpaca", "beam", 2, 2, seed=0)
    specs = [dataclasses.replace(r.spec, beam_parents=None) for r in reqs]
    with pytest.raises(ValueError, match="no beam schedule"):
        replay(create_cache("none", num_pages=100, page_size=16), specs)
