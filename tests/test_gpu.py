"""FlashInfer against the torch reference on page tables produced by every backend (GPU only).

Run by `scripts/gpu_check.sh` (`pytest -m gpu`); skipped without CUDA and flashinfer.
Inputs are bf16 (FlashInfer runs fp16/bf16); the reference reads the same bf16 pages and
accumulates in fp32. Tolerances: attention outputs `atol = rtol = 2e-2` (a few bf16 ulps
of values of scale ~1), LSE `atol = 2e-2`; model logits `atol = 0.1, rtol = 0.05`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention.flashinfer_backend import flashinfer_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and flashinfer"),
]

from attention import ForwardInput, LlamaModel, ModelConfig, build_batch_meta  # noqa: E402
from attention.reference import paged_attention  # noqa: E402
from cachelib import Sequence, available_backends, create_cache  # noqa: E402
from tests.cached_runner import CachedRunner  # noqa: E402

HQ, HKV, D = 8, 2, 128  # GQA 4, head_dim 128 (a FlashInfer-compiled size)
OUT_TOL = dict(atol=2e-2, rtol=2e-2)
# Small model with FlashInfer-friendly head_dim; bf16 like the real presets.
GPU_SMALL = ModelConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=HQ,
    num_kv_heads=HKV, head_dim=D, dtype="bfloat16",
)  # fmt: skip


def _prompts(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 1024, 45).astype(np.int32)
    out = {f"r{i}": np.concatenate([system, rng.integers(0, 1024, 7 + 5 * i)]).astype(np.int32) for i in range(6)}
    out["solo"] = rng.integers(0, 1024, 30).astype(np.int32)
    return out


def check_kernel_on_backend_tables(backend: str, page_size: int, dev: torch.device, att) -> None:
    """`att` (plan/run with `return_lse`) against the reference on `backend`'s page tables.

    Separate from the test so its logic can be exercised on CPU with the reference as `att`.
    """
    from attention.kv_cache import PagedKVCache

    gen = torch.Generator(device=dev).manual_seed(0)
    cache = create_cache(backend, num_pages=4096 // page_size, page_size=page_size)
    kv = PagedKVCache(1, cache.num_pages, page_size, HKV, D, dtype=torch.bfloat16, device=dev)
    tables, cached, q_lens = [], [], []
    for rid, p in _prompts().items():
        seq = Sequence(rid, p)
        m = cache.match(seq)
        ops = cache.admit(seq, m, len(seq))
        assert ops is not None
        kv.apply(ops)
        new = len(seq) - seq.num_computed
        meta = build_batch_meta([seq.page_table], [seq.num_computed], [new], page_size, device=dev)
        kv.write(
            0,
            torch.randn(new, HKV, D, generator=gen, device=dev),
            torch.randn(new, HKV, D, generator=gen, device=dev),
            meta,
        )
        cache.commit(seq, len(seq))
        # queries: the last `new` tokens as a prefill over a (possibly) cached prefix
        tables.append(list(seq.page_table))
        cached.append(len(seq) - new)
        q_lens.append(new)
    # prefill batch (ragged, some sequences with a cached prefix)
    meta = build_batch_meta(tables, cached, q_lens, page_size, device=dev)
    q = torch.randn(meta.num_q_tokens, HQ, D, generator=gen, device=dev).bfloat16()
    att.plan(meta, HQ, HKV, D, torch.bfloat16)
    out, lse = att.run(q, kv.layers[0], return_lse=True)
    ref, ref_lse = paged_attention(q, kv.layers[0], meta, return_lse=True)
    torch.testing.assert_close(out.float(), ref.float(), **OUT_TOL)
    torch.testing.assert_close(lse.float(), ref_lse, atol=2e-2, rtol=0)
    # decode batch: one query per sequence over its whole context
    lens = [c + n for c, n in zip(cached, q_lens, strict=True)]
    dmeta = build_batch_meta(tables, [n - 1 for n in lens], [1] * len(lens), page_size, device=dev)
    dq = torch.randn(len(lens), HQ, D, generator=gen, device=dev).bfloat16()
    att.plan(dmeta, HQ, HKV, D, torch.bfloat16)
    torch.testing.assert_close(
        att.run(dq, kv.layers[0]).float(), paged_attention(dq, kv.layers[0], dmeta).float(), **OUT_TOL
    )


def check_model_through_cache(backend: str, dev: torch.device, attention) -> None:
    """Cached run with `attention` vs the same requests alone with the torch reference."""
    fi = LlamaModel(GPU_SMALL, seed=0, device=dev, attention=attention)
    ref = LlamaModel(GPU_SMALL, seed=0, device=dev, attention="torch")
    cache = create_cache(backend, num_pages=1024, page_size=16)
    runner = CachedRunner(fi, cache)
    prompts = _prompts(1)
    got = runner.run(prompts, 4, concurrency=3)
    for rid, p in prompts.items():
        kv = ref.make_kv_cache(8, 16)
        want = ref.forward([ForwardInput(p, 0, list(range(8)))], kv)[0]
        torch.testing.assert_close(got[rid].logits[0], want, atol=0.1, rtol=0.05)
    cache.check_invariants()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", available_backends())
def test_flashinfer_matches_reference_on_backend_tables(backend, page_size):
    from attention.flashinfer_backend import FlashInferAttention

    dev = torch.device("cuda")
    check_kernel_on_backend_tables(backend, page_size, dev, FlashInferAttention(dev))


@pytest.mark.parametrize("backend", available_backends())
def test_model_with_flashinfer_matches_reference_through_cache(backend):
    check_model_through_cache(backend, torch.device("cuda"), "flashinfer")
