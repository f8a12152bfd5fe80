"""Each router on small hand-made cases with exact expectations (a `StaticView` of fixed
numbers), the approximate tree of `cache_aware`, and the registry's options."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cachelib import PageKeys
from experiments.engine.routers import ROUTERS, StaticView, make_router
from experiments.engine.routers.approx_tree import ApproxTree, block_keys
from experiments.errors import InputError, UsageError
from experiments.runs.router_options import option_parameters, parse_router_opt, resolve_routers
from experiments.workloads.spec import RequestSpec


def req(rid: str, tokens, output: int = 4) -> RequestSpec:
    return RequestSpec(rid, np.asarray(tokens, dtype=np.int32), output)


def loads(*requests: int, **kw) -> StaticView:
    """A view where replica i has `requests[i]` requests in flight (all running)."""
    return StaticView(len(requests), running_counts=list(requests), **kw)


A = np.arange(100)
B = np.arange(1000, 1100)


# -- load-only routers ----------------------------------------------------------------------


def test_round_robin_cycles_from_replica_0():
    r = make_router("round_robin", 3)
    view = StaticView(3)
    assert [r.route(req(f"q{i}", A), view) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_random_is_seeded_and_uniform_over_the_replicas():
    got = [make_router("random", 5, {"seed": 3}).route(req("q", A), StaticView(5)) for _ in range(2)]
    assert got[0] == got[1]
    r = make_router("random", 5, {"seed": 3})
    want = np.random.default_rng(3).integers(5, size=200).tolist()
    assert [r.route(req(f"q{i}", A), StaticView(5)) for i in range(200)] == want
    assert set(want) == set(range(5))


def test_least_load_takes_the_fewest_outstanding_tokens_lowest_index_on_ties():
    r = make_router("least_load", 4)
    assert r.route(req("q", A), StaticView(4, outstanding=[30, 10, 20, 10])) == 1
    assert r.route(req("q", A), StaticView(4, outstanding=[5, 10, 20, 10])) == 0
    # requests in flight do not matter, tokens do
    assert r.route(req("q", A), StaticView(4, running_counts=[0, 9, 9, 9], outstanding=[50, 1, 2, 3])) == 1


def test_power_of_two_draws_two_distinct_replicas_and_keeps_the_lighter():
    n, seed = 5, 11
    outstanding = [40, 10, 30, 10, 0]
    view = StaticView(n, outstanding=outstanding)
    r = make_router("power_of_two", n, {"seed": seed})
    rng = np.random.default_rng(seed)
    for i in range(100):
        first = int(rng.integers(n))
        second = (first + 1 + int(rng.integers(n - 1))) % n
        assert first != second
        want = first if outstanding[first] <= outstanding[second] else second  # a tie keeps the first
        assert r.route(req(f"q{i}", A), view) == want
    assert make_router("power_of_two", 1).route(req("q", A), StaticView(1)) == 0


# -- consistent hashing with bounded loads --------------------------------------------------


def _ring_walk(router, request: RequestSpec, page_size: int) -> list[int]:
    """The replicas in the order the ring meets them clockwise from the request's key."""
    key = router.key(request, page_size)
    start = next((k for k, p in enumerate(router.points) if p > key), 0)
    order: list[int] = []
    for k in range(len(router.points)):
        owner = router.owners[(start + k) % len(router.points)]
        if owner not in order:
            order.append(owner)
    return order


def test_consistent_hash_keys_on_the_first_pages_only():
    r = make_router("consistent_hash", 4, {"prefix_pages": 2})
    view = StaticView(4, page_size=16)
    a = req("a", np.concatenate([np.arange(32), np.arange(500, 600)]))
    b = req("b", np.concatenate([np.arange(32), np.arange(900, 950)]))  # same 2 pages, another tail
    c = req("c", np.concatenate([np.arange(31), [7777]]))  # differs inside the first 2 pages
    assert r.key(a, 16) == r.key(b, 16) != r.key(c, 16)
    assert r.route(a, view) == r.route(b, view) == _ring_walk(r, a, 16)[0]
    assert r.counters == {"home": 2}


def test_consistent_hash_spills_clockwise_past_a_full_replica():
    r = make_router("consistent_hash", 4)  # load factor 1.25
    q = req("q", A)
    walk = _ring_walk(r, q, 16)
    home, nxt, third = walk[0], walk[1], walk[2]
    busy = [0] * 4
    busy[home] = 3  # m = 3 + 1 = 4 requests: a replica may hold ceil(1.25 * 4 / 4) = 2
    assert r.capacity(loads(*busy)) == 2
    assert r.route(q, loads(*busy)) == nxt
    busy[nxt] = 2  # m = 6: ceil(1.25 * 6 / 4) = 2, the next is full too
    assert r.capacity(loads(*busy)) == 2 and r.route(q, loads(*busy)) == third
    busy = [1] * 4  # m = 5: ceil(1.5625) = 2, home has room
    assert r.route(q, loads(*busy)) == home
    assert r.counters == {"spill": 2, "home": 1}


@pytest.mark.parametrize("c", [1.0, 1.25, 2.0])
def test_consistent_hash_never_exceeds_the_bound(c):
    """Every request shares one prefix (one home): each placement respects ceil(c * m / n)."""
    n = 5
    r = make_router("consistent_hash", n, {"load_factor": c})
    busy = [0] * n
    for m in range(1, 60):
        i = r.route(req(f"q{m}", A), loads(*busy))
        busy[i] += 1
        assert max(busy) <= math.ceil(c * m / n)
        if m % 7 == 0:  # a request finishes somewhere
            busy[busy.index(max(busy))] -= 1
    assert r.counters["spill"] > 0 and r.counters["home"] > 0


def test_consistent_hash_refuses_a_load_factor_below_one():
    with pytest.raises(InputError, match="load_factor"):
        make_router("consistent_hash", 4, {"load_factor": 0.9})


# -- session affinity ----------------------------------------------------------------------


def test_session_sticks_to_where_the_session_started():
    r = make_router("session", 3)
    sessions = {"c0-t0": "c0-t0", "c0-t1": "c0-t0", "c0-t2": "c0-t0", "c1-t0": "c1-t0", "c1-t1": "c1-t0"}
    first = r.route(req("c0-t0", A), StaticView(3, outstanding=[9, 0, 5], sessions=sessions))
    assert first == 1
    # replica 1 is now the busiest: the session stays anyway
    assert r.route(req("c0-t1", A), StaticView(3, outstanding=[0, 99, 5], sessions=sessions)) == 1
    assert r.route(req("c1-t0", A), StaticView(3, outstanding=[0, 99, 5], sessions=sessions)) == 0
    assert r.route(req("c0-t2", A), StaticView(3, outstanding=[0, 99, 5], sessions=sessions)) == 1
    assert r.route(req("c1-t1", A), StaticView(3, outstanding=[99, 0, 0], sessions=sessions)) == 0
    # no session (a Mooncake request): the least loaded, every time
    assert r.route(req("lone", A), StaticView(3, outstanding=[3, 2, 1], sessions=sessions)) == 2
    assert r.counters == {"new_session": 2, "sticky": 3, "no_session": 1}


# -- cache_aware ---------------------------------------------------------------------------


def _exact(**options) -> object:
    """cache_aware over tokens (block size 1), so matched shares are exact."""
    return make_router("cache_aware", 2, {"block_size": 1, **options})


def test_cache_aware_switches_between_prefix_match_and_smallest_tree_at_the_threshold():
    r = _exact()  # cache_threshold 0.3
    view = loads(0, 0)
    assert r.route(req("a", A), view) == 0  # empty trees: the smallest, lowest index
    assert r.route(req("b", B), view) == 1  # no match: replica 1's tree (0) is smaller than 0's (100)
    c = np.concatenate([A[:60], np.arange(5000, 5040)])
    assert r.route(req("c", c), view) == 0  # 60% of c is in replica 0's tree: > 0.3
    assert r.tree.size == [140, 100]
    d = np.concatenate([A[:20], np.arange(6000, 6080)])
    assert r.route(req("d", d), view) == 1  # 20% <= 0.3: the smallest tree (100 < 140)
    assert r.counters == {"smallest_tree": 3, "prefix_match": 1}
    low = _exact(cache_threshold=0.1)
    for name, tokens in (("a", A), ("b", B), ("c", c)):
        low.route(req(name, tokens), view)
    assert low.route(req("d", d), view) == 0  # the same 20% is now enough


def test_cache_aware_match_must_exceed_the_threshold_strictly():
    r = _exact(cache_threshold=0.5)
    view = loads(0, 0)
    r.route(req("a", A), view)  # -> 0
    half = np.concatenate([A[:50], np.arange(7000, 7050)])
    assert r.route(req("h", half), view) == 1  # exactly 0.5 is not above 0.5: smallest tree
    more = np.concatenate([A[:51], np.arange(8000, 8049)])
    assert r.route(req("m", more), view) == 0


@pytest.mark.parametrize(
    ("busy", "imbalanced"),
    [((70, 0), True), ((70, 10), False), ((300, 210), False), ((400, 200), True), ((64, 0), False)],
)
def test_cache_aware_load_test_needs_both_thresholds(busy, imbalanced):
    """Defaults 64 and 1.5: imbalanced iff max - min > 64 and max > 1.5 * min."""
    r = _exact()
    r.route(req("a", A), loads(0, 0))  # replica 0 holds A, and is the busier one below
    assert r.route(req("again", A), loads(*busy)) == (1 if imbalanced else 0)
    assert r.counters.get("imbalanced", 0) == imbalanced


def test_cache_aware_inserts_what_it_balances_too():
    r = _exact()
    r.route(req("a", A), loads(0, 0))  # -> 0
    assert r.route(req("a2", A), loads(100, 0)) == 1  # imbalanced: least loaded, and 1 now holds A
    assert r.tree.size == [100, 100]
    # balanced again: both hold all of A; the most recently touched (replica 1) wins
    assert r.route(req("a3", A), loads(0, 0)) == 1
    assert r.counters == {"smallest_tree": 1, "imbalanced": 1, "prefix_match": 1}


def test_cache_aware_prunes_least_recently_used_leaves_on_its_interval():
    r = make_router("cache_aware", 1, {"block_size": 1, "max_tree_size": 100, "eviction_interval_s": 120.0})
    r.route(req("a", A), StaticView(1, time=0.0))
    r.route(req("b", B), StaticView(1, time=1.0))
    r.route(req("b2", B), StaticView(1, time=119.0))  # before the interval: nothing pruned
    assert r.tree.size == [200]
    c = np.arange(9000, 9010)
    r.route(req("c", c), StaticView(1, time=121.0))  # prunes first: A is the least recently used leaf
    assert r.tree.size == [110]
    assert r.tree.prefix_match(block_keys(A, 1))[0] == 0
    assert r.tree.prefix_match(block_keys(B, 1))[0] == 100
    assert r.next_eviction == 240.0


def test_cache_aware_counts_blocks_when_block_size_is_above_one():
    r = make_router("cache_aware", 2, {"block_size": 16})
    view = loads(0, 0)
    r.route(req("a", np.arange(40)), view)  # two full blocks and 8 tokens: two keys
    assert r.tree.size == [2, 0]
    share = np.concatenate([np.arange(35), [999] * 5])  # 35 tokens shared: 2 whole blocks, 32 / 40
    assert r.route(req("s", share), view) == 0 and r.counters["prefix_match"] == 1
    short = np.concatenate([np.arange(15), [999] * 25])  # 15 shared tokens: no whole block
    assert r.route(req("t", short), view) == 1


# -- the approximate tree ------------------------------------------------------------------


def test_tree_splits_edges_and_counts_each_tenants_keys():
    t = ApproxTree(2)
    t.insert(np.arange(10), 0)
    t.insert(np.concatenate([np.arange(4), [50, 51]]), 1)
    assert t.size == [10, 6]
    assert t.prefix_match(np.arange(10)) == (10, 0)
    assert t.prefix_match(np.array([0, 1, 2, 3, 50, 9])) == (5, 1)
    assert t.prefix_match(np.array([0, 1, 2, 99])) == (3, 1)  # both hold [0..3]: 1 touched last
    assert t.smallest_tenant() == 1
    t.evict_by_size(4)  # each drops its leaf; the shared node stays
    assert t.size == [4, 4]
    assert t.prefix_match(np.arange(10))[0] == 4


def test_block_keys_are_stable_and_one_per_full_block():
    tokens = np.arange(50, dtype=np.int32)
    k = block_keys(tokens, 16)
    assert k.dtype == np.int64 and len(k) == 3
    assert np.array_equal(k, block_keys(tokens.astype(np.int64), 16))
    assert len(set(k.tolist())) == 3
    assert block_keys(np.concatenate([tokens[:16], [7] * 16]), 16)[0] == k[0]
    assert np.array_equal(block_keys(tokens, 1), tokens)


# -- the registry --------------------------------------------------------------------------


def test_every_router_is_registered_and_routes_in_range():
    assert list(ROUTERS) == [
        "round_robin", "random", "least_load", "power_of_two", "consistent_hash", "session", "cache_aware",
        "precise", "kv_cost",
    ]  # fmt: skip
    for name in ROUTERS:
        r = make_router(name, 3)
        assert r.name == name and r.subscribes_kv_events == (name in ("precise", "kv_cost"))
        for i in range(3 if r.subscribes_kv_events else 0):  # what the cluster driver does first
            r.on_kv_subscribed(i, PageKeys(16))
        assert r.route(req("q", A), StaticView(3)) in range(3)


def test_unknown_router_and_option_name_what_is_accepted():
    with pytest.raises(InputError, match="unknown router 'nope'; choose one of: round_robin, random"):
        resolve_routers(["nope"], [])
    with pytest.raises(InputError, match="router 'round_robin' does not take .*it takes: no options"):
        resolve_routers(["round_robin"], [parse_router_opt("seed=1")])
    with pytest.raises(InputError, match="it takes: cache_threshold, balance_abs_threshold"):
        resolve_routers(["cache_aware"], [parse_router_opt("threshold=1")])
    with pytest.raises(InputError, match="option cache_threshold expects float, got 'high'"):
        resolve_routers(["cache_aware[cache_threshold=high]"], [])
    with pytest.raises(InputError, match="option balance_abs_threshold expects int"):
        resolve_routers(["cache_aware"], [parse_router_opt("balance_abs_threshold=1.5")])
    with pytest.raises(InputError, match="cache_threshold is a share of the prompt"):
        resolve_routers(["cache_aware"], [parse_router_opt("cache_aware.cache_threshold=2")])
    with pytest.raises(InputError, match="router 'random' is not selected"):
        resolve_routers(["round_robin"], [parse_router_opt("random.seed=2")])
    with pytest.raises(UsageError, match="--router-opt expects KEY=VALUE"):
        parse_router_opt("seed")


def test_options_are_typed_and_defaults_dropped_from_the_label():
    got = resolve_routers(
        ["cache_aware", "cache_aware[cache_threshold=0.5]", "random"],
        [parse_router_opt("random.seed=7"), parse_router_opt("cache_aware.balance_abs_threshold=64")],
    )
    assert [v.label for v in got] == ["cache_aware", "cache_aware[cache_threshold=0.5]", "random[seed=7]"]
    assert got[1].options_dict() == {"cache_threshold": 0.5} and got[2].options_dict() == {"seed": 7}
    assert list(option_parameters("consistent_hash")) == ["prefix_pages", "load_factor", "virtual_nodes"]
    with pytest.raises(UsageError, match="same variant twice"):
        resolve_routers(["random", "random[seed=0]"], [])


def test_default_routers_left_out_over_backends_without_events_are_named(tmp_path, capsys):
    """Taken by default, a KV-event router is not paired with a backend that publishes no
    events; the command says so instead of dropping the pair silently."""
    from experiments.cli.main import main

    rc = main(
        [
            "compare",
            "--workload",
            "shared_doc_qa",
            "--knob",
            "num_requests=12",
            "--knob",
            "num_documents=2",
            "--replicas",
            "2",
            "--backend",
            "none",
            "--capacity-tokens",
            "200000",
            "--protocol",
            "serving",
            "--output-dir",
            str(tmp_path / "out"),
            "--no-progress",
            "--no-bounds",
        ]  # fmt: skip
    )
    assert rc == 0
    err = capsys.readouterr().err
    assert "left out" in err and "precise over none" in err and "kv_cost over none" in err
