"""The tiered caches where they once crashed or leaked: each case here failed before its fix.

- write_back with a host smaller than the GPU: an evicted leaf whose backup evicted its own
  host-only children was queued again, then dropped, and popped a second time with no pages
  (`TypeError` in the documented replay command; pages pinned with no live sequence);
- serving (timed transfers), write_back with storage: a drop under a host copy that a
  storage write still reads (SGLang declines it; the walk goes on, and past SGLang the
  model waits for the write rather than stop), and a request released before its
  load-back completed, its nodes then evicted with the copy in flight;
- misuse accepted: a released sequence's storage hits read 0, a negative transfer priced.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import InvalidRequestError, Sequence, UnknownSequenceError, create_cache
from experiments.cli.main import main

TRACE = "experiments/data/mooncake_conversation_2000.jsonl"


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_documented_write_back_replay_with_a_small_host_runs(page_size, tmp_path, capsys):
    """Issue 38's command, at both page sizes it crashed at."""
    out = tmp_path / "r.json"
    argv = ["replay", "--backend", "radix-hicache", "--trace", TRACE, "--limit", "30"]
    argv += ["--page-size", str(page_size), "--capacity-tokens", "100000", "--no-progress", "--output", str(out)]
    argv += ["--backend-opt", "write_policy=write_back", "--backend-opt", "host_capacity_tokens=50000"]
    assert main(argv) == 0
    assert out.exists()


def _seq(rid: str, tokens) -> Sequence:
    return Sequence(rid, np.asarray(tokens, dtype=np.int32))


def test_a_leaf_evicted_under_write_back_is_evicted_once():
    """GPU 10 pages, host 4, page size 1: a 6-token leaf (N1) with a host-only child (N2)
    cannot be backed up; its backup's host eviction frees N2, which makes N1 a device leaf
    again. N1 is dropped, and the walk must go on to the next leaf, not pop N1 twice."""
    cache = create_cache(
        "radix-hicache",
        num_pages=10,
        page_size=1,
        write_policy="write_back",
        host_capacity_tokens=4,
        track_contents=True,
    )
    for rid, tokens in [("a", range(1, 7)), ("b", range(1, 9)), ("c", [50, 51])]:
        s = _seq(rid, list(tokens))
        cache.prefill(s)
        cache.release(s)  # N1 = 1..6, N2 = 7, 8 below it, N3 = 50, 51: every page cached
    assert cache.evict(2) == 2  # N2, the least recent leaf, backed up and demoted
    cache.check_invariants()
    d = _seq("d", list(range(60, 70)))  # every page: N1 (dropped) and N3 must go
    m, ops, _ = cache.prefill(d)
    assert ops is not None and len(d.page_table) == 10
    cache.check_invariants()
    cache.release(d)
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0 and cache.tier_traffic()["dropped"] == 0


def test_a_release_before_its_load_back_completes_keeps_the_nodes_until_the_ticket():
    cache = create_cache(
        "radix-hicache",
        num_pages=16,
        page_size=1,
        write_policy="write_back",
        host_capacity_tokens=32,
        track_contents=True,
    )
    cache.time_transfers()
    a = _seq("a", list(range(12)))
    cache.prefill(a)
    cache.release(a)
    cache.finish_transfers([t.ticket for t in cache.take_transfers() if t.ticket is not None])
    cache.evict(16)  # everything demoted: host only
    b = _seq("b", list(range(12)) + [99])
    m, ops, computed = cache.prefill(b)
    taken = cache.take_transfers()
    loads = [t for t in taken if t.dst == "gpu"]
    assert computed > m.num_tokens and len(loads) == 1
    cache.release(b)  # before the load-back's ticket completes
    cache.evict(16)
    cache.check_invariants()  # the loaded nodes stay on the GPU: the copy still writes them
    assert cache.stats().pages_pinned > 0
    rest = [t.ticket for t in taken + cache.take_transfers() if t.ticket is not None and t not in loads]
    cache.finish_transfers([loads[0].ticket, *rest])
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0
    assert cache.evict(16) > 0


def test_transfer_tickets_are_refused_unless_in_flight_once():
    cache = create_cache("radix-hicache", num_pages=16, page_size=1, host_capacity_tokens=32)
    cache.time_transfers()
    a = _seq("a", list(range(12)))
    cache.prefill(a)
    cache.release(a)
    tickets = [t.ticket for t in cache.take_transfers() if t.ticket is not None]
    assert tickets
    for bad in ([10**6], [tickets[0], tickets[0]], None, [1.5], ["1"], [True]):
        with pytest.raises(InvalidRequestError):
            cache.finish_transfers(bad)
    cache.check_invariants()
    cache.finish_transfers(tickets)
    with pytest.raises(InvalidRequestError, match="no transfer in flight"):
        cache.finish_transfers(tickets)


@pytest.mark.parametrize("backend", ["radix-hicache", "apc-lmcache", "apc", "radix"])
def test_storage_hits_of_a_sequence_not_live_are_refused(backend):
    options = {"host_capacity_tokens": 64} if backend == "apc" else {}
    cache = create_cache(backend, num_pages=16, page_size=1, **options)
    s = _seq("s", [1, 2, 3, 4])
    cache.prefill(s)
    assert cache.storage_hit_tokens(s) == 0
    cache.release(s)
    with pytest.raises(UnknownSequenceError):
        cache.storage_hit_tokens(s)
    with pytest.raises(UnknownSequenceError):
        cache.storage_hit_tokens(_seq("never", [1]))


@pytest.mark.parametrize("tokens", [-10, -1, 1.5, True, None, "16"])
def test_a_transfer_size_must_be_a_non_negative_int(tokens):
    cache = create_cache("radix-hicache", num_pages=16, page_size=1, host_capacity_tokens=32)
    with pytest.raises(InvalidRequestError, match="tokens must be a non-negative int"):
        cache.tier_link_seconds("host", "gpu", tokens)
    assert cache.tier_link_seconds("host", "gpu", 0) == 0.0


def test_a_link_the_cache_does_not_have_is_refused():
    cache = create_cache("radix-hicache", num_pages=16, page_size=1, host_capacity_tokens=32)
    for src, dst in [("gpu", "gpu"), ("host", "storage"), ("gpu", "nvme")]:
        with pytest.raises(InvalidRequestError, match="no tier link"):
            cache.tier_link_seconds(src, dst, 16)
    with pytest.raises(InvalidRequestError, match="no tier link"):
        create_cache("radix", num_pages=4, page_size=1).tier_link_seconds("host", "gpu", 1)
