"""Executors: what a serving step costs, and what it produces.

- `CostModelExecutor`: virtual time from a roofline of the model's shape on a device
  profile (peak FLOP/s and memory bandwidth, scaled by achievable fractions). Generated
  tokens are fresh ids no prompt uses. Fast: for traces and sweeps.
- `FixedStepExecutor`: a constant time per non-empty step (decisions compared with a real
  scheduler's, independently of any cost model); fresh ids.
- `ReplayExecutor`: the replay protocol's (no time, no tensors, fresh ids).
- `ModelExecutor`: the real forward pass (torch reference on CPU, FlashInfer on GPU) over
  the paged KV cache the backend's page tables address; time is measured; greedy tokens.

All implement `Executor`: `step` takes a batch of `(Sequence, n, start)`, computes KV for
tokens `start .. start + n` (`start` is `seq.num_computed` unless the engine batches
commits) and, for a sequence whose chunk reaches its last known token, produces the next
token. What an executor can do beyond that is declared, never probed:
`supports_decode_windows` (it prices k decode steps at once: `decode_step_seconds`) and
`samples_fresh_tokens` (a forked sample's first token is `fresh_tokens(1)`, not its parent's).
Those that sample fresh ids (all but the model) share `FreshIdExecutor`: one id counter and
the rule for which items sample; `experiments/timing/profile_executor.py` is one more.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from cachelib.types import CopyOp, Sequence
from experiments.engine.compiled import engine_kernels
from experiments.timing.zoo import GPUS, MODELS, GpuSpec, ModelSpec, ZooError, resolve_gpu
from experiments.workloads.spec import GENERATED_TOKEN_BASE

#: a batch item: the sequence, tokens to compute, the first of them
BatchItem = tuple[Sequence, int, int]


class Executor(Protocol):
    """What the scheduler asks of an executor; the capabilities are declared attributes."""

    kind: ClassVar[str]
    #: True: `decode_step_seconds` prices k decode-only steps at once (virtual time), so the
    #: scheduler may simulate a decode window and batch decode commits
    supports_decode_windows: ClassVar[bool]
    #: True: a forked sample's first token is `fresh_tokens(1)`; False: it is the parent's
    samples_fresh_tokens: ClassVar[bool]

    #: the model's layers: a layer-by-layer load overlaps a step's compute over this many
    #: (experiments/engine/transfers.py)
    num_layers: int

    def apply_copies(self, ops: list[CopyOp]) -> None:
        """Copy pages before anything is written into them (copy-on-write)."""

    def step(self, batch: list[BatchItem]) -> tuple[float, list[int | None]]:
        """Run one step; seconds it took and, per item, the sampled token or None."""

    def decode_step_seconds(self, contexts: np.ndarray, k: int) -> np.ndarray:
        """Seconds of each of `k` decode steps (only when `supports_decode_windows`)."""

    def batch_seconds(self, new: np.ndarray, starts: np.ndarray) -> float:
        """Seconds of one step whose items compute `new[i]` tokens from position `starts[i]`,
        in batch order (an item with `new[i] == 0` is not in the step): what `step` charges,
        without sampling (only when `supports_decode_windows`: the engine then takes fresh
        ids itself)."""

    def fresh_tokens(self, k: int) -> list[int]:
        """`k` token ids no prompt uses (only when `samples_fresh_tokens`)."""

    def fresh_token_run(self, k: int) -> range:
        """`fresh_tokens(k)` as the range they form (they are consecutive): the same ids,
        without building the list (only when `samples_fresh_tokens`)."""


class FreshTokens:
    """Generated token ids: a counter from `GENERATED_TOKEN_BASE`, so no prompt matches them."""

    __slots__ = ("next_id",)

    def __init__(self) -> None:
        self.next_id = GENERATED_TOKEN_BASE

    def take(self, k: int) -> list[int]:
        out = list(range(self.next_id, self.next_id + k))
        self.next_id += k
        return out

    def take_run(self, k: int) -> range:
        """`take(k)` as a range: the same ids, the counter moved the same way."""
        out = range(self.next_id, self.next_id + k)
        self.next_id += k
        return out

    def take_array(self, k: int) -> np.ndarray:
        out = np.arange(self.next_id, self.next_id + k, dtype=np.int32)
        self.next_id += k
        return out

    def take_one(self) -> int:
        self.next_id += 1
        return self.next_id - 1


class FreshIdExecutor:
    """What every executor whose samples are fresh ids shares (`samples_fresh_tokens`): the
    ids from one `FreshTokens` counter, a step's samples (one id for each item whose chunk
    reaches its last known token), and page copies that cost nothing it models. Each
    subclass says only what a step costs (`step`, from `sampled`)."""

    samples_fresh_tokens: ClassVar[bool] = True
    tokens: FreshTokens

    def apply_copies(self, ops: list[CopyOp]) -> None:
        pass  # a page copy is a few µs of bandwidth (or no tensors at all): counted by the cache's copied_pages

    def fresh_tokens(self, k: int) -> list[int]:
        return self.tokens.take(k)

    def fresh_token_run(self, k: int) -> range:
        return self.tokens.take_run(k)

    def sampled(self, batch: list[BatchItem]) -> list[int | None]:
        """Each item's sampled id, or None where its chunk stops short of its last token."""
        take = self.tokens.take_one
        return [take() if start + n == len(seq) else None for seq, n, start in batch]


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Peak compute and memory bandwidth, and the fractions of them a real kernel reaches."""

    name: str
    peak_flops: float  # dense bf16 FLOP/s
    mem_bandwidth: float  # bytes/s
    flops_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    step_overhead_s: float = 30e-6  # launch + scheduling per step
    #: the device's memory in bytes (what `--gpu-memory-utilization` takes a share of);
    #: None for a profile that is no real device (`cpu`): capacity is then given outright
    memory_bytes: int | None = None
    #: GPU-to-GPU bandwidth one way (bytes/s; 0: none), the share of it an all-reduce
    #: reaches, and each all-reduce's fixed latency (tensor parallelism only)
    link_bandwidth: float = 0.0
    link_efficiency: float = 0.7
    link_latency_s: float = 10e-6
    #: dense FP8 FLOP/s (0: no FP8 tensor cores): an FP8 model's matmuls run at this rate
    fp8_flops: float = 0.0

    def calibrated(self, bench_json: str | Path) -> DeviceProfile:
        """This profile with the efficiencies `experiments/bench/gpu_attention_bench.py` measured.

        Bandwidth: the best decode row's achieved GB/s (decode reads every KV byte once).
        Compute: the 0%-cached Llama-3-8B prefill's tokens/s times its matmul FLOPs per token.
        Missing rows leave the default efficiency.
        """
        path = Path(bench_json)
        if not path.is_file():
            raise FileNotFoundError(f"GPU benchmark JSON not found: {path}")
        data = json.loads(path.read_text())
        out = self
        decode = [row["achieved_GBps"] for row in data.get("decode", []) if row.get("achieved_GBps")]
        if decode:
            out = replace(out, bandwidth_efficiency=min(1.0, max(decode) * 1e9 / self.mem_bandwidth))
        cold = [row for row in data.get("prefill", []) if row.get("cached_tokens") == 0 and "model_forward" in row]
        if cold:
            flops = 2.0 * llama3_8b_shape().num_params * cold[0]["model_forward"]["tokens_per_s"]
            out = replace(out, flops_efficiency=min(1.0, flops / self.peak_flops))
        return replace(out, name=f"{self.name} (calibrated from {path.name})")


def _gpu_profile(gpu: GpuSpec) -> DeviceProfile:
    return DeviceProfile(
        gpu.name,
        gpu.peak_flops,
        gpu.mem_bandwidth,
        memory_bytes=gpu.memory_bytes,
        link_bandwidth=gpu.link_bandwidth,
        fp8_flops=gpu.fp8_flops,
    )


#: the zoo's GPUs (experiments/timing/zoo.py: their datasheet figures; GB are 10**9 bytes,
#: as the datasheets count them, and vLLM takes its share of the total CUDA reports, which
#: can differ from the datasheet's figure), and a 2-core CPU for tests, with no memory size
DEVICE_PROFILES: dict[str, DeviceProfile] = {
    **{name: _gpu_profile(gpu) for name, gpu in GPUS.items()},
    "cpu": DeviceProfile("cpu", 100e9, 20e9, 0.5, 0.5, 1e-4),
}


def device_profile(name: str) -> DeviceProfile:
    """The profile of device `name` in any spelling the zoo accepts (`a100-80gb`, `H100`)."""
    if name in DEVICE_PROFILES:
        return DEVICE_PROFILES[name]
    try:
        return DEVICE_PROFILES[resolve_gpu(name).name]
    except ZooError:
        raise ZooError(
            f"unknown device {name!r}; choose one of {', '.join(DEVICE_PROFILES)} (or an alias: {', '.join(a for g in GPUS.values() for a in g.aliases)})"
        ) from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the roofline needs of a model, and what its weights take in memory, on each GPU
    of its tensor-parallel group (`tp` GPUs; 1: one GPU holds it all)."""

    num_params: int  # the matmul weights a token runs through (without the embedding's lookup)
    num_layers: int
    num_heads: int
    head_dim: int
    kv_bytes_per_token: int
    bytes_per_param: int = 2
    #: the input embedding's parameters: a lookup, no matmul, but in memory all the same
    embedding_params: int = 0
    #: tensor parallelism: the GPUs the fields above are shares of, and the hidden width
    #: whose per-token activations each layer all-reduces twice
    tp: int = 1
    hidden: int = 0
    #: a mixture of experts: experts per layer, how many a token runs through, and one
    #: expert's parameters over all layers (0: dense)
    experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    #: FP8 weights (`bytes_per_param` 1): matmuls at the device's FP8 rate where it has one
    fp8: bool = False

    @property
    def weight_bytes(self) -> int:
        """Bytes every parameter takes (the matmul weights and the embedding table; every
        expert of a mixture)."""
        idle = (self.experts - self.experts_per_token) * self.expert_params
        return (self.num_params + idle + self.embedding_params) * self.bytes_per_param

    def weights_read(self, tokens: int) -> float | int:
        """Bytes of weights a step of `tokens` tokens reads: all of a dense model's (an
        int, as before mixtures); of a mixture, the experts its tokens touch, expected as
        `E x (1 - (1 - k/E)^tokens)` when each token's k experts are drawn uniformly."""
        if not self.experts:
            return self.num_params * self.bytes_per_param
        e, k = self.experts, self.experts_per_token
        touched = e * (1.0 - (1.0 - k / e) ** tokens)
        return (self.num_params + (touched - k) * self.expert_params) * self.bytes_per_param

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """From an `attention.model.ModelConfig`."""
        width = 2 if cfg.dtype in ("bfloat16", "float16") else 4
        embedding = cfg.vocab_size * cfg.hidden_size
        matmul = cfg.num_params() - embedding  # the embedding is a lookup
        return cls(matmul, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.kv_bytes_per_token(), width, embedding)

    @classmethod
    def from_spec(cls, spec: ModelSpec, tp: int = 1) -> ModelShape:
        """A zoo model on each of `tp` GPUs (a degree vLLM accepts: `ModelSpec.check_tp`):
        every weight matrix and the embedding split `tp` ways, the heads too, KV heads as
        vLLM splits (or replicates) them. The matmul count keeps the norms, as Llama-3-8B's
        always has."""
        spec.check_tp(tp)
        embedding = spec.vocab * spec.hidden
        active = (
            spec.num_params() - embedding - (spec.experts - spec.experts_per_token) * spec.mlp_params() * spec.layers
        )
        expert = spec.mlp_params() * spec.layers if spec.is_moe else 0
        return cls(
            active // tp, spec.layers, spec.heads // tp, spec.head_dim, spec.kv_bytes_per_token(tp), spec.param_bytes,
            embedding // tp, tp, spec.hidden, spec.experts, spec.experts_per_token, expert // tp, spec.fp8_weights,
        )  # fmt: skip


def llama3_8b_shape() -> ModelShape:
    # Meta-Llama-3-8B: 8,030,261,248 parameters (untied 128256 x 4096 embedding and LM head),
    # 32 layers, 32 query heads, 8 KV heads, head dim 128, bf16 (experiments/timing/zoo.py)
    return ModelShape.from_spec(MODELS["llama3-8b"])


class CostModelExecutor(FreshIdExecutor):
    """Roofline time per step; tokens are fresh ids (`2_000_000_000 + n`)."""

    kind: ClassVar[str] = "cost-model"
    supports_decode_windows: ClassVar[bool] = True

    def __init__(
        self, shape: ModelShape | None = None, device: DeviceProfile | str = "h200", kernel: str = "auto"
    ) -> None:
        self.shape = shape or llama3_8b_shape()
        self.device = device_profile(device) if isinstance(device, str) else device
        if self.shape.tp > 1 and not self.device.link_bandwidth:
            raise ZooError(f"--tp {self.shape.tp} on {self.device.name}: the device has no GPU-to-GPU link to time")
        #: the matmuls' FLOPs at the bf16 rate: halved (as counted) for FP8 weights on a
        #: device with FP8 tensor cores at twice the rate; 1.0 otherwise (exact: x * 1.0 == x)
        d = self.device
        self.matmul_scale = d.peak_flops / d.fp8_flops if self.shape.fp8 and d.fp8_flops else 1.0
        #: every weight is read each step (dense), or None: the experts the tokens touch
        self.dense_weight_bytes = None if self.shape.experts else self.shape.num_params * self.shape.bytes_per_param
        self.tokens = FreshTokens()
        self.num_layers = self.shape.num_layers
        #: `batch_seconds`' sums by a compiled loop, or None: numpy (experiments/engine/compiled.py)
        self.kernels = engine_kernels(kernel)
        self.kernel = self.kernels.name

    def step_seconds(self, batch: list[BatchItem]) -> float:
        s, d = self.shape, self.device
        tokens = sum(item[1] for item in batch)
        flops = 2.0 * s.num_params * tokens * self.matmul_scale
        kv_read = 0
        for _, n, ctx in batch:
            # QK^T and PV over the context plus the causal half of the new tokens
            flops += 4.0 * s.num_layers * s.num_heads * s.head_dim * n * (ctx + (n + 1) / 2)
            kv_read += ctx + n
        nbytes = s.weights_read(tokens) + (kv_read + tokens) * s.kv_bytes_per_token
        compute = flops / (d.peak_flops * d.flops_efficiency)
        memory = nbytes / (d.mem_bandwidth * d.bandwidth_efficiency)
        return max(compute, memory) + d.step_overhead_s + self.all_reduce_seconds(tokens)

    def all_reduce_seconds(self, tokens: int) -> float:
        """Tensor parallelism's communication in a step of `tokens` tokens: two all-reduces
        per layer of their hidden states (bf16), each a ring's `2 (tp - 1) / tp` of the
        bytes over the link plus a fixed latency; 0.0 on one GPU (so one GPU's step time is
        what it was before parallelism was modelled, to the last bit)."""
        s, d = self.shape, self.device
        if s.tp == 1:
            return 0.0
        nbytes = tokens * s.hidden * 2
        one = 2 * (s.tp - 1) / s.tp * nbytes / (d.link_bandwidth * d.link_efficiency) + d.link_latency_s
        return 2 * s.num_layers * one

    def decode_step_seconds(self, contexts: np.ndarray, k: int) -> np.ndarray:
        """Seconds of each of `k` decode steps of a batch whose sequences have `contexts`
        computed tokens at the first step (one token each per step): the same roofline as
        `step_seconds`, vectorised over steps."""
        s, d = self.shape, self.device
        b = contexts.size
        j = np.arange(k, dtype=np.float64)
        ctx_sum = float(contexts.sum()) + b * j
        flops = 2.0 * s.num_params * b * self.matmul_scale + 4.0 * s.num_layers * s.num_heads * s.head_dim * (
            ctx_sum + b
        )
        nbytes = s.weights_read(b) + (ctx_sum + 2 * b) * s.kv_bytes_per_token
        compute = flops / (d.peak_flops * d.flops_efficiency)
        memory = nbytes / (d.mem_bandwidth * d.bandwidth_efficiency)
        return np.maximum(compute, memory) + d.step_overhead_s + self.all_reduce_seconds(b)

    def batch_seconds(self, new: np.ndarray, starts: np.ndarray) -> float:
        """`step_seconds` over arrays (`kernels.price_rows`: each item's term is the same
        float expression, and the terms are added one at a time in batch order, as
        `step_seconds` adds them), so the result is its to the last bit."""
        s, d = self.shape, self.device
        per_token = 4.0 * s.num_layers * s.num_heads * s.head_dim
        # (the rule takes contiguous int64 arrays: the engine's rows are; a caller's other
        # integers are converted, not refused)
        new, starts = np.ascontiguousarray(new, dtype=np.int64), np.ascontiguousarray(starts, dtype=np.int64)
        flops, tokens, kv_read = self.kernels.price_rows(new, starts, per_token, 2.0 * s.num_params * self.matmul_scale)
        # (a dense model on one GPU, the engine's hot path: its weight bytes, and no all-reduce)
        weights = self.dense_weight_bytes if self.dense_weight_bytes is not None else s.weights_read(int(tokens))
        nbytes = weights + (int(kv_read) + int(tokens)) * s.kv_bytes_per_token
        compute = float(flops) / (d.peak_flops * d.flops_efficiency)
        memory = nbytes / (d.mem_bandwidth * d.bandwidth_efficiency)
        seconds = max(compute, memory) + d.step_overhead_s
        return seconds if s.tp == 1 else seconds + self.all_reduce_seconds(int(tokens))

    def step(self, batch: list[BatchItem]) -> tuple[float, list[int | None]]:
        return self.step_seconds(batch), self.sampled(batch)


class FixedStepExecutor(FreshIdExecutor):
    """A constant `step_seconds` per non-empty step, whatever the batch (`--executor fixed
    --step-ms X`): scheduling decisions can then be compared with a real scheduler run with
    the same constant (tests/fixtures/vllm_0_33: 20 ms) independently of any cost model.
    Tokens are fresh ids, as the cost model's."""

    kind: ClassVar[str] = "fixed"
    supports_decode_windows: ClassVar[bool] = True
    #: no model behind the constant step: Llama-3-8B's 32 layers, the project's default model
    num_layers: ClassVar[int] = 32

    def __init__(self, step_seconds: float) -> None:
        if not step_seconds > 0:  # also refuses NaN
            raise ValueError(f"step time must be positive, got {step_seconds!r} s")
        self.step_seconds = float(step_seconds)
        self.tokens = FreshTokens()

    def decode_step_seconds(self, contexts: np.ndarray, k: int) -> np.ndarray:
        return np.full(k, self.step_seconds)

    def batch_seconds(self, new: np.ndarray, starts: np.ndarray) -> float:
        return self.step_seconds

    def step(self, batch: list[BatchItem]) -> tuple[float, list[int | None]]:
        return (self.step_seconds if batch else 0.0), self.sampled(batch)


class ReplayExecutor(FreshIdExecutor):
    """The replay protocol's executor: no time and no tensors (replay counts cache work
    only); generated tokens are fresh ids, as the cost model's."""

    kind: ClassVar[str] = "replay"
    supports_decode_windows: ClassVar[bool] = False  # replay takes no steps to window
    num_layers: ClassVar[int] = 1  # no steps, no overlap

    def __init__(self) -> None:
        self.tokens = FreshTokens()

    def decode_step_seconds(self, contexts: np.ndarray, k: int) -> np.ndarray:
        return np.zeros(k)

    def step(self, batch: list[BatchItem]) -> tuple[float, list[int | None]]:
        return 0.0, self.sampled(batch)


class ModelExecutor:
    """The real model over a paged KV cache of `num_pages` pages; greedy decoding."""

    kind: ClassVar[str] = "model"
    supports_decode_windows: ClassVar[bool] = False  # time is measured step by step
    samples_fresh_tokens: ClassVar[bool] = False  # greedy: every sample starts alike

    def __init__(self, model: Any, num_pages: int, page_size: int) -> None:
        self.model = model
        self.kv = model.make_kv_cache(num_pages, page_size)
        self.num_layers = model.config.num_layers
        self.logits: dict[str, list[Any]] = {}  # request id -> logits before each sampled token

    def apply_copies(self, ops: list[CopyOp]) -> None:
        if ops:
            self.kv.apply(ops)

    def decode_step_seconds(self, contexts: np.ndarray, k: int) -> np.ndarray:
        raise NotImplementedError("the model executor measures time step by step (supports_decode_windows=False)")

    def fresh_tokens(self, k: int) -> list[int]:
        raise NotImplementedError("the model executor samples its tokens (samples_fresh_tokens=False)")

    def fresh_token_run(self, k: int) -> range:
        raise NotImplementedError("the model executor samples its tokens (samples_fresh_tokens=False)")

    def step(self, batch: list[BatchItem]) -> tuple[float, list[int | None]]:
        import torch

        from attention.model import ForwardInput

        inputs = [ForwardInput(seq.tokens[start : start + n], start, seq.page_table) for seq, n, start in batch]
        t0 = time.perf_counter()
        logits = self.model.forward(inputs, self.kv)
        seconds = time.perf_counter() - t0
        out: list[int | None] = []
        for i, (seq, n, start) in enumerate(batch):
            if start + n == len(seq):
                row = logits[i]
                self.logits.setdefault(seq.request_id, []).append(row.detach().clone())
                out.append(int(torch.argmax(row.detach().float()).item()))
            else:
                out.append(None)
        return seconds, out
