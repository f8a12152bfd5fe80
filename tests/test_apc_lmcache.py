"""apc-lmcache (LMCache's host and disk stores below apc, backends/apc_lmcache.py): hand cases.

The expectations are derived by hand from the rules L1-L8 of the module docstring (LMCache v1,
0.3.x adapter). Page size 4, LMCache chunks of 8 tokens (two pages) unless said; `evict(100)`
empties the GPU where a case needs the hit to come from below it.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import create_cache
from cachelib.errors import InvalidRequestError, InvariantViolation
from cachelib.types import Sequence, TierCopy
from experiments.engine import replay
from experiments.errors import InputError
from experiments.runs.backend_options import resolve_variants
from experiments.workloads.spec import RequestSpec

P, C = 4, 8


def lmc(host: int = 64, disk: int = 0, pages: int = 100, **options):
    if disk:
        options["disk_capacity_tokens"] = disk
    return create_cache(
        "apc-lmcache", num_pages=pages, page_size=P, lmcache_chunk_size=C, host_capacity_tokens=host, **options
    )


def run(cache, rid: str, tokens: list[int]) -> tuple[int, int, int, list]:
    """One request of the replay protocol without decode: match, admit, commit the prompt,
    release. Returns (GPU hit, tokens not recomputed, of those from disk, the admit's ops)."""
    seq = Sequence(rid, np.array(tokens, dtype=np.int32))
    m = cache.match(seq)
    ops = cache.admit(seq, m, len(seq))
    assert ops is not None
    result = (m.num_tokens, seq.num_computed, cache.storage_hit_tokens(seq), ops)
    cache.check_invariants()
    cache.commit(seq, len(seq))
    cache.check_invariants()
    cache.release(seq)
    cache.check_invariants()
    return result


def chunk_keys(cache, tokens: list[int], n: int) -> list[bytes]:
    """The LMCache keys of the first `n` full chunks of `tokens` (the hash of each chunk's last block)."""
    blocks = cache.hasher.hash_blocks(np.array(tokens, dtype=np.int32), Sequence("k", [0]).extra, 0, n * C // P, None)
    return blocks[C // P - 1 :: C // P]


A = list(range(1, 21))  # 20 tokens: chunks [0, 8) [8, 16), a short [16, 20)
B = list(range(100, 120))
A17 = A[:17]  # two full chunks and one token


# -- L1, L6, L7: what is stored, when --------------------------------------------------------


def test_full_chunks_are_stored_after_prefill_and_the_short_one_only_with_save_unfull_chunk():
    cache = lmc()
    run(cache, "a", A)
    assert list(cache.lmc.host.entries.items()) == [(k, C) for k in chunk_keys(cache, A, 2)]
    assert cache.tier_traffic()["backed_up"] == 16
    unfull = lmc(save_unfull_chunk=True)
    run(unfull, "a", A)
    entries = list(unfull.lmc.host.entries.items())
    assert entries[:2] == [(k, C) for k in chunk_keys(unfull, A, 2)]
    assert entries[2][0].startswith(b"partial:") and entries[2][1] == 4
    assert unfull.tier_traffic()["backed_up"] == 20


def test_the_chunk_boundary_rule_and_a_last_step_of_one_token_counting_as_decode():
    cache = lmc(save_unfull_chunk=True)
    seq = Sequence("a", np.array(A, dtype=np.int32))
    cache.admit(seq, cache.match(seq), 6)
    cache.commit(seq, 6)  # 6 tokens: not the last prefill step, 0 whole chunks
    assert len(cache.lmc.host.entries) == 0
    cache.grow(seq, 10)
    cache.commit(seq, 10)  # chunk 0
    assert list(cache.lmc.host.entries) == chunk_keys(cache, A, 1)
    cache.grow(seq, 15)
    cache.commit(seq, 15)  # 15 < cdiv(8 + 1, 8) * 8 = 16: nothing
    assert len(cache.lmc.host.entries) == 1
    cache.grow(seq, 19)
    cache.commit(seq, 19)  # chunk 1
    assert list(cache.lmc.host.entries) == chunk_keys(cache, A, 2)
    cache.grow(seq, 20)
    cache.commit(seq, 20)  # one token: the adapter's decode phase, so the short chunk is not saved
    assert len(cache.lmc.host.entries) == 2
    cache.release(seq)
    cache.check_invariants()


def test_decode_chunks_are_stored_only_with_save_decode_cache():
    for save, stored in ((False, 1), (True, 2)):
        cache = lmc(save_decode_cache=save)
        seq = Sequence("a", np.array(A[:10], dtype=np.int32))
        cache.admit(seq, cache.match(seq), 10)
        cache.commit(seq, 10)
        for t in range(6):  # decode to 16 tokens: chunk 1 fills
            seq.append_token(500 + t)
            cache.grow(seq, len(seq))
            cache.commit(seq, len(seq))
        assert len(cache.lmc.host.entries) == stored
        cache.release(seq)
        cache.check_invariants()


def test_a_store_larger_than_the_host_keeps_its_first_chunks():
    cache = lmc(host=16, disk=64)
    run(cache, "a", A + [0] * 5)  # 25 tokens: 3 chunks, room for 2 buffers
    assert list(cache.lmc.host.entries) == chunk_keys(cache, A, 2)
    assert list(cache.lmc.disk.entries) == chunk_keys(cache, A, 2)
    assert cache.tier_traffic()["truncated_stores"] == 1


# -- L2, L4: lookup and load -----------------------------------------------------------------


def test_the_hit_is_chunk_aligned_and_only_the_chunks_past_the_gpu_hit_are_loaded():
    cache = lmc(pages=6)  # a GPU of 24 tokens
    run(cache, "a", A)  # its blocks go to the free queue's tail, deepest first
    run(cache, "b", B)  # takes 5 blocks from the head: a keeps only block 0
    gpu, computed, storage, ops = run(cache, "c", A[:16] + [55] * 5)
    # GPU block 0 (4 tokens); LMCache: chunks 0 and 1 (16 tokens); chunk 0 holds token 4, so
    # both are retrieved (16 tokens) and 12 land in the new blocks 1..3
    assert (gpu, computed, storage) == (4, 16, 0)
    load = [op for op in ops if isinstance(op, TierCopy) and not op.to_host]
    assert len(load) == 1 and load[0].host_pages == (1, 2, 3)  # a's chunks are objects 0 and 1
    traffic = cache.tier_traffic()
    assert traffic["retrieved_tokens"] == 16 and traffic["loaded"] == 12


def test_a_chunk_the_gpu_already_holds_is_not_retrieved():
    cache = lmc(pages=6)
    run(cache, "a", A)
    run(cache, "b", B[:16])  # 4 blocks: a keeps blocks 0 and 1
    gpu, computed, storage, _ = run(cache, "c", A[:16] + [55] * 5)
    assert (gpu, computed, storage) == (8, 16, 0)
    assert cache.tier_traffic()["retrieved_tokens"] == 8  # chunk 1 only


def test_no_load_when_the_gpu_hit_covers_the_lmcache_hit():
    cache = lmc()
    run(cache, "a", A)
    gpu, computed, _, ops = run(cache, "c", A[:12] + [77] * 9)
    assert (gpu, computed) == (12, 12) and not [op for op in ops if isinstance(op, TierCopy) and not op.to_host]


def test_a_whole_prompt_hit_recomputes_its_last_token():
    cache = lmc(pages=6, save_unfull_chunk=True)
    run(cache, "a", A)
    run(cache, "b", B)
    gpu, computed, storage, ops = run(cache, "a2", A)
    # the short chunk hits: the hit is the whole prompt, so 20 - 4 - 1 tokens are loaded
    assert (gpu, computed, storage) == (4, 19, 0)
    (load,) = [op for op in ops if isinstance(op, TierCopy) and not op.to_host]
    assert load.host_pages == (1, 2, 3, 4)  # the short chunk is object 2, one page
    without = lmc(pages=6)
    run(without, "a", A)
    run(without, "b", B)
    assert run(without, "a2", A)[:3] == (4, 16, 0)


# -- L3, L5, L7: LRU order, spill and promotion ------------------------------------------------


def test_host_lru_evicts_a_stored_requests_first_chunk_first_and_a_looked_up_ones_last():
    cache = lmc(host=32)
    a, b = chunk_keys(cache, A17, 2), chunk_keys(cache, B[:17], 2)
    run(cache, "a", A17)
    run(cache, "b", B[:17])
    assert list(cache.lmc.host.entries) == a + b  # stored in order: chunk 0 is the older
    run(cache, "a2", A17[:16] + [5])  # the lookup touches a's chunks, deepest first
    assert list(cache.lmc.host.entries) == b + [a[1], a[0]]
    run(cache, "d", list(range(200, 209)))  # one chunk: evicts b's chunk 0, leaving b's chunk 1
    d = chunk_keys(cache, list(range(200, 209)), 1)
    assert list(cache.lmc.host.entries) == [b[1], a[1], a[0], *d]


def test_a_chunk_evicted_from_the_host_is_loaded_from_disk_and_promoted():
    cache = lmc(host=16, disk=64, pages=100)
    a, b = chunk_keys(cache, A17, 2), chunk_keys(cache, B[:17], 2)
    run(cache, "a", A17)
    run(cache, "b", B[:17])  # the host evicts a's chunks; the disk keeps everything
    assert list(cache.lmc.host.entries) == b and list(cache.lmc.disk.entries) == a + b
    cache.evict(100)
    gpu, computed, storage, _ = run(cache, "c", A17[:16] + [9])
    assert (gpu, computed, storage) == (0, 16, 16)
    assert list(cache.lmc.host.entries) == a  # promoted, evicting b's
    # the disk: the lookup touched a's chunks deepest first, then each read touched it in order
    assert list(cache.lmc.disk.entries) == b + a
    t = cache.tier_traffic()
    assert t["promoted_chunks"] == 2 and t["storage_to_host_tokens"] == 16 and t["host_evicted"] == 32


def test_one_request_can_reuse_from_the_host_and_from_disk():
    cache = lmc(host=16, disk=64)
    run(cache, "a", A17)
    run(cache, "a2", A17[:16] + [3])  # touches: the host holds [a1, a0]
    run(cache, "x", list(range(500, 509)))  # evicts a1 from the host
    cache.evict(100)
    gpu, computed, storage, _ = run(cache, "c", A17[:16] + [4])
    # chunk 0 from the host, chunk 1 from disk (promoted, evicting x's chunk, not the pinned a0)
    assert (gpu, computed, storage) == (0, 16, 8)
    assert list(cache.lmc.host.entries) == chunk_keys(cache, A17, 2)


def test_the_disk_evicts_its_least_recently_used_chunks_independently_of_the_host():
    cache = lmc(host=16, disk=32)
    a, b = chunk_keys(cache, A17, 2), chunk_keys(cache, B[:17], 2)
    x = chunk_keys(cache, list(range(500, 509)), 1)
    run(cache, "a", A17)
    run(cache, "b", B[:17])
    run(cache, "x", list(range(500, 509)))
    # each store goes to both; each tier evicts its own LRU end for room
    assert list(cache.lmc.host.entries) == [b[1], *x] and list(cache.lmc.disk.entries) == [a[1], *b, *x]
    assert cache.tier_traffic()["storage_evicted"] == 8
    cache.evict(100)
    # a's chunk 1 alone is useless: the lookup stops at the missing chunk 0
    assert run(cache, "a2", A17)[:3] == (0, 0, 0)


def spec(rid: str, tokens: list[int], out: int = 2) -> RequestSpec:
    return RequestSpec(rid, np.array(tokens, dtype=np.int32), out)


def test_replay_reports_hits_by_tier_with_the_storage_column():
    cache = lmc(host=16, disk=64, pages=5, kv_bytes_per_token=100)  # a GPU of 20 tokens
    r = replay(cache, [spec("a", A17), spec("b", B[:17]), spec("c", A17[:16] + [9])])
    assert r["memory_tiers"] == ["gpu", "host", "storage"]
    assert r["per_request_hits_by_tier"] == [[0, 0, 0], [0, 0, 0], [0, 0, 16]]
    assert r["hit_tokens_by_tier"] == {"gpu": 0, "host": 0, "storage": 16} and r["hit_tokens"] == 16
    t = r["tier_traffic"]
    assert t["storage_to_host_bytes"] == 1600 and t["host_to_storage_bytes"] == t["host_to_storage_tokens"] * 100


def test_the_default_host_is_lmcaches_5_gib_and_no_disk():
    cache = create_cache("apc-lmcache", num_pages=8, page_size=16)
    assert cache.lmc.spec.host.capacity_tokens == 5 * 1024**3 // 131072
    assert cache.memory_tiers == ("gpu", "host") and cache.lmc.spec.chunk_tokens == 256
    plain = create_cache("apc", num_pages=8, page_size=16)
    seq = Sequence("x", [1])
    plain.prefill(seq)
    assert plain.storage_hit_tokens(seq) == 0


def test_invariants_catch_a_store_above_capacity_and_a_lost_page_id():
    cache = lmc(host=16)
    run(cache, "a", A)
    cache.lmc.host.used += 16
    with pytest.raises(InvariantViolation, match="counts"):
        cache.check_invariants()
    cache.lmc.host.used -= 16
    cache.lmc.objects.popitem()
    with pytest.raises(InvariantViolation, match="without a host-page id"):
        cache.check_invariants()


# -- bad input: clear errors before any work -------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"lmcache_chunk_size": 6}, "must be a multiple of the GPU page size 4"),
        ({"lmcache_chunk_size": 0}, "lmcache_chunk_size must be a positive int"),
        ({"host_capacity_tokens": 4}, "smaller than one LMCache chunk of 8 tokens"),
        ({"host_capacity_tokens": 6}, "not a whole number of 4-token pages"),
        ({"host_capacity_tokens": 64, "host_capacity_gb": 1.0}, "give a host tier's size once"),
        ({"host_read_gbps": 0}, "host_read_gbps must be a positive bandwidth"),
        ({"disk_capacity_tokens": 4}, "disk tier of 4 tokens is smaller than one LMCache chunk"),
        ({"disk_capacity_tokens": 6}, "not a whole number of 4-token pages"),
        ({"disk_capacity_tokens": 64, "disk_read_gbps": 0}, "disk_read_gbps must be a positive bandwidth"),
        ({"disk_capacity_tokens": 64, "disk_capacity_gb": 1.0}, "give a disk tier's size once"),
        ({"disk_capacity_tokens": 64, "disk_write_gbps": float("inf")}, "disk_write_gbps must be a positive bandwidth"),
        ({"disk_capacity_gb": float("inf")}, "disk_capacity_gb must be a non-negative finite number"),
        ({"disk_write_gbps": 1.0}, "disk_write_gbps given without disk_capacity_tokens"),
        ({"disk_capacity_gb": -1.0}, "disk_capacity_gb must be a non-negative finite number"),
        ({"save_unfull_chunk": "yes"}, "save_unfull_chunk must be a bool"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token must be a positive int"),
        ({"verify_tokens": True}, "its options are"),
    ],
)
def test_bad_options_are_refused_naming_the_problem(options, message):
    base = {"lmcache_chunk_size": C, "host_capacity_tokens": 64}
    with pytest.raises(InvalidRequestError, match=message):
        create_cache("apc-lmcache", num_pages=8, page_size=P, **(base | options))


def _given(*texts: str):
    from experiments.runs.backend_options import parse_backend_opt

    return [parse_backend_opt(t) for t in texts]


def test_bad_options_are_input_errors_in_the_options_layer():
    with pytest.raises(InputError, match="disk_read_gbps must be a positive bandwidth"):
        resolve_variants(["apc-lmcache"], _given("disk_capacity_tokens=1024", "disk_read_gbps=0"), [16])
    with pytest.raises(InputError, match="must be a multiple of the GPU page size 16"):
        resolve_variants(["apc-lmcache"], _given("lmcache_chunk_size=40"), [16])
    (variant,) = resolve_variants(
        ["apc-lmcache"], _given("host_capacity_tokens=2000000", "disk_capacity_tokens=8000000"), [16]
    )
    assert variant.label == "apc-lmcache[host_capacity_tokens=2000000,disk_capacity_tokens=8000000]"
