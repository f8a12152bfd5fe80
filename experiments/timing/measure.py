"""Measure a step profile on this machine: one decoder layer's work outside attention, by
token count, written as a profile table (experiments/timing/profile.py) with its provenance.

    python -m experiments.timing.measure --model llama3-8b --device h200 --output llama3-8b__h200.csv

On a GPU (torch with CUDA) the layer runs in bf16 and each point is timed with CUDA events;
elsewhere in float32 with `time.perf_counter` (`--device cpu`: a table for tests and for
this machine's CPU). The layer is the zoo model's own shape at tensor-parallel degree 1:
RMS norm, the Q/K/V projection, rotary embedding, the output projection, RMS norm, the
gated MLP (gate and up, SiLU x up, down) and the residual add, as vidur's `mlp.csv` times
them; the weights are random (time does not depend on their values). Each point is the
median of `--repeats` timed runs after one warm-up. The scripts/gpu_check.sh step runs it
on a lent GPU. Attention rows are not measured here (the executor takes attention from the
roofline where a table has none, and says so).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

from experiments.errors import InputError
from experiments.runs.output_dir import write_file_atomically
from experiments.timing.profile import COLUMNS, parse_profile
from experiments.timing.zoo import ModelSpec, resolve_gpu, resolve_model

#: token counts of the grid: powers of two and the points between them, to 8,192
GRID = sorted(
    {
        1,
        2,
        3,
        4,
        6,
        8,
        12,
        16,
        24,
        32,
        48,
        64,
        96,
        128,
        192,
        256,
        384,
        512,
        768,
        1024,
        1536,
        2048,
        3072,
        4096,
        6144,
        8192,
    }
)


class Layer:
    """One decoder layer's weights outside attention, on `device`, in `dtype`."""

    def __init__(self, spec: ModelSpec, device: str, dtype) -> None:
        import torch

        h, q, kv, inter = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.intermediate
        self.spec, self.torch, self.device, self.dtype = spec, torch, device, dtype
        self.qkv, self.o = self.weight(q + 2 * kv, h), self.weight(h, q)
        self.gate_up, self.down = self.weight(2 * inter, h), self.weight(h, inter)
        self.norm1, self.norm2 = torch.ones(h, device=device, dtype=dtype), torch.ones(h, device=device, dtype=dtype)

    def weight(self, rows: int, cols: int):
        return self.torch.randn(rows, cols, device=self.device, dtype=self.dtype) * 0.02

    def run(self, x):
        """The layer's work outside attention for the tokens `x` ([tokens, hidden])."""
        torch, spec = self.torch, self.spec
        f = torch.nn.functional
        h = f.rms_norm(x, (spec.hidden,), self.norm1)
        qkv = h @ self.qkv.T
        q = qkv[:, : spec.heads * spec.head_dim].view(-1, spec.heads, spec.head_dim)
        half = spec.head_dim // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)  # rotary: the rotate-half form
        q = q * 0.5 + rotated * 0.5
        attn_out = q.reshape(x.shape[0], -1) @ self.o.T  # (attention itself is not in this part)
        x = x + attn_out
        h = f.rms_norm(x, (spec.hidden,), self.norm2)
        gate, up = (h @ self.gate_up.T).chunk(2, dim=-1)
        return x + (f.silu(gate) * up) @ self.down.T

    def time_ms(self, tokens: int, repeats: int) -> float:
        """The median milliseconds of `run` on `tokens` tokens."""
        torch = self.torch
        x = torch.randn(tokens, self.spec.hidden, device=self.device, dtype=self.dtype)
        cuda = self.device == "cuda"
        self.run(x)  # warm-up
        out = []
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.run(x)
                end.record()
                torch.cuda.synchronize()
                out.append(start.elapsed_time(end))
            else:
                t = time.perf_counter()
                self.run(x)
                out.append(1e3 * (time.perf_counter() - t))
        return statistics.median(out)


def measure(spec: ModelSpec, device_name: str, tokens: list[int], repeats: int) -> str:
    """The profile table's text: a header with where and how it was measured, then the rows."""
    try:
        import torch
    except ImportError:
        raise InputError("measuring a profile needs torch (the `model` extra)") from None
    cuda = device_name != "cpu"
    if cuda and not torch.cuda.is_available():
        raise InputError(f"--device {device_name}: no CUDA device here (use --device cpu for this machine's CPU)")
    layer = Layer(spec, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    where = torch.cuda.get_device_name(0) if cuda else f"{platform.processor() or platform.machine()} CPU"
    header = [
        f"# model: {spec.name}",
        f"# device: {device_name}",
        f"# source: measured by experiments/timing/measure.py on {where}, {time.strftime('%Y-%m-%d')}",
        f"# engine: PyTorch {torch.__version__} ({'bf16, CUDA events' if cuda else 'float32, perf_counter'}), "
        f"median of {repeats} runs",
        "# license: CC0 (this project's own measurement)",
        ",".join(COLUMNS),
    ]
    rows = [f"linear,1,{t},0,{layer.time_ms(t, repeats):.6g}" for t in tokens]
    return "\n".join(header + rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="measure one decoder layer's linear work into a profile table")
    ap.add_argument("--model", required=True, help="a zoo model (its layer's shape is measured)")
    ap.add_argument("--device", required=True, help="the GPU's zoo name (the table's device), or cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=GRID, help="token counts to measure")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        spec = resolve_model(args.model)
        device = args.device if args.device == "cpu" else resolve_gpu(args.device).name
        if len(set(args.tokens)) < 2 or min(args.tokens) < 1 or args.repeats < 1:
            raise InputError("--tokens needs at least two distinct counts >= 1, --repeats at least 1")
        text = measure(spec, device, sorted(set(args.tokens)), args.repeats)
        parse_profile(text, str(args.output))  # the table it writes loads: the shipped format
    except (InputError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    write_file_atomically(args.output, text)
    print(f"wrote {args.output} ({len(args.tokens)} points)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
