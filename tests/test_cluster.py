"""The cluster driver (experiments/engine/cluster.py): one replica is `serve` exactly; every
request is served once, by the replica its router chose; decode windows stay exact across
replicas; dependent turns arrive after their predecessor wherever it ran; what a router sees;
bad input refused before any work (the router's bad answer at the step, naming it); and the
cluster's cells through `run_cell` and the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cachelib import create_cache
from experiments.__main__ import main
from experiments.engine import CacheClient, CostModelExecutor, FixedStepExecutor, ServingConfig, VirtualClock, serve
from experiments.engine.cluster import ReplicaView, serve_cluster, session_ids
from experiments.engine.routers import ROUTERS, Router, RouterError, make_router
from experiments.engine.vllm import VllmScheduler
from experiments.errors import InputError
from experiments.report.cluster_metrics import merged_timeline
from experiments.runs.runner import PER_REQUEST, CellConfig, run_cell
from experiments.workloads.registry import make_workload
from experiments.workloads.spec import RequestSpec
from tests.helpers import assert_refused_before_work

WORKLOADS = {
    "shared_doc_qa": dict(num_documents=6, num_requests=60, rate=40.0, doc_len=400),
    "multi_turn_chat": dict(num_conversations=12, turns=3, rate=3.0),
    "parallel_sampling": dict(num_requests=20),
}


class NoWindows(CostModelExecutor):
    """The cost model, one step at a time (no decode windows)."""

    supports_decode_windows = False


def _caches(backend: str, n: int, pages: int) -> list:
    return [create_cache(backend, num_pages=pages, page_size=16) for _ in range(n)]


def _without_replica(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "replica"} for r in records]


# -- one replica is `serve` -----------------------------------------------------------------


@pytest.mark.parametrize("workload", list(WORKLOADS))
@pytest.mark.parametrize("backend", ["apc", "none"])
@pytest.mark.parametrize("executor", ["cost", "fixed"])
def test_one_replica_equals_serve(workload, backend, executor):
    specs = make_workload(workload, seed=2, **WORKLOADS[workload]).requests
    make = (lambda: CostModelExecutor()) if executor == "cost" else (lambda: FixedStepExecutor(0.02))  # noqa: E731
    cfg = ServingConfig(1024, 12)
    alone = serve(create_cache(backend, num_pages=150, page_size=16), specs, make(), cfg)
    got = serve_cluster(_caches(backend, 1, 150), specs, [make()], make_router("round_robin", 1), cfg)
    one = got.replicas[0]
    assert _without_replica(one.requests) == alone.requests
    assert (one.steps, one.makespan, one.preemptions, one.timeline) == (
        alone.steps,
        alone.makespan,
        alone.preemptions,
        alone.timeline,
    )
    assert got.makespan == alone.makespan and got.decisions == len(specs)


def test_one_replica_equals_serve_on_the_shipped_trace(shipped_trace):
    specs = shipped_trace[:300]
    cfg = ServingConfig()
    alone = serve(create_cache("apc", num_pages=2000, page_size=16), specs, CostModelExecutor(), cfg)
    got = serve_cluster(_caches("apc", 1, 2000), specs, [CostModelExecutor()], make_router("cache_aware", 1), cfg)
    assert _without_replica(got.replicas[0].requests) == alone.requests
    assert got.makespan == alone.makespan and alone.preemptions > 0  # under pressure, still the same


# -- every request once, where its router sent it --------------------------------------------


class Recording(Router):
    """Round robin that remembers its answers."""

    name = "recording"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self.sent: dict[str, int] = {}

    def route(self, request, view) -> int:
        i = self.sent[request.request_id] = len(self.sent) % self.num_replicas
        return i


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_request_is_served_once_by_the_replica_it_was_routed_to(workload):
    specs = make_workload(workload, seed=1, **WORKLOADS[workload]).requests
    router = Recording(3)
    res = serve_cluster(_caches("apc", 3, 120), specs, [CostModelExecutor() for _ in range(3)], router)
    ids = [r["request_id"] for r in res.requests if r["sample_of"] is None]
    assert sorted(ids) == sorted(s.request_id for s in specs)
    for r in res.requests:
        parent = r["sample_of"] or r["request_id"]
        assert r["replica"] == router.sent[parent] and not r["aborted"]
    for i, rep in enumerate(res.replicas):
        assert all(r["replica"] == i for r in rep.requests)
    assert res.decisions == len(specs)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_every_router_serves_every_request_once(name):
    specs = make_workload("multi_turn_chat", seed=4, **WORKLOADS["multi_turn_chat"]).requests
    res = serve_cluster(_caches("apc", 4, 100), specs, [CostModelExecutor() for _ in range(4)], make_router(name, 4))
    assert sorted(r["request_id"] for r in res.requests) == sorted(s.request_id for s in specs)
    assert sum(len(r.requests) for r in res.replicas) == len(specs)


# -- time across replicas ----------------------------------------------------------------


@pytest.mark.parametrize("think_time", [5.0, 0.3, 0.0])
@pytest.mark.parametrize("name", ["round_robin", "least_load", "cache_aware"])
def test_decode_windows_equal_single_steps_in_a_cluster(think_time, name):
    """A replica's window stops before any arrival in the cluster and before a turn another
    replica could release: the outcome is that of stepping every replica one step at a time."""
    specs = make_workload(
        "multi_turn_chat", seed=1, num_conversations=24, turns=4, think_time=think_time, rate=4.0
    ).requests
    runs = []
    for executor in (CostModelExecutor, NoWindows):
        res = serve_cluster(_caches("apc", 3, 300), specs, [executor() for _ in range(3)], make_router(name, 3))
        runs.append((sorted(res.requests, key=lambda r: r["request_id"]), res.makespan))
    assert runs[0] == runs[1]


def test_a_turn_arrives_its_think_time_after_its_predecessor_finished_anywhere():
    specs = make_workload("multi_turn_chat", seed=3, num_conversations=8, turns=4, think_time=1.0).requests
    by_id = {s.request_id: s for s in specs}
    res = serve_cluster(
        _caches("apc", 3, 200), specs, [CostModelExecutor() for _ in range(3)], make_router("round_robin", 3)
    )
    done = {r["request_id"]: r for r in res.requests}
    moved = 0
    for r in res.requests:
        spec = by_id[r["request_id"]]
        if spec.after is not None:
            prev = done[spec.after]
            assert r["arrival"] == pytest.approx(prev["finished_at"] + spec.think_time, abs=1e-12)
            moved += prev["replica"] != r["replica"]
    assert moved > 0  # round robin moved conversations between replicas


def test_session_keeps_each_conversation_on_one_replica():
    specs = make_workload("multi_turn_chat", seed=5, num_conversations=10, turns=4, rate=5.0).requests
    res = serve_cluster(
        _caches("apc", 3, 200), specs, [CostModelExecutor() for _ in range(3)], make_router("session", 3)
    )
    where: dict[str, set[int]] = {}
    for r in res.requests:
        where.setdefault(r["request_id"].split("-")[0], set()).add(r["replica"])
    assert all(len(replicas) == 1 for replicas in where.values())
    assert res.router_stats == {"new_session": 10, "sticky": 30}


def test_session_ids_follow_after_chains():
    specs = [
        RequestSpec("a0", np.arange(4), 1),
        RequestSpec("a1", np.arange(4), 1, after="a0"),
        RequestSpec("a2", np.arange(4), 1, after="a1"),
        RequestSpec("lone", np.arange(4), 1),
        RequestSpec("b1", np.arange(4), 1, after="missing"),  # its predecessor is not in the batch
    ]
    assert session_ids(specs) == {"a0": "a0", "a1": "a0", "a2": "a0"}


# -- what a router sees ------------------------------------------------------------------


def test_the_view_counts_queues_outstanding_tokens_and_kv_usage():
    specs = [RequestSpec(f"r{i}", np.arange(i * 100, i * 100 + 40, dtype=np.int32), 5) for i in range(3)]
    clock = VirtualClock(specs)
    s = VllmScheduler(
        CacheClient(create_cache("apc", num_pages=20, page_size=16)), CostModelExecutor(), ServingConfig(64, 2), clock
    )
    view = ReplicaView([s], clock, {})
    for i, spec in enumerate(specs):
        s.add(spec, 0.0, i)
    assert (view.waiting(0), view.running(0), view.requests(0)) == (3, 0, 3)
    assert view.outstanding_tokens(0) == 3 * (40 + 5) and view.kv_usage(0) == 0.0
    s.step()  # budget 64: r0's whole prompt and 24 tokens of r1's; r2 waits (max_running 2)
    view.invalidate(0)
    assert (view.waiting(0), view.running(0)) == (1, 2)
    # r0: prompt computed, 4 of 5 tokens to go (it sampled its first); r1: 16 prompt tokens left
    assert view.outstanding_tokens(0) == (0 + 4) + (16 + 5) + (40 + 5)
    assert view.kv_usage(0) == (3 + 2) / 20  # r0 holds 40 tokens (3 pages), r1 24 (2 pages)
    assert view.session(specs[0]) is None and view.page_size == 16


# -- bad input ----------------------------------------------------------------------------


class Wrong(Router):
    name = "wrong"

    def __init__(self, num_replicas: int, answer) -> None:
        super().__init__(num_replicas)
        self.answer = answer

    def route(self, request, view):
        return self.answer


@pytest.mark.parametrize("answer", [2, -1, True, 0.0, None])
def test_a_router_returning_an_invalid_replica_is_named_at_that_step(answer):
    specs = [RequestSpec(f"r{i}", np.arange(20, dtype=np.int32), 2, 0.5 * i) for i in range(3)]
    with pytest.raises(
        RouterError,
        match=r"router 'wrong' returned .* for request 'r0' at t=0\.000000 s; a replica index is an int in 0\.\.1",
    ):
        serve_cluster(_caches("apc", 2, 20), specs, [CostModelExecutor() for _ in range(2)], Wrong(2, answer))


def test_a_numpy_integer_is_a_replica_index():
    specs = [RequestSpec("r0", np.arange(20, dtype=np.int32), 2)]
    res = serve_cluster(_caches("apc", 2, 20), specs, [CostModelExecutor(), CostModelExecutor()], Wrong(2, np.int64(1)))
    assert res.requests[0]["replica"] == 1


def test_a_cluster_that_cannot_run_is_refused_before_any_work():
    specs = [RequestSpec("r0", np.arange(20, dtype=np.int32), 2)]
    with pytest.raises(ValueError, match="at least one replica"):
        serve_cluster([], specs, [], make_router("round_robin", 1))
    with pytest.raises(ValueError, match="one of each per replica"):
        serve_cluster(_caches("apc", 2, 20), specs, [CostModelExecutor()], make_router("round_robin", 2))
    with pytest.raises(ValueError, match="async scheduling runs one replica"):
        serve_cluster(
            _caches("apc", 2, 20),
            specs,
            [CostModelExecutor(), CostModelExecutor()],
            make_router("round_robin", 2),
            ServingConfig(async_scheduling=True),
        )
    with pytest.raises(InputError, match="at least one replica"):
        make_router("round_robin", 0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"replicas": 0}, "replicas .* must be an integer >= 1"),
        ({"replicas": 1, "router": "round_robin"}, "needs a cluster"),
        ({"replicas": 2}, "needs a router"),
        ({"replicas": 2, "router": "nope"}, "unknown router 'nope'"),
        ({"replicas": 2, "router": "cache_aware", "router_options": {"cache_threshold": 3.0}}, "share of the prompt"),
        ({"replicas": 2, "router": "round_robin", "async_scheduling": True}, "runs one replica's engine loop"),
        ({"replicas": 2, "router": "round_robin", "protocol": "both"}, "serving protocol only"),
    ],
)
def test_cell_config_refuses_a_cluster_it_cannot_run(fields, message):
    with pytest.raises(InputError, match=message):
        CellConfig("apc", "no_sharing", 4000, **{"protocol": "serving", **fields})


def test_a_one_replica_cell_reads_as_before_clusters():
    cfg = CellConfig("apc", "no_sharing", 4000)
    assert not {"replicas", "router", "router_options"} & set(cfg.as_dict())
    assert cfg.label == "apc"
    cluster = CellConfig("apc", "no_sharing", 4000, protocol="serving", replicas=4, router="cache_aware",
                         router_options={"cache_threshold": 0.5})  # fmt: skip
    assert cluster.as_dict()["replicas"] == 4 and cluster.key() != cfg.key()
    assert cluster.label == "apc ×4 cache_aware[cache_threshold=0.5]"


# -- cells and the command line ------------------------------------------------------------


def test_a_cluster_cell_has_cluster_and_per_replica_metrics():
    cfg = CellConfig("apc", "multi_turn_chat", 6000, knobs={"num_conversations": 12, "turns": 3}, protocol="serving",
                     replicas=3, router="session")  # fmt: skip
    res = run_cell(cfg)
    c = res["cluster"]
    assert (c["replicas"], c["router"], c["router_decisions"]) == (3, "session", 36)
    assert len(c["per_replica"]) == 3 and sum(p["requests"] for p in c["per_replica"]) == 36
    assert set(c["ttft_ms"]) == {"mean", "p50", "p90", "p99"} and c["ttft_ms"]["p50"] > 0
    served = [p["tokens_served"] for p in c["per_replica"]]
    assert c["load_imbalance"] == pytest.approx(max(served) / (sum(served) / 3))
    assert c["router_us_per_decision"] > 0 and c["router_counters"]["new_session"] == 12
    assert res["serving"]["hit_rate"] == c["hit_rate"] and "replay" not in res
    assert sorted({r["replica"] for r in res[PER_REQUEST]}) == [0, 1, 2]


def test_merged_timeline_sums_each_replicas_latest_pages():
    a = [(1.0, 5), (3.0, 2)]
    b = [(2.0, 7), (3.0, 1), (4.0, 0)]
    assert merged_timeline([a, b]) == [(1.0, 5), (2.0, 12), (3.0, 9), (3.0, 3), (4.0, 2)]


TINY = ["--workload", "multi_turn_chat", "--knob", "num_conversations=6", "--knob", "turns=2", "--no-bounds",
        "--no-progress", "--backend", "apc", "--capacity-tokens", "3000"]  # fmt: skip


def test_compare_runs_replicas_by_routers(tmp_path):
    out = tmp_path / "out"
    argv = ["compare", *TINY, "--replicas", "1", "3", "--router", "round_robin,cache_aware[cache_threshold=0.5]"]
    assert main([*argv, "--output-dir", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["backends"] == ["apc", "apc ×3 round_robin", "apc ×3 cache_aware[cache_threshold=0.5]"]
    single, rr, ca = doc["cells"]
    assert "replicas" not in single["config"] and "cluster" not in single and "replay" in single
    assert (rr["config"]["replicas"], rr["config"]["router"], rr["config"]["protocol"]) == (3, "round_robin", "serving")
    assert ca["config"]["router_options"] == {"cache_threshold": 0.5} and ca["cluster"]["router"] == "cache_aware"
    rows = [json.loads(line) for line in (out / "per_request.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 12
    assert all(list(r) == list(rows[0]) for r in rows)  # one schema: the file loads as one table
    assert (rows[0]["replicas"], rows[0]["router"], rows[0]["replica"]) == (1, None, 0)
    cluster_rows = [r for r in rows if r["router"] is not None]
    assert len(cluster_rows) == 24 and {r["replicas"] for r in cluster_rows} == {3}
    assert {r["replica"] for r in cluster_rows} <= {0, 1, 2} and len({r["replica"] for r in cluster_rows}) > 1
    assert list(cluster_rows[0])[3:5] == ["replicas", "router"] and list(cluster_rows[0])[-1] == "replica"
    report = (out / "report.md").read_text()
    assert "## Clusters at 3,000 tokens per replica" in report and "| apc ×3 round_robin |" in report
    assert "apc ×3 cache_aware[cache_threshold=0.5]" in (out / "results.csv").read_text()
    assert main(["report", str(out)]) == 0


def test_sweep_runs_cluster_sizes_and_routers(tmp_path):
    out = tmp_path / "sweep"
    argv = ["sweep", *TINY, "--replicas", "2", "3", "--router", "least_load", "--protocol", "serving"]
    assert main([*argv, "--output-dir", str(out)]) == 0
    doc = json.loads((out / "multi_turn_chat-p16" / "results.json").read_text())
    assert doc["backends"] == ["apc ×2 least_load", "apc ×3 least_load"]
    assert len(list((out / "cells").glob("*.json"))) == 2


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--replicas", "0"], 2, "must be positive"),
        (["--router", "round_robin"], 3, "add --replicas N with N > 1"),
        (["--router-opt", "seed=1"], 3, "add --replicas N with N > 1"),
        (["--replicas", "2", "--router", "nope"], 3, "unknown router 'nope'"),
        (["--replicas", "2", "--router", "random", "--router-opt", "sed=1"], 3, "it takes: seed"),
        (["--replicas", "2", "--router", "random", "--async-scheduling"], 3, "runs one replica's engine loop"),
        (["--replicas", "2", "--router", "random", "--protocol", "replay"], 3, "serving protocol only"),
    ],
)
def test_bad_cluster_input_is_refused_before_any_work(tmp_path, capsys, monkeypatch, extra, code, message):
    assert_refused_before_work(
        ["compare", *TINY, *extra, "--output-dir", str(tmp_path / "o")], code, message, capsys, monkeypatch
    )


def test_a_cluster_sweep_on_local_ray_matches_local_processes(tmp_path, capsys):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    if ray.is_initialized():
        ray.shutdown()
    argv = ["sweep", *TINY, "--replicas", "2", "--router", "round_robin,cache_aware", "--protocol", "serving"]
    outs = {}
    for where, extra in (("local", []), ("ray", ["--ray", "local"])):
        assert main([*argv, *extra, "--output-dir", str(tmp_path / where)]) == 0
        doc = json.loads((tmp_path / where / "multi_turn_chat-p16" / "results.json").read_text())
        outs[where] = [(c["config"]["router"], c["cluster"]["hit_rate"], c["cluster"]["ttft_ms"]) for c in doc["cells"]]
    assert outs["local"] == outs["ray"] and len(outs["ray"]) == 2
    assert not ray.is_initialized()
