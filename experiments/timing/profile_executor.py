"""`ProfileExecutor`: a serving step's time from a measured profile (`--executor profile`).

A step's time is composed as vidur composes it, by batch composition, per GPU of the
tensor-parallel group:

    layers x (linear(N) + attention) + 2 x layers x all_reduce(N)   (the last when tp > 1)
    + the LM head over the step's sequences + the device's fixed step overhead

`N` is the step's tokens (prefill chunks and decode tokens together). `linear` and
`all_reduce` are read from the profile (experiments/timing/profile.py); attention from its
`attn_prefill` rows (each prefill chunk by its tokens and context) and `attn_decode` rows
(the decode requests by their count and mean context) where the table has them, else from
the roofline of the device (FLOPs of QK^T and PV, or the KV bytes read, whichever takes
longer), and the LM head from the roofline (its weights read once, one row per sequence).
`describe()` says which parts are measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np

from experiments.engine.executors import BatchItem, DeviceProfile, FreshIdExecutor, FreshTokens, ModelShape
from experiments.timing.profile import ProfileError, StepProfile
from experiments.timing.zoo import resolve_model

#: the parts of a step, in the order `predict-step` prints them
PARTS = ("linear", "attention", "all_reduce", "lm_head", "overhead")


class ProfileExecutor(FreshIdExecutor):
    """Step times from a measured profile; tokens are fresh ids, as the cost model's."""

    kind: ClassVar[str] = "profile"
    supports_decode_windows: ClassVar[bool] = True

    def __init__(self, profile: StepProfile, device: DeviceProfile, tp: int = 1, model: str | None = None) -> None:
        if model is not None and resolve_model(model).name != profile.model.name:
            raise ProfileError(
                f"{profile.path}: measured for {profile.model.name}, but the run's model is {resolve_model(model).name}"
            )
        if profile.device != device.name:
            raise ProfileError(f"{profile.path}: measured on {profile.device}, but the run is on {device.name}")
        shape = ModelShape.from_spec(profile.model, tp)  # (checks the degree against the heads)
        profile.check_degree(tp)
        self.profile, self.shape, self.device = profile, shape, device
        self.tokens = FreshTokens()
        self.num_layers = shape.num_layers
        tp = shape.tp
        self.linear = profile.linear[tp]
        self.all_reduce = profile.all_reduce.get(tp)
        self.attn_prefill = profile.attn_prefill.get(tp)
        self.attn_decode = profile.attn_decode.get(tp)
        spec = profile.model
        # the LM head on each GPU: its share of vocab x hidden, read once per step
        self.head_params = spec.vocab * spec.hidden // tp

    def describe(self) -> str:
        measured = "linear" + (", all-reduce" if self.all_reduce is not None and self.shape.tp > 1 else "")
        if self.attn_prefill is not None or self.attn_decode is not None:
            measured += ", attention"
            rest = "LM head"
        else:
            rest = "attention and LM head"
        name = Path(self.profile.path).name  # (the file: a shipped table is found by model and device)
        return f"profile {name} ({measured} measured: {self.profile.describe()}; {rest} from the roofline)"

    # -- the parts of a step -------------------------------------------------------------------

    def parts(self, new: np.ndarray, starts: np.ndarray) -> dict[str, float]:
        """Seconds of each part of a step whose items compute `new[i]` tokens from `starts[i]`
        (items with `new[i] == 0` are not in the step)."""
        on = new > 0
        new, starts = (
            new[on].astype(np.int64, copy=False),
            starts[on].astype(np.int64, copy=False),
        )  # (masking copied them)
        tokens = int(new.sum())
        if not tokens:
            return dict.fromkeys(PARTS, 0.0)
        layers = self.shape.num_layers
        out = {
            "linear": layers * float(self.linear(tokens)) / 1e3,
            "attention": layers * self.attention_ms(new, starts) / 1e3,
            "all_reduce": 0.0,
            "lm_head": self.lm_head_seconds(new.size),
            "overhead": self.device.step_overhead_s,
        }
        if self.shape.tp > 1:
            out["all_reduce"] = 2 * layers * float(self.all_reduce(tokens)) / 1e3
        return out

    def attention_ms(self, new: np.ndarray, starts: np.ndarray) -> float:
        """One layer's attention in ms: decode items (one new token) together, prefill chunks one by one."""
        decode = (new == 1) & (starts > 0)
        ms = 0.0
        if decode.any():
            ctx = starts[decode] + 1
            if self.attn_decode is not None:
                ms += self.attn_decode(int(decode.sum()), float(ctx.mean()))
            else:
                ms += self.roofline_attention_ms(new[decode], starts[decode])
        prefill = ~decode
        if prefill.any():
            if self.attn_prefill is not None:
                ms += sum(self.attn_prefill(int(n), int(c)) for n, c in zip(new[prefill], starts[prefill], strict=True))
            else:
                ms += self.roofline_attention_ms(new[prefill], starts[prefill])
        return ms

    def roofline_attention_ms(self, new: np.ndarray, starts: np.ndarray) -> float:
        """One layer's attention by the roofline: QK^T and PV over each item's context and
        the causal half of its new tokens, or its KV read, whichever takes longer."""
        s, d = self.shape, self.device
        flops = 4.0 * s.num_heads * s.head_dim * float((new * (starts + (new + 1) / 2)).sum())
        kv_bytes = float((starts + new).sum()) * s.kv_bytes_per_token / s.num_layers
        return 1e3 * max(
            flops / (d.peak_flops * d.flops_efficiency), kv_bytes / (d.mem_bandwidth * d.bandwidth_efficiency)
        )

    def lm_head_seconds(self, rows: int) -> float:
        d = self.device
        compute = 2.0 * self.head_params * rows / (d.peak_flops * d.flops_efficiency)
        memory = self.head_params * self.shape.bytes_per_param / (d.mem_bandwidth * d.bandwidth_efficiency)
        return max(compute, memory)

    # -- Executor ----------------------------------------------------------------------------

    def batch_seconds(self, new: np.ndarray, starts: np.ndarray) -> float:
        return sum(self.parts(np.asarray(new), np.asarray(starts)).values())

    def step_seconds(self, batch: list[BatchItem]) -> float:
        new = np.fromiter((n for _, n, _ in batch), np.int64, len(batch))
        starts = np.fromiter((s for _, _, s in batch), np.int64, len(batch))
        return self.batch_seconds(new, starts)

    def decode_step_seconds(self, contexts: np.ndarray, k: int) -> np.ndarray:
        """Each of `k` decode steps of the batch whose computed counts are `contexts` at the first."""
        contexts = np.asarray(contexts, dtype=np.int64)
        ones = np.ones(contexts.size, dtype=np.int64)
        if self.attn_decode is not None or not contexts.all():
            return np.array([self.batch_seconds(ones, contexts + j) for j in range(k)], dtype=np.float64)
        # all decode, attention from the roofline: every part but attention is the same each
        # step, and attention grows with the context (vectorised over the k steps)
        first = self.parts(ones, contexts)
        fixed = first["linear"] + first["all_reduce"] + first["lm_head"] + first["overhead"]
        s, d, b = self.shape, self.device, contexts.size
        ctx = float(contexts.sum()) + b * (np.arange(k, dtype=np.float64) + 1)  # each step's context and new token
        flops = 4.0 * s.num_heads * s.head_dim * ctx  # (n * (start + (n + 1) / 2) with n = 1: start + 1)
        kv_bytes = ctx * s.kv_bytes_per_token / s.num_layers
        per_layer = np.maximum(
            flops / (d.peak_flops * d.flops_efficiency), kv_bytes / (d.mem_bandwidth * d.bandwidth_efficiency)
        )
        return fixed + s.num_layers * per_layer

    def step(self, batch: list[BatchItem]) -> tuple[float, list[int | None]]:
        return self.step_seconds(batch), self.sampled(batch)
