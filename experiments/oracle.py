"""Offline bounds on prefix-cache hits under the replay protocol (DESIGN §6).

Two bounds, both counted exactly as `experiments.engine.replay` counts a backend's hits:

- `infinite_hits`: a cache that never evicts. Request i hits the longest run of its leading
  full pages that some earlier request computed (its prompt's full pages; generated tokens
  have ids no prompt uses, so pages holding them never match, unless a request's
  `forced_output` names the tokens it generates, as a conversation re-sends them: then the
  full pages of prompt + output - 1 tokens count too), capped at `len - 1` tokens
  and rounded down to a page, as apc and radix cap it. Different `cache_salt`, `lora_id` or
  multimodal hashes never share: page keys are apc's chained block hashes, which fold them in.
- `belady_hits`: the offline optimum at the same capacity. The cache is a trie of pages (a
  cached page's ancestors are cached). When room is needed it evicts the unpinned cached leaf
  whose next use is farthest in the future (never again = infinity). The next use of a page
  is the next request whose *hittable* prefix (first `(len - 1) // page_size` pages) passes
  through it. Evictions are lazy: a page leaves only when a request's pages do not fit.

What the Belady bound assumes: the same page size and the same token capacity as the backends,
and the same protocol and accounting. Requests run in trace order; while a request runs it
holds `ceil(prompt / page_size)` pages for its prompt (hit pages shared with the cache, the
rest new) and then `ceil((prompt + output - 1) / page_size)` in all while it decodes (all
or nothing; when that does not fit even alone the request is truncated and holds only its
prompt, as in the engine). Its full prompt pages join the trie when the prompt is committed;
generated and partial pages are dropped at release (no request can hit them, so caching them
only takes room; with forced outputs, generated pages a later prompt re-sends join the trie as
decoding fills them, like prompt pages; they are unit pages too, so the argument below
should carry over, but the tests check only infinite >= Belady >= apc, radix for them, not
exhaustive optimality). A full last page that the cap makes it recompute while a copy is cached is
one page, not two: the request's copy takes the cached one's place (apc keeps both under one
hash and can evict either; radix frees the duplicate at commit), except while another
in-flight request pins the cached copy, when prefill needs a page of its own. A request whose prompt pages exceed the capacity is unschedulable: it counts no hit
and no prompt tokens, for every policy alike (admission needs only the page count).

Why it bounds every online policy at concurrency 1 (exact, not a heuristic). Relax the trie
constraint: let the cache hold any set S of pages and credit request i with |S ∩ H_i|, H_i
its hittable pages. That is a paging problem with unit pages, a capacity that shrinks while
a request runs (its private pages) and batch accesses; farthest-next-use eviction with lazy
eviction (equivalently, bypass) is optimal for it by Belady's exchange argument, which only
swaps one unit page for another at equal occupancy and so survives a varying capacity. The
relaxation can only gain, so its optimum bounds every prefix-closed policy. And the relaxed
Belady *is* prefix-closed: a page's next use is never earlier than its parent's (a request
through the child passes the parent), and pins are prefix-closed, so among unpinned pages a
farthest one can always be found at a leaf; evicting leaves only is a valid tie-break of
the relaxed Belady. So farthest-next-use leaf eviction is optimal on the trie too, and for
prefix-closed states |S ∩ H_i| is exactly the hit a backend counts. `tests/test_oracle.py`
checks this against an exhaustive search over every eviction choice on random small
workloads (page sizes 1-2 there; a one-off run of 4,000 workloads with page sizes 1-4 and
salts also found Belady equal to the optimum and apc, radix never above it).

Where it is only a strong reference, not a proof:
- concurrency > 1: which requests overlap depends on admission failures, which depend on how
  many pages in-flight requests share, hence on the policy; Belady here follows its own
  schedule (oldest finishes first, as the engine does), so a backend could in principle
  beat it. Treat the number as "Belady (farthest-next-use leaf eviction)".
- `paged` shares declared prefixes at token granularity (a partial last page copy-on-write)
  and outside this accounting; the page-granular bounds do not bind it. `infinite_hits` at
  `page_size=1` still bounds any policy that reuses only exact prompt prefixes.
- Pages are identified by chained xxh3-128 hashes (as apc does); a collision is ignored.
- Belady's hit on one request is no ceiling on a backend's (Belady may give up a hit now for
  two later); only the total is. `capacity_pages=None` means the sum of every request's pages: no eviction,
  so Belady then equals `infinite_hits` request by request.
"""

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

from cachelib.hashing import BlockHasher
from experiments.workloads.spec import RequestSpec

#: next use of a page that no later request hits
NEVER = sys.maxsize


@dataclass(frozen=True, slots=True)
class PageKeys:
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


def page_keys(requests: Seq[RequestSpec], page_size: int) -> PageKeys:
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
    return PageKeys(page_size, keys, prompt_lens, [spec.output_len for spec in requests], parent)


def _result(
    name: str, pk: PageKeys, num_pages: int | None, concurrency: int, hits: list[int], evicted: int, truncated: int
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


def infinite_hits(requests: Seq[RequestSpec], page_size: int, *, keys: PageKeys | None = None) -> dict[str, Any]:
    """Hits of a cache that never evicts (per request, total tokens, rate); `keys` reuses
    a `page_keys` result for the same requests and page size."""
    pk = keys if keys is not None else page_keys(requests, page_size)
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


def _check_keys(pk: PageKeys, requests: Seq[RequestSpec], page_size: int) -> None:
    if pk.page_size != page_size or len(pk.keys) != len(requests):
        raise ValueError("keys were computed for other requests or another page size")


def _uses(pk: PageKeys, scheduled: list[bool]) -> tuple[array, array]:
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


def belady_hits(
    requests: Seq[RequestSpec],
    page_size: int,
    capacity_pages: int | None,
    concurrency: int = 1,
    *,
    keys: PageKeys | None = None,
) -> dict[str, Any]:
    """Belady (farthest-next-use leaf eviction) at `capacity_pages` pages (None: unlimited),
    under the replay protocol with `concurrency` requests in flight. See the module doc."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pk = keys if keys is not None else page_keys(requests, page_size)
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
