"""FlashInfer's paged prefill and decode wrappers behind the model's `plan` / `run` interface.

`flashinfer` is imported only inside `FlashInferAttention.__init__`, after CUDA is known to
be present: nothing on the CPU path imports it. Plan once per batch (page-table metadata,
split-KV scheduling), run once per layer. The argument building is separate and pure, so
CPU tests check it without a GPU.

Semantics match `attention.reference`: NHD layout `[num_pages, 2, page_size, Hkv, D]`,
`causal=True` aligned bottom-right, softmax scale `1/sqrt(D)`, LSE base 2. Decode uses
`BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)`, which runs the prefill
kernels with one query row (fast for GQA).

Two kernel families run (FlashInfer 0.7.4): the prefill wrapper's `backend="auto"` picks fa3
(Hopper, sm90a) when the batch's longest query exceeds 64 tokens and fa2 otherwise; decode
runs fa2. `expected_backend` states that rule, `FlashInferAttention.resolved_backend()` reads
what the last `plan` chose; the benchmark records it and the GPU tests compare the two.
scripts/build_flashinfer_aot.sh builds exactly these two modules ahead of time.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import torch

from attention.metadata import BatchMeta, ShapeMismatchError

DEFAULT_WORKSPACE_BYTES = 256 * 1024 * 1024
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
#: FlashInfer 0.7.4 picks fa3 only for a longest query above this (prefill.py, _determine_auto_backend)
FA2_MAX_QUERY = 64


def flashinfer_available() -> bool:
    """True when CUDA is usable and the `flashinfer` package is installed (nothing is imported)."""
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def expected_backend(wrapper_kind: str, max_query_len: int, *, sm90a: bool) -> str:
    """The FlashInfer backend `auto` should resolve to for our bf16 / head-dim-128 plans."""
    if wrapper_kind == "decode":
        return "fa2"  # tensor-core decode: fa2's prefill kernels with one query row
    if wrapper_kind != "prefill":
        raise ValueError(f"wrapper_kind is 'prefill' or 'decode', got {wrapper_kind!r}")
    if max_query_len < 1:
        raise ValueError(f"max_query_len must be >= 1, got {max_query_len}")
    return "fa3" if sm90a and max_query_len > FA2_MAX_QUERY else "fa2"


def resolved_backend(wrapper: Any, wrapper_kind: str) -> str:
    """What a planned FlashInfer wrapper resolved `backend="auto"` to ('fa2', 'fa3', ...).

    The decode wrapper says so in its public `resolved_backend`; the prefill wrapper has no
    public equivalent in FlashInfer 0.7.4 and keeps its pick in `_backend`.
    """
    if wrapper_kind == "decode":
        value = wrapper.resolved_backend
    elif wrapper_kind == "prefill":
        value = wrapper._backend
    else:
        raise ValueError(f"wrapper_kind is 'prefill' or 'decode', got {wrapper_kind!r}")
    if not isinstance(value, str) or value == "auto":
        raise RuntimeError(f"the {wrapper_kind} wrapper has not resolved a backend (plan() first?): {value!r}")
    return value


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _SUPPORTED_DTYPES:
        raise ShapeMismatchError(f"FlashInfer runs float16/bfloat16, got {dtype}")


def prefill_plan_args(
    meta: BatchMeta,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of `BatchPrefillWithPagedKVCacheWrapper.plan`."""
    _check_dtype(dtype)
    if num_qo_heads % num_kv_heads:
        raise ShapeMismatchError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    args = (
        meta.qo_indptr,
        meta.kv_indptr,
        meta.kv_indices,
        meta.kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        meta.page_size,
    )
    kwargs = dict(
        causal=causal,
        pos_encoding_mode="NONE",  # RoPE is applied by the model before K is cached
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        q_data_type=dtype,
        kv_data_type=dtype,
    )
    return args, kwargs


def decode_plan_args(
    meta: BatchMeta,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    *,
    sm_scale: float | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Positional and keyword arguments of `BatchDecodeWithPagedKVCacheWrapper.plan`."""
    _check_dtype(dtype)
    if not meta.is_decode:
        raise ShapeMismatchError(f"decode needs one query per sequence, got query lengths {meta.q_lens}")
    if num_qo_heads % num_kv_heads:
        raise ShapeMismatchError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    args = (
        meta.kv_indptr,
        meta.kv_indices,
        meta.kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        meta.page_size,
    )
    kwargs = dict(
        pos_encoding_mode="NONE",
        sm_scale=sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim),
        q_data_type=dtype,
        kv_data_type=dtype,
    )
    return args, kwargs


class FlashInferAttention:
    """Paged prefill/decode on GPU through FlashInfer; same interface as `TorchAttention`."""

    name = "flashinfer"

    def __init__(
        self,
        device: torch.device | str = "cuda",
        *,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        sm_scale: float | None = None,
        use_decode_kernel: bool = True,
    ) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("FlashInferAttention needs CUDA; use attention='torch' on CPU")
        import flashinfer  # noqa: PLC0415 - lazy on purpose: never imported on the CPU path

        self.device = torch.device(device)
        self.sm_scale = sm_scale
        self.use_decode_kernel = use_decode_kernel
        self._workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=True)
        self._active: Any = None
        self._meta: BatchMeta | None = None
        self.active_kind: str | None = None  # "prefill" or "decode": the wrapper the last plan used

    def plan(self, meta: BatchMeta, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        """Plan once per batch; the decode wrapper when every sequence has one query."""
        if self.use_decode_kernel and meta.is_decode:
            args, kwargs = decode_plan_args(meta, num_qo_heads, num_kv_heads, head_dim, dtype, sm_scale=self.sm_scale)
            self._decode.plan(*args, **kwargs)
            self._active = self._decode
            self.active_kind = "decode"
        else:
            args, kwargs = prefill_plan_args(meta, num_qo_heads, num_kv_heads, head_dim, dtype, sm_scale=self.sm_scale)
            self._prefill.plan(*args, **kwargs)
            self._active = self._prefill
            self.active_kind = "prefill"
        self._meta = meta

    def resolved_backend(self) -> str:
        """The FlashInfer backend the last `plan` resolved ('fa2' or 'fa3')."""
        if self._active is None or self.active_kind is None:
            raise RuntimeError("resolved_backend() before plan()")
        return resolved_backend(self._active, self.active_kind)

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor, *, return_lse: bool = False):
        """`q [total_q, Hq, D]` over `kv_layer [P, 2, S, Hkv, D]` -> `out [total_q, Hq, D]` (and `lse [total_q, Hq]`)."""
        if self._active is None or self._meta is None:
            raise RuntimeError("run() before plan()")
        if q.shape[0] != self._meta.num_q_tokens:
            raise ShapeMismatchError(f"q has {q.shape[0]} rows, the planned batch has {self._meta.num_q_tokens}")
        return self._active.run(q, kv_layer, return_lse=return_lse)


def make_attention(kind: str = "auto", device: torch.device | str = "cpu", **options: Any):
    """`--attention auto|torch|flashinfer`: auto picks FlashInfer on a CUDA device when installed."""
    from attention.reference import TorchAttention  # noqa: PLC0415 - avoid an import cycle

    dev = torch.device(device)
    if kind == "auto":
        kind = "flashinfer" if dev.type == "cuda" and flashinfer_available() else "torch"
    if kind == "torch":
        return TorchAttention(sm_scale=options.get("sm_scale"))
    if kind == "flashinfer":
        if dev.type != "cuda":
            raise ValueError(f"attention='flashinfer' needs a CUDA device, got {dev}")
        return FlashInferAttention(dev, **options)
    raise ValueError(f"unknown attention backend {kind!r}; choose auto, torch or flashinfer")
