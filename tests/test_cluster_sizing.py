"""Sizing, timing and the latency metrics of a serving run, and the bounds beside a cluster:
KV capacity from the device and model (experiments/runs/sizing.py) exact on hand-made cases;
arrivals re-timed (experiments/runs/retiming.py) by a scale exactly and by a seeded Poisson
process at the right rate; TTFT / TPOT / ITL / E2E and goodput exact on a hand-made run of
a fixed step time (experiments/report/metrics.py, engine/token_gaps.py); the pooled cache equal to
one cache replayed at the cluster's capacity; bad input refused before any work."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from cachelib import create_cache
from experiments.__main__ import main
from experiments.bounds.oracle import belady_hits
from experiments.engine import CostModelExecutor, FixedStepExecutor, ServingConfig, replay, serve
from experiments.engine.cluster import serve_cluster
from experiments.engine.executors import DEVICE_PROFILES, DeviceProfile, ModelShape, llama3_8b_shape
from experiments.engine.routers import make_router
from experiments.engine.token_gaps import TokenGaps
from experiments.errors import InputError
from experiments.report.cluster_metrics import cluster_section
from experiments.report.metrics import Slos, latency_ms, latency_section
from experiments.runs.retiming import on_their_own, poisson_arrivals, retime
from experiments.runs.runner import PER_REQUEST, CellConfig, bounds, build_workload, run_cell
from experiments.runs.sizing import CapacityGiven, KvSizing, SizingError
from experiments.workloads.registry import make_workload
from experiments.workloads.spec import RequestSpec
from tests.helpers import assert_refused_before_work

# -- capacity from the device and model -------------------------------------------------------

#: a hand-made model: 1,000 matmul + 500 embedding parameters of 2 bytes, 32 bytes of KV a token
SHAPE = ModelShape(1000, 2, 2, 4, 32, bytes_per_param=2, embedding_params=500)


@pytest.fixture
def toy_device(monkeypatch):
    monkeypatch.setitem(DEVICE_PROFILES, "toy", DeviceProfile("toy", 1e12, 1e12, memory_bytes=10_000))
    return "toy"


def test_capacity_arithmetic_on_a_hand_made_device(toy_device):
    s = KvSizing(SHAPE, page_size=4)
    assert SHAPE.weight_bytes == 3000 and s.page_bytes == 128
    # U = 0.5: floor(0.5 x 10,000) - 3,000 = 2,000 bytes = 15 pages of 128 (1,920) = 60 tokens
    assert s.kv_bytes_on(toy_device, 0.5) == 2000
    assert s.tokens_on(toy_device, 0.5) == 60
    assert s.tokens_on(toy_device, 0.3131) == 4  # floor(3,131) - 3,000 = 131 bytes: one page
    # 1e-6 GB = 1,000 bytes = 7 pages = 28 tokens
    assert s.tokens_for_gb(1e-6) == 28
    kv = s.describe(60, toy_device, {"gpu_memory_utilization": 0.5})
    assert kv == {
        "given": "gpu_memory_utilization",
        "tokens": 60,
        "pages": 15,
        "bytes": 1920,
        "gb": 1920 / 1e9,
        "kv_bytes_per_token": 32,
        "gpu_memory_utilization": 0.5,
        "device_memory_bytes": 10_000,
        "weight_bytes": 3000,
    }
    assert s.describe(61, toy_device, {})["given"] == "tokens" and s.describe(61, toy_device, {})["pages"] == 15


def test_llama3_8b_on_an_h200_at_vllms_default_utilization():
    shape = llama3_8b_shape()
    assert shape.weight_bytes == 8_030_261_248 * 2 and shape.kv_bytes_per_token == 131_072
    s = KvSizing(shape, 16)
    # 0.9 x 141e9 - 16,060,522,496 = 110,839,477,504 bytes = 52,852 pages of 2 MiB
    assert s.kv_bytes_on("h200", 0.9) == 110_839_477_504
    assert s.tokens_on("h200", 0.9) == 52_852 * 16
    assert s.tokens_for_gb(10) == 10**10 // (131_072 * 16) * 16
    assert CapacityGiven.of(None, None, [0.9], default=[1]).cells(16, "llama3-8b", "h200") == [
        (845_632, {"gpu_memory_utilization": 0.9})
    ]


def test_capacity_is_given_one_way_and_values_must_differ():
    assert CapacityGiven.of(None, None, None, default=[5, 5, 7]) == CapacityGiven("tokens", (5, 7))
    with pytest.raises(SizingError, match="--capacity-tokens and --capacity-gb each set"):
        CapacityGiven.of([1000], [1.0], None, default=[1])
    with pytest.raises(SizingError, match="give the same capacity"):
        CapacityGiven("capacity_gb", (1.0, 1.000001)).cells(16, "llama3-8b", "h200")
    with pytest.raises(SizingError, match="no memory size"):
        KvSizing(llama3_8b_shape(), 16).tokens_on("cpu", 0.9)
    with pytest.raises(SizingError, match="after the weights"):
        KvSizing(llama3_8b_shape(), 16).tokens_on("h200", 0.1)  # 14.1 GB < 16.06 GB of weights


def test_a_cell_records_its_capacity_in_tokens_and_gb():
    tokens = KvSizing(llama3_8b_shape(), 16).tokens_for_gb(0.5)
    cfg = CellConfig("apc", "no_sharing", tokens, capacity_gb=0.5, knobs={"num_requests": 8}, protocol="serving")
    kv = run_cell(cfg)["kv_capacity"]
    assert (kv["given"], kv["tokens"], kv["capacity_gb"]) == ("capacity_gb", tokens, 0.5)
    assert kv["bytes"] == tokens * 131_072 and 0.5 - 16 * 131_072 / 1e9 < kv["gb"] <= 0.5  # whole pages of 2 MiB
    with pytest.raises(InputError, match="is not what capacity_gb 0.5 gives"):
        run_cell(dataclasses.replace(cfg, capacity_tokens=tokens + 16))


# -- arrivals re-timed ---------------------------------------------------------------------------


def _chat() -> list[RequestSpec]:
    return make_workload("multi_turn_chat", seed=3, num_conversations=5, turns=3, rate=2.0).requests


def test_time_scale_multiplies_every_arrival_and_think_time_exactly():
    specs = _chat()
    got = retime(specs, time_scale=2.5)
    assert [s.arrival for s in got] == [s.arrival * 2.5 for s in specs]
    assert [s.think_time for s in got] == [s.think_time * 2.5 for s in specs]
    assert [(s.request_id, s.after, s.output_len) for s in got] == [
        (s.request_id, s.after, s.output_len) for s in specs
    ]
    assert retime(specs) == specs


def test_poisson_retiming_is_seeded_reproducible_and_at_the_rate():
    n, rate = 20_000, 5.0
    t = poisson_arrivals(n, rate, seed=7)
    assert np.array_equal(t, poisson_arrivals(n, rate, seed=7))
    assert not np.array_equal(t, poisson_arrivals(n, rate, seed=8))
    assert t[-1] == pytest.approx(n / rate, rel=1e-12)  # vLLM's rescaling: the mean rate is exactly R
    gaps = np.diff(np.concatenate(([0.0], t)))
    assert (gaps > 0).all() and gaps.mean() == pytest.approx(1 / rate, rel=1e-12)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)  # exponential gaps: CV 1
    assert not poisson_arrivals(4, math.inf, seed=7).any()


def test_poisson_retimes_only_requests_on_their_own_in_arrival_order():
    specs = _chat()
    got = retime(specs, request_rate=4.0, seed=1)
    own = on_their_own(specs)
    assert len(own) == 5 and all(specs[i].after is None for i in own)
    assert [got[i].arrival for i in own] == poisson_arrivals(5, 4.0, seed=1).tolist()
    for i, (s, g) in enumerate(zip(specs, got, strict=True)):
        if i not in own:  # a dependent turn still follows its predecessor, its think time kept
            assert (g.arrival, g.think_time, g.after) == (s.arrival, s.think_time, s.after)


def test_a_retimed_cell_serves_at_the_new_arrivals():
    cfg = CellConfig("apc", "no_sharing", 20_000, knobs={"num_requests": 12}, protocol="serving", request_rate=3.0)
    res = run_cell(cfg)
    want = poisson_arrivals(12, 3.0, seed=cfg.seed).tolist()
    assert sorted(r["arrival"] for r in res[PER_REQUEST]) == want
    assert res["config"]["request_rate"] == 3.0


# -- latencies and goodput, exact on a hand-made run ---------------------------------------------

#: A (4-token prompt, 6 tokens out) and B (4, 3) on 3 pages of 4 tokens, a 10 ms step: both
#: prefill in step 1; in step 2 B cannot grow and is preempted (it is the last running); A
#: decodes alone (a decode window under vllm) until it finishes at step 6, evicting B's cached
#: page for its third page; B recomputes in step 7 and finishes in step 8.
A = RequestSpec("A", np.arange(1, 5, dtype=np.int32), 6)
B = RequestSpec("B", np.arange(101, 105, dtype=np.int32), 3)


def _ends(k: int) -> list[float]:
    """Step ends of k 10 ms steps, accumulated as the clock accumulates them."""
    out = [0.0]
    for _ in range(k):
        out.append(out[-1] + 0.01)
    return out


def test_ttft_tpot_itl_e2e_and_goodput_on_a_hand_made_run():
    res = serve(create_cache("apc", num_pages=3, page_size=4), [A, B], FixedStepExecutor(0.01), ServingConfig(64, 8))
    t = _ends(8)
    a, b = sorted(res.requests, key=lambda r: r["request_id"])
    assert (a["preemptions"], b["preemptions"], a["finished_at"], b["finished_at"]) == (0, 1, t[6], t[8])
    itl = [t[i + 1] - t[i] for i in range(1, 6)] + [t[7] - t[1], t[8] - t[7]]  # A's five, B's two
    assert sorted(res.itl.expanded().tolist()) == sorted(itl)
    got = latency_section(res.requests, res.itl, res.makespan, Slos(ttft_ms=50, tpot_ms=20))
    assert got["ttft_ms"] == latency_ms([t[1], t[1]])
    assert got["tpot_ms"] == latency_ms([(t[6] - t[1]) / 5, (t[8] - t[1]) / 2])  # 10 ms and 35 ms
    assert got["itl_ms"] == latency_ms(itl)
    assert got["itl_ms"]["mean"] == pytest.approx(120 / 7) and got["itl_ms"]["p99"] == pytest.approx(57.0)
    assert got["e2e_ms"] == latency_ms([t[6], t[8]])
    # B's TPOT (35 ms) misses 20 ms: one good request over the 80 ms run
    assert got["goodput"] == {"slo_ttft_ms": 50, "slo_tpot_ms": 20, "good_requests": 1, "requests_per_s": 1 / t[8]}
    assert latency_section(res.requests, res.itl, res.makespan, Slos(tpot_ms=40))["goodput"]["good_requests"] == 2
    assert latency_section(res.requests, res.itl, res.makespan, Slos(ttft_ms=5))["goodput"]["good_requests"] == 0
    assert "goodput" not in latency_section(res.requests, res.itl, res.makespan)


def test_a_one_token_request_meets_any_tpot_slo_as_in_vllm():
    one = RequestSpec("one", np.arange(1, 5, dtype=np.int32), 1)
    res = serve(create_cache("apc", num_pages=3, page_size=4), [one], FixedStepExecutor(0.01))
    got = latency_section(res.requests, res.itl, res.makespan, Slos(tpot_ms=1e-9))
    assert got["goodput"]["good_requests"] == 1 and got["tpot_ms"]["mean"] is None and res.itl.total == 0


def test_a_clusters_latencies_per_replica_and_whole():
    caches = [create_cache("apc", num_pages=3, page_size=4) for _ in range(2)]
    executors = [FixedStepExecutor(0.01), FixedStepExecutor(0.01)]
    res = serve_cluster(caches, [A, B], executors, make_router("round_robin", 2))
    c = cluster_section(res, [cache.stats() for cache in caches], {}, Slos(tpot_ms=20))
    t = _ends(6)
    a_gaps, b_gaps = [t[i + 1] - t[i] for i in range(1, 6)], [t[2] - t[1], t[3] - t[2]]  # alone, nobody preempts
    assert c["per_replica"][0]["itl_ms"] == latency_ms(a_gaps) and c["per_replica"][1]["itl_ms"] == latency_ms(b_gaps)
    assert c["itl_ms"] == latency_ms(a_gaps + b_gaps)
    assert c["e2e_ms"] == latency_ms([t[6], t[3]])
    # goodput over the cluster's 60 ms, both good: the replicas' add up to the cluster's
    assert c["goodput"]["requests_per_s"] == 2 / t[6]
    assert sum(p["goodput"]["requests_per_s"] for p in c["per_replica"]) == pytest.approx(2 / t[6])


class NoWindows(CostModelExecutor):
    supports_decode_windows = False


def test_every_gap_once_and_windows_give_the_same_gaps_as_single_steps():
    specs = make_workload("shared_doc_qa", seed=2, num_documents=6, num_requests=60, rate=40.0, doc_len=400).requests
    cfg = ServingConfig(1024, 12)
    windows = serve(create_cache("apc", num_pages=150, page_size=16), specs, CostModelExecutor(), cfg)
    single = serve(create_cache("apc", num_pages=150, page_size=16), specs, NoWindows(), cfg)
    assert windows.preemptions > 0 and len(windows.requests) == len(single.requests)
    got, want = np.sort(windows.itl.expanded()), np.sort(single.itl.expanded())
    # windows accumulate the clock step by step: the same floats
    assert windows.requests == single.requests and np.array_equal(got, want)
    done = [r for r in windows.requests if r["sample_of"] is None and r["generated"] > 0]
    assert windows.itl.total == sum(r["generated"] - 1 for r in done)
    spans = sum(r["finished_at"] - r["first_token_at"] for r in done)
    assert windows.itl.expanded().sum() == pytest.approx(spans, rel=1e-9)


def test_async_scheduling_records_every_gap_once():
    specs = make_workload("multi_turn_chat", seed=2, num_conversations=12, turns=3, rate=3.0).requests
    res = serve(create_cache("apc", num_pages=150, page_size=16), specs, FixedStepExecutor(0.02),
                ServingConfig(1024, 12, async_scheduling=True))  # fmt: skip
    done = [r for r in res.requests if r["generated"] > 0]
    assert res.itl.total == sum(r["generated"] - 1 for r in done)
    assert res.itl.expanded().sum() == pytest.approx(sum(r["finished_at"] - r["first_token_at"] for r in done))


def test_token_gaps_merge_and_group_a_steps_regular_gaps():
    """Two requests' tokens through the delivery rule: steps at 1.0 and 1.5 (both), 2.0 (a
    only), 3.0 (both: b missed a step, its own gap), then a window of steps ending at 4.0,
    4.25, 5.0."""
    from experiments.engine.kernels import deliver

    known, generated, target = np.zeros(2, np.int64), np.zeros(2, np.int64), np.full(2, 99, np.int64)
    has_first, timed, last = np.zeros(2, bool), np.ones(2, bool), np.full(2, np.nan)
    g = TokenGaps()

    def step(got, at, last_at=None, k=1):
        prev = g.last_step
        tokens = np.array(got, dtype=np.int64) * k
        _, _, gaps, regular = deliver(
            known, generated, target, has_first, timed, last, tokens, at, at if last_at is None else last_at,
            0.0 if prev is None else prev, prev is not None,
        )  # fmt: skip
        g.add_step(gaps.tolist(), int(regular), at)

    step([1, 1], 1.0)
    step([1, 1], 1.5)
    step([1, 0], 2.0)
    step([1, 1], 3.0)
    ends = np.array([4.0, 4.25, 5.0])
    step([1, 1], 4.0, last_at=5.0, k=3)
    g.add_window_steps(ends, 2)
    assert list(zip(g.values, g.counts, strict=True)) == [
        (0.5, 2),
        (0.5, 1),
        (1.5, 1),
        (1.0, 1),
        (1.0, 2),
        (0.25, 2),
        (0.75, 2),
    ]
    assert TokenGaps.merged([g, g]).total == 2 * g.total == 22


# -- the pooled bound ----------------------------------------------------------------------------


def test_the_pooled_bound_is_one_cache_replayed_at_the_clusters_capacity():
    knobs = {"num_documents": 30, "num_requests": 200, "doc_len": 400}
    cluster = CellConfig("apc", "shared_doc_qa", 4000, knobs=knobs, protocol="serving", replicas=3, router="random")
    wl = build_workload(cluster)
    got = bounds(wl, 16, [4000], [cluster, dataclasses.replace(cluster, router="round_robin")])
    pooled = got["pooled"]["12000"]
    alone = replay(create_cache("apc", num_pages=750, page_size=16), wl.requests)
    assert pooled["replay"] == {"apc": {"hit_rate": alone["hit_rate"], "hit_tokens": alone["hit_tokens"]}}
    belady = belady_hits(wl.requests, 16, 750)
    assert pooled["belady"] == {"hit_rate": belady["hit_rate"], "hit_tokens": belady["hit_tokens"]}
    assert pooled["shapes"] == [[3, 4000]] and pooled["capacity_tokens"] == 12000
    assert got["belady"]["4000"]["hit_rate"] < belady["hit_rate"] <= got["infinite"]["hit_rate"]
    assert "pooled" not in bounds(wl, 16, [4000], [dataclasses.replace(cluster, replicas=1, router=None)])


# -- the command line ------------------------------------------------------------------------------

TINY = ["--workload", "multi_turn_chat", "--knob", "num_conversations=6", "--knob", "turns=2", "--no-progress",
        "--backend", "apc"]  # fmt: skip


def test_compare_with_sizing_timing_slos_and_pooled_bounds(tmp_path):
    out = tmp_path / "out"
    argv = ["compare", *TINY, "--capacity-gb", "0.4", "--replicas", "1", "2", "--router", "round_robin",
            "--time-scale", "0.5", "--slo-ttft-ms", "200", "--slo-tpot-ms", "30", "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    tokens = KvSizing(llama3_8b_shape(), 16).tokens_for_gb(0.4)
    assert doc["capacities"] == [tokens] and doc["settings"]["time_scale"] == 0.5
    single, rr = doc["cells"]
    for cell in (single, rr):
        assert cell["config"]["capacity_gb"] == 0.4 and cell["kv_capacity"]["tokens"] == tokens
        lat = cell["serving"]["latency"]
        assert set(lat) == {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput"} and lat["itl_ms"]["p50"] > 0
    assert set(rr["cluster"]["per_replica"][0]) >= {"itl_ms", "e2e_ms", "goodput"}
    assert doc["bounds"]["pooled"][str(2 * tokens)]["replay"]["apc"]["hit_rate"] > 0
    report = (out / "report.md").read_text()
    assert f"## Capacity {tokens:,} tokens (0.40 GB of KV for llama3-8b, --capacity-gb 0.4)" in report
    assert "## Latency and throughput at" in report and "| *pooled 2 ×" in report
    assert "request goodput (req/s)" in report
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert {"capacity_gb", "kv_capacity.gb", "serving.latency.itl_ms.p99"} <= set(header)


def test_sweep_sizes_each_page_size_on_its_own(tmp_path):
    out = tmp_path / "sweep"
    argv = ["sweep", *TINY, "--gpu-memory-utilization", "0.12", "--model", "tiny", "--page-size", "16", "48",
            "--protocol", "serving", "--no-bounds", "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    for page in (16, 48):
        doc = json.loads((out / f"multi_turn_chat-p{page}" / "results.json").read_text())
        kv = doc["cells"][0]["kv_capacity"]
        assert (
            doc["capacities"] == [kv["tokens"]] and kv["tokens"] % page == 0 and kv["given"] == "gpu_memory_utilization"
        )


@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (["--capacity-tokens", "3000", "--capacity-gb", "1"], 3, "--capacity-tokens and --capacity-gb each set"),
        (["--capacity-gb", "1", "--gpu-memory-utilization", "0.9"], 3, "--capacity-gb and --gpu-memory-utilization"),
        (["--gpu-memory-utilization", "1.5"], 2, "must be at most 1"),
        (["--gpu-memory-utilization", "0.1"], 3, "after the weights"),
        (["--gpu-memory-utilization", "0.9", "--device", "cpu"], 3, "no memory size"),
        (["--capacity-gb", "1", "1.0000001"], 3, "give the same capacity"),
        (["--capacity-gb", "0"], 2, "must be positive"),
        (["--time-scale", "2", "--request-rate", "4"], 3, "--time-scale and --request-rate both given"),
        (["--request-rate", "0"], 2, "must be positive"),
        (["--request-rate", "nan"], 2, "must be positive and finite"),
        (["--time-scale", "inf"], 2, "must be positive and finite"),
        (["--slo-ttft-ms", "-5"], 2, "must be positive"),
        (["--request-rate", "4", "--protocol", "replay"], 3, "--protocol replay has none"),
        (["--slo-tpot-ms", "10", "--protocol", "replay"], 3, "--protocol replay has none"),
    ],
)
def test_bad_sizing_and_timing_are_refused_before_any_work(tmp_path, capsys, monkeypatch, extra, code, message):
    assert_refused_before_work(
        ["compare", *TINY, *extra, "--output-dir", str(tmp_path / "o")], code, message, capsys, monkeypatch
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"capacity_gb": -1.0}, "must be a positive number and finite"),
        ({"gpu_memory_utilization": 1.2}, "and at most 1"),
        ({"request_rate": float("nan")}, "(or inf)"),
        ({"capacity_gb": 1.0, "gpu_memory_utilization": 0.9}, "each sets the KV capacity"),
        ({"time_scale": 2.0, "request_rate": 1.0}, "leaving none to scale"),
        ({"slo_ttft_ms": 10.0, "protocol": "replay"}, "has none"),
    ],
)
def test_cell_config_refuses_bad_sizing_and_timing(fields, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        CellConfig("apc", "no_sharing", 4000, **fields)


def test_a_plain_cell_reads_and_is_keyed_as_before():
    plain = CellConfig("apc", "no_sharing", 4000)
    assert plain.plain and not {"capacity_gb", "time_scale", "request_rate", "slo_ttft_ms"} & set(plain.as_dict())
    timed = dataclasses.replace(plain, request_rate=math.inf)
    assert not timed.plain and timed.as_dict()["request_rate"] == math.inf and timed.key() != plain.key()


@pytest.mark.parametrize("n", [1, 2, 5, 1000, 100_001])
def test_latency_quantiles_are_numpys_one_by_one(n):
    """`latency_ms` takes every quantile in one `np.percentile` call: each must equal the
    call of its own, to the bit (ties, even and odd counts)."""
    from experiments.report.metrics import QUANTILES

    rng = np.random.default_rng(n)
    seconds = rng.exponential(0.03, n)
    seconds[::3] = seconds[0]
    got = latency_ms(seconds)
    ms = seconds * 1000.0
    assert got == {"mean": float(ms.mean()), **{k: float(np.percentile(ms, q)) for k, q in QUANTILES}}
