"""A Llama-style decoder over the paged KV cache, with dummy weights from a seed.

RMSNorm, RoPE at absolute positions, GQA, SwiGLU, tied or untied LM head (docs/design.md §5).
`forward` computes K/V only for the tokens the cache did not supply, writes them into the
pages the backend allocated, attends over the whole paged context, and returns logits.
Weights are random (seeded), the usual way serving systems benchmark without checkpoints:
the output is meaningless but exactly reproducible, which is all the comparison needs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from attention.config import PRESETS, ModelConfig  # noqa: F401 (the model's shapes, re-exported)
from attention.flashinfer_backend import make_attention
from attention.kv_cache import PagedKVCache
from attention.metadata import AttentionInputError, ShapeMismatchError, TokenIdError, build_batch_meta


class ForwardInput(NamedTuple):
    """One sequence of a batch: the tokens still to compute, how many precede them with KV
    already in the pages, and the page table covering all of them."""

    tokens: Any  # 1-D int array or tensor of the new token ids
    num_cached: int
    page_table: list[int]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama (rotate-half) rotary embedding of `x [T, H, D]` with `cos, sin [T, 1, D]`."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class LlamaModel:
    """Seeded dummy-weight decoder; `forward` runs one batch over a `PagedKVCache`."""

    def __init__(
        self,
        config: ModelConfig | str = "tiny",
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
        attention: str | Any = "auto",
    ) -> None:
        cfg = PRESETS[config] if isinstance(config, str) else config
        if cfg.num_heads % cfg.num_kv_heads:
            raise ShapeMismatchError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
        if cfg.head_dim % 2:
            raise ShapeMismatchError(f"RoPE needs an even head_dim, got {cfg.head_dim}")
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = cfg.torch_dtype
        self.attention = make_attention(attention, self.device) if isinstance(attention, str) else attention
        self._init_weights(seed)
        half = cfg.head_dim // 2
        self._inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(half, dtype=torch.float64, device=self.device) / half))

    def _init_weights(self, seed: int) -> None:
        cfg, dev = self.config, self.device
        gen = torch.Generator(device=dev).manual_seed(seed)

        def rand(*shape: int, std: float) -> torch.Tensor:
            # drawn in fp32 then cast, so a seed gives the same weights in every dtype
            return (torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32) * std).to(self.dtype)

        h, hd = cfg.hidden_size, cfg.head_dim
        self.embed = rand(cfg.vocab_size, h, std=1.0)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(cfg.num_layers):
            # std 1/sqrt(fan_in): activations keep unit scale through the residual stream
            self.layers.append(
                dict(
                    attn_norm=torch.ones(h, dtype=self.dtype, device=dev),
                    wq=rand(cfg.num_heads * hd, h, std=h**-0.5),
                    wk=rand(cfg.num_kv_heads * hd, h, std=h**-0.5),
                    wv=rand(cfg.num_kv_heads * hd, h, std=h**-0.5),
                    wo=rand(h, cfg.num_heads * hd, std=(cfg.num_heads * hd) ** -0.5),
                    mlp_norm=torch.ones(h, dtype=self.dtype, device=dev),
                    w_gate=rand(cfg.intermediate_size, h, std=h**-0.5),
                    w_up=rand(cfg.intermediate_size, h, std=h**-0.5),
                    w_down=rand(h, cfg.intermediate_size, std=cfg.intermediate_size**-0.5),
                )
            )
        self.final_norm = torch.ones(h, dtype=self.dtype, device=dev)
        self.lm_head = self.embed if cfg.tie_embeddings else rand(cfg.vocab_size, h, std=h**-0.5)

    def make_kv_cache(self, num_pages: int, page_size: int) -> PagedKVCache:
        """A KV cache shaped for this model."""
        cfg = self.config
        return PagedKVCache(
            cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device
        )

    def _token_tensor(self, batch: list[ForwardInput]) -> torch.Tensor:
        parts = []
        vocab = self.config.vocab_size
        for b, item in enumerate(batch):
            toks = item.tokens
            arr = toks.detach().cpu().numpy() if isinstance(toks, torch.Tensor) else np.asarray(toks)
            if arr.ndim != 1 or arr.size == 0:
                raise AttentionInputError(f"sequence {b}: tokens must be a non-empty 1-D array, got shape {arr.shape}")
            if not np.issubdtype(arr.dtype, np.integer):
                raise TokenIdError(f"sequence {b}: token ids must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise TokenIdError(f"sequence {b}: token id {bad} outside the vocabulary [0, {vocab})")
            parts.append(arr.astype(np.int64, copy=False))
        return torch.from_numpy(np.concatenate(parts)).to(self.device)

    @torch.inference_mode()
    def forward(self, batch: list[ForwardInput], kv_cache: PagedKVCache, *, all_logits: bool = False) -> torch.Tensor:
        """Run one batch; returns fp32 logits `[B, vocab]` at each sequence's last new token,
        or with `all_logits` `[total_q, vocab]` for every new token (sequences concatenated).

        Every check (token ids, page tables, head counts, dtypes) runs before any kernel.
        """
        cfg = self.config
        if (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_dim) != (
            cfg.num_layers,
            cfg.num_kv_heads,
            cfg.head_dim,
        ):
            raise ShapeMismatchError(
                f"KV cache has {kv_cache.num_layers} layers x {kv_cache.num_kv_heads} KV heads x head_dim {kv_cache.head_dim}, "
                f"the model needs {cfg.num_layers} x {cfg.num_kv_heads} x {cfg.head_dim}"
            )
        if kv_cache.dtype != self.dtype:
            raise ShapeMismatchError(f"KV cache dtype {kv_cache.dtype} != model dtype {self.dtype}")
        if not batch:
            raise AttentionInputError("empty batch")
        tokens = self._token_tensor(batch)
        meta = build_batch_meta(
            [item.page_table for item in batch],
            [item.num_cached for item in batch],
            [len(item.tokens) for item in batch],
            kv_cache.page_size,
            num_pages=kv_cache.num_pages,
            device=self.device,
        )
        t, hq, hkv, hd = tokens.numel(), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.attention.plan(meta, hq, hkv, hd, self.dtype)
        angles = (meta.positions.double().unsqueeze(1) * self._inv_freq).float()  # (T, D/2)
        cos = torch.cat((angles.cos(), angles.cos()), dim=-1).unsqueeze(1)  # (T, 1, D)
        sin = torch.cat((angles.sin(), angles.sin()), dim=-1).unsqueeze(1)
        x = self.embed[tokens]  # (T, hidden)
        for i, w in enumerate(self.layers):
            h = _rms_norm(x, w["attn_norm"], cfg.rms_eps)
            q = _rope((h @ w["wq"].T).view(t, hq, hd), cos, sin)  # (T, Hq, D)
            k = _rope((h @ w["wk"].T).view(t, hkv, hd), cos, sin)  # (T, Hkv, D)
            v = (h @ w["wv"].T).view(t, hkv, hd)
            kv_cache.write(i, k, v, meta)  # new K/V first: attention reads them from the pages
            o = self.attention.run(q, kv_cache.layers[i])  # (T, Hq, D)
            x = x + o.reshape(t, hq * hd) @ w["wo"].T
            h = _rms_norm(x, w["mlp_norm"], cfg.rms_eps)
            x = x + (F.silu(h @ w["w_gate"].T) * (h @ w["w_up"].T)) @ w["w_down"].T
        if not all_logits:
            x = x[meta.qo_indptr[1:].long() - 1]  # (B, hidden): each sequence's last new token
        x = _rms_norm(x, self.final_norm, cfg.rms_eps)
        return (x @ self.lm_head.T).float()
