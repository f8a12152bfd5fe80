"""GPU attention benchmark: FlashInfer decode and prefill on the shapes the comparison uses.

- decode: batch 64 x 4096-token contexts, llama3-8b attention shapes (32 query heads, 8 KV
  heads, head_dim 128, bf16), page sizes 1 / 16 / 64, pages scattered over the pool as a
  long-running cache leaves them; kernel time (one layer) and achieved GB/s of KV read.
- prefill: the llama3-8b model (seeded dummy weights) on an 8192-token prompt with 0 / 50 /
  90 % of it already in the cache: time of the forward over the uncached suffix, and of the
  attention kernel alone (one layer) for the same batch.

Timing: warm-ups, then `--repeat` runs each bracketed by `torch.cuda.synchronize()` and
timed with `perf_counter`; medians reported. Writes JSON (`--output`).
Run: `PYTHONPATH=. python3 experiments/bench/gpu_attention_bench.py --output reports/gpu/x.json`
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from attention import PRESETS, ForwardInput, LlamaModel, build_batch_meta  # noqa: E402
from attention.flashinfer_backend import FlashInferAttention  # noqa: E402
from attention.kv_cache import PagedKVCache  # noqa: E402
from experiments.bench import RESULTS  # noqa: E402

CFG = PRESETS["llama3-8b"]


def timed(fn: Callable[[], object], *, warmup: int, repeat: int) -> dict[str, float]:
    """Median / min / max milliseconds of `fn`, device synchronized around every run."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()  # the kernel is asynchronous: wait before reading the timer
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "repeat": repeat}


def scattered_tables(batch: int, pages_each: int, num_pages: int, gen: torch.Generator) -> list[list[int]]:
    perm = torch.randperm(num_pages, generator=gen)[: batch * pages_each].view(batch, pages_each)
    return perm.tolist()


def bench_decode(page_size: int, *, batch: int, context: int, warmup: int, repeat: int) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(page_size)
    pages_each = -(-context // page_size)
    num_pages = batch * pages_each
    kv = PagedKVCache(1, num_pages, page_size, CFG.num_kv_heads, CFG.head_dim, dtype=torch.bfloat16, device=dev)
    kv.layers[0].normal_()
    tables = scattered_tables(batch, pages_each, num_pages, gen)
    meta = build_batch_meta(tables, [context - 1] * batch, [1] * batch, page_size, num_pages=num_pages, device=dev)
    q = torch.randn(batch, CFG.num_heads, CFG.head_dim, device=dev, dtype=torch.bfloat16)
    att = FlashInferAttention(dev)
    t0 = time.perf_counter()
    att.plan(meta, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, torch.bfloat16)
    plan_ms = (time.perf_counter() - t0) * 1e3
    stats = timed(lambda: att.run(q, kv.layers[0]), warmup=warmup, repeat=repeat)
    kv_bytes = batch * context * 2 * CFG.num_kv_heads * CFG.head_dim * 2  # K and V, bf16
    io_bytes = kv_bytes + 2 * q.numel() * 2 + meta.kv_indices.numel() * 4
    return {
        "page_size": page_size,
        "batch": batch,
        "context": context,
        "kernel": "BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)",
        "plan_ms": plan_ms,
        **stats,
        "kv_bytes": kv_bytes,
        "achieved_GBps": io_bytes / (stats["median_ms"] * 1e-3) / 1e9,
    }


def bench_prefill(
    model: LlamaModel | None, fraction: float, *, prompt: int, page_size: int, warmup: int, repeat: int
) -> dict:
    dev = torch.device("cuda")
    cached = int(prompt * fraction) // page_size * page_size  # whole pages, as caches hand them out
    new = prompt - cached
    num_pages = -(-prompt // page_size)
    table = list(range(num_pages))
    tokens = torch.randint(0, CFG.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0)).numpy()
    row: dict = {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": new, "page_size": page_size}
    # attention kernel alone, one layer, same batch
    kv1 = PagedKVCache(1, num_pages, page_size, CFG.num_kv_heads, CFG.head_dim, dtype=torch.bfloat16, device=dev)
    kv1.layers[0].normal_()
    meta = build_batch_meta([table], [cached], [new], page_size, device=dev)
    q = torch.randn(new, CFG.num_heads, CFG.head_dim, device=dev, dtype=torch.bfloat16)
    att = FlashInferAttention(dev)
    att.plan(meta, CFG.num_heads, CFG.num_kv_heads, CFG.head_dim, torch.bfloat16)
    a = timed(lambda: att.run(q, kv1.layers[0]), warmup=warmup, repeat=repeat)
    # causal FLOPs: each new query i sees cached + i + 1 keys; QK^T and PV, 2 FLOPs per MAC
    keys_seen = new * cached + new * (new + 1) / 2
    flops = 4 * CFG.num_heads * CFG.head_dim * keys_seen
    row["attention_layer"] = {**a, "TFLOPs": flops / (a["median_ms"] * 1e-3) / 1e12}
    if model is not None:
        kv = model.make_kv_cache(num_pages, page_size)
        if cached:  # fill the cached prefix once (its content does not change the timing)
            model.forward([ForwardInput(tokens[:cached], 0, table)], kv)
        step = ForwardInput(tokens[cached:], cached, table)
        m = timed(lambda: model.forward([step], kv), warmup=warmup, repeat=repeat)
        row["model_forward"] = {**m, "tokens_per_s": new / (m["median_ms"] * 1e-3)}
        del kv
        torch.cuda.empty_cache()
    return row


def _git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", type=Path, default=RESULTS / "gpu_attention_bench.json")
    ap.add_argument("--page-size", "--page-sizes", dest="page_sizes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    ap.add_argument("--prefill-page-size", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--no-model", action="store_true", help="skip the full llama3-8b forward (16 GB of weights)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_attention_bench needs CUDA")
    import flashinfer  # noqa: PLC0415 - only here, on a GPU machine

    report: dict = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": _git_commit(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": getattr(flashinfer, "__version__", "unknown"),
        "python": platform.python_version(),
        "shapes": {"num_qo_heads": CFG.num_heads, "num_kv_heads": CFG.num_kv_heads, "head_dim": CFG.head_dim},
        "decode": [],
        "prefill": [],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row: a run cut short still leaves its numbers
        args.output.write_text(json.dumps(report, indent=2) + "\n")

    for ps in args.page_sizes:
        row = bench_decode(ps, batch=args.batch, context=args.context, warmup=args.warmup, repeat=args.repeat)
        print(f"decode page_size={ps}: {row['median_ms']:.3f} ms, {row['achieved_GBps']:.0f} GB/s", flush=True)
        report["decode"].append(row)
        save()
    model = None
    if not args.no_model:
        t0 = time.perf_counter()
        model = LlamaModel("llama3-8b", seed=0, device="cuda", attention="flashinfer")
        torch.cuda.synchronize()
        report["model_init_s"] = time.perf_counter() - t0
    for f in args.fractions:
        row = bench_prefill(
            model, f, prompt=args.prompt, page_size=args.prefill_page_size, warmup=2, repeat=max(3, args.repeat // 4)
        )
        msg = f"prefill {int(f * 100)}% cached: attention/layer {row['attention_layer']['median_ms']:.3f} ms"
        if "model_forward" in row:
            msg += f", model forward {row['model_forward']['median_ms']:.1f} ms"
        print(msg, flush=True)
        report["prefill"].append(row)
        save()
    return report


if __name__ == "__main__":
    main()
