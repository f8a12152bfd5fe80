"""A deliberately naive model of SGLang 0.5.23's `RadixCache` under the replay protocol.

Written from SGLang 0.5.23's sources (`mem_cache/radix_cache.py`, `evict_policy.py`,
`allocator/base.py`, `allocation.py`, `common.py`), independently of `backends/radix.py`,
and kept simple on purpose: token runs are Python lists compared element by element, keys
are re-sliced at every step, and every eviction rebuilds a heap of all unlocked leaves found
by walking the whole tree (SGLang's `evict`). Pages are only counted.

Time is SGLang's `time.monotonic()` replaced by a counter that ticks at *every* call, as the
real code makes them: once per walk (`_match_prefix_helper`, `_insert_helper`) and twice per
`TreeNode()` (last access, creation), so a node created or split by a walk is a little newer
than the walk's stamp, exactly as in SGLang. (The backend ticks once per walk; the two must
order every candidate the same way.)

The calls, per request, as SGLang 0.5.23's scheduler makes them:
- `match_kv_cache`: `match_prefix` of the first `len - 1` tokens, page-aligned; then
  `inc_lock_ref(last_node)` when the request is admitted.
- `alloc_for_extend` -> `evict_to_free_tokens(demand)`: evict `demand - available` tokens
  when positive, where demand = extend tokens (page size 1, `alloc_token_slots`) or extend
  tokens + one page (`alloc_paged_token_slots_extend`'s per-request over-estimate).
- `checkpoint_kv_cache` after the prefill: `checkpoint(up_to=prompt)`: insert the
  page-aligned prompt with `inserted_len = cache_inserted_len` (a node gains an LFU hit only
  when it ends past that), free the pages of `[cache_protected_len, prefix_len)` (the
  tree's copies win), re-match the key (touches the path), move the lock.
- decode, one step per token: `evict_to_free_tokens(1)` at page size 1, or `page_size`
  tokens at larger sizes (`alloc_paged_token_slots_decode`, every step, even when the step
  needs no new page); a page is taken when the token starts one.
- `release_kv_cache(checkpoint=True)` at finish: `checkpoint(up_to=prompt + output - 1)`
  (always: it refreshes the path even when nothing is new; when the key is longer than the
  prompt it also re-inserts the page-aligned prompt, `split_prompt`), free the rest of the
  row, unlock.

The replay protocol around them (docs/design.md §6, `experiments/engine/replay.py`): trace order, at most
C in flight, the oldest finishing first; a prompt that does not fit (free + evictable pages
after locking its match < the pages it needs) unlocks, finishes the oldest in-flight request
and matches again; a decode that cannot fit its whole output does the same before it starts.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

GENERATED_TOKEN_BASE = 2_000_000_000


@dataclass(eq=False)
class Node:
    key: list[int]
    parent: Node | None
    node_id: int
    last_access: int
    created: int
    children: dict = field(default_factory=dict)
    lock_ref: int = 0
    hit_count: int = 0


@dataclass(eq=False)
class Req:
    """What SGLang's `Req` carries for the tree: tokens, last node, protected / inserted lengths."""

    tokens: list[int]
    prompt_len: int
    last: Node
    protected: int  # cache_protected_len
    inserted: int = 0  # cache_inserted_len
    pages: int = 0  # pages in the request's row
    computed: int = 0  # tokens with KV


class SGLangRadixModel:
    """SGLang 0.5.23 `RadixCache` + token/page allocator, pages counted, a counting clock."""

    def __init__(self, page_size: int, num_pages: int, policy: str = "lru") -> None:
        self.ps = page_size
        self.free = num_pages
        self.policy = policy
        self.now = 0
        self.ids = 0
        self.root = self._node([], None)
        self.root.lock_ref = 1
        self.evicted: list[tuple[int, list[int]]] = []  # (start token, key) per evicted node

    def monotonic(self) -> int:
        self.now += 1
        return self.now

    # -- the tree -------------------------------------------------------------------

    def _node(self, key: list[int], parent: Node | None) -> Node:
        self.ids += 1
        last = self.monotonic()
        return Node(key, parent, self.ids, last, self.monotonic())

    def _child_key(self, key: list[int]):
        return key[0] if self.ps == 1 else tuple(key[: self.ps])

    def _key_match(self, a: list[int], b: list[int]) -> int:
        if self.ps == 1:
            i = 0
            for x, y in zip(a, b, strict=False):
                if x != y:
                    break
                i += 1
            return i
        i = 0
        n = min(len(a), len(b))
        while i + self.ps <= n and a[i : i + self.ps] == b[i : i + self.ps]:
            i += self.ps
        return i

    def _split(self, child: Node, split_len: int) -> Node:
        new = self._node(child.key[:split_len], child.parent)
        new.hit_count = child.hit_count
        new.lock_ref = child.lock_ref
        new.children = {self._child_key(child.key[split_len:]): child}
        child.parent.children[self._child_key(child.key)] = new
        child.key = child.key[split_len:]
        child.parent = new
        return new

    def match_prefix(self, key: list[int]) -> tuple[int, Node]:
        key = key[: len(key) // self.ps * self.ps]
        if not key:
            return 0, self.root
        t = self.monotonic()
        node = self.root
        node.last_access = t
        matched = 0
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            child.last_access = t
            n = self._key_match(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                matched += n
                break
            matched += n
            node = child
            key = key[n:]
        return matched, node

    def insert(self, key: list[int], inserted_len: int) -> tuple[int, Node]:
        key = key[: len(key) // self.ps * self.ps]
        t = self.monotonic()
        node = self.root
        node.last_access = t
        total = 0
        while key and self._child_key(key) in node.children:
            node = node.children[self._child_key(key)]
            node.last_access = t
            n = self._key_match(node.key, key)
            total += n
            key = key[n:]
            if n < len(node.key):
                node = self._split(node, n)
            if total > inserted_len:
                node.hit_count += 1
        if key:
            new = self._node(key, node)
            if total + len(key) > inserted_len:
                new.hit_count += 1
            node.children[self._child_key(key)] = new
            node = new
        return total, node

    def inc_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: Node) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            node = node.parent

    def _all_nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evictable_size(self) -> int:
        return sum(len(n.key) for n in self._all_nodes() if n is not self.root and n.lock_ref == 0)

    def _priority(self, n: Node):
        return {
            "lru": (n.last_access,),
            "lfu": (n.hit_count, n.last_access),
            "fifo": (n.created,),
            "mru": (-n.last_access,),
            "filo": (-n.created,),
        }[self.policy]

    def evict(self, num_tokens: int) -> None:
        heap = [
            (self._priority(n), n.node_id, n)
            for n in self._all_nodes()
            if n is not self.root and not n.children and n.lock_ref == 0
        ]
        heapq.heapify(heap)
        done = 0
        while done < num_tokens and heap:
            _, _, x = heapq.heappop(heap)
            start, p = 0, x.parent
            while p is not None:
                start += len(p.key)
                p = p.parent
            self.evicted.append((start, x.key))
            del x.parent.children[self._child_key(x.key)]
            self.free += len(x.key) // self.ps
            done += len(x.key)
            parent = x.parent
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), parent.node_id, parent))

    # -- the allocator ----------------------------------------------------------------

    def evict_to_free_tokens(self, num_tokens: int) -> None:
        shortfall = num_tokens - self.free * self.ps
        if shortfall > 0:
            self.evict(shortfall)

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.ps)

    # -- the scheduler's calls ----------------------------------------------------------

    def checkpoint(self, req: Req, up_to: int) -> None:
        key = req.tokens[:up_to]
        aligned = len(key) // self.ps * self.ps
        prefix, _ = self.insert(key, req.inserted)
        req.inserted = max(req.inserted, aligned)
        prompt_aligned = req.prompt_len // self.ps * self.ps
        if 0 < prompt_aligned < aligned:  # split_prompt: the prompt boundary, once more
            self.insert(key[:prompt_aligned], prompt_aligned)
        if prefix > req.protected:  # our copies of what the tree already held
            self.free += (prefix - req.protected) // self.ps
        _, new_last = self.match_prefix(key[:aligned])
        req.protected = max(req.protected, aligned)
        self.dec_lock_ref(req.last)
        self.inc_lock_ref(new_last)
        req.last = new_last

    def try_admit(self, tokens: list[int], prompt_len: int) -> Req | None:
        hit, last = self.match_prefix(tokens[: prompt_len - 1])
        self.inc_lock_ref(last)
        need = self.pages(prompt_len) - hit // self.ps
        if self.free + self.evictable_size() // self.ps < need:
            self.dec_lock_ref(last)
            return None
        extend = prompt_len - hit
        self.evict_to_free_tokens(extend + (self.ps if self.ps > 1 else 0))
        self.free -= need
        return Req(tokens, prompt_len, last, hit, pages=self.pages(prompt_len), computed=hit)

    def fits_decode(self, req: Req, target: int) -> bool:
        need = self.pages(target) - req.pages
        return self.free + self.evictable_size() // self.ps >= need

    def decode(self, req: Req, target: int) -> None:
        for pos in range(req.computed, target):
            self.evict_to_free_tokens(self.ps)
            if pos == req.pages * self.ps:
                self.free -= 1
                req.pages += 1
        req.computed = max(req.computed, target)

    def release(self, req: Req) -> None:
        self.checkpoint(req, req.computed)
        self.free += req.pages - req.protected // self.ps
        self.dec_lock_ref(req.last)


def replay_model(
    model: SGLangRadixModel, requests: list[tuple[list[int], int]], concurrency: int = 1
) -> tuple[list[int], int]:
    """Replay (prompt tokens, output length) pairs; returns (hit per request, -1 if
    unschedulable; total evicted tokens)."""
    inflight: deque[Req] = deque()
    hits: list[int] = []
    token = GENERATED_TOKEN_BASE
    for prompt, output_len in requests:
        while len(inflight) >= concurrency:
            model.release(inflight.popleft())
        while True:
            req = model.try_admit(prompt, len(prompt))
            if req is not None or not inflight:
                break
            model.release(inflight.popleft())
        if req is None:
            hits.append(-1)
            continue
        hits.append(req.protected)
        req.computed = len(prompt)
        model.checkpoint(req, len(prompt))
        req.tokens = prompt + list(range(token, token + output_len))
        token += output_len
        target = len(prompt) + max(output_len - 1, 0)
        if target > len(prompt):
            while not model.fits_decode(req, target) and inflight:
                model.release(inflight.popleft())
            if model.fits_decode(req, target):
                model.decode(req, target)
        inflight.append(req)
    while inflight:
        model.release(inflight.popleft())
    return hits, sum(len(key) for _, key in model.evicted)
