"""Model shapes (`ModelConfig`) and the named presets, without torch: the cost model, the
capacity sizing and the command line's checks read them on installs without the `model`
extra; attention/model.py builds the decoder from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: bytes per element of the dtypes a ModelConfig names (torch.finfo(dtype).bits // 8)
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shapes of a Llama-style decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: str = "float32"

    @property
    def torch_dtype(self) -> Any:
        """The dtype as a `torch.dtype` (imports torch: the model executor's path only)."""
        import torch

        return getattr(torch, self.dtype)

    def num_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * h * self.intermediate_size
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + head + self.num_layers * (attn + mlp + 2 * h) + h

    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of `dtype` (a table, so sizing a model needs no torch)."""
        try:
            return DTYPE_BYTES[self.dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {self.dtype!r}; one of: {', '.join(DTYPE_BYTES)}") from None


PRESETS: dict[str, ModelConfig] = {
    # fast on CPU; GQA ratio 2 so the grouped path is always exercised
    "tiny": ModelConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_embeddings=False,
        dtype="float32",
    ),
    # Meta-Llama-3-8B shapes; GPU only (16 GB of bf16 weights)
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=500000.0,
        rms_eps=1e-5,
        tie_embeddings=False,
        dtype="bfloat16",
    ),
}
