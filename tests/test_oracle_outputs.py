"""Bounds when generated tokens come back: a conversation re-sends its answers (forced outputs)."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelib import create_cache
from experiments.bounds.oracle import belady_hits, infinite_hits, page_keys
from experiments.engine import replay, unlimited_pages
from experiments.workloads.registry import make_workload
from experiments.workloads.spec import RequestSpec


def conversations(turns: list[list[tuple[list[int], list[int]]]]) -> list[RequestSpec]:
    """Each conversation's turn t re-sends turns < t (user tokens + answer) before its user
    tokens; each turn's answer is its forced output."""
    specs = []
    longest = max(len(c) for c in turns)
    for t in range(longest):  # interleave conversations turn by turn
        for ci, conv in enumerate(turns):
            if t >= len(conv):
                continue
            history = [tok for user, ans in conv[:t] for tok in user + ans]
            user, ans = conv[t]
            rid = f"c{ci}t{t}"
            answer = np.asarray(ans, dtype=np.int32)
            specs.append(RequestSpec(rid, np.asarray(history + user, dtype=np.int32), len(ans), forced_output=answer))
    return specs


def _replay(backend, specs, page_size, pages):
    cache = create_cache(backend, num_pages=pages, page_size=page_size)
    result = replay(cache, specs)
    cache.check_invariants()
    return result


turn = st.tuples(
    st.lists(st.integers(1, 3), min_size=1, max_size=3), st.lists(st.integers(1, 3), min_size=1, max_size=3)
)


@settings(max_examples=120, deadline=None)
@given(
    turns=st.lists(st.lists(turn, min_size=1, max_size=3), min_size=1, max_size=3),
    page_size=st.sampled_from([1, 2]),
    capacity=st.integers(4, 14),
)
def test_infinite_ge_belady_ge_backends_when_answers_come_back(turns, page_size, capacity):
    specs = conversations(turns)
    keys = page_keys(specs, page_size)
    inf = infinite_hits(specs, page_size, keys=keys)
    bel = belady_hits(specs, page_size, capacity, keys=keys)
    assert inf["hit_tokens"] >= bel["hit_tokens"]
    for backend in ("apc", "radix"):
        got = _replay(backend, specs, page_size, capacity)
        assert got["unschedulable"] == bel["unschedulable"]
        assert got["hit_tokens"] <= bel["hit_tokens"], backend
    unlimited = belady_hits(specs, page_size, None, keys=keys)
    assert unlimited["per_request_hits"] == inf["per_request_hits"]
    assert (
        _replay("apc", specs, page_size, unlimited_pages(specs, page_size))["per_request_hits"]
        == inf["per_request_hits"]
    )


def test_chat_answers_are_reused_only_when_outputs_are_given():
    wl = make_workload("multi_turn_chat", seed=0, num_conversations=10, turns=4)
    with_out = infinite_hits(wl.requests, 16)
    unforced = [dataclasses.replace(s, forced_output=None) for s in wl.requests]
    without = infinite_hits(unforced, 16)
    assert with_out["hit_tokens"] > without["hit_tokens"]
    pages = unlimited_pages(wl.requests, 16)
    apc = replay(create_cache("apc", num_pages=pages, page_size=16), wl.requests)
    assert apc["per_request_hits"] == with_out["per_request_hits"]
