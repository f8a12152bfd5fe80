"""Attention and model: one paged KV cache that every backend's page tables feed.

`kv_cache` stores KV in FlashInfer's NHD layout, `metadata` turns page tables into CSR
batch metadata, `reference` is the exact torch attention (CPU, CI), `flashinfer_backend`
the GPU kernels (imported lazily, only with CUDA), `model` a seeded Llama-style decoder.
The engine (`experiments.engine`) drives it through any `PrefixCache`. Importing this
package never imports flashinfer.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: name -> the module defining it; imported on first use (PEP 562), so `attention.config`
#: (model shapes) is importable without torch, which the other modules need
_WHERE = {
    "flashinfer_available": "attention.flashinfer_backend",
    "make_attention": "attention.flashinfer_backend",
    "PagedKVCache": "attention.kv_cache",
    "AttentionInputError": "attention.metadata",
    "BatchMeta": "attention.metadata",
    "PageTableError": "attention.metadata",
    "ShapeMismatchError": "attention.metadata",
    "TokenIdError": "attention.metadata",
    "build_batch_meta": "attention.metadata",
    "PRESETS": "attention.config",
    "ModelConfig": "attention.config",
    "ForwardInput": "attention.model",
    "LlamaModel": "attention.model",
    "TorchAttention": "attention.reference",
    "paged_attention": "attention.reference",
    "paged_decode": "attention.reference",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'attention' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


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
