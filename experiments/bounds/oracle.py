"""Offline bounds on prefix-cache hits under the replay protocol (docs/design.md §6).

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

How it is computed (the numbers are those of the page-by-page definition above; the tests
compare both with a page-by-page reference implementation, request by request). Pages are
grouped in *nodes*: runs of up to `per_node` consecutive pages of a chain that every request
reaching the run's first page continues through in order (a node's cached pages, pinned
pages, pages seen and pages a request can hit are always a prefix of the node). For a
Mooncake trace a node is one 512-token block (`per_node = 512 // page_size`), found from the
hash ids without expanding a token (see `page_keys`); otherwise a node is one page. The state
is per node (counts, not per-page flags), next uses are per (node, request) with the number of
the node's pages the request can hit, and Belady evicts a node's leaf pages in runs: a run of
pages with the same next use at once, and pages nobody uses again (all tied, so evicted in the
order they became leaves, one per leaf in turn) a whole round of leaves at a time.
"""

from __future__ import annotations

import heapq
import sys
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from itertools import chain as chain_iter
from typing import Any

import numpy as np

from cachelib.hashing import BlockHasher
from experiments.workloads.mooncake import ALIAS_LIMIT, HIGH_FIRSTS, MOONCAKE_BLOCK, MooncakePrompt
from experiments.workloads.spec import RequestSpec

#: next use of a page that no later request hits
NEVER = sys.maxsize


@dataclass(frozen=True, slots=True)
class PageKeys:
    """Every request's full pages (its prompt's, and generated ones a forced output re-sends)
    as chains of nodes, shared by both bounds (see the module doc).

    Request i's full page t is page `t % per_node` of node `nodes(i)[t // per_node]`; its
    chain has `full_pages[i]` pages. Equal (node, page) = equal tokens, equal prefix before
    them and equal extra keys. `parent[n]` is the node whose last page precedes node n's
    first page (-1 for a first node); `num_keys` counts distinct pages.
    """

    page_size: int
    per_node: int
    node_ids: np.ndarray  # int32, every request's nodes in order; request i's are node_ids[starts[i]:starts[i+1]]
    starts: np.ndarray  # int64, len(requests) + 1
    full_pages: list[int]
    prompt_lens: list[int]
    output_lens: list[int]
    parent: np.ndarray  # int32 per node
    num_keys: int

    @property
    def num_nodes(self) -> int:
        return len(self.parent)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def nodes(self, i: int) -> list[int]:
        return self.node_ids[self.starts[i] : self.starts[i + 1]].tolist()

    def hittable(self, i: int) -> int:
        """Pages request i may hit: its first `len - 1` tokens, rounded down to a page."""
        return (self.prompt_lens[i] - 1) // self.page_size

    def chain(self, i: int) -> list[int]:
        """Request i's full pages as page ids `node * per_node + page` (for tests and tools)."""
        p = self.per_node
        ns = self.nodes(i)
        return [ns[t // p] * p + t % p for t in range(self.full_pages[i])]

    def page_parent(self, k: int) -> int:
        """The page id before page id `k` in its chain (-1 for a first page)."""
        n, j = divmod(k, self.per_node)
        if j:
            return k - 1
        p = int(self.parent[n])
        return -1 if p < 0 else p * self.per_node + self.per_node - 1


def page_keys(requests: Seq[RequestSpec], page_size: int) -> PageKeys:
    """Intern every request's full pages: its prompt's, and when its `forced_output` gives the
    tokens it generates (a conversation re-sends them), also the full pages of prompt +
    output - 1 tokens (the last generated token gets no KV).

    Pages are apc's chained block hashes of the tokens, one node per page, except for a
    Mooncake trace (every prompt a `MooncakePrompt`, no extra keys, no forced output) when
    `page_size` divides 512: then one node per (previous node, hash id), never expanding a
    prompt. Both give the same pages: a block's tokens depend only on its hash id (a shorter
    last block is a prefix of the same tokens), two different ids differ within their first
    3 tokens (`block_tokens`, guarantee 1), so within a page of 4 tokens or more, and two ids
    below 2,000,000,000 differ in their first token (guarantee 2), which covers pages of 1 or
    2 tokens; with larger ids and pages under 4 tokens the token hashes are used."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if MOONCAKE_BLOCK % page_size == 0 and all(_by_hash_ids(spec) for spec in requests):
        keys = _mooncake_keys(requests, page_size)
        if keys is not None:
            return keys
    return _token_keys(requests, page_size)


def _by_hash_ids(spec: RequestSpec) -> bool:
    extra = spec.extra
    return (
        isinstance(spec.prompt_source, MooncakePrompt)
        and spec.prompt_source.block_size == MOONCAKE_BLOCK  # the fast path's nodes are 512-token blocks
        and extra.cache_salt is None
        and extra.lora_id is None
        and not extra.mm
        and (spec.forced_output is None or spec.output_len <= 1)
    )


def _token_keys(requests: Seq[RequestSpec], page_size: int) -> PageKeys:
    """One node per page, interned by its chained block hash (the definition)."""
    hasher = BlockHasher(page_size)
    ids: dict[bytes, int] = {}
    parent = array("i")
    flat = array("i")
    starts = [0]
    full_pages: list[int] = []
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
        prev = -1
        for h in hasher.hash_blocks(tokens, spec.extra, 0, n_full, None):
            k = ids.get(h)
            if k is None:
                k = ids[h] = len(parent)
                parent.append(prev)
            flat.append(k)
            prev = k
        full_pages.append(n_full)
        starts.append(len(flat))
    return PageKeys(
        page_size=page_size,
        per_node=1,
        node_ids=np.frombuffer(flat, dtype=np.int32) if flat else np.zeros(0, np.int32),
        starts=np.asarray(starts, dtype=np.int64),
        full_pages=full_pages,
        prompt_lens=prompt_lens,
        output_lens=[spec.output_len for spec in requests],
        parent=np.frombuffer(parent, dtype=np.int32) if parent else np.zeros(0, np.int32),
        num_keys=len(parent),
    )


def _mooncake_keys(requests: Seq[RequestSpec], page_size: int) -> PageKeys | None:
    """One node per 512-token block, interned by (previous node, hash id), depth by depth;
    None when pages of 1 or 2 tokens could alias (hash ids of 2,000,000,000 and more)."""
    per_node = MOONCAKE_BLOCK // page_size
    prompt_lens = [len(spec.prompt_source) for spec in requests]
    for spec, n in zip(requests, prompt_lens, strict=True):
        if n == 0:
            raise ValueError(f"request {spec.request_id!r}: empty prompt")
    full = np.asarray(prompt_lens, dtype=np.int64) // page_size
    blocks = -(-full // per_node)  # blocks holding at least one full page
    total = int(blocks.sum())
    hids = np.fromiter(
        chain_iter.from_iterable(
            spec.prompt_source.hash_ids[:b] for spec, b in zip(requests, blocks.tolist(), strict=True)
        ),
        dtype=np.int64,
        count=total,
    )
    if page_size < 3 and total and int(hids.max()) >= ALIAS_LIMIT + HIGH_FIRSTS:
        return None
    starts = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(blocks, out=starts[1:])
    dense = np.unique(hids, return_inverse=True)[1].astype(np.int64)  # ids as 0, 1, 2, ...
    del hids
    width = int(dense.max(initial=0)) + 1
    node = np.empty(total, dtype=np.int32)
    deep = np.argsort(-blocks, kind="stable")  # requests, most blocks first
    first, depth = starts[:-1][deep], blocks[deep]
    parents: list[np.ndarray] = []
    num = 0
    for d in range(int(depth.max(initial=0))):
        at = first[: np.searchsorted(-depth, -d)] + d  # block d of every request that has one
        prev = node[at - 1].astype(np.int64) + 1 if d else np.zeros(at.size, dtype=np.int64)
        key = prev * width + dense[at]  # below (total + 1) ** 2: no overflow under 3e9 blocks
        uk, inv = np.unique(key, return_inverse=True)
        node[at] = num + inv
        parents.append((uk // width - 1).astype(np.int32))
        num += uk.size
    del dense
    # distinct pages: per node, the most pages a request has in it (all of them but in a
    # request's last block)
    most = np.zeros(num, dtype=np.int64)
    some = blocks > 0
    last = starts[1:][some] - 1
    inner = np.ones(total, dtype=bool)
    inner[last] = False
    most[node[inner]] = per_node
    np.maximum.at(most, node[last], (full - (blocks - 1) * per_node)[some])
    return PageKeys(
        page_size=page_size,
        per_node=per_node,
        node_ids=node,
        starts=starts,
        full_pages=full.tolist(),
        prompt_lens=prompt_lens,
        output_lens=[spec.output_len for spec in requests],
        parent=np.concatenate(parents).astype(np.int32) if parents else np.zeros(0, np.int32),
        num_keys=int(most.sum()),
    )


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


def _prefix(ns: list[int], per_node: int, have: list[int], limit: int) -> int:
    """How many of a chain's first `limit` pages are in a prefix-closed set given per node
    as a prefix length `have[node]`."""
    h = 0
    for b, n in enumerate(ns):
        want = limit - b * per_node
        if want <= 0:
            break
        if want > per_node:
            want = per_node
        got = have[n]
        if got < want:
            return h + got
        h += want
    return h


def infinite_hits(requests: Seq[RequestSpec], page_size: int, *, keys: PageKeys | None = None) -> dict[str, Any]:
    """Hits of a cache that never evicts (per request, total tokens, rate); `keys` reuses
    a `page_keys` result for the same requests and page size."""
    pk = keys if keys is not None else page_keys(requests, page_size)
    _check_keys(pk, requests, page_size)
    p = pk.per_node
    seen = [0] * pk.num_nodes  # pages seen, a prefix of each node
    hits: list[int] = []
    for i in range(len(pk)):
        ns = pk.nodes(i)
        hits.append(_prefix(ns, p, seen, pk.hittable(i)) * page_size)
        left = pk.full_pages[i]
        for n in ns:
            a = p if left > p else left
            if seen[n] < a:
                seen[n] = a
            left -= a
    return _result("infinite", pk, None, 1, hits, 0, 0)


def _check_keys(pk: PageKeys, requests: Seq[RequestSpec], page_size: int) -> None:
    if pk.page_size != page_size or len(pk) != len(requests):
        raise ValueError("keys were computed for other requests or another page size")


def _uses(pk: PageKeys, scheduled: list[bool]) -> tuple[array, array, array, array]:
    """For each node, the requests that can hit it (ascending), how many of its pages each
    can hit, and the suffix maximum of those counts, in CSR form (`x[start[n]:start[n + 1]]`)."""
    per = pk.per_node
    n = len(pk)
    cap = (np.asarray(pk.prompt_lens, dtype=np.int64) - 1) // pk.page_size
    cap[~np.asarray(scheduled, dtype=bool)] = 0
    used = -(-cap // per)  # nodes holding a hittable page
    total = int(used.sum())
    ends = np.cumsum(used)
    at = np.arange(total, dtype=np.int64)
    at += np.repeat(pk.starts[:-1] - (ends - used), used)  # where each use's node is in node_ids
    node = pk.node_ids[at]
    del at
    req = np.repeat(np.arange(n, dtype=np.int32), used)
    count = np.full(total, per, dtype=np.int32)  # all its pages, but in its last node
    some = used > 0
    count[ends[some] - 1] = (cap - (used - 1) * per)[some]
    order = np.argsort(node, kind="stable")  # stable: request indices stay ascending
    node, req, count = node[order], req[order], count[order]
    del order
    start = np.zeros(pk.num_nodes + 1, dtype=np.int64)
    np.cumsum(np.bincount(node, minlength=pk.num_nodes), out=start[1:])
    # suffix maximum within each node's segment: reversed running maximum, offset by segment
    seg = (pk.num_nodes - node[::-1].astype(np.int64)) * (per + 1)
    del node
    top = (np.maximum.accumulate(seg + count[::-1]) - seg)[::-1]
    del seg

    def arr(code: str, x: np.ndarray) -> array:
        out = array(code)
        out.frombytes(x.astype(np.int32 if code == "i" else np.int64).tobytes())
        return out

    return arr("i", req), arr("i", count), arr("i", top), arr("q", start)


def belady_hits(
    requests: Seq[RequestSpec],
    page_size: int,
    capacity_pages: int | None,
    concurrency: int = 1,
    *,
    keys: PageKeys | None = None,
) -> dict[str, Any]:
    """Belady (farthest-next-use leaf eviction) at `capacity_pages` pages (None: unlimited),
    under the replay protocol with `concurrency` requests in flight. See the module doc;
    `keys` reuses a `page_keys` result for the same requests and page size."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    pk = keys if keys is not None else page_keys(requests, page_size)
    _check_keys(pk, requests, page_size)
    return Belady(pk, capacity_pages, concurrency).run()


class Belady:
    """The Belady bound's replay (module docstring): requests in trace order, each served
    (`serve`: room made by finishing the oldest, its prompt admitted, its output decoded),
    over a trie of cached pages whose unpinned leaves wait in two eviction queues.

    State per node (a run of a chain's pages, `PageKeys`): `cached` pages (a prefix),
    `kids` (cached child nodes), `pinned` pages (the most any in-flight request holds) and
    `holders`, with the pages each holder holds in `shared` when two or more do. Unpinned
    leaves are queued for eviction: those nobody uses again first, in the order they became
    leaves (`never`, all tied at NEVER), then farthest next use first (`heap`). An entry
    (…, node, low) stands for the node's top cached page and says pages low.. of the node
    share its next use; it is valid while its stamp is the node's (`stamp`) and that page
    an unpinned leaf: a node's cached pages change only by its own entry's evictions, or
    pinned (inserted) and then queued anew when unpinned."""

    def __init__(self, pk: PageKeys, capacity_pages: int | None, concurrency: int) -> None:
        self.pk = pk
        self.concurrency = concurrency
        ps = pk.page_size
        self.P = pk.per_node
        self.need = [-(-p // ps) for p in pk.prompt_lens]
        self.total = [-(-(p + max(o - 1, 0)) // ps) for p, o in zip(pk.prompt_lens, pk.output_lens, strict=True)]
        if capacity_pages is None:
            self.capacity = max(sum(self.total), 1)
        elif isinstance(capacity_pages, bool) or not isinstance(capacity_pages, int) or capacity_pages < 1:
            raise ValueError(f"capacity_pages must be a positive int or None, got {capacity_pages!r}")
        else:
            self.capacity = capacity_pages
        self.unlimited = capacity_pages is None
        # Admission needs only the page count, so who is unschedulable is policy-free; those
        # requests never use a page and must not keep one alive.
        self.scheduled = [self.need[i] <= self.capacity for i in range(len(pk))]
        self.use_req, self.use_count, self.use_top, self.use_start = _uses(pk, self.scheduled)
        self.parent = array("i", pk.parent.tobytes())
        m = pk.num_nodes
        self.cached, self.kids, self.pinned, self.holders, self.stamp = ([0] * m for _ in range(5))
        self.shared: dict[int, list[int]] = {}
        self.never: deque[tuple[int, int, int]] = deque()  # (stamp, node, low)
        self.heap: list[tuple[int, int, int, int]] = []  # (-next use, stamp, node, low)
        self.counter = self.tree_size = self.pinned_pages = self.private = 0
        self.last_admitted = -1
        self.evicted = self.truncated = 0
        self.inflight: deque[tuple[list[int], int, int]] = deque()  # (nodes, pages held, private pages)
        self.hits: list[int] = []

    def run(self) -> dict[str, Any]:
        for i in range(len(self.pk)):
            self.serve(i)
        while self.inflight:
            self.finish_oldest()
        assert self.pinned_pages == 0 and self.private == 0 and self.tree_size <= self.capacity, (
            "belady: book-keeping broke"
        )
        result = _result("belady", self.pk, self.capacity, self.concurrency, self.hits, self.evicted, self.truncated)
        result["capacity_unlimited"] = self.unlimited
        return result

    # -- a request -------------------------------------------------------------------------

    def serve(self, i: int) -> None:
        """Request i: room in flight, its prompt admitted (finishing the oldest for room), its
        output decoded; unschedulable (hit -1) when its prompt exceeds the capacity."""
        while len(self.inflight) >= self.concurrency:
            self.finish_oldest()
        if not self.scheduled[i]:
            while self.inflight:  # the engine finishes everyone before giving up on a request
                self.finish_oldest()
            self.hits.append(-1)
            return
        ns = self.pk.nodes(i)
        held, own = self.admit_prompt(i, ns)
        held, own = self.decode(i, ns, held, own)
        self.inflight.append((ns, held, own))

    def admit_prompt(self, i: int, ns: list[int]) -> tuple[int, int]:
        """Request i's prompt: its hit (the cached prefix of its hittable pages), room made
        for the rest, its full pages inserted; returns (pages it holds, private pages)."""
        pk, P, cached = self.pk, self.P, self.cached
        prompt_full = pk.prompt_lens[i] // pk.page_size  # pages beyond it: generated (forced outputs)
        h = _prefix(ns, P, cached, pk.hittable(i))
        new = self.need[i] - h
        if self.inflight:
            while self.pinned_pages + self.private + new + h - _prefix(ns, P, self.pinned, h) > self.capacity:
                self.finish_oldest()  # never with nothing in flight: then it fits (scheduled)
        self.last_admitted = i
        # The full last page beyond the cap may be cached already: the request recomputes it
        # and then holds one copy. Keeping that copy costs nothing, so it is pinned as the
        # request's own page; only when another request pins it does the recompute need a
        # page of its own during prefill (then merged, as radix does at commit).
        dup = transient = 0
        if h < prompt_full:
            k, j = ns[h // P], h % P
            dup = int(cached[k] > j)
            transient = int(dup and self.pinned[k] > j)
        # Pinning the pages it computes before they exist changes nothing: making room
        # looks only at cached pages, and these are not (one page at a time would pin them
        # as they join the tree).
        self.hold(ns, 0, prompt_full)
        self.make_room(new - dup + transient)
        own = self.need[i] - prompt_full  # the partial last page
        self.insert(ns, h + dup, prompt_full)
        self.private += own
        self.hits.append(h * pk.page_size)
        return prompt_full, own

    def decode(self, i: int, ns: list[int], held: int, own: int) -> tuple[int, int]:
        """Request i's output, all or nothing (truncated when it does not fit even alone):
        generated pages a later prompt re-sends (forced outputs) join the tree as decoding
        fills them, the rest stays private; returns (pages it holds, private pages)."""
        full, prompt_full = self.pk.full_pages[i], held
        grow = self.total[i] - self.need[i]
        if grow <= 0 and full <= prompt_full:
            return held, own
        while self.pinned_pages + self.private + grow > self.capacity and self.inflight:
            self.finish_oldest()
        if self.pinned_pages + self.private + grow > self.capacity:
            self.truncated += 1
        elif full > prompt_full:
            # (the prompt's partial page becomes the first generated one). Pages already
            # cached are pinned first, so making room cannot evict them.
            self.private -= own
            have = _prefix(ns, self.P, self.cached, full)
            self.hold(ns, prompt_full, full)
            self.make_room(full - have + self.total[i] - full)
            self.insert(ns, have, full)
            held = full
            own = self.total[i] - full
            self.private += own
        else:
            self.make_room(grow)
            self.private += grow
            own += grow
        return held, own

    def finish_oldest(self) -> None:
        """The oldest request in flight finishes: its pages unpinned, its last one queued."""
        ns, held, own = self.inflight.popleft()
        self.private -= own
        self.hold(ns, held, 0)
        if held:
            P = self.P
            k, j = ns[(held - 1) // P], (held - 1) % P
            if self.pinned[k] <= j and self.cached[k] == j + 1 and (j < P - 1 or not self.kids[k]):
                self.candidate(k, j)

    # -- the trie ----------------------------------------------------------------------------

    def hold(self, ns: list[int], old: int, new: int) -> None:
        """A request's held pages (a prefix of its chain) go from `old` to `new`."""
        P, pinned, holders = self.P, self.pinned, self.holders
        delta = 0
        lo, hi = (old, new) if old < new else (new, old)
        for b in range(lo // P, -(-hi // P)):
            k = ns[b]
            base = b * P
            a_old = old - base
            a_old = P if a_old > P else (a_old if a_old > 0 else 0)
            a_new = new - base
            a_new = P if a_new > P else (a_new if a_new > 0 else 0)
            was = pinned[k]
            if not a_old and not holders[k]:  # the first holder: the common case
                holders[k] = 1
                pinned[k] = a_new
                delta += a_new
                continue
            if holders[k] == 1 and a_old:  # the only holder
                if not a_new:
                    holders[k] = 0
                pinned[k] = a_new
                delta += a_new - was
                continue
            delta += self._share(k, was, a_old, a_new)
        self.pinned_pages += delta

    def _share(self, k: int, was: int, a_old: int, a_new: int) -> int:
        """Node k, held by several requests: one's hold goes from `a_old` to `a_new` pages;
        returns how its pinned pages moved."""
        held = self.shared.get(k)
        if held is None:
            held = self.shared[k] = [was]
        if a_old:
            held.remove(a_old)
        if a_new:
            held.append(a_new)
        self.holders[k] = len(held)
        top = max(held) if held else 0
        if len(held) < 2:
            del self.shared[k]
        self.pinned[k] = top
        return top - was

    def insert(self, ns: list[int], old: int, new: int) -> None:
        """Cache pages old..new-1 of a chain (uncached; the pages before them are cached).
        Nothing when old == new: the node may hold more cached pages than this chain has."""
        if new <= old:
            return
        P, cached, parent, kids = self.P, self.cached, self.parent, self.kids
        self.tree_size += new - old
        b = old // P
        while b * P < new:
            k = ns[b]
            if not cached[k] and parent[k] >= 0:
                kids[parent[k]] += 1
            cached[k] = min(P, new - b * P)
            b += 1

    def candidate(self, k: int, j: int) -> None:
        """Page j of node k just became an unpinned leaf: queue it by its next use after the
        latest admission (with the lowest page of the node sharing that next use)."""
        self.counter += 1
        counter = self.stamp[k] = self.counter
        use_req, use_count, use_top = self.use_req, self.use_count, self.use_top
        lo, hi = self.use_start[k], self.use_start[k + 1]
        pos = bisect_right(use_req, self.last_admitted, lo, hi)
        if pos == hi or use_top[pos] <= j:
            self.never.append((counter, k, use_top[pos] if pos < hi else 0))
            return
        low = 0
        while use_count[pos] <= j:
            if use_count[pos] > low:
                low = use_count[pos]
            pos += 1
        heapq.heappush(self.heap, (-use_req[pos], counter, k, low))

    def evict(self, k: int, num: int) -> None:
        """Node k's top `num` cached pages (unpinned leaves in turn) were evicted: queue the
        new leaf. The caller counts them in `tree_size` and `evicted`."""
        left = self.cached[k] = self.cached[k] - num
        if left:
            if self.pinned[k] < left:
                self.candidate(k, left - 1)
            return
        p = self.parent[k]
        if p >= 0:
            self.kids[p] -= 1
            if not self.kids[p] and self.pinned[p] < self.P:
                self.candidate(p, self.P - 1)

    # -- making room ------------------------------------------------------------------------

    def make_room(self, num: int) -> None:
        """Evict farthest-next-use leaves until `num` pages are free (the caller checked
        that unpinned pages suffice), exactly as one page at a time would: the leaves
        nobody uses again first (`evict_unused`), then by next use (`evict_farthest`)."""
        short = num - (self.capacity - self.tree_size - self.private)
        if short <= 0:
            return
        self.tree_size -= short  # all of them are evicted below
        self.evicted += short
        while short and self.never:
            rounds = self.unused_rounds(short)
            if rounds:
                short -= rounds
                continue
            short = self.evict_unused(short)
        self.evict_farthest(short)

    def unused_rounds(self, short: int) -> int:
        """When `short` covers two rounds of the never-used leaves: whole rounds at once
        (each leaf gives one page and its parent page, tied at NEVER too, rejoins the back,
        so the queue's order is unchanged); returns the pages so evicted (0: none)."""
        never = self.never
        if short < 2 * len(never):
            return 0
        cached, pinned, kids, stamp, P = self.cached, self.pinned, self.kids, self.stamp, self.P
        live = [
            e
            for e in never
            if stamp[e[1]] == e[0] and pinned[e[1]] < cached[e[1]] and (cached[e[1]] < P or not kids[e[1]])
        ]
        self.never = deque(live)
        if not live:
            return 0
        rounds = short // len(live)
        for _, k, low in live:
            r = cached[k] - 1 - (low if low > pinned[k] else pinned[k])
            if r < rounds:
                rounds = r
        if rounds <= 0:
            return 0
        for _, k, _ in live:
            cached[k] -= rounds
        return rounds * len(live)

    def evict_unused(self, short: int) -> int:
        """One page at a time from the never-used leaves, at most one round; returns the
        pages still short."""
        never = self.never
        cached, pinned, kids, stamp, P = self.cached, self.pinned, self.kids, self.stamp, self.P
        steps = len(never)
        popleft, append = never.popleft, never.append
        while steps and short:
            steps -= 1
            e = popleft()
            k = e[1]
            c = cached[k]
            if stamp[k] != e[0] or pinned[k] >= c or (c == P and kids[k]):
                continue  # stale: pinned, grew a child or re-queued since
            short -= 1
            if c - 1 > e[2] and pinned[k] < c - 1:  # the page below is NEVER too: no lookup
                cached[k] = c - 1
                append(e)
            else:
                self.evict(k, 1)
        return short

    def evict_farthest(self, short: int) -> None:
        """`short` pages from the leaves by farthest next use; a run of a node's pages that
        share it goes at once (evicting one exposes the next)."""
        heap, pop = self.heap, heapq.heappop
        cached, pinned, kids, stamp, P = self.cached, self.pinned, self.kids, self.stamp, self.P
        while short:
            _, s, k, low = pop(heap)
            c = cached[k]
            if stamp[k] != s or pinned[k] >= c or (c == P and kids[k]):
                continue
            run = c - (low if low > pinned[k] else pinned[k])
            run = short if short < run else run
            short -= run
            self.evict(k, run)
