"""radix-aged (LRFU eviction over the radix tree): exact eviction orders where it differs from
LRU, the LFU and LRU limits, cost weighting, and its registration (the property and
output-equivalence tests cover it automatically through `available_backends()`)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from backends.radix_aged import AgedRadixCache
from cachelib import InvalidRequestError, available_backends, create_cache, get_backend
from tests.helpers import run_prompt, seq


def aged(half_life: float, cost_context: float | None = None, num_pages: int = 64) -> AgedRadixCache:
    return create_cache(
        "radix-aged",
        num_pages=num_pages,
        page_size=1,
        half_life=half_life,
        cost_context=cost_context,
        track_contents=True,
    )


def serve(cache, rid: str, tokens) -> int:
    """One request: match, admit, commit the prompt, release. Returns its hit tokens."""
    s = seq(rid, tokens)
    hit = run_prompt(cache, s).num_tokens
    cache.release(s)
    cache.check_invariants()
    return hit


DOC_A, DOC_B, DOC_C = [100, 101, 102, 103], [200, 201, 202, 203], [300, 301, 302, 303]


def hot_doc_then_scan(cache) -> None:
    """Document A asked three times (questions 1, 2, 3), then B and C once each (a scan)."""
    for q in (1, 2, 3):
        serve(cache, f"a{q}", DOC_A + [q])
    serve(cache, "b", DOC_B + [9])
    serve(cache, "c", DOC_C + [9])


def first_tokens_in_eviction_order(cache) -> list[int]:
    """Evict everything one leaf at a time; the first token of each node as it goes."""
    out = []
    cache.on_evict = lambda ns, start, key: out.append(int(key[0]))
    while cache.stats().pages_cached:
        cache.evict(1)
        cache.check_invariants()
    return out


def test_registered_and_covered_by_the_generic_tests():
    assert "radix-aged" in available_backends()
    assert get_backend("radix-aged") is AgedRadixCache
    # it takes no eviction policy: the CLI's --eviction-policy with radix-aged selected is an error
    assert "eviction_policy" not in AgedRadixCache.__init__.__code__.co_varnames


def test_aged_scores_by_hand():
    # lookups are the clock: a1 at 1, a2 at 2, a3 at 3, b at 4, c at 5; h = 2
    cache = aged(half_life=2)
    hot_doc_then_scan(cache)
    nodes = {int(n.key[0]): n for n in cache.tree.nodes()}
    f_a = 1.0
    f_a = f_a * 2 ** (-(2 - 1) / 2) + 1  # a2 reuses A
    f_a = f_a * 2 ** (-(3 - 2) / 2) + 1  # a3 reuses A
    assert nodes[100].policy_state == pytest.approx(math.log2(f_a) + 3 / 2)
    assert nodes[1].policy_state == pytest.approx(1 / 2)  # split off a1's leaf: a1's one reference
    assert nodes[2].policy_state == pytest.approx(2 / 2) and nodes[3].policy_state == pytest.approx(3 / 2)
    assert nodes[200].policy_state == pytest.approx(4 / 2) and nodes[300].policy_state == pytest.approx(5 / 2)


def test_frequent_prefix_outlives_a_scan_where_lru_drops_it():
    lru = create_cache("radix", num_pages=64, page_size=1, track_contents=True)
    hot_doc_then_scan(lru)
    assert first_tokens_in_eviction_order(lru) == [1, 2, 3, 100, 200, 300]

    cache = aged(half_life=2)
    hot_doc_then_scan(cache)
    # scores: q1 .5, q2 1, q3 1.5, B 2, C 2.5, doc A log2(2.207) + 1.5 = 2.64
    assert first_tokens_in_eviction_order(cache) == [1, 2, 3, 200, 300, 100]


@pytest.mark.parametrize("policy, a_hits", [("lru", 0), ("aged", 4)])
def test_hit_after_pressure(policy, a_hits):
    """Evict 7 tokens (room for one new request), then ask about A again."""
    cache = create_cache("radix", num_pages=64, page_size=1) if policy == "lru" else aged(half_life=2)
    hot_doc_then_scan(cache)
    assert cache.evict(7) >= 7
    assert serve(cache, "a4", DOC_A + [4]) == a_hits


def test_fast_decay_is_lru_order_here():
    # h = 0.5: A's three references are old by the time of B and C
    cache = aged(half_life=0.5)
    hot_doc_then_scan(cache)
    assert first_tokens_in_eviction_order(cache) == [1, 2, 3, 100, 200, 300]


def test_infinite_half_life_counts_references():
    cache = aged(half_life=math.inf)
    hot_doc_then_scan(cache)
    nodes = {int(n.key[0]): n for n in cache.tree.nodes()}
    assert 2 ** nodes[100].policy_state == pytest.approx(3)  # created by a1, reused by a2, a3
    assert all(2 ** nodes[t].policy_state == pytest.approx(1) for t in (1, 2, 3, 200, 300))
    # equal counts fall back to LRU among them; the hot document goes last
    assert first_tokens_in_eviction_order(cache) == [1, 2, 3, 200, 300, 100]


def test_cost_weighting_keeps_the_deeper_node():
    """Two once-used 4-token leaves: D at positions 8..11 (older), S at 0..3 (newer).
    Without cost S outlives D; with cost_context 4, D's recompute is dearer:
    D = 2/1 + log2(1 + 10/4) = 3.81 vs S = 3/1 + log2(1 + 2/4) = 3.58."""
    base = list(range(8))

    def build(cache):
        serve(cache, "x", base + [50, 51, 52, 53, 54])  # lookup 1: one leaf of 13
        serve(cache, "y", base + [60, 61, 62, 63, 64])  # lookup 2: splits at 8; D = [60..64]
        serve(cache, "s", [200, 201, 202, 203, 204])  # lookup 3: S
        return [(start, n) for start, n in cache.evictable_leaves_in_order()]

    assert build(aged(half_life=1)) == [(8, 5), (8, 5), (0, 5)]
    weighted = aged(half_life=1, cost_context=4)
    assert build(weighted) == [(8, 5), (0, 5), (8, 5)]
    leaves = [int(k[-1].key[0]) for k in weighted.tree.candidates]
    assert leaves == [50, 200, 60]  # x's tail (1 reference at lookup 1) goes first either way


def test_split_keeps_the_history_and_rekeys_the_lower_part():
    cache = aged(half_life=4, cost_context=4)
    serve(cache, "x", list(range(10)))  # one leaf, start 0
    serve(cache, "y", list(range(6)) + [77, 78])  # splits it at 6: the lower part starts at 6
    cache.check_invariants()  # a stale candidate key (old start) would fail here
    lower = next(n for n in cache.tree.nodes() if n.start == 6 and int(n.key[0]) == 6)
    upper = lower.parent
    assert lower.policy_state == pytest.approx(1 / 4)
    assert upper.policy_state == pytest.approx(2 / 4 + math.log2(1 + 2 ** (-1 / 4)))


def test_same_hits_as_radix_without_pressure():
    """Eviction order is all it changes: with room for everything the hits are radix's."""
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(1000, 2000, 24)) for _ in range(5)]
    a, r = aged(half_life=8, num_pages=4096), create_cache("radix", num_pages=4096, page_size=1)
    for i in range(40):
        toks = docs[int(rng.integers(5))] + list(rng.integers(0, 999, 6))
        assert serve(a, f"q{i}", toks) == serve(r, f"q{i}", toks)


@pytest.mark.parametrize("kw", [{"half_life": 0}, {"half_life": -1}, {"half_life": True}, {"cost_context": 0}])
def test_bad_options(kw):
    with pytest.raises(InvalidRequestError):
        create_cache("radix-aged", num_pages=8, page_size=1, **kw)
