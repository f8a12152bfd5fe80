"""Calibration, shown: every timing model beside every measured source available offline.

    python -m experiments.timing.calibration --output-dir reports/calibration   (make calibration)

writes `report.md` and `calibration.json` (per source and timing model: `name`, `points`,
`median_abs_pct_error`, `p90_abs_pct_error`, and the same per model and GPU). The sources:

- `vidur-linear`: vidur's measured time of one decoder layer outside attention (A100 and
  H100; Llama-2/3 and Qwen-72B; tensor-parallel degrees 1-8; 1 to 32k tokens), the
  shipped profiles' `linear` rows. The roofline predicts it as its matmul FLOPs or its
  weight bytes, whichever takes longer; the profile executor by interpolation with every
  other point held out (it is not judged on the points it was given).
- `vidur-all-reduce`: vidur's NCCL all-reduce times on one DGX node (2, 4, 8 GPUs), the
  profiles' `all_reduce` rows, against the roofline's ring model and, held out as above,
  the profile's interpolation.

- `dynamo-h200-prefill`, `dynamo-h200-decode`: vLLM's TTFT of one request by prompt length,
  and its ITL by batch and context, measured on one H200 with Llama-3.1-8B-Instruct-FP8 by
  NVIDIA Dynamo's SLA profiler (shipped as test data in the ai-dynamo 1.6.1 wheel;
  `experiments/timing/sources/`, Apache-2.0). The roofline predicts a prefill as its chunks
  of 8,192 tokens, a decode step as one of `min(batch, 1024)` requests (vLLM's default
  `max_num_seqs` on such a GPU); no profile exists for this model and GPU.

Not yet here (each is a gap the report names): vidur's attention times (stored with Git
LFS, unavailable), published end-to-end vLLM/SGLang serving benchmarks, and this
project's own GPU runs (`scripts/gpu_check.sh` writes a profile where a GPU is lent).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from experiments.engine.executors import DEVICE_PROFILES, CostModelExecutor, DeviceProfile, ModelShape
from experiments.runs.output_dir import write_file_atomically
from experiments.timing.profile import Curve, StepProfile, load_profile, shipped_profiles
from experiments.timing.zoo import ModelSpec, resolve_model

#: the timing models calibrated, as the command line names them
MODELS = ("roofline", "profile")


def roofline_linear_ms(spec: ModelSpec, device: DeviceProfile, tp: int, tokens: np.ndarray) -> np.ndarray:
    """The roofline's time for one layer outside attention: its matmuls (2 FLOPs per weight
    per token) or reading its weights, whichever takes longer, on each of `tp` GPUs."""
    params = (spec.layer_params(active=True) - 2 * spec.hidden) / tp
    compute = 2.0 * params * tokens / (device.peak_flops * device.flops_efficiency)
    memory = spec.layer_params() / tp * spec.dtype_bytes / (device.mem_bandwidth * device.bandwidth_efficiency)
    return 1e3 * np.maximum(compute, memory)


def roofline_all_reduce_ms(spec: ModelSpec, device: DeviceProfile, tp: int, tokens: np.ndarray) -> np.ndarray:
    """The roofline's ring all-reduce of `tokens` hidden states (bf16) over `tp` GPUs
    (`CostModelExecutor.all_reduce_seconds` per all-reduce)."""
    nbytes = tokens * spec.hidden * 2.0
    return 1e3 * (2 * (tp - 1) / tp * nbytes / (device.link_bandwidth * device.link_efficiency) + device.link_latency_s)


def held_out(curve: Curve) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, measured, predicted) at every other point, predicted from the others alone;
    points past the last kept one are left out (that would judge extrapolation)."""
    kept = Curve(curve.x[::2], curve.y[::2])
    x, y = curve.x[1::2], curve.y[1::2]
    inside = x < kept.x[-1]
    return x[inside], y[inside], kept(x[inside])


def errors(measured: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    return 100.0 * np.abs(predicted - measured) / measured


def summary(name: str, errs: np.ndarray) -> dict[str, Any]:
    return {
        "name": name,
        "points": int(errs.size),
        "median_abs_pct_error": float(np.median(errs)) if errs.size else None,
        "p90_abs_pct_error": float(np.percentile(errs, 90)) if errs.size else None,
    }


def calibrate(tables: dict[tuple[str, str], Path] | None = None) -> dict[str, Any]:
    """Every (source, timing model): its errors overall and per table."""
    tables = shipped_profiles() if tables is None else tables
    profiles = {key: load_profile(path) for key, path in tables.items()}
    sources = []
    for source, op in (("vidur-linear", "linear"), ("vidur-all-reduce", "all_reduce")):
        for model in MODELS:
            per_table, every = [], []
            for (m, g), profile in sorted(profiles.items()):
                errs = _errors_of(profile, op, model)
                if errs.size:
                    per_table.append(summary(f"{m} on {g}", errs))
                    every.append(errs)
            entry = summary(f"{source} / {model}", np.concatenate(every) if every else np.zeros(0))
            entry.update(source=source, timing_model=model, per_table=per_table)
            sources.append(entry)
    sources += dynamo_sources()
    return {
        "schema_version": 1,
        "sources": sources,
        "tables": {f"{m} on {g}": Path(p.path).name for (m, g), p in sorted(profiles.items())},
        "not_yet": [
            "vidur attention times (attention.csv is stored with Git LFS and was not available)",
            "a profile for the Dynamo source's model and GPU (Llama-3.1-8B FP8 on H200): none is shipped",
            "published vLLM/SGLang serving benchmarks (end to end, with their citation)",
            "this project's own GPU measurements (scripts/gpu_check.sh, when a GPU is lent)",
        ],
    }


@functools.cache
def calibrate_once() -> dict[str, Any]:
    """`calibrate()` of the shipped tables, once per process (reports ask for it per document)."""
    return calibrate()


def headline(executor: str) -> str:
    """One sentence for a report: the timing model and its error against the measured
    layer times (vidur's), as `make calibration` computes it."""
    result = calibrate_once()
    model = "roofline" if executor == "cost" else "profile"
    by = {s["source"]: s for s in result["sources"] if s["timing_model"] == model}
    lin, ar = by["vidur-linear"], by["vidur-all-reduce"]
    what = (
        "a roofline of the model on the device (FLOPs or bytes, whichever takes longer)"
        if model == "roofline"
        else "measured operator times (a profile table), interpolated; attention from the roofline where the table has none"
    )
    served = ""
    if model == "roofline":
        pre, dec = by["dynamo-h200-prefill"], by["dynamo-h200-decode"]
        served = (
            f"; against vLLM's TTFT and ITL measured on an H200 (NVIDIA Dynamo's profiler) "
            f"{pre['median_abs_pct_error']:.2g}% and {dec['median_abs_pct_error']:.2g}% (p90 "
            f"{pre['p90_abs_pct_error']:.2g}% and {dec['p90_abs_pct_error']:.2g}%)"
        )
    return (
        f"{what}; against vidur's measured layer times its median error is {lin['median_abs_pct_error']:.2g}% "
        f"(p90 {lin['p90_abs_pct_error']:.2g}%), all-reduce {ar['median_abs_pct_error']:.2g}%{served} "
        "(reports/calibration; attention alone is not yet calibrated)."
    )


def interpolation_error() -> float:
    """The profile executor's median error on the shipped tables' held-out layer times."""
    return next(
        s for s in calibrate_once()["sources"] if s["source"] == "vidur-linear" and s["timing_model"] == "profile"
    )["median_abs_pct_error"]


#: the measured serving points shipped as calibration sources (experiments/timing/sources/)
SOURCES_DIR = Path(__file__).parent / "sources"
#: vLLM's defaults the Dynamo source ran with: a step's token budget and its running limit
PREFILL_CHUNK, MAX_NUM_SEQS = 8192, 1024


def dynamo_sources() -> list[dict[str, Any]]:
    """The roofline against Dynamo's H200 measurements, prefill (TTFT) and decode (ITL)."""
    path = SOURCES_DIR / "dynamo_h200_llama3.1-8b-fp8.csv"
    rows = [line.split(",") for line in path.read_text().splitlines() if line and not line.startswith(("#", "kind"))]
    cost = CostModelExecutor(ModelShape.from_spec(resolve_model("llama3.1-8b-fp8")), "h200")
    out = []
    for kind in ("prefill", "decode"):
        measured, predicted = [], []
        for _, tokens, context, batch, ms in (r for r in rows if r[0] == kind):
            measured.append(float(ms))
            if kind == "prefill":
                t = int(tokens)
                chunks = [(min(PREFILL_CHUNK, t - s), s) for s in range(0, t, PREFILL_CHUNK)]
                predicted.append(1e3 * sum(cost.batch_seconds(np.array([n]), np.array([s])) for n, s in chunks))
            else:
                b = min(int(batch), MAX_NUM_SEQS)
                predicted.append(1e3 * cost.batch_seconds(np.ones(b, dtype=np.int64), np.full(b, int(context))))
        errs = errors(np.array(measured), np.array(predicted))
        entry = summary(f"dynamo-h200-{kind} / roofline", errs)
        entry.update(
            source=f"dynamo-h200-{kind}",
            timing_model="roofline",
            per_table=[summary("llama3.1-8b-fp8 on h200", errs)],
            measured_ms=measured,
            predicted_ms=[round(p, 4) for p in predicted],
        )
        out.append(entry)
    return out


def _errors_of(profile: StepProfile, op: str, model: str) -> np.ndarray:
    curves = profile.linear if op == "linear" else profile.all_reduce
    device = DEVICE_PROFILES[profile.device]
    out = []
    for tp, curve in sorted(curves.items()):
        if model == "profile":
            _, y, predicted = held_out(curve)
        else:
            y = curve.y
            fn = roofline_linear_ms if op == "linear" else roofline_all_reduce_ms
            predicted = fn(profile.model, device, tp, curve.x)
        out.append(errors(y, predicted))
    return np.concatenate(out) if out else np.zeros(0)


def render(result: dict[str, Any]) -> str:
    lines = [
        "# Calibration: the timing models against measured step parts",
        "",
        "Generated by `make calibration` (`python -m experiments.timing.calibration`); the numbers are",
        "in `calibration.json`. Absolute error of each prediction, in % of the measurement.",
        "",
        "| source | timing model | points | median abs % error | p90 abs % error |",
        "|---|---|---:|---:|---:|",
    ]
    for s in result["sources"]:
        lines.append(
            f"| {s['source']} | {s['timing_model']} | {s['points']:,} | {_pct(s['median_abs_pct_error'])} | {_pct(s['p90_abs_pct_error'])} |"
        )
    lines += ["", "## Per table", ""]
    for s in result["sources"]:
        lines.append(
            f"**{s['source']} / {s['timing_model']}**: "
            + "; ".join(
                f"{t['name']} {_pct(t['median_abs_pct_error'])} (p90 {_pct(t['p90_abs_pct_error'])})"
                for t in s["per_table"]
            )
        )
        lines.append("")
    lines += ["## Not yet calibrated against", ""] + [f"- {n}" for n in result["not_yet"]]
    return "\n".join(lines) + "\n"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}%"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="calibrate the timing models against the measured sources")
    ap.add_argument("--output-dir", type=Path, default=Path("reports/calibration"))
    args = ap.parse_args(argv)
    result = calibrate()
    args.output_dir.mkdir(parents=True, exist_ok=True)
    write_file_atomically(args.output_dir / "calibration.json", json.dumps(result, indent=1) + "\n")
    write_file_atomically(args.output_dir / "report.md", render(result))
    for s in result["sources"]:
        print(
            f"{s['source']} / {s['timing_model']}: median {_pct(s['median_abs_pct_error'])}, p90 {_pct(s['p90_abs_pct_error'])} over {s['points']:,} points"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
