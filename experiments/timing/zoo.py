"""The model zoo and the devices: what a timing model needs of a model and a GPU, by name.

A `ModelSpec` holds a decoder's architecture as its Hugging Face `config.json` states it
(layers, widths, heads, vocabulary, experts); every count the timing models and the KV
sizing use is derived from it, so a parameter count is checked, not typed twice. A
`GpuSpec` holds a GPU's datasheet figures. A model on `tp` GPUs is sharded as vLLM shards
it (tensor parallelism: attention heads and MLP columns split over the GPUs, the vocabulary
too; KV heads split, or replicated when there are fewer than GPUs, as vLLM's
`get_num_kv_heads` replicates them): `ModelSpec.check_tp`, `kv_bytes_per_token(tp)`, and
the roofline's per-GPU shape (`experiments.engine.executors.ModelShape.from_spec`).

Names are the zoo's (`llama3-70b`, `h100`); Hugging Face ids and common GPU spellings are
aliases (`meta-llama/Meta-Llama-3-70B`, `a100-80gb`, `nvidia-h100`). An unknown name is
an error listing the known ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from experiments.errors import InputError

GB = 10**9


class ZooError(InputError, ValueError):
    """An unknown model or device name, or a parallel degree the model cannot take."""


class UnknownName(ZooError):
    """A model or GPU name the zoo does not have (under any alias)."""


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-style decoder (gated MLP, RMS norms, grouped-query attention), or a
    mixture of experts with `experts` MLPs per layer of which `experts_per_token` run."""

    name: str
    hf_id: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # one MLP's (one expert's, for a mixture)
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    experts: int = 0  # 0: dense
    experts_per_token: int = 0
    dtype_bytes: int = 2  # bf16: the KV cache's, and the weights' unless `fp8_weights`
    #: FP8 weights (one byte each; matmuls at the GPU's FP8 rate where it has one)
    fp8_weights: bool = False

    @property
    def param_bytes(self) -> int:
        return 1 if self.fp8_weights else self.dtype_bytes

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def attention_params(self) -> int:
        """One layer's Q, K, V and output projections (and Q/K/V biases where the model has them)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = (q + 2 * kv) if self.qkv_bias else 0
        return self.hidden * q + 2 * self.hidden * kv + q * self.hidden + bias

    def mlp_params(self) -> int:
        """One gated MLP's up, gate and down projections (one expert's, for a mixture)."""
        return 3 * self.hidden * self.intermediate

    def router_params(self) -> int:
        return self.hidden * self.experts if self.is_moe else 0

    def layer_params(self, active: bool = False) -> int:
        """One layer's parameters: every expert's, or (`active`) those one token runs through."""
        mlps = 1 if not self.is_moe else (self.experts_per_token if active else self.experts)
        return self.attention_params() + mlps * self.mlp_params() + self.router_params() + 2 * self.hidden

    def num_params(self) -> int:
        """Every parameter (embedding, LM head unless tied, layers, final norm): the weights' size."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + head + self.layers * self.layer_params() + self.hidden

    def matmul_params(self, active: bool = True) -> int:
        """The parameters a token multiplies through (2 FLOPs each): its layers' and the LM
        head; the embedding is a lookup, and norms are not matmuls."""
        return self.layers * (self.layer_params(active) - 2 * self.hidden) + self.vocab * self.hidden

    def check_tp(self, tp: int) -> None:
        """A tensor-parallel degree vLLM accepts for this model; a `ZooError` otherwise."""
        if tp.__class__ is not int or tp < 1:
            raise ZooError(f"--tp must be a positive integer, got {tp!r}")
        if self.heads % tp:
            raise ZooError(
                f"--tp {tp} does not divide {self.name}'s {self.heads} attention heads (vLLM refuses it too)"
            )
        if self.kv_heads % tp and tp % self.kv_heads:
            raise ZooError(
                f"--tp {tp} neither divides {self.name}'s {self.kv_heads} KV heads nor is a multiple of them "
                "(vLLM can neither split nor replicate them)"
            )

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        """vLLM's `get_num_kv_heads`: split over the GPUs, at least one each (replicated)."""
        return max(1, self.kv_heads // tp)

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """K and V of one token over all layers, on each of `tp` GPUs (every GPU holds its
        heads of every token)."""
        return 2 * self.layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures: dense bf16 FLOP/s, memory bandwidth and size, the GPU-to-GPU
    link's one-way bandwidth (NVLink: half the bidirectional figure the datasheets quote),
    and dense FP8 FLOP/s (0: no FP8 tensor cores)."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: int
    link_bandwidth: float
    aliases: tuple[str, ...] = ()
    fp8_flops: float = 0.0


# Hugging Face config.json values (the repository named by hf_id).
MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama3-8b", "meta-llama/Meta-Llama-3-8B", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelSpec("llama3-70b", "meta-llama/Meta-Llama-3-70B", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelSpec(
            "llama3.1-8b-fp8",
            "nvidia/Llama-3.1-8B-Instruct-FP8",
            32,
            4096,
            32,
            8,
            128,
            14336,
            128256,
            fp8_weights=True,
        ),  # fmt: skip  (Llama-3.1-8B's shape, FP8 weights, bf16 KV: the model of Dynamo's H200 profile)
        ModelSpec("llama2-7b", "meta-llama/Llama-2-7b-hf", 32, 4096, 32, 32, 128, 11008, 32000),
        ModelSpec("llama2-70b", "meta-llama/Llama-2-70b-hf", 80, 8192, 64, 8, 128, 28672, 32000),
        ModelSpec("qwen-72b", "Qwen/Qwen-72B", 80, 8192, 64, 64, 128, 24576, 152064, qkv_bias=True),
        ModelSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, qkv_bias=True),
        ModelSpec("qwen2.5-72b", "Qwen/Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064, qkv_bias=True),
        ModelSpec(
            "mixtral-8x7b",
            "mistralai/Mixtral-8x7B-v0.1",
            32,
            4096,
            32,
            8,
            128,
            14336,
            32000,
            experts=8,
            experts_per_token=2,
        ),  # fmt: skip
    )
}

# NVIDIA datasheets (SXM parts): dense bf16 Tensor Core FLOP/s, HBM bandwidth and size,
# NVLink bandwidth (H100/H200 900 GB/s, A100 600 GB/s, both directions together).
GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("h200", 989e12, 4.8e12, 141 * GB, 450e9, ("h200-141gb", "h200-sxm", "nvidia-h200"), 1979e12),
        GpuSpec("h100", 989e12, 3.35e12, 80 * GB, 450e9, ("h100-80gb", "h100-sxm", "nvidia-h100"), 1979e12),
        GpuSpec("a100", 312e12, 2.039e12, 80 * GB, 300e9, ("a100-80gb", "a100-sxm4-80gb", "nvidia-a100")),
        GpuSpec("a100-40gb", 312e12, 1.555e12, 40 * GB, 300e9, ("a100-sxm4-40gb",)),
    )
}


def _key(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def resolve_model(name: str) -> ModelSpec:
    """The zoo's model named `name` or its Hugging Face id (case-insensitive)."""
    k = _key(name)
    for m in MODELS.values():
        if k in (m.name, m.hf_id.lower(), m.hf_id.lower().split("/")[-1]):
            return m
    raise UnknownName(f"unknown model {name!r}; the zoo has {', '.join(MODELS)} (or their Hugging Face ids)")


def resolve_gpu(name: str) -> GpuSpec:
    """The GPU named `name` in any of its spellings (case-insensitive)."""
    k = _key(name)
    for g in GPUS.values():
        if k == g.name or k in g.aliases:
            return g
    raise UnknownName(
        f"unknown GPU {name!r}; known: {', '.join(GPUS)} (also {', '.join(a for g in GPUS.values() for a in g.aliases)})"
    )
