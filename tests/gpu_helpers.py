"""What tests/test_gpu.py measures, kept apart so CPU tests run the same code with the torch
reference standing in for FlashInfer (tests/test_gpu_helpers.py).

Tolerances are measured, not reasoned: each kernel comparison also computes, on the same
inputs, a reference that follows the kernel's precision contract (bf16 inputs, the softmax
probabilities rounded to bf16 before they multiply V, fp32 accumulation, bf16 output); its
distance to the fp32 reference (or the output's own bf16 rounding, if larger) is the error
that contract alone produces. The kernel's distance must stay within `ERROR_FACTOR` times that, and every number (kernel error,
contract error, output rounding, the bound) is recorded to $GPU_MEASUREMENTS as JSON, so the
next tolerance can be read off a device run.

Greedy tokens with and without caching must be identical; a step where they differ counts
as a tie, not a failure, only when the no-cache run's top-2 logit margin there is smaller
than the logit difference measured between the two runs at that step (recorded as such).
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attention import BatchMeta, build_batch_meta
from attention.kv_cache import PagedKVCache
from attention.reference import check_attention_shapes, paged_attention
from cachelib import Sequence, create_cache

HQ, HKV, D = 8, 2, 128  # GQA 4, head_dim 128 (the head size the prebuilt modules serve)
#: kernel error / precision-contract error allowed; the one unmeasured number here. 4, not 1:
#: a split-KV kernel rounds partial outputs before merging them (a second rounding the contract
#: reference does not do). Wrong kernels (no causal mask, one wrong page) measured on CPU land
#: 30x to 1000x beyond the resulting bound (tests/test_gpu_helpers.py checks they are caught).
ERROR_FACTOR = 4.0
#: kind -> (shared system prompt, shortest and longest own part): a 'short' request stays
#: <= 64 tokens even uncached (FlashInfer's fa2 prefill), a 'long' one's own part alone is
#: > 64 (fa3 on Hopper) whatever the cache supplies
SHAPES = {"short": (20, 7, 30), "long": (45, 70, 200)}


def prompts(kind: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Six requests sharing a system prompt, plus one unrelated (see SHAPES)."""
    system_len, lo, hi = SHAPES[kind]
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 1024, system_len).astype(np.int32)
    lens = np.linspace(lo, hi, 6).astype(int)
    out = {
        f"r{i}": np.concatenate([system, rng.integers(0, 1024, int(n))]).astype(np.int32) for i, n in enumerate(lens)
    }
    out["solo"] = rng.integers(0, 1024, int(hi)).astype(np.int32)
    return out


@dataclass
class KernelCase:
    """One layer of KV written through `backend`'s page tables, and a prefill and a decode batch."""

    kv: PagedKVCache
    prefill_meta: BatchMeta
    q: torch.Tensor
    decode_meta: BatchMeta
    dq: torch.Tensor

    @property
    def max_query(self) -> int:
        return max(self.prefill_meta.q_lens)


def build_case(
    backend: str, page_size: int, kind: str, dev: torch.device, dtype: torch.dtype = torch.bfloat16
) -> KernelCase:
    """Admit the prompts into `backend` one by one (later ones hit what earlier ones committed),
    write random K/V for the tokens each had to compute; then the queries: each request's
    computed suffix as one ragged prefill batch over its cached prefix, and one decode query
    per request over its whole context."""
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(f"{backend}/{page_size}/{kind}".encode()))
    cache = create_cache(backend, num_pages=8192 // page_size, page_size=page_size)
    kv = PagedKVCache(1, cache.num_pages, page_size, HKV, D, dtype=dtype, device=dev)
    tables, cached, q_lens = [], [], []
    for rid, p in prompts(kind).items():
        seq = Sequence(rid, p)
        m = cache.match(seq)
        ops = cache.admit(seq, m, len(seq))
        if ops is None:
            raise RuntimeError(f"{backend}: no room for {rid}; give the cache more pages")
        kv.apply(ops)
        new = len(seq) - seq.num_computed
        meta = build_batch_meta([seq.page_table], [seq.num_computed], [new], page_size, device=dev)
        kv.write(
            0,
            torch.randn(new, HKV, D, generator=gen, device=dev).to(dtype),
            torch.randn(new, HKV, D, generator=gen, device=dev).to(dtype),
            meta,
        )
        cache.commit(seq, len(seq))
        tables.append(list(seq.page_table))
        cached.append(len(seq) - new)
        q_lens.append(new)
    cache.check_invariants()
    pmeta = build_batch_meta(tables, cached, q_lens, page_size, device=dev)
    q = torch.randn(pmeta.num_q_tokens, HQ, D, generator=gen, device=dev).to(dtype)
    lens = [c + n for c, n in zip(cached, q_lens, strict=True)]
    dmeta = build_batch_meta(tables, [n - 1 for n in lens], [1] * len(lens), page_size, device=dev)
    dq = torch.randn(len(lens), HQ, D, generator=gen, device=dev).to(dtype)
    return KernelCase(kv, pmeta, q, dmeta, dq)


def contract_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: BatchMeta, *, causal: bool = True
) -> torch.Tensor:
    """The reference with a flash kernel's precision contract: bf16 (q's dtype) inputs, scores and
    softmax in fp32, probabilities rounded to q's dtype before P @ V (fp32 accumulation),
    output in q's dtype. Its distance to the fp32 reference is what that contract costs."""
    hq, hkv, d = check_attention_shapes(q, kv_layer, meta)
    group = hq // hkv
    scale = 1.0 / math.sqrt(d)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    start = 0
    for q_len, kv_len, pages in zip(meta.q_lens, meta.kv_lens, meta.pages, strict=True):
        idx = torch.tensor(pages, dtype=torch.int64, device=kv_layer.device)
        block = kv_layer[idx]
        k = block[:, 0].reshape(-1, hkv, d)[:kv_len].float()
        v = block[:, 1].reshape(-1, hkv, d)[:kv_len]
        qb = q[start : start + q_len].float().view(q_len, hkv, group, d)
        scores = torch.einsum("qhgd,khd->hgqk", qb, k) * scale
        if causal:
            rows = torch.arange(q_len, device=q.device).unsqueeze(1)
            cols = torch.arange(kv_len, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(cols > rows + (kv_len - q_len), float("-inf"))
        m = scores.amax(dim=-1, keepdim=True)
        p = torch.exp(scores - m)
        denom = p.sum(dim=-1, keepdim=True)  # fp32, from the unrounded p, as the kernels keep it
        pv = torch.einsum("hgqk,khd->hgqd", p.to(q.dtype).float(), v.float()) / denom
        out[start : start + q_len] = pv.permute(2, 0, 1, 3).reshape(q_len, hq, d).to(q.dtype)
        start += q_len
    return out


def measure_errors(out: torch.Tensor, q: torch.Tensor, kv_layer: torch.Tensor, meta: BatchMeta) -> dict[str, Any]:
    """`out` (the kernel's) against the fp32 reference, with the measured bound."""
    exact = paged_attention(q.float(), kv_layer.float(), meta)
    contract = contract_attention(q, kv_layer, meta)
    kernel_err = (out.float() - exact).abs().max().item()
    contract_err = (contract.float() - exact).abs().max().item()
    rounding_err = (exact.to(q.dtype).float() - exact).abs().max().item()
    bound = ERROR_FACTOR * max(contract_err, rounding_err)
    return {
        "max_abs_err": kernel_err,
        "contract_max_abs_err": contract_err,
        "output_rounding_max_abs_err": rounding_err,
        "bound": bound,
        "within_bound": kernel_err <= bound,
        "max_abs_exact": exact.abs().max().item(),
    }


def measure_lse_errors(lse: torch.Tensor, q: torch.Tensor, kv_layer: torch.Tensor, meta: BatchMeta) -> dict[str, Any]:
    """The kernel's base-2 LSE against the fp32 reference's. Bound: `ERROR_FACTOR` times the
    LSE shift that rounding the scores to q's dtype would cause, measured on these inputs
    (the kernels keep scores in fp32, so they should sit well inside it)."""
    _, exact = paged_attention(q.float(), kv_layer.float(), meta, return_lse=True)
    hq, hkv, d = check_attention_shapes(q, kv_layer, meta)
    group, scale = hq // hkv, 1.0 / math.sqrt(d)
    shift, start = 0.0, 0
    for q_len, kv_len, pages in zip(meta.q_lens, meta.kv_lens, meta.pages, strict=True):
        idx = torch.tensor(pages, dtype=torch.int64, device=kv_layer.device)
        k = kv_layer[idx][:, 0].reshape(-1, hkv, d)[:kv_len].float()
        qb = q[start : start + q_len].float().view(q_len, hkv, group, d)
        scores = torch.einsum("qhgd,khd->hgqk", qb, k) * scale
        rows = torch.arange(q_len, device=q.device).unsqueeze(1)
        cols = torch.arange(kv_len, device=q.device).unsqueeze(0)
        mask = cols > rows + (kv_len - q_len)
        full = torch.logsumexp(scores.masked_fill(mask, float("-inf")), dim=-1)
        rounded = torch.logsumexp(scores.to(q.dtype).float().masked_fill(mask, float("-inf")), dim=-1)
        shift = max(shift, ((rounded - full).abs().max() / math.log(2.0)).item())
        start += q_len
    err = (lse.float() - exact).abs().max().item()
    bound = ERROR_FACTOR * shift
    return {
        "lse_max_abs_err": err,
        "lse_rounded_scores_shift": shift,
        "lse_bound": bound,
        "lse_within_bound": err <= bound,
    }


def greedy_agreement(cached: dict, alone: dict) -> dict[str, Any]:
    """Compare greedy tokens of cached runs with the same requests run alone.

    `cached` / `alone`: request id -> RequestResult (tokens, logits per step). Returns counts,
    the largest logit difference seen, the smallest top-2 margin, and the mismatches, each
    classed as a tie (margin below the measured difference at that step) or not.
    """
    mismatches, max_diff, min_margin, steps = [], 0.0, math.inf, 0
    for rid, got in cached.items():
        want = alone[rid]
        for step, (tg, tw) in enumerate(zip(got.tokens, want.tokens, strict=True)):
            lg, lw = got.logits[step].float(), want.logits[step].float()
            diff = (lg - lw).abs().max().item()
            top2 = torch.topk(lw, 2).values
            margin = (top2[0] - top2[1]).item()
            max_diff, min_margin, steps = max(max_diff, diff), min(min_margin, margin), steps + 1
            if tg != tw:
                mismatches.append(
                    {"request": rid, "step": step, "margin": margin, "logit_diff": diff, "tie": margin <= diff}
                )
                break  # past a different token the two runs see different contexts
    return {
        "steps_compared": steps,
        "max_logit_diff": max_diff,
        "min_top2_margin": min_margin,
        "mismatches": mismatches,
        "non_tie_mismatches": sum(not m["tie"] for m in mismatches),
    }


class MeasurementLog:
    """Appends named records and rewrites the JSON file each time (atomic), if a path is set."""

    def __init__(self, path: str | os.PathLike | None) -> None:
        self.path = Path(path) if path else None
        self.records: list[dict[str, Any]] = []

    @classmethod
    def from_env(cls) -> MeasurementLog:
        return cls(os.environ.get("GPU_MEASUREMENTS"))

    def record(self, case: str, **values: Any) -> None:
        self.records.append({"case": case, **values})
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(
            json.dumps({"error_factor": ERROR_FACTOR, "records": self.records}, indent=1, default=str) + "\n"
        )
        tmp.replace(self.path)


def fork_branches(runner: Any, prompt: np.ndarray, branches: int, new_tokens: int) -> tuple[dict, dict]:
    """Parallel sampling through `runner` (a CachedRunner): prefill `prompt`, fork `branches - 1`
    children right away (they share the partial last page), force each branch's first token to
    a different top-k choice, then decode all branches as one batch, greedily. Every write into
    a shared page must be preceded by its copy (copy-on-write). Returns (results, forced)."""
    from tests.cached_runner import RequestResult

    parent = Sequence("p", prompt)
    first = runner.prefill(parent)
    top = torch.topk(first, branches).indices.tolist()
    live = [parent] + [runner.fork(parent, f"c{i}") for i in range(1, branches)]
    forced = {s.request_id: {0: top[i]} for i, s in enumerate(live)}
    got = {s.request_id: RequestResult(s.request_id) for s in live}
    logits = {s.request_id: first for s in live}
    for step in range(new_tokens):
        toks = []
        for s in live:
            rid = s.request_id
            tok = forced[rid].get(step, int(torch.argmax(logits[rid])))
            got[rid].logits.append(logits[rid])
            got[rid].tokens.append(tok)
            toks.append(tok)
        if step + 1 < new_tokens:
            out = runner.decode(live, toks)
            logits = {s.request_id: out[i] for i, s in enumerate(live)}
    runner.release(live)
    return got, forced
