"""Pure-torch paged attention with FlashInfer's semantics; what CPU tests and CI run.

Semantics reproduced (docs/design.md §5): queries of sequence b are the last `q_len` tokens of its
`kv_len`-token context; with `causal=True` query row i sees keys `0 .. i + kv_len - q_len`
(bottom-right alignment); GQA maps query head h to KV head `h // (Hq // Hkv)`; softmax
scale `1/sqrt(head_dim)` unless given; scores, softmax and the weighted sum in fp32; the
optional LSE is base 2 (`log2(sum(exp(s)))`), as FlashInfer returns it.
"""

from __future__ import annotations

import math

import torch

from attention.metadata import BatchMeta, ShapeMismatchError

_LOG2E = 1.0 / math.log(2.0)


def check_attention_shapes(q: torch.Tensor, kv_layer: torch.Tensor, meta: BatchMeta) -> tuple[int, int, int]:
    """Validate `q [total_q, Hq, D]` against `kv_layer [P, 2, S, Hkv, D]`; returns (Hq, Hkv, D)."""
    if q.dim() != 3:
        raise ShapeMismatchError(f"q must be [total_q, num_qo_heads, head_dim], got shape {tuple(q.shape)}")
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ShapeMismatchError(
            f"kv layer must be [num_pages, 2, page_size, num_kv_heads, head_dim], got shape {tuple(kv_layer.shape)}"
        )
    total_q, hq, d = q.shape
    _, _, page_size, hkv, dk = kv_layer.shape
    if d != dk:
        raise ShapeMismatchError(f"query head_dim {d} != KV head_dim {dk}")
    if hq % hkv != 0:
        raise ShapeMismatchError(f"num_qo_heads {hq} is not a multiple of num_kv_heads {hkv}")
    if page_size != meta.page_size:
        raise ShapeMismatchError(f"kv layer page size {page_size} != batch page size {meta.page_size}")
    if total_q != meta.num_q_tokens:
        raise ShapeMismatchError(f"q has {total_q} rows, the batch has {meta.num_q_tokens} query tokens")
    return hq, hkv, d


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: BatchMeta,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Batched attention of `q [total_q, Hq, D]` over the paged context in `kv_layer`.

    Returns `out [total_q, Hq, D]` in q's dtype and, with `return_lse`, `lse [total_q, Hq]`
    (fp32, base 2).
    """
    hq, hkv, d = check_attention_shapes(q, kv_layer, meta)
    group = hq // hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    start = 0
    for q_len, kv_len, pages in zip(meta.q_lens, meta.kv_lens, meta.pages, strict=True):
        idx = torch.tensor(pages, dtype=torch.int64, device=kv_layer.device)
        block = kv_layer[idx].float()  # (n_pages, 2, S, Hkv, D)
        k = block[:, 0].reshape(-1, hkv, d)[:kv_len]  # (kv_len, Hkv, D)
        v = block[:, 1].reshape(-1, hkv, d)[:kv_len]
        qb = q[start : start + q_len].float().view(q_len, hkv, group, d)  # query head h = kv_head * group + g
        scores = torch.einsum("qhgd,khd->hgqk", qb, k) * scale  # (Hkv, G, q_len, kv_len)
        if causal:
            rows = torch.arange(q_len, device=q.device).unsqueeze(1)
            cols = torch.arange(kv_len, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(cols > rows + (kv_len - q_len), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        ob = torch.einsum("hgqk,khd->qhgd", probs, v).reshape(q_len, hq, d)
        out[start : start + q_len] = ob.to(q.dtype)
        if lse is not None:
            lse[start : start + q_len] = (torch.logsumexp(scores, dim=-1) * _LOG2E).permute(2, 0, 1).reshape(q_len, hq)
        start += q_len
    return (out, lse) if lse is not None else out


def paged_decode(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: BatchMeta,
    *,
    sm_scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode: one query `q [B, Hq, D]` per sequence over its whole context."""
    if not meta.is_decode:
        raise ShapeMismatchError(f"decode needs one query per sequence, got query lengths {meta.q_lens}")
    return paged_attention(q, kv_layer, meta, causal=False, sm_scale=sm_scale, return_lse=return_lse)


class TorchAttention:
    """The reference behind the `plan` / `run` interface the model calls (plan per batch, run per layer)."""

    name = "torch"

    def __init__(self, *, sm_scale: float | None = None) -> None:
        self.sm_scale = sm_scale
        self._meta: BatchMeta | None = None

    def plan(self, meta: BatchMeta, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        if num_qo_heads % num_kv_heads != 0:
            raise ShapeMismatchError(f"num_qo_heads {num_qo_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self._meta = meta

    def run(self, q: torch.Tensor, kv_layer: torch.Tensor) -> torch.Tensor:
        if self._meta is None:
            raise RuntimeError("run() before plan()")
        return paged_attention(q, kv_layer, self._meta, causal=True, sm_scale=self.sm_scale)
