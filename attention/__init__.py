"""Attention and model: one paged KV cache that every backend's page tables feed.

`kv_cache` stores KV in FlashInfer's NHD layout, `metadata` turns page tables into CSR
batch metadata, `reference` is the exact torch attention (CPU, CI), `flashinfer_backend`
the GPU kernels (imported lazily, only with CUDA), `model` a seeded Llama-style decoder.
The engine (`experiments.engine`) drives it through any `PrefixCache`. Importing this
package never imports flashinfer.
"""

from __future__ import annotations

from attention.flashinfer_backend import flashinfer_available, make_attention
from attention.kv_cache import PagedKVCache
from attention.metadata import (
    AttentionInputError,
    BatchMeta,
    PageTableError,
    ShapeMismatchError,
    TokenIdError,
    build_batch_meta,
)
from attention.model import PRESETS, ForwardInput, LlamaModel, ModelConfig
from attention.reference import TorchAttention, paged_attention, paged_decode

__all__ = [
    "PRESETS",
    "AttentionInputError",
    "BatchMeta",
    "ForwardInput",
    "LlamaModel",
    "ModelConfig",
    "PageTableError",
    "PagedKVCache",
    "ShapeMismatchError",
    "TokenIdError",
    "TorchAttention",
    "build_batch_meta",
    "flashinfer_available",
    "make_attention",
    "paged_attention",
    "paged_decode",
]
