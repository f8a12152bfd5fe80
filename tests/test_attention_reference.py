"""The torch paged reference against a dense causal attention written here independently,
plus the CSR metadata, the KV cache's scatter and copies, and the FlashInfer argument
building (pure, so it runs on CPU)."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from attention.flashinfer_backend import decode_plan_args, make_attention, prefill_plan_args
from attention.kv_cache import PagedKVCache
from attention.metadata import PageTableError, ShapeMismatchError, build_batch_meta
from attention.reference import TorchAttention, paged_attention, paged_decode

D = 16


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n_q, Hq, D) is the suffix of a context with k, v (n_kv, Hkv, D); float64, loops.

    Returns out (n_q, Hq, D) and natural-log LSE (n_q, Hq).
    """
    n_q, hq, d = q.shape
    n_kv, hkv, _ = k.shape
    out = torch.zeros(n_q, hq, d, dtype=torch.float64)
    lse = torch.zeros(n_q, hq, dtype=torch.float64)
    for h in range(hq):
        kh = h * hkv // hq  # contiguous groups of query heads share a KV head
        for i in range(n_q):
            pos = n_kv - n_q + i  # absolute position of this query
            s = (k[: pos + 1, kh].double() @ q[i, h].double()) / math.sqrt(d)
            m = s.max()
            w = torch.exp(s - m)
            out[i, h] = (w[:, None] * v[: pos + 1, kh].double()).sum(0) / w.sum()
            lse[i, h] = m + torch.log(w.sum())
    return out, lse


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is much faster than two on a 2-core runner."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def scattered_tables(kv_lens: list[int], page_size: int, num_pages: int, rng: np.random.Generator) -> list[list[int]]:
    """Disjoint page tables in random physical order (never identity), one spare page each."""
    need = [-(-n // page_size) + 1 for n in kv_lens]
    perm = rng.permutation(num_pages)[: sum(need)].tolist()
    out, at = [], 0
    for n in need:
        out.append(perm[at : at + n])
        at += n
    return out


def fill(kv: PagedKVCache, tables: list[list[int]], kv_lens: list[int], gen: torch.Generator):
    """Random dense K/V per sequence, written into its pages; returns the dense copies."""
    dense = []
    for table, n in zip(tables, kv_lens, strict=True):
        k = torch.randn(n, kv.num_kv_heads, D, generator=gen)
        v = torch.randn(n, kv.num_kv_heads, D, generator=gen)
        meta = build_batch_meta([table], [0], [n], kv.page_size)
        kv.write(0, k, v, meta)
        dense.append((k, v))
    return dense


CASES = [
    # (page_size, hq, hkv, kv_lens, q_lens): q_len == kv_len is prefill with no cached prefix
    (1, 4, 4, [5, 1, 9], [5, 1, 9]),
    (4, 4, 4, [13, 8, 3], [13, 2, 1]),
    (4, 8, 2, [17, 30], [17, 7]),
    (16, 4, 1, [40, 16, 1, 33], [40, 5, 1, 1]),
    (16, 8, 2, [70, 33], [3, 33]),
    (1, 8, 2, [12, 6], [4, 6]),
]


@pytest.mark.parametrize("page_size,hq,hkv,kv_lens,q_lens", CASES)
def test_prefill_matches_dense(page_size, hq, hkv, kv_lens, q_lens):
    rng = np.random.default_rng(page_size * 100 + hq + len(kv_lens))
    gen = torch.Generator().manual_seed(7)
    num_pages = sum(-(-n // page_size) + 1 for n in kv_lens) + 5
    kv = PagedKVCache(1, num_pages, page_size, hkv, D)
    tables = scattered_tables(kv_lens, page_size, num_pages, rng)
    dense = fill(kv, tables, kv_lens, gen)
    cached = [n - q for n, q in zip(kv_lens, q_lens, strict=True)]
    meta = build_batch_meta(tables, cached, q_lens, page_size, num_pages=num_pages)
    q = torch.randn(sum(q_lens), hq, D, generator=gen)
    out, lse = paged_attention(q, kv.layers[0], meta, return_lse=True)
    start = 0
    for (k, v), n_q in zip(dense, q_lens, strict=True):
        want, want_lse = dense_attention(q[start : start + n_q], k, v)
        torch.testing.assert_close(out[start : start + n_q].double(), want, atol=2e-5, rtol=1e-5)
        # FlashInfer's LSE is base 2: log2(sum exp(s)) = ln(...) / ln 2
        torch.testing.assert_close(lse[start : start + n_q].double(), want_lse / math.log(2), atol=2e-5, rtol=1e-5)
        start += n_q


@pytest.mark.parametrize("page_size,hq,hkv", [(1, 4, 4), (4, 4, 1), (16, 8, 2)])
def test_decode_matches_dense(page_size, hq, hkv):
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(11)
    kv_lens = [1, 7, 16, 33, 50]
    num_pages = sum(-(-n // page_size) + 1 for n in kv_lens)
    kv = PagedKVCache(1, num_pages, page_size, hkv, D)
    tables = scattered_tables(kv_lens, page_size, num_pages, rng)
    dense = fill(kv, tables, kv_lens, gen)
    meta = build_batch_meta(tables, [n - 1 for n in kv_lens], [1] * len(kv_lens), page_size)
    assert meta.is_decode
    q = torch.randn(len(kv_lens), hq, D, generator=gen)
    out = paged_decode(q, kv.layers[0], meta)
    for b, (k, v) in enumerate(dense):
        want, _ = dense_attention(q[b : b + 1], k, v)
        torch.testing.assert_close(out[b : b + 1].double(), want, atol=2e-5, rtol=1e-5)


def test_non_causal_sees_whole_context():
    gen = torch.Generator().manual_seed(1)
    kv = PagedKVCache(1, 4, 4, 2, D)
    ((k, v),) = fill(kv, [[2, 0, 3]], [10], gen)
    meta = build_batch_meta([[2, 0, 3]], [6], [4], 4)
    q = torch.randn(4, 2, D, generator=gen)
    out = paged_attention(q, kv.layers[0], meta, causal=False)
    want = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D), -1)
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", want, v), atol=1e-5, rtol=1e-5)


def test_bf16_inputs_accumulate_in_fp32():
    gen = torch.Generator().manual_seed(2)
    kv = PagedKVCache(1, 8, 4, 2, D, dtype=torch.bfloat16)
    k = torch.randn(20, 2, D, generator=gen)
    v = torch.randn(20, 2, D, generator=gen)
    kv.write(0, k, v, build_batch_meta([[7, 1, 5, 3, 0]], [0], [20], 4))
    meta = build_batch_meta([[7, 1, 5, 3, 0]], [12], [8], 4)
    q = torch.randn(8, 4, D, generator=gen).bfloat16()
    out = paged_attention(q, kv.layers[0], meta)
    assert out.dtype == torch.bfloat16
    want, _ = dense_attention(q.float(), k.bfloat16().float(), v.bfloat16().float())
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)


# -- metadata ------------------------------------------------------------------------


def test_metadata_csr_exact():
    meta = build_batch_meta([[5, 2, 9], [4], [1, 3, 8]], [3, 0, 4], [4, 2, 1], 4, num_pages=10)
    assert meta.qo_indptr.tolist() == [0, 4, 6, 7]
    assert meta.kv_indptr.tolist() == [0, 2, 3, 5]  # kv lens 7, 2, 5 -> 2, 1, 2 pages
    assert meta.kv_indices.tolist() == [5, 2, 4, 1, 3]
    assert meta.kv_last_page_len.tolist() == [3, 2, 1]
    assert all(t.dtype == torch.int32 for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len))
    assert meta.positions.tolist() == [3, 4, 5, 6, 0, 1, 4]
    assert meta.write_pages.tolist() == [5, 2, 2, 2, 4, 4, 3]
    assert meta.write_slots.tolist() == [3, 0, 1, 2, 0, 1, 0]
    assert not meta.is_decode and meta.num_q_tokens == 7


def test_metadata_full_last_page():
    meta = build_batch_meta([[0, 1]], [7], [1], 4)
    assert meta.kv_last_page_len.tolist() == [4] and meta.kv_indptr.tolist() == [0, 2]


@pytest.mark.parametrize(
    "tables,cached,q_lens,match",
    [
        ([[0]], [3], [2], "page table has 1 pages but 5 tokens need 2"),
        ([[0, 11]], [0], [5], "page id 11 outside the pool"),
        ([[0, 1], [1, 2]], [0, 0], [6, 3], "same \\(page, slot\\)"),
        ([[0]], [0], [0], "number of new tokens"),
        ([[0]], [-1], [1], "num_cached"),
    ],
)
def test_metadata_rejects_bad_tables(tables, cached, q_lens, match):
    with pytest.raises(ValueError, match=match):
        build_batch_meta(tables, cached, q_lens, 4, num_pages=10)


def test_page_table_error_is_a_value_error():
    with pytest.raises(PageTableError):
        build_batch_meta([[0]], [4], [4], 4)
    assert issubclass(PageTableError, ValueError)


# -- KV cache ------------------------------------------------------------------------


def test_kv_cache_layout_and_copy_on_write():
    kv = PagedKVCache(2, 6, 4, 2, D)
    assert kv.layers[0].shape == (6, 2, 4, 2, D)  # NHD: [pages, K/V, slot, head, dim]
    k = torch.arange(6 * 2 * D, dtype=torch.float32).view(6, 2, D)
    meta = build_batch_meta([[3, 1]], [0], [6], 4)
    for layer in range(2):
        kv.write(layer, k, -k, meta)
    assert torch.equal(kv.layers[1][3, 0, 2], k[2]) and torch.equal(kv.layers[1][1, 1, 1], -k[5])
    assert kv.apply([(1, 4), (3, 5)]) == 2
    for layer in range(2):
        assert torch.equal(kv.layers[layer][4], kv.layers[layer][1])
        assert torch.equal(kv.layers[layer][5], kv.layers[layer][3])
    gk, gv = kv.gather(0, [5, 4], 6)
    assert torch.equal(gk, k) and torch.equal(gv, -k)
    assert kv.apply([]) == 0 and kv.apply(None) == 0


def test_kv_cache_rejects_bad_input():
    kv = PagedKVCache(1, 4, 4, 2, D)
    meta = build_batch_meta([[0]], [0], [3], 4)
    with pytest.raises(ShapeMismatchError, match="expects"):
        kv.write(0, torch.zeros(3, 4, D), torch.zeros(3, 4, D), meta)
    with pytest.raises(PageTableError, match="outside the pool"):
        kv.apply([(0, 4)])
    with pytest.raises(PageTableError, match="same destination"):
        kv.apply([(0, 2), (1, 2)])


def test_reference_rejects_mismatched_heads():
    kv = PagedKVCache(1, 4, 4, 3, D)
    meta = build_batch_meta([[0]], [0], [2], 4)
    with pytest.raises(ShapeMismatchError, match="not a multiple of num_kv_heads 3"):
        paged_attention(torch.zeros(2, 4, D), kv.layers[0], meta)
    with pytest.raises(ShapeMismatchError, match="head_dim"):
        paged_attention(torch.zeros(2, 3, D + 2), kv.layers[0], meta)
    with pytest.raises(ShapeMismatchError, match="query tokens"):
        paged_attention(torch.zeros(3, 3, D), kv.layers[0], meta)
    with pytest.raises(ShapeMismatchError, match="one query per sequence"):
        paged_decode(torch.zeros(2, 3, D), kv.layers[0], meta)
    with pytest.raises(ShapeMismatchError):
        TorchAttention().plan(meta, 4, 3, D, torch.float32)


# -- FlashInfer argument building (no GPU, no import) ----------------------------------


def test_flashinfer_plan_args_are_built_without_flashinfer():
    meta = build_batch_meta([[5, 2, 9], [4]], [3, 1], [4, 1], 4)
    args, kwargs = prefill_plan_args(meta, 32, 8, 128, torch.bfloat16)
    assert args[:4] == (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len)
    assert args[4:] == (32, 8, 128, 4)
    assert kwargs["causal"] is True and kwargs["pos_encoding_mode"] == "NONE"
    assert kwargs["sm_scale"] == pytest.approx(1 / math.sqrt(128))
    assert kwargs["q_data_type"] is torch.bfloat16 and kwargs["kv_data_type"] is torch.bfloat16
    dmeta = build_batch_meta([[5, 2, 9], [4]], [6, 1], [1, 1], 4)
    dargs, dkw = decode_plan_args(dmeta, 32, 8, 128, torch.float16)
    assert dargs == (dmeta.kv_indptr, dmeta.kv_indices, dmeta.kv_last_page_len, 32, 8, 128, 4)
    assert "causal" not in dkw
    with pytest.raises(ShapeMismatchError, match="one query per sequence"):
        decode_plan_args(meta, 32, 8, 128, torch.float16)
    with pytest.raises(ShapeMismatchError, match="float16/bfloat16"):
        prefill_plan_args(meta, 32, 8, 128, torch.float32)
    with pytest.raises(ShapeMismatchError, match="multiple"):
        prefill_plan_args(meta, 30, 8, 128, torch.float16)
    assert "flashinfer" not in sys.modules


def test_make_attention_on_cpu_is_torch():
    assert make_attention("auto", "cpu").name == "torch"
    assert make_attention("torch", "cpu").name == "torch"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_attention("flashinfer", "cpu")
    with pytest.raises(ValueError, match="unknown attention"):
        make_attention("xformers", "cpu")
    assert "flashinfer" not in sys.modules


# -- GPU tooling, as far as a CPU allows --------------------------------------------------


def test_gpu_bench_imports_without_flashinfer():
    import importlib

    bench = importlib.import_module("experiments.bench.gpu_attention_bench")
    assert callable(bench.main) and "flashinfer" not in sys.modules


def test_gpu_scripts_dry_run(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    dry = subprocess.run(
        ["bash", "scripts/prepare_gpu_wheels.sh", "--dry-run"], cwd=root, capture_output=True, text=True, check=True
    )
    assert "flashinfer-python==" in dry.stdout and "apache-tvm-ffi==" in dry.stdout  # tvm-ffi pinned
    aot = subprocess.run(
        ["bash", "scripts/build_flashinfer_aot.sh", "--dry-run", "--dest", str(tmp_path / "whl")],
        cwd=root, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert "flashinfer/data/aot/<name>/<name>.so" in aot.stdout and "apache-tvm-ffi==" in aot.stdout
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path)}
    chk = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=root, env=env, capture_output=True, text=True)
    assert chk.returncode == 0, chk.stdout + chk.stderr
    assert "pytest -m gpu" in chk.stdout and "gpu_attention_bench.py" in chk.stdout
    assert "flashinfer_aot.py resolve" in chk.stdout and "FLASHINFER_DISABLE_JIT=1" in chk.stdout
    assert any(p.name.startswith("gpu_check_") for p in tmp_path.iterdir())
