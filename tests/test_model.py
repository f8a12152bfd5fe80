"""The tiny Llama-style model: incremental (paged, chunked, decode) == one-shot, seeds,
presets, and bad input rejected before any kernel runs. `llama3-8b` is never built here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention import PRESETS, ForwardInput, LlamaModel, ModelConfig, PagedKVCache
from attention.metadata import PageTableError, ShapeMismatchError, TokenIdError
from attention.reference import TorchAttention

ATOL = RTOL = 1e-4  # fp32 on CPU; observed differences are ~2e-6 on logits of scale ~1


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel("tiny", seed=0, attention="torch")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread is much faster than two on a 2-core runner."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, PRESETS["tiny"].vocab_size, n).astype(np.int32)


def test_incremental_equals_one_shot(model):
    toks = prompt(23)
    kv = model.make_kv_cache(8, 4)
    full = model.forward([ForwardInput(toks, 0, list(range(6)))], kv, all_logits=True)  # (23, vocab)
    assert full.shape == (23, model.config.vocab_size) and full.dtype == torch.float32
    # scattered pages, prefill in chunks of 5 / 7 / 11, then decode one token at a time
    kv2 = model.make_kv_cache(16, 4)
    table = [9, 3, 14, 0, 7, 12]
    got = []
    at = 0
    for step in (5, 7, 4, 1, 1, 1, 1, 1, 1, 1):
        got.append(model.forward([ForwardInput(toks[at : at + step], at, table)], kv2, all_logits=True))
        at += step
    assert at == 23
    torch.testing.assert_close(torch.cat(got), full, atol=ATOL, rtol=RTOL)


def test_ragged_batch_equals_separate_runs(model):
    a, b, c = prompt(9, 1), prompt(4, 2), prompt(17, 3)
    kv = model.make_kv_cache(32, 4)
    # first fill prefixes of a and c, then one ragged batch: a suffix, b whole, c one token
    model.forward([ForwardInput(a[:5], 0, [0, 1, 2])], kv)
    model.forward([ForwardInput(c[:16], 0, [10, 11, 12, 13, 14])], kv)
    batch = [
        ForwardInput(a[5:], 5, [0, 1, 2]),
        ForwardInput(b, 0, [20]),
        ForwardInput(c[16:], 16, [10, 11, 12, 13, 14]),
    ]
    got = model.forward(batch, kv)  # (3, vocab): last new token of each
    for i, toks in enumerate((a, b, c)):
        alone = model.forward([ForwardInput(toks, 0, list(range(5)))], model.make_kv_cache(5, 4))
        torch.testing.assert_close(got[i : i + 1], alone, atol=ATOL, rtol=RTOL)


def test_position_matters(model):
    """RoPE at absolute positions: the same token after different prefixes gives different K."""
    kv = model.make_kv_cache(4, 4)
    x = model.forward([ForwardInput(np.array([5, 6, 7], np.int32), 0, [0])], kv)
    y = model.forward([ForwardInput(np.array([9, 6, 7], np.int32), 0, [1])], kv)
    assert not torch.allclose(x, y)


def test_seed_determines_weights():
    a = LlamaModel("tiny", seed=1, attention="torch")
    b = LlamaModel("tiny", seed=1, attention="torch")
    c = LlamaModel("tiny", seed=2, attention="torch")
    toks = prompt(6)
    run = lambda m: m.forward([ForwardInput(toks, 0, [0, 1])], m.make_kv_cache(2, 4))  # noqa: E731
    assert torch.equal(run(a), run(b))
    assert not torch.allclose(run(a), run(c))


def test_tied_head_and_custom_config():
    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_layers=1,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        tie_embeddings=True,
    )
    m = LlamaModel(cfg, seed=0, attention=TorchAttention())
    assert m.lm_head is m.embed
    out = m.forward([ForwardInput(np.arange(10, dtype=np.int32), 0, [0, 1, 2])], m.make_kv_cache(3, 4))
    assert out.shape == (1, 64) and torch.isfinite(out).all()


def test_presets():
    big = PRESETS["llama3-8b"]  # shapes only: never instantiated on CPU
    assert (big.num_layers, big.num_heads, big.num_kv_heads, big.head_dim, big.hidden_size) == (32, 32, 8, 128, 4096)
    assert big.vocab_size == 128256 and big.intermediate_size == 14336 and big.dtype == "bfloat16"
    assert 7.9e9 < big.num_params() < 8.1e9
    assert big.kv_bytes_per_token() == 2 * 32 * 8 * 128 * 2  # 128 KiB per token
    tiny = PRESETS["tiny"]
    assert tiny.num_heads // tiny.num_kv_heads == 2 and tiny.dtype == "float32"


def test_bad_input_is_rejected_before_any_kernel(model):
    class Exploding(TorchAttention):
        def run(self, q, kv_layer):  # noqa: ARG002
            raise AssertionError("a kernel ran on bad input")

    m = LlamaModel("tiny", seed=0, attention=Exploding())
    kv = m.make_kv_cache(4, 4)
    before = [t.clone() for t in kv.layers]
    with pytest.raises(TokenIdError, match="token id 512 outside the vocabulary"):
        m.forward([ForwardInput(np.array([1, 512], np.int32), 0, [0])], kv)
    with pytest.raises(TokenIdError, match="-3"):
        m.forward([ForwardInput(np.array([-3], np.int64), 0, [0])], kv)
    with pytest.raises(PageTableError, match="page table has 1 pages but 7 tokens need 2"):
        m.forward([ForwardInput(np.arange(3, dtype=np.int32), 4, [0])], kv)
    wrong_heads = PagedKVCache(2, 4, 4, 4, 16)  # 4 KV heads, the model has 2
    with pytest.raises(ShapeMismatchError, match="4 KV heads"):
        m.forward([ForwardInput(np.arange(3, dtype=np.int32), 0, [0])], wrong_heads)
    with pytest.raises(ShapeMismatchError, match="not a multiple"):
        LlamaModel(ModelConfig(64, 32, 48, 1, num_heads=6, num_kv_heads=4, head_dim=8), attention="torch")
    with pytest.raises(ValueError):
        m.forward([ForwardInput(np.array([1.5, 2.0]), 0, [0])], kv)
    assert all(torch.equal(a, b) for a, b in zip(before, kv.layers, strict=True))  # nothing was written
