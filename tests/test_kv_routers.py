"""The routers on KV events, `precise` (llm-d) and `kv_cost` (Dynamo), on hand-made cases with
exact expectations: their index follows stores and evictions, scores and costs to the
digit, ties, weights, temperature; and in a cluster: subscribed to every replica, every
request served once, the index equal to each replica's cache at the end, refused before any
work over a backend that publishes no events."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from cachelib import ExtraKeys, PageKeys, PagesRemoved, PagesStored, Sequence, create_cache
from experiments.__main__ import main
from experiments.engine import CacheClient, CostModelExecutor, FixedStepExecutor, ServingConfig, VirtualClock
from experiments.engine.cluster import ReplicaView, serve_cluster
from experiments.engine.routers import ROUTERS, StaticView, make_router
from experiments.engine.routers.kv_cost import softmax_pick
from experiments.engine.routers.kv_index import KvIndex
from experiments.engine.routers.precise import kv_usage_scores, queue_scores
from experiments.engine.vllm import VllmScheduler
from experiments.errors import InputError
from experiments.runs.backend_options import BackendVariant
from experiments.runs.cluster_grid import cells_over, check_shapes, cluster_shapes
from experiments.runs.runner import CellConfig
from experiments.workloads.registry import make_workload
from experiments.workloads.spec import RequestSpec
from tests.test_kv_events import published

PS = 4
KEYS = PageKeys(PS)
PROMPT = np.arange(100, 118, dtype=np.int32)  # 18 tokens: 4 full pages (the last 2 tokens partial)
PAGES = KEYS.keys(PROMPT, ExtraKeys())


def req(rid: str = "q", tokens=PROMPT) -> RequestSpec:
    return RequestSpec(rid, np.asarray(tokens, dtype=np.int32), 4)


def subscribed(name: str, n: int = 3, **options):
    router = make_router(name, n, options)
    for i in range(n):
        router.on_kv_subscribed(i, KEYS)
    return router


def store(router, replica: int, first: int, last: int) -> None:
    """Replica `replica` caches the prompt's pages `first..last-1`."""
    router.on_kv_event(replica, PagesStored(PAGES[first:last], PAGES[first - 1] if first else None))


def view(n: int = 3, **kw) -> StaticView:
    return StaticView(n, page_size=PS, **kw)


# -- the index -------------------------------------------------------------------------------


def test_the_index_counts_pages_and_matches_consecutive_pages_from_the_first():
    index = KvIndex(2)
    index.watch(0, KEYS)
    index.watch(1, KEYS)
    index.apply(0, PagesStored(PAGES[:3], None))
    index.apply(1, PagesStored(PAGES[1:4], PAGES[0]))  # not the first page: no prefix
    assert index.overlaps(req()) == ([3, 0], 4) and index.sizes == [3, 3]
    index.apply(0, PagesStored(PAGES[:1], None))  # a duplicate of page 0 (apc keeps both)
    index.apply(0, PagesRemoved(PAGES[:1]))
    assert index.overlaps(req())[0] == [3, 0]  # the duplicate still holds it
    index.apply(0, PagesRemoved(PAGES[1:2]))
    assert index.overlaps(req())[0] == [1, 0] and index.sizes == [2, 3]
    with pytest.raises(KeyError):
        index.apply(1, PagesRemoved(PAGES[:1]))  # never stored there: a broken stream


def test_the_index_keys_requests_by_their_extra_keys():
    index = KvIndex(1)
    index.watch(0, KEYS)
    index.apply(0, PagesStored(KEYS.keys(PROMPT, ExtraKeys(cache_salt="a")), None))
    salted = RequestSpec("q", PROMPT, 4, extra=ExtraKeys(cache_salt="a"))
    assert index.overlaps(salted) == ([4], 4) and index.overlaps(req()) == ([0], 4)


# -- precise -------------------------------------------------------------------------------


def test_precise_scores_the_longest_cached_prefix_over_the_prompt_plus_load():
    r = subscribed("precise")
    store(r, 0, 0, 3)
    store(r, 1, 0, 1)
    # equal loads: each load scorer gives 1.0 everywhere; prefix weight 2 x matched / 4 pages
    assert r.scores(req(), view()) == [2 * 3 / 4 + 2, 2 * 1 / 4 + 2, 2.0]
    assert r.route(req(), view()) == 0
    assert r.counters == {"prefix_hit": 1}


def test_precise_loses_a_replica_score_when_it_evicts_the_prefix():
    r = subscribed("precise")
    store(r, 0, 0, 4)
    store(r, 1, 0, 2)
    assert r.route(req(), view()) == 0
    r.on_kv_event(0, PagesRemoved(PAGES[:1]))  # replica 0 evicted the prompt's first page
    assert r.scores(req(), view())[0] == 2.0  # its pages 1..3 are no prefix any more
    assert r.route(req(), view()) == 1


def test_precise_follows_a_real_cache_that_evicts():
    """Subscribed to real apc caches: a committed prompt draws the next request to its
    replica; once that replica evicts it, the router no longer sees it there."""
    caches = [create_cache("apc", num_pages=16, page_size=PS) for _ in range(2)]
    r = make_router("precise", 2)
    for i, cache in enumerate(caches):
        r.on_kv_subscribed(i, cache.page_keys())
        cache.subscribe(_Tagged(r, i))
    seq = Sequence("a", PROMPT)
    caches[1].admit(seq, caches[1].match(seq), len(PROMPT))
    caches[1].commit(seq, len(PROMPT))
    caches[1].release(seq)
    assert r.scores(req(), view(2)) == [2.0, 4.0] and r.route(req(), view(2)) == 1
    assert caches[1].evict(16) == 4
    assert r.scores(req(), view(2)) == [2.0, 2.0]


class _Tagged:
    def __init__(self, router, replica: int) -> None:
        self.router, self.replica = router, replica

    def on_kv_event(self, event) -> None:
        self.router.on_kv_event(self.replica, event)


def test_precise_breaks_ties_at_random_seeded():
    r = subscribed("precise", 3, seed=5)
    got = [r.route(req(f"q{i}"), view()) for i in range(40)]
    rng = np.random.default_rng(5)
    assert got == [int(rng.integers(3)) for _ in range(40)]
    assert r.counters == {"no_hit": 40, "tie": 40}
    r = subscribed("precise", 3, seed=5)
    store(r, 2, 0, 1)
    store(r, 1, 0, 1)  # 1 and 2 tie; 0 is out
    rng = np.random.default_rng(5)
    assert [r.route(req(), view()) for _ in range(10)] == [[1, 2][int(rng.integers(2))] for _ in range(10)]


def test_precise_weights_trade_the_prefix_against_load():
    # replica 0 holds the whole prompt but has 5 waiting and half its KV pinned
    loaded = view(waiting_counts=[5, 0, 1], usage=[0.5, 0.0, 0.0])
    r = subscribed("precise")
    store(r, 0, 0, 4)
    # queue: (5 - q) / 5 = [0, 1, 0.8]; KV: 1 - usage = [0.5, 1, 1]
    assert r.scores(req(), loaded) == [2.0 + 0.0 + 0.5, 0.0 + 1.0 + 1.0, 0.0 + 0.8 + 1.0]
    assert r.route(req(), loaded) == 0
    r = subscribed("precise", prefix_weight=0.5)
    store(r, 0, 0, 4)
    assert r.scores(req(), loaded) == [0.5 + 0.0 + 0.5, 2.0, 1.8] and r.route(req(), loaded) == 1
    r = subscribed("precise", prefix_weight=0.5, load_scorers="kv_usage", load_weight=2.0)
    store(r, 0, 0, 4)
    assert r.scores(req(), loaded) == [0.5 + 1.0, 2.0, 2.0]  # 1 and 2 tie on KV usage alone


def test_precise_load_scorers_normalise_as_llm_d():
    assert queue_scores(view(waiting_counts=[2, 4, 6])) == [1.0, 0.5, 0.0]
    assert queue_scores(view(waiting_counts=[3, 3, 3])) == [1.0, 1.0, 1.0]
    assert kv_usage_scores(view(usage=[0.25, 1.0, 0.0])) == [0.75, 0.0, 1.0]


def test_precise_gives_no_prefix_score_to_a_prompt_without_a_full_page():
    r = subscribed("precise")
    store(r, 0, 0, 4)
    assert r.scores(req("short", PROMPT[:3]), view()) == [2.0, 2.0, 2.0]


# -- kv_cost -------------------------------------------------------------------------------


def test_kv_cost_is_prefill_blocks_plus_decode_blocks():
    r = subscribed("kv_cost", 2)
    store(r, 0, 0, 3)
    # replica 0: (18 - 3 x 4) / 4 = 1.5 prefill blocks + 4 new decode blocks; replica 1: 18 / 4 + 4
    assert r.costs(req(), view(2)) == [1.5 + 4, 4.5 + 4]
    assert r.route(req(), view(2)) == 0 and r.counters == {"lowest_cost": 1}


def test_kv_cost_trades_the_overlap_against_load():
    busy = view(2, pages=[10, 0], prefill=[0, 0])  # replica 0 holds the prefix, and 10 active blocks
    r = subscribed("kv_cost", 2)
    store(r, 0, 0, 4)
    assert r.costs(req(), busy) == [0.5 + 10 + 4, 4.5 + 0 + 4] and r.route(req(), busy) == 1
    r = subscribed("kv_cost", 2, overlap_weight=4.0)  # prefill counts four times as much
    store(r, 0, 0, 4)
    assert r.costs(req(), busy) == [2.0 + 14, 18.0 + 4] and r.route(req(), busy) == 0
    queued = view(2, prefill=[0, 40])  # replica 1 has 40 prompt tokens queued to prefill
    r = subscribed("kv_cost", 2)
    assert r.costs(req(), queued) == [4.5 + 4, (40 + 18) / 4 + 4] and r.route(req(), queued) == 0


def test_kv_cost_ties_go_to_the_smallest_cache_then_at_random():
    r = subscribed("kv_cost", 3, seed=2)
    other = KEYS.keys(np.arange(900, 912, dtype=np.int32), ExtraKeys())
    r.on_kv_event(0, PagesStored(other, None))  # unrelated pages: replica 0's cache is larger
    r.on_kv_event(2, PagesStored(other[:1], None))
    assert r.route(req(), view()) == 1 and r.counters == {"tie": 1}
    r = subscribed("kv_cost", 3, seed=2)
    rng = np.random.default_rng(2)
    assert [r.route(req(), view()) for _ in range(20)] == [int(rng.integers(3)) for _ in range(20)]


def test_kv_cost_at_temperature_0_is_deterministic():
    picks = set()
    for seed in range(5):
        r = subscribed("kv_cost", 2, seed=seed)
        store(r, 1, 0, 2)
        picks.add(r.route(req(), view(2)))
    assert picks == {1}


def test_softmax_sampling_follows_dynamo():
    p0 = 1 / (1 + math.exp(-1))  # costs [0, 1] at temperature 1: weights exp(0), exp(-1)
    assert softmax_pick([0.0, 1.0], 1.0, p0 - 1e-9) == 0 and softmax_pick([0.0, 1.0], 1.0, p0 + 1e-9) == 1
    # normalised: costs [10, 20] at temperature 1 are costs [0, 1]; at 0.5, weights exp(0), exp(-2)
    assert softmax_pick([10.0, 20.0], 1.0, p0 - 1e-9) == 0
    p0_half = 1 / (1 + math.exp(-2))
    assert softmax_pick([10.0, 20.0], 0.5, p0_half - 1e-9) == 0 and softmax_pick([10.0, 20.0], 0.5, p0_half + 1e-9) == 1
    assert [softmax_pick([3.0, 3.0, 3.0], 2.0, u) for u in (0.2, 0.5, 0.9)] == [0, 1, 2]  # equal: uniform


def test_kv_cost_sampling_is_seeded_and_reproducible():
    def run(seed: int) -> list[int]:
        r = subscribed("kv_cost", 3, temperature=0.7, seed=seed)
        store(r, 0, 0, 4)
        store(r, 1, 0, 2)
        return [r.route(req(), view()) for _ in range(300)]

    got = run(9)
    assert got == run(9) and got != run(10)
    costs = [0.5 + 4, 2.5 + 4, 4.5 + 4]
    rng = np.random.default_rng(9)
    assert got == [softmax_pick(costs, 0.7, float(rng.random())) for _ in range(300)]
    share = Counter(got)
    assert share[0] > share[1] > share[2] > 0  # lower cost, picked more often


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("precise", {"prefix_weight": -1.0}, "scorer weight"),
        ("precise", {"load_weight": math.inf}, "scorer weight"),
        ("precise", {"load_scorers": "queue,kv_usage"}, "load_scorers is one of"),
        ("kv_cost", {"temperature": -0.1}, "finite and >= 0"),
        ("kv_cost", {"overlap_weight": math.nan}, "finite and >= 0"),
    ],
)
def test_bad_options_are_refused(name, options, message):
    with pytest.raises(InputError, match=message):
        make_router(name, 2, options)


# -- in a cluster --------------------------------------------------------------------------


def test_the_view_counts_prefill_tokens_and_active_pages():
    """What kv_cost reads: the prompt tokens still to prefill, and the full prompt pages of
    the requests in flight (waiting ones included, from the moment they are routed)."""
    specs = [RequestSpec(f"r{i}", np.arange(i * 100, i * 100 + 40, dtype=np.int32), 5) for i in range(3)]
    clock = VirtualClock(specs)
    s = VllmScheduler(
        CacheClient(create_cache("apc", num_pages=20, page_size=16)), CostModelExecutor(), ServingConfig(64, 2), clock
    )
    view = ReplicaView([s], clock, {})
    for i, spec in enumerate(specs):
        s.add(spec, 0.0, i)
    assert (view.prefill_tokens(0), view.active_pages(0)) == (3 * 40, 3 * 2)
    s.step()  # budget 64: r0's whole prompt and 24 tokens of r1's; r2 waits
    view.invalidate(0)
    assert (view.prefill_tokens(0), view.active_pages(0)) == (0 + 16 + 40, 3 * 2)


@pytest.mark.parametrize("backend", ["apc", "radix", "radix-aged"])
@pytest.mark.parametrize("name", ["precise", "kv_cost"])
def test_every_request_is_served_once_and_the_index_is_each_cache(backend, name):
    specs = make_workload("shared_doc_qa", seed=3, num_documents=5, num_requests=60, rate=30.0, doc_len=300).requests
    caches = [create_cache(backend, num_pages=60, page_size=16) for _ in range(3)]
    router = make_router(name, 3)
    res = serve_cluster(caches, specs, [CostModelExecutor() for _ in range(3)], router)
    assert sorted(r["request_id"] for r in res.requests) == sorted(s.request_id for s in specs)
    assert sum(len(r.requests) for r in res.replicas) == len(specs) and res.decisions == len(specs)
    assert sum(c.stats().evicted_pages for c in caches) > 0  # under pressure: the index saw removals
    for i, cache in enumerate(caches):
        assert Counter(router.index.pages[i]) == published(cache)
        assert router.index.sizes[i] == sum(published(cache).values())
    assert res.router_seconds > 0


def test_precise_keeps_a_document_on_the_replica_that_cached_it():
    """Two documents asked in turn, each request finished before the next arrives (loads
    equal): after each document's first request, precise sends it where it is cached."""
    docs = [np.arange(0, 64, dtype=np.int32), np.arange(1000, 1064, dtype=np.int32)]
    specs = [
        RequestSpec(f"q{i}", np.concatenate([docs[i % 2], [5000 + i] * 8]).astype(np.int32), 2, arrival=10.0 * i)
        for i in range(10)
    ]
    caches = [create_cache("apc", num_pages=100, page_size=16) for _ in range(3)]
    res = serve_cluster(caches, specs, [FixedStepExecutor(0.01) for _ in range(3)], make_router("precise", 3))
    where = {r["request_id"]: r["replica"] for r in res.requests}
    assert len({where[f"q{i}"] for i in range(0, 10, 2)}) == 1
    assert len({where[f"q{i}"] for i in range(1, 10, 2)}) == 1
    hits = [r["hit_tokens_first"] for r in sorted(res.requests, key=lambda r: r["arrival"])]
    assert hits[:2] == [0, 0] and all(h == 64 for h in hits[2:])


@pytest.mark.parametrize("backend", ["none", "paged"])
@pytest.mark.parametrize("name", ["precise", "kv_cost"])
def test_a_router_on_events_is_refused_over_a_backend_without_them(backend, name):
    specs = [RequestSpec("r0", np.arange(20, dtype=np.int32), 2)]
    caches = [create_cache(backend, num_pages=20, page_size=16) for _ in range(2)]
    with pytest.raises(ValueError, match=f"router '{name}' needs KV events, which a {backend} cache does not publish"):
        serve_cluster(caches, specs, [CostModelExecutor(), CostModelExecutor()], make_router(name, 2))
    with pytest.raises(InputError, match=f"router '{name}' needs KV events.* backend '{backend}'"):
        CellConfig(backend, "no_sharing", 4000, protocol="serving", replicas=2, router=name)


def test_by_default_a_grid_leaves_out_event_routers_over_silent_backends():
    """No --router: every router, but precise and kv_cost only over backends that publish
    events. Named, the pair is refused before any work (below)."""
    template = CellConfig("", "no_sharing", 0, protocol="serving")
    variants = [BackendVariant("apc"), BackendVariant("none")]
    shapes = cluster_shapes([1, 2], [], [])
    check_shapes(template, shapes, variants)
    cells = cells_over(template, variants, [4000], shapes)
    pairs = [(c.backend, c.router) for c in cells]
    assert pairs[:2] == [("apc", None), ("none", None)]
    assert {r for b, r in pairs if b == "apc"} == {None, *ROUTERS}
    assert {r for b, r in pairs if b == "none"} == {None, *ROUTERS} - {"precise", "kv_cost"}
    named = cluster_shapes([2], ["precise"], [])
    with pytest.raises(InputError, match="router 'precise' needs KV events.* backend 'none'"):
        check_shapes(template, named, variants)


def test_the_command_line_refuses_a_named_event_router_over_a_silent_backend(tmp_path, capsys, monkeypatch):
    import experiments.cli.compare as cli_compare

    def started(*args, **kwargs):
        pytest.fail("work started before the settings were checked")

    monkeypatch.setattr(cli_compare, "build_workload", started)
    argv = ["compare", "--workload", "multi_turn_chat", "--backend", "apc,paged", "--capacity-tokens", "3000",
            "--replicas", "2", "--router", "kv_cost", "--no-progress", "--output-dir", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 3
    assert "router 'kv_cost' needs KV events, which backend 'paged' does not publish" in capsys.readouterr().err
