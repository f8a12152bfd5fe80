"""FlashInfer on the GPU: both kernel families, every backend's page tables, caching never
changing greedy tokens, copy-on-write pages (GPU only; `scripts/gpu_check.sh` runs them).

Skipped without CUDA and flashinfer. bf16 throughout. What is measured and how the bounds
come from measurements: tests/gpu_helpers.py (the same code runs on CPU in
tests/test_gpu_helpers.py). Every measured number goes to $GPU_MEASUREMENTS (JSON) when set.

Kernel families (FlashInfer 0.7.4, `backend="auto"`): a prefill batch whose longest query is
<= 64 tokens runs fa2, a longer one fa3 on Hopper (sm90a); decode with tensor cores runs fa2.
The "short" and "long" cases below hit each, and each asserts the family it expected.
"""

from __future__ import annotations

import pytest
import torch

from attention.flashinfer_backend import expected_backend, flashinfer_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not flashinfer_available(), reason="needs CUDA and flashinfer"),
]

from attention import LlamaModel, ModelConfig  # noqa: E402
from cachelib import available_backends, create_cache  # noqa: E402
from tests.cached_runner import CachedRunner, run_alone  # noqa: E402
from tests.gpu_helpers import (  # noqa: E402
    HKV,
    HQ,
    D,
    MeasurementLog,
    build_case,
    fork_branches,
    greedy_agreement,
    measure_errors,
    measure_lse_errors,
    prompts,
)

NEW_TOKENS = 12
# Small model with the head size the prebuilt modules serve; bf16 like the real presets.
GPU_SMALL = ModelConfig(
    vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=HQ,
    num_kv_heads=HKV, head_dim=D, dtype="bfloat16",
)  # fmt: skip
LOG = MeasurementLog.from_env()


def _sm90a() -> bool:
    return torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.parametrize("kind", ["short", "long"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("backend", available_backends())
def test_kernels_match_reference_on_backend_tables(backend, page_size, kind):
    from attention.flashinfer_backend import FlashInferAttention

    dev = torch.device("cuda")
    case = build_case(backend, page_size, kind, dev)
    att = FlashInferAttention(dev)
    layer = case.kv.layers[0]
    # prefill: the ragged batch of suffixes over cached prefixes
    att.plan(case.prefill_meta, HQ, HKV, D, torch.bfloat16)
    got_p, want_p = att.resolved_backend(), expected_backend("prefill", case.max_query, sm90a=_sm90a())
    out, lse = att.run(case.q, layer, return_lse=True)
    pre = {
        **measure_errors(out, case.q, layer, case.prefill_meta),
        **measure_lse_errors(lse, case.q, layer, case.prefill_meta),
    }
    LOG.record(f"kernel/{backend}/page{page_size}/{kind}/prefill", flashinfer_backend=got_p, expected=want_p,
               max_query=case.max_query, **pre)  # fmt: skip
    # decode: one query per sequence over its whole context
    att.plan(case.decode_meta, HQ, HKV, D, torch.bfloat16)
    got_d = att.resolved_backend()
    dout = att.run(case.dq, layer)
    dec = measure_errors(dout, case.dq, layer, case.decode_meta)
    LOG.record(f"kernel/{backend}/page{page_size}/{kind}/decode", flashinfer_backend=got_d, expected="fa2", **dec)
    assert got_p == want_p, f"prefill (longest query {case.max_query}) ran {got_p}, expected {want_p}"
    assert got_d == "fa2", f"decode ran {got_d}"
    assert pre["within_bound"], f"prefill error {pre['max_abs_err']:.3g} > measured bound {pre['bound']:.3g}"
    assert pre["lse_within_bound"], f"LSE error {pre['lse_max_abs_err']:.3g} > measured bound {pre['lse_bound']:.3g}"
    assert dec["within_bound"], f"decode error {dec['max_abs_err']:.3g} > measured bound {dec['bound']:.3g}"


@pytest.mark.parametrize("backend", available_backends())
def test_greedy_tokens_same_with_and_without_cache(backend):
    """Short and long requests (fa2 and fa3 prefills; a cached request's suffix may switch it to
    fa2) through the cache, against each request alone with no cache, both on FlashInfer."""
    dev = torch.device("cuda")
    model = LlamaModel(GPU_SMALL, seed=0, device=dev, attention="flashinfer")
    cache = create_cache(backend, num_pages=2048, page_size=16)
    runner = CachedRunner(model, cache)
    reqs = {**prompts("short", 1), **{f"L{k}": v for k, v in prompts("long", 2).items()}}
    got = runner.run(reqs, NEW_TOKENS, concurrency=3)
    alone = {rid: run_alone(model, p, NEW_TOKENS) for rid, p in reqs.items()}
    agreement = greedy_agreement(got, alone)
    # the same requests through the torch reference (fp32 accumulation), for the record
    ref = LlamaModel(GPU_SMALL, seed=0, device=dev, attention="torch")
    ref_diff = max(
        (alone[rid].logits[0] - run_alone(ref, p, 1).logits[0]).abs().max().item() for rid, p in reqs.items()
    )
    hits = sum(r.hit_tokens for r in got.values())
    LOG.record(f"greedy/{backend}", hit_tokens=hits, first_logits_vs_torch_max_diff=ref_diff, **agreement)
    cache.check_invariants()
    assert agreement["non_tie_mismatches"] == 0, agreement["mismatches"]
    if cache.reuses_kv and not cache.declares_prefixes:  # shares automatically (paged shares only declared prefixes)
        assert hits > 0, f"{backend} reused nothing: the comparison is vacuous"


@pytest.mark.parametrize("backend", available_backends())
def test_copy_on_write_pages(backend):
    """Four branches forked off one 38-token prompt (page 16: the partial last page is shared)
    decode as one batch; each must match the same forced request run alone."""
    dev = torch.device("cuda")
    model = LlamaModel(GPU_SMALL, seed=0, device=dev, attention="flashinfer")
    cache = create_cache(backend, num_pages=256, page_size=16)
    runner = CachedRunner(model, cache)
    prompt = prompts("long", 3)["r0"][:38]
    got, forced = fork_branches(runner, prompt, 4, NEW_TOKENS)
    alone = {rid: run_alone(model, prompt, NEW_TOKENS, forced=forced[rid]) for rid in got}
    agreement = greedy_agreement(got, alone)
    LOG.record(f"cow/{backend}", copied_pages=runner.copied_pages, **agreement)
    cache.check_invariants()
    assert runner.copied_pages > 0, "no copy-on-write happened: the case is vacuous"
    assert len({tuple(r.tokens) for r in got.values()}) == 4, "branches should differ"
    assert agreement["non_tie_mismatches"] == 0, agreement["mismatches"]
