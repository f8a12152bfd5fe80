"""radix-hicache's storage tier (L3, SGLang 0.5.23's HiCache storage layer) on hand-made
cases: what is on which tier after each call, the storage prefetch and what stops it (the
threshold, a full host), the file backend's LRU eviction and the shared pool's put rule,
one shared pool across two replicas, the replay's storage column, bad options refused.

Page size 1 and 12-token prompts as in tests/test_radix_hicache.py; `prefetch_threshold=0`
(SGLang then prefetches any hit of a page or more) keeps them short enough to prefetch.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.radix_hicache_tree import on_device
from cachelib import InvalidRequestError, Sequence, StorageCopy, create_cache
from cachelib.tiers import FILE_READ_GBPS, SHARED_WRITE_GBPS, StorageTier
from experiments.engine import replay
from experiments.engine.cluster import share_storage
from experiments.errors import InputError
from experiments.runs.backend_options import OptionGiven, resolve_variants
from experiments.workloads.spec import RequestSpec

A = list(range(12))
B = list(range(100, 112))
C = list(range(200, 212))
D = list(range(300, 312))


def make(write_policy: str = "write_through", host: int = 36, **storage):
    options = {"storage_backend": "file", "prefetch_threshold": 0} | storage
    return create_cache(
        "radix-hicache",
        num_pages=24,
        page_size=1,
        write_policy=write_policy,
        host_capacity_tokens=host,
        track_contents=True,
        **options,
    )


_ids = iter(range(10**9))


def serve(cache, tokens: list[int]) -> tuple[int, int, int, list]:
    """One request through the protocol's calls: (GPU hit, host tokens loaded back, of them
    from storage, the storage moves handed out at admission)."""
    seq = Sequence(f"r{next(_ids)}", np.asarray(tokens, dtype=np.int32))
    m = cache.match(seq)
    ops = cache.admit(seq, m, len(seq))
    assert ops is not None
    out = (m.num_tokens, seq.num_computed - m.num_tokens, cache.storage_hit_tokens(seq))
    cache.commit(seq, len(seq))
    cache.check_invariants()
    cache.release(seq)
    cache.check_invariants()
    return (*out, [op for op in ops if isinstance(op, StorageCopy)])


def tiers(cache) -> dict[tuple[int, int], str]:
    out = {}
    for n in cache.tree.nodes():
        where = {(True, False): "gpu", (False, True): "host", (True, True): "both"}[
            (on_device(n), n.host_pages is not None)
        ]
        out[(int(n.key[0]), len(n.key))] = where
    return out


def stored(cache) -> int:
    return cache.storage_tier.used_tokens


def test_backups_go_on_to_storage_and_a_prefix_the_host_lost_comes_back_from_it():
    cache = make()
    # every host backup is written to storage at its ack (write_through: at the insert)
    assert serve(cache, A)[:3] == (0, 0, 0)
    assert tiers(cache) == {(0, 12): "both"} and stored(cache) == 12
    assert serve(cache, B)[:3] == (0, 0, 0)
    assert serve(cache, C)[:3] == (0, 0, 0)  # A demoted: host only
    assert tiers(cache) == {(0, 12): "host", (100, 12): "both", (200, 12): "both"}
    # D's backup needs host room: A, the only host-only leaf, is evicted from the host;
    # storage still has it
    assert serve(cache, D)[:3] == (0, 0, 0)
    assert tiers(cache) == {(100, 12): "host", (200, 12): "both", (300, 12): "both"}
    assert stored(cache) == 48
    # A + 1: no device or host hit; storage has A's 12 tokens. The host is full, so host
    # copies are evicted for the whole hit (B, the host-only leaf), A becomes a host node
    # and is loaded back (C demoted for it, then D for the new token's page)
    gpu, loaded, from_storage, moves = serve(cache, A + [1])
    assert (gpu, loaded, from_storage) == (0, 12, 12)
    # the prefetch's read, then the demoted C and D, whose host copies reach the executor's
    # storage only now (their storage writes were decided at their backups)
    assert [(op.to_storage, op.tokens) for op in moves] == [(False, 12), (True, 12), (True, 12)]
    assert list(moves[0].keys) == cache.tree.node_keys(
        next(n for n in cache.tree.nodes() if n.start == 0 and n.key[0] == 0)
    )
    assert tiers(cache) == {(0, 12): "both", (1, 1): "both", (300, 12): "host"}
    traffic = cache.tier_traffic()
    assert traffic["prefetched"] == 12 and traffic["storage_read_tokens"] == 12
    assert traffic["stored"] == 49 and traffic["storage_written_tokens"] == 49  # + the new 1-token leaf
    assert traffic["storage_to_host_bytes"] == cache.storage_tier.bytes_of(12)
    assert traffic["host_to_storage_bytes"] == cache.storage_tier.bytes_of(49)


def test_no_host_room_for_the_hit_means_no_prefetch():
    # a host of 24 holds C and D, both also on the device (write_through never frees
    # those for a prefetch): the hit finds no host room and A + 1 recomputes
    cache = make(host=24)
    for p in (A, B, C, D):
        serve(cache, p)
    assert tiers(cache) == {(200, 12): "both", (300, 12): "both"}
    assert cache.storage_tier.hit_pages(cache.tree.node_keys(next(iter(cache.tree.nodes())))) == 12
    assert serve(cache, A + [1])[:3] == (0, 0, 0)
    assert cache.tier_traffic()["prefetched"] == 0


def test_a_match_made_before_the_tree_grew_below_it_is_admitted_without_a_prefetch():
    """The contract admits a stale match as it was made when nothing was evicted since
    (radix does). Replica 1 matches A + [1] while A is only in the shared pool (replica 0
    stored it); then A + [2] brings A onto replica 1's device. A fresh match would hit A
    there; the stale one prefetches nothing (SGLang, which matches and prefetches at once,
    never meets this) and recomputes, and the tiers stay whole. (Found by the property
    tests: the prefetch tried to put a second child for A under the root.)"""
    from cachelib.tiers import NO_PREFETCH

    one, two = make(storage_backend="shared"), make(storage_backend="shared")
    share_storage([one, two])
    serve(one, A)
    late = Sequence("late", np.asarray(A + [1], dtype=np.int32))
    m = two.match(late)
    assert m.num_tokens == 0 and two.storage_prefetch(late, m).tokens == 12  # A is in the pool only
    assert serve(two, A + [2])[:3] == (0, 12, 12)  # A comes onto replica 1: host, then device
    assert two.storage_prefetch(late, m) == NO_PREFETCH
    ops = two.admit(late, m, len(late))  # nothing was evicted: the stale match stands
    assert ops is not None and late.num_computed == 0 and two.storage_hit_tokens(late) == 0
    two.check_invariants()
    two.commit(late, len(late))
    two.release(late)
    two.check_invariants()
    assert serve(two, A + [1])[:3] == (12, 0, 0)  # A + [1]'s own copy of A was a duplicate


def test_the_prefetch_threshold_declines_short_spans_and_short_hits():
    # SGLang's default threshold, 256 tokens: a 12-token prompt is never prefetched
    cache = make(prefetch_threshold=256)
    for p in (A, B, C, D):
        serve(cache, p)
    assert serve(cache, A + [1])[:3] == (0, 0, 0)
    # a threshold of 10: A's 12 stored tokens qualify, a span of only 8 does not. Under a
    # threshold of 8 those 8 come up to the host (A's first 8 pages are stored under the
    # same keys) but are not loaded: fewer than 10 host tokens are recomputed
    for threshold, prompt, expected, prefetched in (
        (10, A + [1], (0, 12, 12), 12),
        (10, A[:8] + [99], (0, 0, 0), 0),
        (8, A[:8] + [99], (0, 0, 0), 8),
    ):
        cache = make(prefetch_threshold=threshold)
        for p in (A, B, C, D):
            serve(cache, p)
        assert serve(cache, prompt)[:3] == expected
        assert cache.tier_traffic()["prefetched"] == prefetched


def test_write_back_backs_up_at_eviction_and_only_then_stores():
    cache = make("write_back")
    serve(cache, A)
    assert stored(cache) == 0  # write_back backs up nothing at the insert
    serve(cache, B)
    serve(cache, C)  # A evicted from the device: backed up to the host, then to storage
    assert tiers(cache) == {(0, 12): "host", (100, 12): "gpu", (200, 12): "gpu"}
    assert stored(cache) == 12


def test_the_file_backend_evicts_least_recently_used_pages_to_90_percent():
    tier = StorageTier.build(1, capacity_tokens=10, kv_bytes_per_token=2)
    keys = [bytes([i]) for i in range(13)]
    assert tier.write(keys[:10]) == 10 and tier.evicted_pages == 0
    tier.read(keys[:1])  # page 0 is the most recently used now
    tier.write(keys[:2])  # page 1 already stored: the file backend refreshes it
    assert tier.keys()[-2:] == [keys[0], keys[1]]
    # an 11th page: evict down to int(10 x 2 bytes x 0.9) - 2 = 16 bytes, 8 pages
    assert tier.write(keys[10:11]) == 1
    assert tier.evicted_pages == 2
    assert tier.keys() == [*keys[4:10], keys[0], keys[1], keys[10]]
    assert tier.hit_pages([keys[4], keys[5], keys[2]]) == 2


def test_the_shared_pool_skips_a_stored_page_without_refreshing_it():
    tier = StorageTier.build(1, backend="shared", capacity_tokens=4)
    keys = [bytes([i]) for i in range(6)]
    tier.write(keys[:4])
    tier.write(keys[:1])  # Mooncake: an existing key is filtered out before the put
    assert tier.skipped_pages == 1 and tier.keys() == keys[:4]
    tier.write(keys[4:5])  # over the cap: down to int(4 x 0.95) - 1 = 2 pages, then the new one
    assert tier.keys() == [keys[2], keys[3], keys[4]]


def test_one_shared_pool_gives_a_hit_on_the_other_replica():
    one, two = make(storage_backend="shared"), make(storage_backend="shared")
    share_storage([one, two])
    assert two.storage_tier is one.storage_tier and two.tree.storage is one.storage_tier
    serve(one, A)  # replica 0 computes A and stores it
    # replica 1 never saw A: the shared pool has it, prefetched and loaded back
    assert serve(two, A + [1])[:3] == (0, 12, 12)
    assert tiers(two) == {(0, 12): "both", (1, 1): "both"}
    # local disks stay each replica's own
    a, b = make(), make()
    share_storage([a, b])
    assert a.storage_tier is not b.storage_tier
    serve(a, A)
    assert serve(b, A + [1])[:3] == (0, 0, 0)


def test_a_shared_pool_is_joined_only_by_equal_empty_shared_tiers():
    one = make(storage_backend="shared")
    with pytest.raises(InvalidRequestError, match="storage_backend=shared"):
        make().use_storage_pool(one.storage_tier)
    with pytest.raises(InvalidRequestError, match="same size"):
        make(storage_backend="shared", storage_capacity_tokens=48).use_storage_pool(one.storage_tier)
    used = make(storage_backend="shared")
    serve(used, A)
    with pytest.raises(InvalidRequestError, match="before the cache stores anything"):
        used.use_storage_pool(one.storage_tier)
    with pytest.raises(InvalidRequestError, match="no storage tier"):
        create_cache("radix", num_pages=4, page_size=1).use_storage_pool(one.storage_tier)


def test_replay_reports_the_storage_column():
    reqs = [RequestSpec(f"q{i}", np.asarray(p, dtype=np.int32), 1) for i, p in enumerate([A, B, C, D, A + [50]])]
    result = replay(make(), reqs)
    assert result["memory_tiers"] == ["gpu", "host", "storage"]
    assert result["per_request_hits_by_tier"] == [[0, 0, 0]] * 4 + [[0, 0, 12]]
    assert result["per_request_hits"] == [0, 0, 0, 0, 12]
    assert result["hit_tokens_by_tier"] == {"gpu": 0, "host": 0, "storage": 12}
    assert result["tier_traffic"]["storage_read_tokens"] == 12


# -- bad input: refused before any work ----------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"storage_backend": "nfs"}, "unknown storage_backend 'nfs'"),
        ({"storage_backend": "file", "storage_capacity_tokens": 8}, "storage tier smaller than one page"),
        ({"storage_backend": "file", "storage_capacity_tokens": 24}, "not a whole number of 16-token pages"),
        ({"storage_backend": "file", "storage_capacity_gb": 1e-9}, "storage tier smaller than one page"),
        ({"storage_backend": "file", "storage_capacity_tokens": -16}, "storage_capacity_tokens must be"),
        ({"storage_backend": "file", "storage_read_gbps": 0}, "storage_read_gbps must be a positive bandwidth"),
        ({"storage_backend": "shared", "storage_write_gbps": -2.0}, "storage_write_gbps must be a positive"),
        ({"storage_backend": "file", "prefetch_policy": "eager"}, "unknown prefetch_policy 'eager'"),
        ({"storage_backend": "file", "prefetch_threshold": -1}, "prefetch_threshold must be"),
        ({"storage_capacity_tokens": 64}, "given without a storage tier"),
        ({"prefetch_policy": "timeout"}, "given without a storage tier"),
    ],
)
def test_bad_storage_options_are_refused(options, message):
    with pytest.raises(InvalidRequestError, match=message):
        create_cache("radix-hicache", num_pages=8, page_size=16, **options)


def test_bad_storage_options_fail_in_the_options_layer_and_defaults_are_the_backends():
    with pytest.raises(InputError, match="unknown prefetch_policy 'soon'"):
        resolve_variants(
            ["radix-hicache"],
            [
                OptionGiven("storage_backend", "file", "--backend-opt"),
                OptionGiven("prefetch_policy", "soon", "--backend-opt"),
            ],
            [1],
        )
    (variant,) = resolve_variants(
        ["radix-hicache"],
        [
            OptionGiven("storage_backend", "shared", "--backend-opt"),
            OptionGiven("storage_capacity_gb", "2", "--backend-opt"),
        ],
        [16],
    )
    cache = create_cache("radix-hicache", num_pages=8, page_size=16, **variant.options_dict())
    tier = cache.storage_tier
    assert tier.shared and tier.figures.write_gbps == SHARED_WRITE_GBPS
    assert tier.capacity_tokens == int(2e9) // tier.figures.kv_bytes_per_token // 16 * 16
    assert create_cache(
        "radix-hicache", num_pages=8, page_size=16, storage_backend="file"
    ).storage_tier.figures.read_gbps == (FILE_READ_GBPS)


def test_a_served_cluster_shares_one_pool_between_its_replicas():
    """`serve_cluster` joins the replicas' shared tiers (`share_storage`): round robin sends
    the second request to the other replica, which finds the first's prefix in the pool."""
    from experiments.engine import CostModelExecutor
    from experiments.engine.cluster import serve_cluster
    from experiments.engine.routers import make_router

    doc = list(range(1000, 1064))
    specs = [
        RequestSpec("a", np.asarray(doc + [1, 2], dtype=np.int32), 2, arrival=0.0),
        RequestSpec("b", np.asarray(doc + [3, 4], dtype=np.int32), 2, arrival=60.0),
    ]
    for backend, fetched in (("shared", 64), ("file", 0)):
        caches = [
            create_cache(
                "radix-hicache",
                num_pages=16,
                page_size=16,
                host_capacity_tokens=512,
                storage_backend=backend,
                prefetch_threshold=16,
                # serving times the prefetch: under best_effort a request scheduled the
                # instant it arrives takes none of it (tests/test_storage_clock.py)
                prefetch_policy="wait_complete",
            )
            for _ in range(2)
        ]
        res = serve_cluster(caches, specs, [CostModelExecutor(), CostModelExecutor()], make_router("round_robin", 2))
        assert [r["replica"] for r in res.requests] == [0, 1]
        assert caches[1].tier_traffic()["prefetched"] == fetched
        assert (caches[0].storage_tier is caches[1].storage_tier) == (backend == "shared")
