"""A deliberately naive model of SGLang's `RadixCache` decisions under the replay protocol.

Written from SGLang's behaviour, independently of `backends/radix.py`, and kept simple on
purpose: token runs are Python lists compared element by element (SGLang's own
`_key_match_*`), keys are re-sliced at every step, and every eviction rebuilds a heap of all
unlocked leaves found by walking the whole tree (SGLang's `evict`). Pages are only counted.

The scheduler side follows DESIGN §6 as `experiments/engine.py` runs it with one request in
flight: `match_prefix` of the first `len - 1` tokens (page-aligned) -> lock, allocate the
prompt (all or nothing; when free pages are short, ask the tree for all the new pages, as
SGLang's prefill does) -> `cache_unfinished_req` (insert the prompt, free duplicates,
re-match, move the lock) -> decode one token at a time (a page short: evict one page, as
SGLang's decode allocation does) -> the finish-time insert of prompt + output - 1 tokens
(skipped when that adds nothing, as the engine skips the commit) -> unlock, free the rest.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

GENERATED_TOKEN_BASE = 2_000_000_000


@dataclass(eq=False)
class Node:
    key: list[int]
    parent: Node | None
    node_id: int
    created: int
    last_access: int
    children: dict = field(default_factory=dict)
    lock_ref: int = 0
    hit_count: int = 0


class SGLangRadixModel:
    """SGLang `RadixCache` with a logical clock (one tick per match / insert walk)."""

    def __init__(self, page_size: int, num_pages: int, policy: str = "lru") -> None:
        self.ps = page_size
        self.free = num_pages
        self.policy = policy
        self.clock = 0
        self.ids = 0
        self.root = self._node([], None)
        self.root.lock_ref = 1
        self.evicted: list[tuple[int, list[int]]] = []  # (start token, key) per evicted node

    # -- the tree -------------------------------------------------------------------

    def _node(self, key: list[int], parent: Node | None) -> Node:
        self.ids += 1
        return Node(key, parent, self.ids, self.clock, self.clock)

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
        while i < n and a[i : i + self.ps] == b[i : i + self.ps]:
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
        self.clock += 1
        node = self.root
        node.last_access = self.clock
        matched = 0
        while key and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            child.last_access = self.clock
            n = self._key_match(child.key, key)
            if n < len(child.key):
                node = self._split(child, n)
                matched += n
                break
            matched += n
            node = child
            key = key[n:]
        return matched, node

    def insert(self, key: list[int], chunked: bool = False) -> int:
        self.clock += 1
        node = self.root
        node.last_access = self.clock
        total = 0
        while key and self._child_key(key) in node.children:
            node = node.children[self._child_key(key)]
            node.last_access = self.clock
            n = self._key_match(node.key, key)
            total += n
            key = key[n:]
            if n < len(node.key):
                node = self._split(node, n)
            if not chunked:
                node.hit_count += 1
        if key:
            new = self._node(key, node)
            if not chunked:
                new.hit_count += 1
            node.children[self._child_key(key)] = new
        return total

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
        }[self.policy] + (n.node_id,)

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

    # -- the replay protocol, one request at a time -----------------------------------

    def pages(self, tokens: int) -> int:
        return -(-tokens // self.ps)

    def serve(self, prompt: list[int], output_len: int, next_token: int) -> tuple[int, int]:
        """Serve one request alone; returns (hit tokens or -1 if unschedulable, next token id)."""
        ps = self.ps
        hit, last = self.match_prefix(prompt[: len(prompt) - 1])
        self.inc_lock_ref(last)
        need = self.pages(len(prompt)) - hit // ps
        if self.free + self.evictable_size() < need:
            self.dec_lock_ref(last)
            return -1, next_token
        if self.free < need:
            self.evict(need * ps)
        self.free -= need
        table = self.pages(len(prompt))
        protected = hit
        # cache_unfinished_req after the prefill
        aligned = len(prompt) // ps * ps
        prefix = self.insert(prompt[:aligned])
        self.free += (prefix - protected) // ps if prefix > protected else 0
        _, new_last = self.match_prefix(prompt[:aligned])
        self.dec_lock_ref(last)
        self.inc_lock_ref(new_last)
        last, protected = new_last, aligned
        tokens = prompt + list(range(next_token, next_token + output_len))
        next_token += output_len
        target = len(prompt) + max(output_len - 1, 0)
        if target > len(prompt):
            need = self.pages(target) - table
            if self.free + self.evictable_size() >= need:
                for t in range(len(prompt), target):  # decode step by step
                    if t // ps >= table:
                        if self.free == 0:
                            self.evict(ps)
                        self.free -= 1
                        table += 1
                # the finish-time insert (cache_finished_req)
                aligned = target // ps * ps
                prefix = self.insert(tokens[:aligned])
                self.free += (prefix - protected) // ps if prefix > protected else 0
                protected = max(protected, aligned)
        # release: unlock, free what the tree did not take
        self.dec_lock_ref(last)
        self.free += table - protected // ps
        return hit, next_token
