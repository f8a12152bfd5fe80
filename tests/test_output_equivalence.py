"""Caching never changes the output (docs/design.md §5), for every registered backend.

Each backend runs a workload with shared prefixes through the tiny model; every request's
logits (at the last prompt token and before each generated token) must equal those of the
same request run alone with no cache, and greedy generation of 16 tokens must give the same
tokens. A fork case (parallel sampling) exercises copy-on-write.

Tolerance: fp32 on CPU, `atol = rtol = 1e-4` on logits of scale ~1 (observed max difference
~2e-6: a cached prefix only changes how the computation is batched, never what is computed).
Backends registered later are picked up by `available_backends()`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attention import LlamaModel
from cachelib import Sequence, available_backends, create_cache
from tests.cached_runner import CachedRunner, RequestResult, run_alone

ATOL = RTOL = 1e-4
NEW_TOKENS = 16
VOCAB = 512
BACKENDS = available_backends()
# These share only through fork or declared prefixes, never automatically (docs/design.md §4).
NO_AUTOMATIC_SHARING = {"none", "paged"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_model) -> LlamaModel:
    return tiny_model


def _toks(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n).astype(np.int32)


def _workload() -> dict[str, np.ndarray]:
    """Shared system prompts (page-unaligned), an exact repeat, a prefix of another."""
    rng = np.random.default_rng(1234)
    system, doc = _toks(rng, 37), _toks(rng, 21)
    w = {f"sys{i}": np.concatenate([system, _toks(rng, 3 + 2 * i)]) for i in range(5)}
    w["doc0"] = np.concatenate([doc, _toks(rng, 9)])
    w["doc1"] = np.concatenate([doc, w["doc0"][21:27], _toks(rng, 4)])  # longer shared run
    w["repeat"] = w["sys1"].copy()
    w["prefix_of_sys2"] = w["sys2"][:39].copy()
    w["short"] = _toks(rng, 2)
    return w


WORKLOAD = _workload()


@pytest.fixture(scope="module")
def alone(model) -> dict[str, RequestResult]:
    return {rid: run_alone(model, p, NEW_TOKENS) for rid, p in WORKLOAD.items()}


def assert_same(got: RequestResult, want: RequestResult, rid: str) -> None:
    assert got.tokens == want.tokens, f"{rid}: greedy tokens differ"
    torch.testing.assert_close(
        got.stacked_logits, want.stacked_logits, atol=ATOL, rtol=RTOL, msg=lambda m: f"{rid}: {m}"
    )


def _assert_drained(cache) -> None:
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0, "pages still pinned after every sequence was released"


#: the workload in an order that evicts each prefix before it comes back (a cache too small)
TWO_ROUNDS = ["sys0", "doc0", "sys1", "doc1", "sys2", "repeat", "sys3", "prefix_of_sys2", "sys4", "short"] * 2


def assert_same_through_two_rounds(model, cache, alone: dict[str, RequestResult]) -> None:
    """Run the workload twice through `cache`, a request at a time (the second round finds
    its prefixes in whatever tier kept them): every output equals the request's alone."""
    runner = CachedRunner(model, cache)
    for rid in TWO_ROUNDS:
        got = runner.run({rid: WORKLOAD[rid]}, NEW_TOKENS)[rid]
        assert_same(got, alone[rid], rid)


@pytest.mark.parametrize("page_size,chunk", [(1, None), (4, None), (4, 8), (16, None)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_prefix_workload(model, alone, backend, page_size, chunk):
    cache = create_cache(backend, num_pages=1024 // page_size, page_size=page_size)
    runner = CachedRunner(model, cache, prefill_chunk=chunk)
    results = runner.run(WORKLOAD, NEW_TOKENS, concurrency=3)
    for rid in WORKLOAD:
        assert_same(results[rid], alone[rid], rid)
    if backend not in NO_AUTOMATIC_SHARING:
        assert sum(r.hit_tokens for r in results.values()) > 0, "the workload never hit the cache"
    _assert_drained(cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multi_turn_reuses_generated_tokens(model, backend):
    """Turn 2 re-sends turn 1's prompt and output: KV written during decode is reused."""
    cache = create_cache(backend, num_pages=256, page_size=4)
    runner = CachedRunner(model, cache)
    turn1 = runner.run({"t1": WORKLOAD["sys0"]}, NEW_TOKENS)["t1"]
    rng = np.random.default_rng(5)
    prompt2 = np.concatenate([WORKLOAD["sys0"], np.array(turn1.tokens, np.int32), _toks(rng, 6)])
    turn2 = runner.run({"t2": prompt2}, NEW_TOKENS)["t2"]
    assert_same(turn2, run_alone(model, prompt2, NEW_TOKENS), "t2")
    if backend not in NO_AUTOMATIC_SHARING:
        assert turn2.hit_tokens >= len(WORKLOAD["sys0"]), f"turn 2 reused only {turn2.hit_tokens} tokens"
    _assert_drained(cache)


FORK_AT = 6  # decode step at which a branch forks again (beam-search-like)


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fork_parallel_sampling_copy_on_write(model, backend, page_size):
    """n=4 samples of one prompt: fork right after prefill (the partial last page is shared),
    each branch starts from a different top-k token; at step FORK_AT branch c1 forks again
    and the new branch takes c1's second-best token. All branches decode as one batch, so
    every write into a shared page must be preceded by its CopyOp."""
    prompt = WORKLOAD["sys3"][:38]  # 38 tokens: the last page is partial for 4 and 16
    cache = create_cache(backend, num_pages=512 // page_size, page_size=page_size)
    runner = CachedRunner(model, cache)
    parent = Sequence("p", prompt)
    first = runner.prefill(parent)
    top = torch.topk(first, 4).indices.tolist()
    live = [parent] + [runner.fork(parent, f"c{i}") for i in range(1, 4)]
    force = {s.request_id: {0: top[i]} for i, s in enumerate(live)}
    got = {s.request_id: RequestResult(s.request_id) for s in live}
    logits = {s.request_id: first for s in live}
    for step in range(NEW_TOKENS):
        if step == FORK_AT:  # every branch is fully computed here: fork c1 mid-decode
            c1 = live[1]
            live.append(runner.fork(c1, "g"))
            force["g"] = {**force["c1"], step: int(torch.topk(logits["c1"], 2).indices[1])}
            got["g"] = RequestResult("g", list(got["c1"].logits), list(got["c1"].tokens))
            logits["g"] = logits["c1"]
        toks = []
        for s in live:
            rid = s.request_id
            tok = force[rid].get(step, int(torch.argmax(logits[rid])))
            got[rid].logits.append(logits[rid])
            got[rid].tokens.append(tok)
            toks.append(tok)
        if step + 1 < NEW_TOKENS:
            out = runner.decode(live, toks)
            logits = {s.request_id: out[i] for i, s in enumerate(live)}
    assert runner.copied_pages > 0, "no copy-on-write happened: the fork case is vacuous"
    runner.release(live)
    _assert_drained(cache)
    assert len({tuple(r.tokens) for r in got.values()}) == 5, "branches should differ"
    for rid, res in got.items():
        assert_same(res, run_alone(model, prompt, NEW_TOKENS, forced=force[rid]), rid)


@pytest.mark.parametrize("write_policy", ["write_through", "write_through_selective", "write_back"])
def test_kv_moved_through_the_host_tier_gives_the_same_output(model, alone, write_policy):
    """radix-hicache with a GPU too small for the workload: prefixes are demoted to the host
    and loaded back (`TierCopy` moves the executor applies), and every output is unchanged."""
    cache = create_cache(
        "radix-hicache", num_pages=24, page_size=4, write_policy=write_policy, host_capacity_tokens=256
    )
    assert_same_through_two_rounds(model, cache, alone)  # the second round finds its prefixes on the host
    traffic = cache.tier_traffic()
    assert traffic["demoted"] > 0 and traffic["loaded"] > 0, traffic
    _assert_drained(cache)


def test_kv_moved_through_the_storage_tier_gives_the_same_output(model, alone):
    """radix-hicache with a GPU and a host both too small for the workload and a file
    storage tier below: prefixes are backed up to storage, prefetched back into the host
    and loaded to the GPU (`StorageCopy` and `TierCopy` moves the executor applies), and
    every output is unchanged."""
    cache = create_cache(
        "radix-hicache",
        num_pages=24,
        page_size=4,
        host_capacity_tokens=64,
        storage_backend="file",
        prefetch_threshold=8,
    )
    assert_same_through_two_rounds(model, cache, alone)  # the second round finds its prefixes in storage
    traffic = cache.tier_traffic()
    assert traffic["stored"] > 0 and traffic["prefetched"] > 0, traffic
    _assert_drained(cache)
