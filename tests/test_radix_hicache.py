"""radix-hicache on hand-made cases: what lies on which tier after each request, per write
policy; load-back and the 10-token rule; the host tier's eviction order; write_back's
duplicate reclaim and drop; the replay's tier metrics; bad options refused before any work.

Page size 1 and 12-token prompts (A, B, C, D below) keep the arithmetic visible: a GPU of
24 tokens holds two of them. Every request runs the replay protocol's calls (match, admit
the prompt, commit it, release: the release inserts the whole prompt).
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.radix_hicache_tree import on_device
from cachelib import InvalidRequestError, Sequence, TierCopy, create_cache
from cachelib.tiers import H200_HOST_READ_GBPS, LLAMA3_8B_KV_BYTES_PER_TOKEN, HostTier
from experiments.engine import replay
from experiments.errors import InputError
from experiments.runs.backend_options import resolve_variants
from experiments.workloads.spec import RequestSpec

A = list(range(12))
B = list(range(100, 112))
C = list(range(200, 212))
D = list(range(300, 312))


def make(write_policy: str, gpu: int = 24, host: int = 48, page_size: int = 1):
    return create_cache(
        "radix-hicache",
        num_pages=gpu // page_size,
        page_size=page_size,
        write_policy=write_policy,
        host_capacity_tokens=host,
        track_contents=True,
    )


_ids = iter(range(10**9))


def serve(cache, tokens: list[int]) -> tuple[int, int]:
    """One request through the protocol's calls; (GPU hit, host tokens loaded back)."""
    seq = Sequence(f"r{next(_ids)}", np.asarray(tokens, dtype=np.int32))
    m = cache.match(seq)
    assert cache.admit(seq, m, len(seq)) is not None
    gpu, loaded = m.num_tokens, seq.num_computed - m.num_tokens
    cache.commit(seq, len(seq))
    cache.check_invariants()
    cache.release(seq)
    cache.check_invariants()
    return gpu, loaded


def tiers(cache) -> dict[tuple[int, int], str]:
    """(first token, length) of every node -> where its KV is: gpu, host or both."""
    out = {}
    for n in cache.tree.nodes():
        where = {(True, False): "gpu", (False, True): "host", (True, True): "both"}[
            (on_device(n), n.host_pages is not None)
        ]
        out[(int(n.key[0]), len(n.key))] = where
    return out


# -- write_through: a node is backed up at its first hit --------------------------------


def test_write_through_demotes_loads_back_and_applies_the_10_token_rule():
    cache = make("write_through")
    assert serve(cache, A) == (0, 0)
    assert tiers(cache) == {(0, 12): "both"}  # backed up at its insert (threshold 1)
    assert serve(cache, B) == (0, 0)
    assert tiers(cache) == {(0, 12): "both", (100, 12): "both"}
    # the GPU is full: C's shortfall demotes the least recently used device leaf, A,
    # whose host copy stays
    assert serve(cache, C) == (0, 0)
    assert tiers(cache) == {(0, 12): "host", (100, 12): "both", (200, 12): "both"}
    # A + one token: the 12 host tokens are loaded back (B is demoted for them, then C for
    # the one new token); the new leaf is backed up at its insert
    assert serve(cache, A + [50]) == (0, 12)
    assert tiers(cache) == {(0, 12): "both", (50, 1): "both", (100, 12): "host", (200, 12): "host"}
    # 9 host tokens of B: fewer than 10, so recomputed; the insert puts them back on the
    # GPU with the request's own pages (B is split where the match ended)
    assert serve(cache, B[:9] + [77]) == (0, 0)
    assert tiers(cache) == {
        (0, 12): "both",
        (50, 1): "both",
        (100, 9): "both",
        (109, 3): "host",
        (77, 1): "both",
        (200, 12): "host",
    }
    # 10 host tokens: loaded
    assert serve(cache, C[:10] + [78]) == (0, 10)
    traffic = cache.tier_traffic()
    assert traffic["loaded"] == 22 and traffic["host_to_gpu_bytes"] == 22 * LLAMA3_8B_KV_BYTES_PER_TOKEN


def test_host_eviction_takes_host_leaves_least_recently_used_first():
    cache = make("write_through", gpu=12, host=36)
    serve(cache, A)
    serve(cache, B)  # demotes A
    serve(cache, C)  # demotes B
    assert tiers(cache) == {(0, 12): "host", (100, 12): "host", (200, 12): "both"}  # host full
    # a lookup through A refreshes it (a match stamps the host nodes it walks)
    cache.match(Sequence("look", np.asarray(A + [1], dtype=np.int32)))
    # D demotes C; D's backup needs 12 host tokens: the oldest host leaf, B, leaves the
    # tree (A was looked up since; C is newer)
    serve(cache, D)
    assert tiers(cache) == {(0, 12): "host", (200, 12): "host", (300, 12): "both"}
    assert cache.tier_traffic()["host_evicted"] == 12


def test_write_through_backup_stops_when_the_host_cannot_take_a_node():
    cache = make("write_through", gpu=24, host=8)  # smaller than one prompt
    serve(cache, A)
    assert tiers(cache) == {(0, 12): "gpu"}  # the backup failed; nothing on the host
    serve(cache, B)
    serve(cache, C)  # A had no host copy: deleted
    assert tiers(cache) == {(100, 12): "gpu", (200, 12): "gpu"}
    assert cache.tier_traffic()["deleted"] == 12


# -- write_through_selective: backed up at the second hit --------------------------------


def test_write_through_selective_backs_up_a_node_at_its_second_hit():
    cache = make("write_through_selective")
    serve(cache, A)
    assert tiers(cache) == {(0, 12): "gpu"}  # one hit: not yet
    assert serve(cache, A + [60]) == (12, 0)
    assert tiers(cache) == {(0, 12): "both", (60, 1): "gpu"}  # A's second hit; [60]'s first
    serve(cache, B)  # one token short: the LRU device leaf, [60], has no host copy: deleted
    assert tiers(cache) == {(0, 12): "both", (100, 12): "gpu"}
    serve(cache, C)  # A is the LRU device leaf: demoted, its host copy stays
    assert tiers(cache) == {(0, 12): "host", (100, 12): "gpu", (200, 12): "gpu"}
    serve(cache, D)  # B has no host copy: deleted
    assert tiers(cache) == {(0, 12): "host", (200, 12): "gpu", (300, 12): "gpu"}


# -- write_back: backed up only when the GPU evicts ---------------------------------------


def test_write_back_backs_up_on_eviction_only():
    cache = make("write_back", host=12)
    serve(cache, A)
    serve(cache, B)
    assert tiers(cache) == {(0, 12): "gpu", (100, 12): "gpu"}  # never at insert
    serve(cache, C)  # A is evicted: backed up first, then demoted
    assert tiers(cache) == {(0, 12): "host", (100, 12): "gpu", (200, 12): "gpu"}
    serve(cache, D)  # B's backup needs the whole host: A, a host leaf, leaves the tree
    assert tiers(cache) == {(100, 12): "host", (200, 12): "gpu", (300, 12): "gpu"}


def test_write_back_drops_what_the_host_cannot_take():
    cache = make("write_back", host=8)
    serve(cache, A)
    serve(cache, B)
    serve(cache, C)  # A cannot be backed up (12 > 8 host tokens): dropped
    assert tiers(cache) == {(100, 12): "gpu", (200, 12): "gpu"}
    assert cache.tier_traffic()["deleted"] == 12 and cache.tier_traffic()["backed_up"] == 0


def test_write_back_host_eviction_first_frees_copies_of_nodes_also_on_the_gpu():
    cache = make("write_back", host=24)
    serve(cache, A)
    serve(cache, B)
    serve(cache, C)  # A: backed up and demoted
    assert serve(cache, A + [50]) == (0, 12)  # B demoted for the load, C for the new token
    assert tiers(cache) == {(0, 12): "both", (50, 1): "gpu", (200, 12): "host"}  # B's host copy made room for C
    # E is one token short: [50] is evicted, its backup needs 1 host token; the host is
    # full (A, C): A's host copy goes first (A is also on the GPU), not a host leaf
    serve(cache, D)
    assert tiers(cache) == {(0, 12): "gpu", (50, 1): "host", (200, 12): "host", (300, 12): "gpu"}
    assert cache.tier_traffic()["host_reclaimed"] == 12


# -- page size 16: the same rules on whole pages ------------------------------------------


def test_page_size_16_loads_whole_pages():
    cache = make("write_through", gpu=64, host=128, page_size=16)
    x = list(range(1000, 1040))  # 40 tokens: 2 whole pages go into the tree
    y = list(range(2000, 2040))
    serve(cache, x)
    serve(cache, y)
    serve(cache, list(range(3000, 3040)))  # demotes x
    assert serve(cache, x + [5]) == (0, 32)  # limit 40 -> 32 tokens: two host pages back


# -- replay metrics ------------------------------------------------------------------------


def test_replay_reports_hits_by_tier_and_traffic():
    reqs = [RequestSpec(f"q{i}", np.asarray(p, dtype=np.int32), 1) for i, p in enumerate([A, B, C, A + [50]])]
    result = replay(make("write_through"), reqs)
    assert result["per_request_hits_by_tier"] == [[0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 12, 0]]
    assert result["per_request_hits"] == [0, 0, 0, 12]  # every token not recomputed
    assert result["hit_tokens"] == 12 and result["hit_tokens_by_tier"] == {"gpu": 0, "host": 12, "storage": 0}
    assert result["memory_tiers"] == ["gpu", "host"]
    assert (
        result["tier_traffic"]["gpu_to_host_bytes"]
        == result["tier_traffic"]["backed_up"] * LLAMA3_8B_KV_BYTES_PER_TOKEN
    )
    plain = replay(create_cache("radix", num_pages=24, page_size=1), reqs)
    assert "per_request_hits_by_tier" not in plain and "tier_traffic" not in plain


# -- bad input: refused before any work ----------------------------------------------------


@pytest.mark.parametrize(
    "options, message",
    [
        ({"write_policy": "write_around"}, "unknown write_policy"),
        ({"host_capacity_tokens": 8}, "smaller than one page"),
        ({"host_capacity_tokens": 24}, "not a whole number of 16-token pages"),
        ({"host_capacity_tokens": -16}, "host_capacity_tokens must be a non-negative int"),
        ({"host_capacity_gb": 1e-9}, "smaller than one page"),
        ({"host_capacity_tokens": 32, "host_capacity_gb": 1.0}, "give a host tier's size once"),
        ({"host_read_gbps": 0}, "host_read_gbps must be a positive bandwidth"),
        ({"host_write_gbps": -1.0}, "host_write_gbps must be a positive bandwidth"),
        ({"host_read_gbps": float("inf")}, "host_read_gbps must be a positive bandwidth"),  # free transfers, unsaid
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token must be a positive int"),
    ],
)
def test_bad_tier_options_are_refused(options, message):
    with pytest.raises(InvalidRequestError, match=message):
        create_cache("radix-hicache", num_pages=8, page_size=16, **options)


def test_bad_tier_options_fail_in_the_options_layer_before_any_work():
    from experiments.runs.backend_options import OptionGiven

    with pytest.raises(InputError, match="unknown write_policy 'bogus'"):
        resolve_variants(["radix-hicache"], [OptionGiven("write_policy", "bogus", "--backend-opt")], [1])
    with pytest.raises(InputError, match="host_read_gbps"):
        resolve_variants(["radix-hicache"], [OptionGiven("host_read_gbps", "0", "--backend-opt")], [1])
    variant = resolve_variants(
        ["radix-hicache"],
        [
            OptionGiven("host_capacity_tokens", "64", "--backend-opt"),
            OptionGiven("write_policy", "write_back", "--backend-opt"),
        ],
        [1, 16],
    )[0]
    assert variant.label == "radix-hicache[host_capacity_tokens=64,write_policy=write_back]"


def test_tier_defaults():
    tier = HostTier.build(16, 1024)
    assert tier.capacity_tokens == 2048  # SGLang's default --hicache-ratio 2
    assert tier.read_gbps == H200_HOST_READ_GBPS == 64.0
    gb = HostTier.build(16, 1024, capacity_gb=1.0)
    assert gb.capacity_tokens == 1_000_000_000 // LLAMA3_8B_KV_BYTES_PER_TOKEN // 16 * 16
    assert tier.transfer_seconds(1000, write=True) == pytest.approx(1000 * LLAMA3_8B_KV_BYTES_PER_TOKEN / 64e9)


# -- the bytes: TierCopy moves for the executor ----------------------------------------------


def test_demotes_and_loads_are_handed_out_with_the_next_admit_in_order():
    cache = make("write_through", gpu=16, host=24)
    serve(cache, A)
    (a,) = cache.tree.nodes()
    a_gpu, a_host = tuple(a.pages), tuple(a.host_pages)
    seq = Sequence("b", np.asarray(B, dtype=np.int32))
    ops = cache.admit(seq, cache.match(seq), 12)  # evicts A: its GPU copy goes to the host now
    assert ops == [TierCopy(True, a_gpu, a_host)]
    cache.commit(seq, 12)
    cache.release(seq)
    (b,) = [n for n in cache.tree.nodes() if on_device(n)]
    b_gpu, b_host = tuple(b.pages), tuple(b.host_pages)
    seq = Sequence("a2", np.asarray(A + [1], dtype=np.int32))
    ops = cache.admit(seq, cache.match(seq), 13)  # B evicted (saved first), then A loaded
    assert ops[0] == TierCopy(True, b_gpu, b_host)
    assert ops[1].to_host is False and ops[1].host_pages == a_host and len(ops) == 2
    assert seq.page_table[:12] == list(ops[1].device_pages) and seq.num_computed == 12
    assert cache.stats().copied_pages == 0  # tier moves are not copy-on-write copies


def test_the_kv_cache_applies_tier_moves_in_order():
    import torch

    from attention.kv_cache import PagedKVCache
    from cachelib import CopyOp

    kv = PagedKVCache(1, 4, 1, 1, 1)
    for page in range(4):
        kv.layers[0][page] = float(page + 1)
    # save page 0 to host 7, copy page 1 over page 0, load host 7 into page 2
    kv.apply([TierCopy(True, (0,), (7,)), CopyOp(1, 0), TierCopy(False, (2,), (7,))])
    assert [float(kv.layers[0][p].flatten()[0]) for p in range(4)] == [2.0, 2.0, 1.0, 4.0]
    with pytest.raises(Exception, match="never written"):
        kv.apply([TierCopy(False, (3,), (9,))])
    assert torch.equal(kv.layers[0][3], torch.full_like(kv.layers[0][3], 4.0))
