"""The GPU path's CPU-testable parts: the measuring helpers of tests/test_gpu.py run with the
torch reference standing in for FlashInfer, the benchmark's timing and targets, the backend
rule, and (slow, only where the wheels were built) the AOT load test. Nothing here imports
flashinfer into this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from attention import TorchAttention, paged_attention
from attention.flashinfer_backend import FA2_MAX_QUERY, expected_backend, resolved_backend
from cachelib import available_backends, create_cache
from experiments.bench.gpu_timing import WallClock, time_calls, time_host
from tests.cached_runner import CachedRunner, RequestResult, run_alone
from tests.gpu_helpers import (
    MeasurementLog,
    build_case,
    contract_attention,
    fork_branches,
    greedy_agreement,
    measure_errors,
    measure_lse_errors,
)

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- which kernel family: the rule and the cases that must hit each ------------------------


def test_expected_backend_rule():
    assert expected_backend("decode", 1, sm90a=True) == "fa2"
    assert expected_backend("prefill", FA2_MAX_QUERY, sm90a=True) == "fa2"
    assert expected_backend("prefill", FA2_MAX_QUERY + 1, sm90a=True) == "fa3"
    assert expected_backend("prefill", 4096, sm90a=False) == "fa2"  # fa3 is Hopper-only
    with pytest.raises(ValueError, match="wrapper_kind"):
        expected_backend("append", 1, sm90a=True)
    with pytest.raises(ValueError, match="max_query_len"):
        expected_backend("prefill", 0, sm90a=True)


def test_resolved_backend_reads_each_wrapper_its_own_way():
    assert resolved_backend(SimpleNamespace(_backend="fa3"), "prefill") == "fa3"
    assert resolved_backend(SimpleNamespace(resolved_backend="fa2", _backend="auto"), "decode") == "fa2"
    with pytest.raises(RuntimeError, match="not resolved"):
        resolved_backend(SimpleNamespace(_backend="auto"), "prefill")
    with pytest.raises(ValueError, match="wrapper_kind"):
        resolved_backend(SimpleNamespace(_backend="fa2"), "ragged")


@pytest.mark.parametrize("backend", available_backends())
def test_cases_hit_both_kernel_families(backend):
    """'short' batches stay on fa2 and 'long' ones go to fa3 for every backend, cache hits or not."""
    short = build_case(backend, 16, "short", CPU, dtype=torch.float32)
    long = build_case(backend, 16, "long", CPU, dtype=torch.float32)
    assert short.max_query <= FA2_MAX_QUERY
    assert min(long.prefill_meta.q_lens) > FA2_MAX_QUERY
    assert short.decode_meta.is_decode and long.decode_meta.is_decode


# -- measured tolerances ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def case():
    return build_case("radix", 16, "long", CPU)  # bf16, cache hits, ragged batch


def test_reference_is_within_its_measured_bound(case):
    layer = case.kv.layers[0]
    out, lse = paged_attention(case.q, layer, case.prefill_meta, return_lse=True)  # bf16 out, fp32 inside
    errs = measure_errors(out, case.q, layer, case.prefill_meta)
    assert errs["within_bound"], errs
    assert 0 < errs["output_rounding_max_abs_err"] <= errs["bound"]
    assert errs["contract_max_abs_err"] > 0  # rounding P to bf16 costs something measurable
    lse_errs = measure_lse_errors(lse, case.q, layer, case.prefill_meta)
    assert lse_errs["lse_within_bound"] and lse_errs["lse_bound"] > 0, lse_errs


def test_contract_reference_is_close_to_exact(case):
    layer = case.kv.layers[0]
    exact = paged_attention(case.q.float(), layer.float(), case.prefill_meta)
    got = contract_attention(case.q, layer, case.prefill_meta)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, atol=0.05, rtol=0.05)


def test_measured_bound_rejects_wrong_kernels(case):
    """The bound must catch the bugs it is for: a missing causal mask, an off-by-one page."""
    layer = case.kv.layers[0]
    no_mask = paged_attention(case.q, layer, case.prefill_meta, causal=False)
    assert not measure_errors(no_mask, case.q, layer, case.prefill_meta)["within_bound"]
    swapped = layer.clone()
    swapped[case.prefill_meta.pages[0][0]] = layer[case.prefill_meta.pages[-1][0]]  # one wrong page
    wrong = paged_attention(case.q, swapped, case.prefill_meta)
    assert not measure_errors(wrong, case.q, layer, case.prefill_meta)["within_bound"]
    _, lse = paged_attention(case.q, layer, case.prefill_meta, return_lse=True)
    assert not measure_lse_errors(lse + 0.05, case.q, layer, case.prefill_meta)["lse_within_bound"]


# -- greedy agreement and copy-on-write ----------------------------------------------------------


def _result(tokens, logits):
    return RequestResult("x", [torch.tensor(lg, dtype=torch.float32) for lg in logits], list(tokens))


def test_greedy_agreement_classifies_ties():
    want = _result([0, 1], [[2.0, 1.0, 0.0], [0.0, 5.0, 0.0]])
    same = greedy_agreement({"a": _result([0, 1], [[2.0, 1.0, 0.0], [0.0, 5.0, 0.0]])}, {"a": want})
    assert same["mismatches"] == [] and same["steps_compared"] == 2 and same["max_logit_diff"] == 0
    # a real disagreement: margin 1.0, the runs' logits differ by 0.01
    real = greedy_agreement({"a": _result([1, 1], [[2.0, 1.01, 0.0], [0, 0, 0]])}, {"a": want})
    assert real["non_tie_mismatches"] == 1 and real["mismatches"][0]["step"] == 0
    # a tie: margin 0.001, logits differ by 0.01
    close = _result([0, 1], [[1.001, 1.0, 0.0], [0.0, 5.0, 0.0]])
    tie = greedy_agreement({"a": _result([1, 1], [[0.991, 1.0, 0.0], [0, 0, 0]])}, {"a": close})
    assert tie["non_tie_mismatches"] == 0 and tie["mismatches"][0]["tie"]


def test_fork_branches_copy_on_write_on_cpu(tiny_model):
    cache = create_cache("apc", num_pages=64, page_size=16)
    runner = CachedRunner(tiny_model, cache)
    prompt = np.arange(1, 39, dtype=np.int32)  # 38 tokens: the last page is partial
    got, forced = fork_branches(runner, prompt, 4, 6)
    assert runner.copied_pages > 0
    alone = {rid: run_alone(tiny_model, prompt, 6, forced=forced[rid]) for rid in got}
    agreement = greedy_agreement(got, alone)
    assert agreement["mismatches"] == [] and agreement["steps_compared"] == 24
    assert agreement["max_logit_diff"] < 1e-3  # fp32 on CPU: batching alone changes nothing
    cache.check_invariants()


def test_measurement_log_writes_json(tmp_path):
    log = MeasurementLog(tmp_path / "sub" / "m.json")
    log.record("a", x=1.5)
    log.record("b", y="fa3")
    data = json.loads((tmp_path / "sub" / "m.json").read_text())
    assert [r["case"] for r in data["records"]] == ["a", "b"] and data["records"][0]["x"] == 1.5
    assert not list((tmp_path / "sub").glob("*.tmp"))
    MeasurementLog(None).record("c")  # no path: kept in memory only


# -- timing and the benchmark's summary -----------------------------------------------------------


def test_time_calls_counts_and_divides():
    calls = []
    stats = time_calls(lambda: calls.append(1), WallClock(), warmup=2, repeat=3, inner=5)
    assert len(calls) == 2 + 3 * 5
    assert stats["repeat"] == 3 and stats["inner"] == 5 and stats["method"] == "perf_counter"
    assert 0 <= stats["min_ms"] <= stats["median_ms"] <= stats["max_ms"]
    with pytest.raises(ValueError, match="inner"):
        time_calls(lambda: None, WallClock(), warmup=0, repeat=1, inner=0)
    host = time_host(lambda: calls.append(1), repeat=4, sync=lambda: None)
    assert host["repeat"] == 4 and len(calls) == 2 + 15 + 4


def test_time_calls_reports_per_call_time():
    import time

    stats = time_calls(lambda: time.sleep(0.002), WallClock(), warmup=0, repeat=2, inner=3)
    assert 1.9 <= stats["min_ms"] < 20  # ~2 ms a call, not 6 ms a sample


def test_bench_targets_from_rows():
    from experiments.bench.gpu_attention_bench import targets

    report = {
        "decode": [{"page_size": 16, "fraction_of_peak_bandwidth": 0.83}],
        "prefill": [
            {"cached_tokens": 0, "prompt_tokens": 8192, "model_forward": {"median_ms": 700.0, "minus_host_ms": 690.0}},
            {
                "cached_tokens": 7360,
                "prompt_tokens": 8192,
                "model_forward": {"median_ms": 100.0, "minus_host_ms": 90.0},
            },
        ],
    }
    t = targets(report, peak=4.8e12)
    assert t["decode_page16_fraction_of_peak"]["met"] is True
    assert t["prefill_90pct_cached_speedup"]["measured"] == pytest.approx(7.0)
    assert t["prefill_90pct_cached_speedup"]["measured_without_host"] == pytest.approx(690 / 90)
    assert targets({"decode": [], "prefill": []}, peak=4.8e12) == {}
    assert "flashinfer" not in sys.modules


# -- the prebuilt modules (only where scripts/build_flashinfer_aot.sh has run) --------------------


@pytest.mark.slow
@pytest.mark.skipif(
    not list((ROOT / ".whl").glob("flashinfer_python-*.whl"))
    or not (ROOT / "build" / "flashinfer-aot" / "dl").is_dir(),
    reason="no wheels built here (scripts/build_flashinfer_aot.sh)",
)
def test_aot_wheels_load_with_jit_disabled():
    env = {**os.environ, "PY": sys.executable}
    r = subprocess.run(
        ["bash", "scripts/build_flashinfer_aot.sh", "--verify-only"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "verify: ok" in r.stdout and "loaded by flashinfer (JIT disabled)" in r.stdout


class _ReferenceAsKernel(TorchAttention):
    """The reference behind the benchmark's attention interface (which wrapper, which backend)."""

    active_kind: str | None = None

    def plan(self, meta, num_qo_heads, num_kv_heads, head_dim, dtype) -> None:
        super().plan(meta, num_qo_heads, num_kv_heads, head_dim, dtype)
        self.active_kind = "decode" if meta.is_decode else "prefill"

    def resolved_backend(self) -> str:
        return "torch-reference"


def test_bench_rows_on_cpu(tiny_model):
    """The benchmark's row building end to end on CPU: small shapes, the reference as kernel."""
    from experiments.bench.gpu_attention_bench import Bench, bench_decode, bench_prefill

    b = Bench(CPU, WallClock(), cfg=tiny_model.config, sm90a=True)
    att = _ReferenceAsKernel()
    d = bench_decode(b, att, 16, batch=2, context=40, warmup=0, repeat=2, inner=2, peak=1e12)
    assert d["flashinfer_wrapper"] == "decode" and d["expected_backend"] == "fa2"
    assert d["flashinfer_backend"] == "torch-reference" and d["inner"] == 2 and d["method"] == "perf_counter"
    assert d["achieved_GBps"] > 0 and d["plan_ms"] >= 0 and d["host_metadata_ms"] > 0
    assert d["fraction_of_peak_bandwidth"] == pytest.approx(d["achieved_GBps"] * 1e9 / 1e12)
    p = bench_prefill(b, att, tiny_model, 0.5, prompt=200, page_size=16, warmup=0, repeat=1, inner=1)
    assert (p["cached_tokens"], p["computed_tokens"]) == (96, 104)
    assert p["expected_backend"] == "fa3" and p["flashinfer_wrapper"] == "prefill"
    mf = p["model_forward"]
    assert mf["host_ms"] == pytest.approx(p["host_metadata_ms"] + p["plan_ms"])
    assert mf["minus_host_ms"] == pytest.approx(mf["median_ms"] - mf["host_ms"])
    assert "flashinfer" not in sys.modules


def test_bench_rows_feed_the_cost_model_calibration(tiny_model, tmp_path):
    """`--device-calibration` reads the rows the benchmark writes (decode GB/s)."""
    from experiments.bench.gpu_attention_bench import Bench, bench_decode
    from experiments.engine.executors import DEVICE_PROFILES

    b = Bench(CPU, WallClock(), cfg=tiny_model.config, sm90a=False)
    d = bench_decode(b, _ReferenceAsKernel(), 16, batch=2, context=40, warmup=0, repeat=1, inner=1, peak=1e12)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"decode": [d], "prefill": []}))
    cal = DEVICE_PROFILES["h200"].calibrated(path)
    assert cal.bandwidth_efficiency == pytest.approx(min(1.0, d["achieved_GBps"] * 1e9 / 4.8e12))
