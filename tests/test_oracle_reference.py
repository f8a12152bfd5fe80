"""The bounds against the page-by-page implementation they replaced (commit 4133cf8, kept
below verbatim as the reference): the same numbers request by request on random workloads
(prompts, forced outputs, salts, concurrency, capacities), and Mooncake page keys built from
hash ids equal to the token-hash definition (the shipped trace slice and random traces)."""

from __future__ import annotations

import heapq
import sys
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachelib.hashing import BlockHasher
from cachelib.types import ExtraKeys
from experiments.bounds.oracle import _token_keys, belady_hits, infinite_hits, page_keys
from experiments.workloads.mooncake import ALIAS_LIMIT, MooncakePrompt
from experiments.workloads.spec import RequestSpec

NEVER = sys.maxsize

# -- the reference: experiments/bounds/oracle.py at 4133cf8, names prefixed ref_ ----------------------


@dataclass(frozen=True, slots=True)
class RefPageKeys:
    """Every request's full prompt pages as small integer ids, shared by both bounds.

    Equal id = equal tokens, equal prefix before them and equal extra keys. `parent[k]` is
    the id of the page before page `k` in its chain (-1 for a first page).
    """

    page_size: int
    keys: list[np.ndarray]  # per request, int32 ids of its full pages, in order (see page_keys)
    prompt_lens: list[int]
    output_lens: list[int]
    parent: list[int]

    @property
    def num_keys(self) -> int:
        return len(self.parent)

    def hittable(self, i: int) -> int:
        """Pages request i may hit: its first `len - 1` tokens, rounded down to a page."""
        return (self.prompt_lens[i] - 1) // self.page_size


def ref_page_keys(requests: Seq[RequestSpec], page_size: int) -> RefPageKeys:
    """Intern the chained block hashes of every request's full pages: its prompt's, and when
    its `forced_output` gives the tokens it generates (a conversation re-sends them), also
    the full pages of prompt + output - 1 tokens (the last generated token gets no KV)."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    hasher = BlockHasher(page_size)
    ids: dict[bytes, int] = {}
    parent: list[int] = []
    keys: list[np.ndarray] = []
    prompt_lens: list[int] = []
    for spec in requests:
        tokens = np.ascontiguousarray(spec.prompt, dtype=np.int32)
        if tokens.size == 0:
            raise ValueError(f"request {spec.request_id!r}: empty prompt")
        prompt_lens.append(int(tokens.size))
        out = spec.forced_output
        if out is not None and spec.output_len > 1:
            tokens = np.concatenate([tokens, np.asarray(out[: spec.output_len - 1], dtype=np.int32)])
        n_full = tokens.size // page_size
        chain: list[int] = []
        prev = -1
        for h in hasher.hash_blocks(tokens, spec.extra, 0, n_full, None):
            k = ids.get(h)
            if k is None:
                k = ids[h] = len(parent)
                parent.append(prev)
            chain.append(k)
            prev = k
        keys.append(np.asarray(chain, dtype=np.int32))
    return RefPageKeys(page_size, keys, prompt_lens, [spec.output_len for spec in requests], parent)


def _result(
    name: str, pk: RefPageKeys, num_pages: int | None, concurrency: int, hits: list[int], evicted: int, truncated: int
) -> dict[str, Any]:
    """The bound in the shape of `engine.replay`'s result (hits are -1 when unschedulable)."""
    prompt_tokens = sum(n for n, h in zip(pk.prompt_lens, hits, strict=True) if h >= 0)
    hit_tokens = sum(h for h in hits if h > 0)
    unschedulable = sum(1 for h in hits if h < 0)
    return {
        "backend": name,
        "page_size": pk.page_size,
        "num_pages": num_pages,
        "capacity_tokens": None if num_pages is None else num_pages * pk.page_size,
        "concurrency": concurrency,
        "requests": len(hits),
        "scheduled": len(hits) - unschedulable,
        "prompt_tokens": prompt_tokens,
        "hit_tokens": hit_tokens,
        "computed_prompt_tokens": prompt_tokens - hit_tokens,
        "hit_rate": hit_tokens / prompt_tokens if prompt_tokens else 0.0,
        "evicted_pages": evicted,
        "unschedulable": unschedulable,
        "truncated": truncated,
        "per_request_hits": hits,
    }


def ref_infinite_hits(requests: Seq[RequestSpec], page_size: int, *, keys: RefPageKeys | None = None) -> dict[str, Any]:
    """Hits of a cache that never evicts (per request, total tokens, rate); `keys` reuses
    a `page_keys` result for the same requests and page size."""
    pk = keys if keys is not None else ref_page_keys(requests, page_size)
    _check_keys(pk, requests, page_size)
    seen = bytearray(pk.num_keys)
    hits: list[int] = []
    for i, chain in enumerate(pk.keys):
        ks = chain.tolist()
        cap = pk.hittable(i)
        h = 0
        while h < cap and seen[ks[h]]:
            h += 1
        hits.append(h * page_size)
        for k in ks:
            seen[k] = 1
    return _result("infinite", pk, None, 1, hits, 0, 0)


def _check_keys(pk: RefPageKeys, requests: Seq[RequestSpec], page_size: int) -> None:
    if pk.page_size != page_size or len(pk.keys) != len(requests):
        raise ValueError("keys were computed for other requests or another page size")


def _uses(pk: RefPageKeys, scheduled: list[bool]) -> tuple[array, array]:
    """For each page id, the sorted indices of the requests that can hit it, in CSR form
    (`flat[start[k]:start[k + 1]]`); `array` keeps a million ids in a few MB."""
    chains = [c[: pk.hittable(i)] for i, c in enumerate(pk.keys) if scheduled[i]]
    owners = [i for i, c in enumerate(pk.keys) if scheduled[i]]
    if not chains:
        return array("i"), array("q", [0] * (pk.num_keys + 1))
    key_all = np.concatenate(chains)
    req_all = np.repeat(np.asarray(owners, dtype=np.int32), [c.size for c in chains])
    order = np.argsort(key_all, kind="stable")  # stable: request indices stay ascending
    flat = array("i")
    flat.frombytes(req_all[order].astype(np.int32).tobytes())
    start = np.zeros(pk.num_keys + 1, dtype=np.int64)
    np.cumsum(np.bincount(key_all, minlength=pk.num_keys), out=start[1:])
    return flat, array("q", start.tobytes())


def ref_belady_hits(
    requests: Seq[RequestSpec],
    page_size: int,
    capacity_pages: int | None,
    concurrency: int = 1,
    *,
    keys: RefPageKeys | None = None,
) -> dict[str, Any]:
    """Belady (farthest-next-use leaf eviction) at `capacity_pages` pages (None: unlimited),
    under the replay protocol with `concurrency` requests in flight. See the module doc."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pk = keys if keys is not None else ref_page_keys(requests, page_size)
    _check_keys(pk, requests, page_size)
    n = len(pk.keys)
    need = [-(-p // page_size) for p in pk.prompt_lens]
    total = [-(-(p + max(o - 1, 0)) // page_size) for p, o in zip(pk.prompt_lens, pk.output_lens, strict=True)]
    if capacity_pages is None:
        capacity = max(sum(total), 1)
    elif isinstance(capacity_pages, bool) or not isinstance(capacity_pages, int) or capacity_pages < 1:
        raise ValueError(f"capacity_pages must be a positive int or None, got {capacity_pages!r}")
    else:
        capacity = capacity_pages
    # Admission needs only the page count, so who is unschedulable is policy-free; those
    # requests never use a page and must not keep one alive.
    scheduled = [need[i] <= capacity for i in range(n)]
    flat, start = _uses(pk, scheduled)
    parent = pk.parent
    m = pk.num_keys
    cached = bytearray(m)
    pins = [0] * m
    nchild = [0] * m  # cached children
    stamp = [0] * m  # only a page's latest heap entry is valid
    heap: list[tuple[int, int, int]] = []  # (-next use, push order, page)
    push = heapq.heappush
    pop = heapq.heappop
    counter = 0
    tree_size = pinned_nodes = private = 0
    last_admitted = -1
    evicted = truncated = 0
    inflight: deque[tuple[list[int], int]] = deque()  # (pinned pages, private pages)
    hits: list[int] = []

    def candidate(k: int) -> None:
        """k just became an unpinned leaf: queue it by its next use after the latest admission."""
        nonlocal counter
        lo, hi = start[k], start[k + 1]
        j = bisect_right(flat, last_admitted, lo, hi)
        counter += 1
        stamp[k] = counter
        push(heap, (-(flat[j] if j < hi else NEVER), counter, k))

    def make_room(num: int) -> None:
        """Evict farthest-next-use leaves until `num` pages are free (the caller checked
        that unpinned pages suffice)."""
        nonlocal tree_size, evicted
        while capacity - tree_size - private < num:
            _, c, k = pop(heap)
            if stamp[k] != c or not cached[k] or pins[k] or nchild[k]:
                continue  # stale: pinned, grew a child or re-pushed since
            cached[k] = 0
            tree_size -= 1
            evicted += 1
            p = parent[k]
            if p >= 0:
                nchild[p] -= 1
                if nchild[p] == 0 and pins[p] == 0:
                    candidate(p)

    def finish_oldest() -> None:
        nonlocal pinned_nodes, private
        held, own = inflight.popleft()
        private -= own
        for k in held:
            pins[k] -= 1
            if pins[k] == 0:
                pinned_nodes -= 1
                if nchild[k] == 0:
                    candidate(k)

    for i in range(n):
        while len(inflight) >= concurrency:
            finish_oldest()
        if not scheduled[i]:
            while inflight:  # the engine finishes everyone before giving up on a request
                finish_oldest()
            hits.append(-1)
            continue
        ks = pk.keys[i].tolist()
        prompt_full = pk.prompt_lens[i] // page_size  # ks beyond it: generated pages (forced outputs)
        cap = pk.hittable(i)
        h = 0
        while h < cap and cached[ks[h]]:
            h += 1
        new = need[i] - h
        while pinned_nodes + private + new + sum(1 for k in ks[:h] if pins[k] == 0) > capacity:
            finish_oldest()  # never with nothing in flight: then it fits (scheduled)
        last_admitted = i
        # The full last page beyond the cap may be cached already: the request recomputes it
        # and then holds one copy. Keeping that copy costs nothing, so it is pinned as the
        # request's own page; only when another request pins it does the recompute need a
        # page of its own during prefill (then merged, as radix does at commit).
        dup = h < prompt_full and cached[ks[h]]
        transient = dup and pins[ks[h]] > 0
        held = ks[: h + dup]
        for k in held:
            if pins[k] == 0:
                pinned_nodes += 1
            pins[k] += 1
        make_room(new - dup + transient)
        own = need[i] - prompt_full  # the partial last page
        for k in ks[h + dup : prompt_full]:
            cached[k] = 1
            pins[k] = 1
            tree_size += 1
            pinned_nodes += 1
            p = parent[k]
            if p >= 0:
                nchild[p] += 1
            held.append(k)
        private += own
        hits.append(h * page_size)
        grow = total[i] - need[i]
        if grow > 0 or len(ks) > prompt_full:
            while pinned_nodes + private + grow > capacity and inflight:
                finish_oldest()
            if pinned_nodes + private + grow > capacity:
                truncated += 1
            elif len(ks) > prompt_full:
                # Generated pages a later prompt re-sends join the tree as decoding fills them
                # (the prompt's partial page becomes the first); the rest stays private. Pages
                # already cached are pinned first, so making room cannot evict them.
                private -= own
                for k in ks[prompt_full:]:
                    if cached[k]:
                        if pins[k] == 0:
                            pinned_nodes += 1
                        pins[k] += 1
                fresh = [k for k in ks[prompt_full:] if not cached[k]]
                make_room(len(fresh) + total[i] - len(ks))
                for k in fresh:
                    cached[k] = 1
                    pins[k] = 1
                    tree_size += 1
                    pinned_nodes += 1
                    if parent[k] >= 0:
                        nchild[parent[k]] += 1
                held.extend(ks[prompt_full:])
                own = total[i] - len(ks)
                private += own
            else:
                make_room(grow)
                private += grow
                own += grow
        inflight.append((held, own))
    while inflight:
        finish_oldest()
    assert pinned_nodes == 0 and private == 0 and tree_size <= capacity, "belady: book-keeping broke"
    result = _result("belady", pk, capacity, concurrency, hits, evicted, truncated)
    result["capacity_unlimited"] = capacity_pages is None
    return result


# -- comparisons -----------------------------------------------------------------------------

KEYS = ("per_request_hits", "hit_tokens", "prompt_tokens", "evicted_pages", "unschedulable", "truncated", "scheduled")


def same(a: dict, b: dict) -> None:
    for key in KEYS:
        assert a[key] == b[key], (key, a[key], b[key])


def check_against_reference(reqs: list[RequestSpec], ps: int, capacities, concurrencies=(1, 2, 3)) -> None:
    ref = ref_page_keys(reqs, ps)
    pk = page_keys(reqs, ps)
    assert pk.num_keys == ref.num_keys
    same(infinite_hits(reqs, ps, keys=pk), ref_infinite_hits(reqs, ps, keys=ref))
    for cap in capacities:
        for c in concurrencies:
            same(belady_hits(reqs, ps, cap, c, keys=pk), ref_belady_hits(reqs, ps, cap, c, keys=ref))


def req(tokens, output_len: int = 1, forced=None, **extra) -> RequestSpec:
    toks = np.asarray(tokens, dtype=np.int32)
    out = None if forced is None else np.asarray(forced, dtype=np.int32)
    return RequestSpec(f"r{id(toks)}", toks, output_len, extra=ExtraKeys(**extra), forced_output=out)


@st.composite
def token_workloads(draw):
    """Prompts that share prefixes (each a random earlier prompt's prefix plus a tail), some
    repeated exactly, some re-sending an earlier request's prompt and forced output."""
    n = draw(st.integers(1, 14))
    reqs: list[RequestSpec] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["fresh", "extend", "extend", "repeat", "resend"]))
        if kind == "fresh" or not reqs:
            tokens = draw(st.lists(st.integers(1, 3), min_size=1, max_size=12))
        else:
            base = draw(st.sampled_from(reqs))
            src = base.prompt.tolist()
            if kind == "repeat":
                tokens = src
            elif kind == "resend" and base.forced_output is not None:
                tokens = (
                    src
                    + base.forced_output[: base.output_len - 1].tolist()
                    + draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
                )
            else:
                cut = draw(st.integers(0, len(src)))
                tokens = src[:cut] + draw(st.lists(st.integers(1, 3), min_size=1, max_size=8))
        out_len = draw(st.integers(0, 6))
        forced = draw(st.lists(st.integers(1, 3), min_size=out_len, max_size=out_len)) if draw(st.booleans()) else None
        salt = draw(st.sampled_from([None, None, None, "a"]))
        reqs.append(req(tokens, out_len, forced, cache_salt=salt))
    return reqs


@settings(max_examples=400, deadline=None)
@given(
    reqs=token_workloads(),
    page_size=st.sampled_from([1, 2, 3]),
    caps=st.lists(st.integers(1, 24), min_size=1, max_size=3),
)
def test_token_workloads_match_the_reference(reqs, page_size, caps):
    check_against_reference(reqs, page_size, [*caps, None])


def mooncake_req(hash_ids: list[int], input_length: int, output_len: int = 1) -> RequestSpec:
    return RequestSpec(f"mc{id(hash_ids)}", MooncakePrompt(tuple(hash_ids), input_length), output_len)


@st.composite
def mooncake_workloads(draw, high: bool = False):
    """Hash-id chains sharing prefixes (ids reused under other prefixes too), lengths ending
    anywhere in their last block; `high` draws ids where the expansion changes scheme."""
    pool = (
        st.sampled_from(
            [0, 1, ALIAS_LIMIT - 1, ALIAS_LIMIT, ALIAS_LIMIT + 7, 2_000_000_000 - 1, 2_000_000_000, 2**40, 2**63 - 1]
        )
        if high
        else st.integers(0, 6)
    )
    n = draw(st.integers(1, 10))
    chains: list[list[int]] = []
    reqs = []
    for _ in range(n):
        if chains and draw(st.booleans()):
            base = draw(st.sampled_from(chains))
            ids = base[: draw(st.integers(1, len(base)))] + draw(st.lists(pool, max_size=2))
        else:
            ids = draw(st.lists(pool, min_size=1, max_size=3))
        chains.append(ids)
        last = draw(st.sampled_from([1, 2, 3, 15, 16, 17, 255, 256, 511, 512]))
        reqs.append(mooncake_req(ids, 512 * (len(ids) - 1) + last, draw(st.integers(0, 600))))
    return reqs


def expanded(reqs: list[RequestSpec]) -> list[RequestSpec]:
    """The same requests with their prompts as token arrays (so page keys hash the tokens)."""
    return [RequestSpec(s.request_id, s.prompt, s.output_len) for s in reqs]


def assert_same_pages(a, b) -> None:
    """Two PageKeys name the same pages: request by request, a one-to-one map of page ids."""
    forward: dict[int, int] = {}
    backward: dict[int, int] = {}
    for i in range(len(a)):
        ca, cb = a.chain(i), b.chain(i)
        assert len(ca) == len(cb)
        for x, y in zip(ca, cb, strict=True):
            assert forward.setdefault(x, y) == y and backward.setdefault(y, x) == x
    assert a.num_keys == b.num_keys == len(forward)


@settings(max_examples=150, deadline=None)
@given(reqs=mooncake_workloads(), page_size=st.sampled_from([16, 64, 128, 256, 512]), data=st.data())
def test_mooncake_keys_and_bounds_match_the_tokens(reqs, page_size, data):
    pk = page_keys(reqs, page_size)
    assert pk.per_node == 512 // page_size  # built from the hash ids
    assert_same_pages(pk, _token_keys(reqs, page_size))
    total = sum(-(-len(s.prompt_source) // page_size) for s in reqs)
    caps = data.draw(st.lists(st.integers(1, max(total, 1)), min_size=1, max_size=3))
    check_against_reference(expanded(reqs), page_size, [*caps, None], (1, 2))
    for cap in caps:
        for c in (1, 2):
            same(belady_hits(reqs, page_size, cap, c, keys=pk), ref_belady_hits(expanded(reqs), page_size, cap, c))


@settings(max_examples=60, deadline=None)
@given(reqs=mooncake_workloads(high=True), page_size=st.sampled_from([1, 2, 4, 16]))
def test_mooncake_keys_with_ids_past_the_alias_limit(reqs, page_size):
    pk = page_keys(reqs, page_size)
    per = 512 // page_size
    # ids of blocks that hold a full page: a shorter last block has no page to alias
    used = [h for s in reqs for h in s.prompt_source.hash_ids[: -(-(len(s.prompt_source) // page_size) // per)]]
    aliasing = page_size < 3 and any(h >= 2_000_000_000 for h in used)
    assert pk.per_node == (1 if aliasing else per)
    assert_same_pages(pk, _token_keys(reqs, page_size))


def test_mooncake_keys_fall_back_for_what_hash_ids_do_not_cover():
    ids = [0, 1, 2]
    salted = RequestSpec("s", MooncakePrompt(tuple(ids), 1200), 3, extra=ExtraKeys(cache_salt="x"))
    plain = mooncake_req(ids, 1200, 3)
    assert page_keys([plain], 16).per_node == 32
    assert page_keys([plain, salted], 16).per_node == 1  # extra keys: token hashes
    assert page_keys([plain], 48).per_node == 1  # 48 does not divide 512
    forced = RequestSpec("f", MooncakePrompt(tuple(ids), 1200), 3, forced_output=np.arange(5, dtype=np.int32))
    assert page_keys([plain, forced], 16).per_node == 1
    with pytest.raises(ValueError, match="empty prompt"):
        page_keys([mooncake_req([0], 0)], 16)


# -- the shipped trace slice -------------------------------------------------------------------


def test_shipped_slice_keys_equal_the_token_hashes(shipped_trace):
    pk = page_keys(shipped_trace, 16)
    assert pk.per_node == 32
    assert_same_pages(pk, _token_keys(shipped_trace, 16))


@pytest.mark.parametrize("page_size", [16, 64])
def test_shipped_slice_bounds_equal_the_reference(shipped_trace, page_size):
    reqs = shipped_trace[:400]
    ref = ref_page_keys(reqs, page_size)
    pk = page_keys(reqs, page_size)
    same(infinite_hits(reqs, page_size, keys=pk), ref_infinite_hits(reqs, page_size, keys=ref))
    for tokens in (20_000, 100_000, 400_000):
        for c in (1, 2):
            pages = tokens // page_size
            same(belady_hits(reqs, page_size, pages, c, keys=pk), ref_belady_hits(reqs, page_size, pages, c, keys=ref))
