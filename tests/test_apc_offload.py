"""apc's host tier (vLLM 0.33 CPU KV offloading, backends/apc_offload.py): hand cases.

The expectations are derived by hand from the vLLM 0.33.0 sources (the rule numbers are the
module docstring's R1-R10); the per-request goldens of the real connector are compared in
tests/test_apc_offload_fidelity.py. Page size 4, one GPU block per host chunk unless said.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import create_cache
from cachelib.errors import InvalidRequestError
from cachelib.types import Sequence
from experiments.engine import replay
from experiments.errors import InputError
from experiments.runs.backend_options import resolve_variants
from experiments.workloads.spec import RequestSpec

P = 4


def tiered(host_tokens: int = 12, eviction: str = "lru", pages: int = 100, **options):
    return create_cache(
        "apc", num_pages=pages, page_size=P, host_capacity_tokens=host_tokens, host_eviction=eviction, **options
    )


def run(cache, rid: str, tokens: list[int], decode: int = 1) -> tuple[int, int, int]:
    """One request of the replay protocol: match, admit, commit the prompt, decode, release.
    Returns (GPU hit, tokens not recomputed, tokens loaded from the host)."""
    seq = Sequence(rid, np.array(tokens, dtype=np.int32))
    m = cache.match(seq)
    loaded = cache.tier_traffic()["loaded"]
    assert cache.admit(seq, m, len(seq)) is not None
    result = (m.num_tokens, seq.num_computed, cache.tier_traffic()["loaded"] - loaded)
    cache.commit(seq, len(seq))
    for i in range(decode - 1):
        seq.append_token(10_000 + i)
        cache.grow(seq, len(seq))
        cache.commit(seq, len(seq))
    cache.release(seq)
    cache.check_invariants()
    return result


def keys(cache, tokens: list[int], n: int) -> list[bytes]:
    """The host keys of the first `n` chunks of `tokens` (the hash of each chunk's last block)."""
    return cache.hasher.hash_blocks(np.array(tokens, dtype=np.int32), Sequence("k", [0]).extra, 0, n, None)


A = list(range(1, 13))  # 3 full blocks
B = list(range(100, 109))  # 2 full blocks + 1
C = list(range(200, 205))  # 1 full block + 1
D = list(range(300, 309))  # 2 full blocks + 1


# -- R5, R6: what is stored, when ----------------------------------------------------------


def test_full_prompt_blocks_are_stored_as_they_fill_and_decode_blocks_are_not():
    cache = tiered(host_tokens=40)
    seq = Sequence("a", np.array(A[:9], dtype=np.int32))
    m = cache.match(seq)
    cache.admit(seq, m, len(seq))
    assert cache.host.cached_keys() == set()
    cache.commit(seq, 4)  # a chunked prefill: block 0 is computed
    assert cache.host.cached_keys() == set(keys(cache, A, 1))
    cache.commit(seq, 9)
    assert cache.host.cached_keys() == set(keys(cache, A, 2))
    for t in range(8):  # decode fills blocks 2 and 3: offload_prompt_only (vLLM's default)
        seq.append_token(50 + t)
        cache.grow(seq, len(seq))
        cache.commit(seq, len(seq))
    cache.release(seq)
    assert cache.host.cached_keys() == set(keys(cache, A, 2))
    assert cache.tier_traffic()["backed_up"] == 8


def test_decode_blocks_are_stored_with_offload_prompt_only_false():
    cache = tiered(host_tokens=40, offload_prompt_only=False)
    run(cache, "a", A[:9], decode=9)  # 9 prompt + 8 decoded with KV = 17 tokens: 4 full blocks
    assert len(cache.host.cached_keys()) == 4


def test_a_store_the_host_cannot_take_is_refused_whole_and_retried_at_release():
    cache = tiered(host_tokens=8)  # two chunks; the prompt has three full blocks
    run(cache, "a", A + [99])
    rep = cache.tier_traffic()
    assert cache.host.cached_keys() == set()  # all or nothing (prepare_store returns None)
    assert rep["failed_stores"] == 2 and rep["stored_chunks"] == 0  # at the prompt's commit, at release


# -- R2, R3, R4: lookup and load -------------------------------------------------------------


def test_a_prompt_evicted_from_the_gpu_is_loaded_back_from_the_host():
    cache = tiered(host_tokens=40)
    run(cache, "a", A)
    cache.evict(cache.num_pages)  # the GPU forgets everything; the host keeps its copies (R9)
    assert cache.stats().pages_cached == 0
    assert run(cache, "b", A + [7, 7]) == (0, 12, 12)  # (GPU hit, not recomputed, loaded)
    rep = cache.tier_traffic()
    assert rep["loaded"] == 12 and rep["loaded_chunks"] == 3
    # the loaded blocks are GPU-cached again (hashed at commit) and the host copies stay
    seq = Sequence("c", np.array(A + [5], dtype=np.int32))
    assert cache.match(seq).num_tokens == 12
    assert cache.host.cached_keys() >= set(keys(cache, A, 3))


def test_a_fully_cached_prompt_loads_its_last_block_from_the_host_and_recomputes_one_token():
    cache = tiered(host_tokens=40)
    run(cache, "a", A)
    # the GPU holds all three blocks, but its hit stops at len - 1 (two blocks); the
    # connector looks up from there up to len: the third chunk is loaded, the last token
    # recomputed (vLLM's _update_waiting_for_remote_kv)
    assert run(cache, "b", A) == (8, 11, 4)
    h2 = keys(cache, A, 3)[2]
    assert len(cache.index.members(h2)) == 2  # the loaded block is a duplicate of the GPU's


def test_a_host_hit_shorter_than_one_chunk_past_the_gpu_hit_is_not_loaded():
    cache = tiered(host_tokens=64, host_block_size=8)  # chunks of two GPU blocks
    run(cache, "a", A[:8] + [1])  # chunk 0 = blocks 0 and 1
    cache.evict(cache.num_pages)
    run(cache, "b", A[:4] + [2])  # GPU caches block 0 again (its chunk is not full: no store)
    # GPU hit 4 tokens; the lookup starts at chunk 4 // 8 = 0 and reaches token 8: 4 tokens
    # past the GPU hit, less than a chunk, so no load (`_lookup_complete_chunks`)
    assert run(cache, "c", A[:8] + [3]) == (4, 4, 0)


def test_the_host_hit_stops_at_the_first_missing_chunk():
    cache = tiered(host_tokens=40)
    run(cache, "a", A[:4] + [1])  # chunk of block 0 only
    run(cache, "x", A[:8] + [1])  # blocks 0, 1 (block 1's chunk is stored too)
    cache.evict(cache.num_pages)
    assert run(cache, "b", A + [1]) == (0, 8, 8)  # blocks 0, 1 on the host, 2 nowhere


def test_chunks_the_load_reached_are_not_offered_again():
    cache = tiered(host_tokens=40)
    run(cache, "a", A[:8] + [1])
    cache.evict(cache.num_pages)
    before = cache.tier_traffic()
    run(cache, "b", A + [1])  # loads blocks 0, 1; stores block 2 only
    after = cache.tier_traffic()
    assert after["stored_chunks"] - before["stored_chunks"] == 1
    assert after["reused_chunks"] == before["reused_chunks"]


def test_without_a_load_every_chunk_is_offered_and_the_cached_ones_count_as_reused():
    cache = tiered(host_tokens=40)
    run(cache, "a", A[:8] + [1])
    run(cache, "b", A + [1])  # GPU hit on blocks 0, 1: offered again, reused on the host
    rep = cache.tier_traffic()
    assert rep["reused_chunks"] == 2 and rep["stored_chunks"] == 3


# -- R7, R8: host eviction order ----------------------------------------------------------------


def test_lru_evicts_a_requests_tail_first_and_refreshes_reused_chunks():
    cache = tiered(host_tokens=12, eviction="lru")  # three chunks
    run(cache, "x", B)  # B0, B1
    b0, b1 = keys(cache, B, 2)
    # at finish the request's chunks get fresh ranks tail first: the head is the most recent
    assert cache.host.eviction_order() == [b1, b0]
    run(cache, "y", C)
    (c0,) = keys(cache, C, 1)
    assert cache.host.eviction_order() == [b1, b0, c0]
    run(cache, "z", D[:4] + [1])  # a new chunk: the host is full, the LRU one goes
    (d0,) = keys(cache, D, 1)
    assert cache.host.cached_keys() == {b0, c0, d0}
    run(cache, "w", B[:4] + [9])  # a GPU hit on B0: offered, reused: the most recent now
    assert cache.host.eviction_order() == [c0, d0, b0]


def scenario_where_policies_differ(eviction: str):
    """X stores x0, x1; W reuses x0 and stores w1; U stores u0 (evicting x1); V stores
    two new chunks."""
    cache = tiered(host_tokens=12, eviction=eviction)
    X = list(range(1, 9)) + [0]
    W = X[:4] + [40, 41, 42, 43, 0]
    U = [60, 61, 62, 63, 0]
    V = [80, 81, 82, 83, 84, 85, 86, 87, 0]
    for rid, toks in (("x", X), ("w", W), ("u", U)):
        run(cache, rid, toks)
    x0 = keys(cache, X, 1)[0]
    w1 = keys(cache, W, 2)[1]
    u0 = keys(cache, U, 1)[0]
    assert cache.host.cached_keys() == {x0, w1, u0}
    run(cache, "v", V)
    return cache, x0, w1, u0


def test_lru_and_arc_evict_differently_when_a_chunk_was_reused():
    lru, x0, w1, u0 = scenario_where_policies_differ("lru")
    # LRU by recency: w1, x0 (W's finish) are older than u0
    assert u0 in lru.host.cached_keys() and x0 not in lru.host.cached_keys()
    arc, x0, w1, u0 = scenario_where_policies_differ("arc")
    # ARC: x0 was reused by W, so it moved to T2 (frequency); T1 (w1, u0) is evicted first
    assert x0 in arc.host.cached_keys() and u0 not in arc.host.cached_keys() and w1 not in arc.host.cached_keys()
    assert list(arc.host.policy.t2) == [x0] and set(arc.host.policy.b1) >= {w1, u0}


def test_arc_adapts_its_target_on_a_ghost_hit():
    arc, x0, w1, u0 = scenario_where_policies_differ("arc")
    assert arc.host.policy.target_t1 == 0
    # u0 is a B1 ghost: storing it again raises the T1 target by max(1, |B2| / |B1|)
    run(arc, "u2", [60, 61, 62, 63, 5])
    assert arc.host.policy.target_t1 == 1


# -- metrics and replay output ---------------------------------------------------------------


def spec(rid: str, tokens: list[int], out: int = 2) -> RequestSpec:
    return RequestSpec(rid, np.array(tokens, dtype=np.int32), out)


def test_replay_reports_hits_by_tier_and_bytes_per_direction():
    cache = tiered(host_tokens=40, pages=4, kv_bytes_per_token=100)  # a GPU of 4 blocks
    requests = [spec("a", A + [1]), spec("b", D), spec("c", A + [2])]
    r = replay(cache, requests)
    # a frees its table last block first: the partial block to the head, the hashed ones to
    # the tail in reverse, so the queue is [a3, a2, a1, a0]; b takes three blocks from the
    # head, evicting a2 and a1. c: a0 from the GPU, a1 and a2 loaded back from the host
    assert r["per_request_hits"] == [0, 0, 12]
    assert r["per_request_hits_by_tier"] == [[0, 0, 0], [0, 0, 0], [4, 8, 0]]
    assert r["hit_tokens_by_tier"] == {"gpu": 4, "host": 8, "storage": 0} and r["hit_tokens"] == 12
    host = r["tier_traffic"]
    assert host["host_to_gpu_bytes"] == 800 and host["gpu_to_host_bytes"] == host["backed_up"] * 100


def test_replay_without_a_host_tier_has_no_tier_fields():
    r = replay(create_cache("apc", num_pages=8, page_size=P), [spec("a", A)])
    assert "per_request_hits_by_tier" not in r and "tier_traffic" not in r
    r2 = replay(tiered(host_tokens=40), [spec("a", A)])
    assert r2["memory_tiers"] == ["gpu", "host"]
    # bytes from the default model's KV bytes per token (cachelib/tiers.py: Llama-3-8B bf16)
    assert r2["tier_traffic"]["gpu_to_host_bytes"] == r2["tier_traffic"]["backed_up"] * 131072


# -- bad input: clear errors before any work -------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"host_capacity_tokens": 3}, "a host tier smaller than one page"),
        ({"host_capacity_tokens": 6}, "not a whole number of 4-token pages"),
        ({"host_capacity_tokens": 12, "host_block_size": 16}, "smaller than one host block of 16 tokens"),
        ({"host_capacity_tokens": -4}, "host_capacity_tokens must be a non-negative int"),
        ({"host_capacity_tokens": 64, "host_read_gbps": 0}, "host_read_gbps must be a positive bandwidth"),
        ({"host_capacity_tokens": 64, "host_capacity_gb": 1.0}, "give a host tier's size once"),
        ({"host_capacity_tokens": 64, "host_eviction": "mru"}, "host_eviction must be one of lru, arc"),
        ({"host_capacity_tokens": 64, "host_block_size": 6}, "must be a multiple of the GPU page size 4"),
        ({"host_capacity_tokens": 64, "host_block_size": -4}, "host_block_size must be a non-negative int"),
        ({"host_capacity_tokens": 64, "kv_bytes_per_token": -1}, "kv_bytes_per_token must be a positive int"),
        ({"host_eviction": "arc"}, "host_eviction given without host_capacity_tokens"),
        ({"offload_prompt_only": False}, "offload_prompt_only given without host_capacity_tokens"),
        ({"host_write_gbps": 10.0}, "host_write_gbps given without host_capacity_tokens"),
        ({"host_capacity_tokens": 64, "verify_tokens": True}, "verify_tokens does not cover the host tier"),
    ],
)
def test_bad_host_options_are_refused_naming_the_problem(options, message):
    with pytest.raises(InvalidRequestError, match=message):
        create_cache("apc", num_pages=8, page_size=P, **options)


def test_bad_host_options_are_input_errors_in_the_options_layer():
    with pytest.raises(InputError, match="host_eviction must be one of lru, arc"):
        resolve_variants(["apc"], _given("host_capacity_tokens=64", "host_eviction=fifo"), [16])
    with pytest.raises(InputError, match="smaller than one page of 16 tokens"):
        resolve_variants(["apc"], _given("host_capacity_tokens=0", "host_capacity_gb=0.000001"), [16])
    with pytest.raises(InputError, match="smaller than one host block of 32 tokens"):
        resolve_variants(["apc"], _given("host_capacity_tokens=16", "host_block_size=32"), [16])
    (variant,) = resolve_variants(["apc"], _given("host_capacity_tokens=2000000", "host_eviction=arc"), [16])
    assert variant.label == "apc[host_capacity_tokens=2000000,host_eviction=arc]"


def _given(*texts: str):
    from experiments.runs.backend_options import parse_backend_opt

    return [parse_backend_opt(t) for t in texts]
