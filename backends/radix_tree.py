"""The radix tree behind the `radix` backend (SGLang `RadixCache` semantics, docs/design.md §4 radix).

A node holds a run of token ids (`key`, int32) and the page ids holding their KV (`pages`,
one per `page_size` tokens); children are keyed by their first `page_size` tokens. Each
namespace (`cache_salt`, `lora_id`) has its own root, so two namespaces never share a node.

Page ids come in two forms. The radix cache keeps them as int32 arrays
(`backends/radix_pages.py`): a node's `pages` is a view of the table that computed them,
or a copy when the view would be short beside the buffer under it (`_node_pages`), so
inserting a prompt copies no page id. A subclass's cache may keep lists of ints instead
(radix-hicache): a node it inserts for a running request then *borrows* its pages: `pages`
is None and `lender` is that request's page table, whose slots `[start, end) / page_size`
are the node's pages (`pages_of`). The table holds still where it is lent (the request
only appends to it, and its own later inserts start past it), the request holds the node
locked until it ends, and when it ends the cache hands the borrowers lists of their own
(`RadixCache._settle_borrowers`).

What the tree keeps exact at every step (SGLang's `inc_lock_ref` / `dec_lock_ref`):
`lock_ref` counts the holders of a node and of every node below it on their paths;
`evictable_tokens` sums unlocked nodes, `protected_tokens` locked ones. The eviction
candidates are the unlocked leaves, kept in an `EvictionQueue` by policy key and updated
incrementally (a node enters when it becomes an unlocked leaf, leaves when it is locked,
gains a child or is evicted, and is re-keyed when touched), never rebuilt per eviction.

The order is a strategy object (`backends/radix_policy.py`): the tree tells it of the
events that can move a key (creation, split, a lookup's references) and re-keys the
candidates whose key moved; the five SGLang policies read only the node fields below.

Recency is a logical clock: every walk (match or insert) takes one tick and stamps every
node it visits with it, as SGLang stamps one `time.monotonic()` per walk; runs are
therefore reproducible. Among leaves the policy keys are unique (two nodes stamped by one
walk lie on one root path, so at most one of them is a leaf), so the order is SGLang's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from heapq import heapify, heappop, heappush
from typing import Protocol

import numpy as np

from backends.radix_policy import EvictionPolicy


class RadixNode:
    """A run of tokens and their pages (its own list, or borrowed: `lender`). Evicted
    (SGLang's `evicted`) once both `pages` and `lender` are None."""

    __slots__ = (
        "key",
        "edge",
        "pages",
        "lender",
        "children",
        "parent",
        "lock_ref",
        "last_access",
        "creation",
        "hit_count",
        "node_id",
        "start",
        "cand_key",
        "namespace",
        "policy_state",
        "page_keys",
    )

    def __init__(
        self, key: np.ndarray, pages: list[int] | None, parent: RadixNode | None, tick: int, node_id: int, edge=None
    ) -> None:
        self.key = key
        self.edge = edge  # its key in the parent's children map (its first page of tokens)
        self.pages = pages
        self.lender: list[int] | None = None  # the running request's table it borrows pages from
        self.children: dict = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = tick
        self.creation = tick
        self.hit_count = 0
        self.node_id = node_id
        self.start = 0 if parent is None else parent.start + len(parent.key)  # token offset
        self.cand_key: tuple | None = None  # its current entry in the eviction queue, if there
        self.namespace = None if parent is None else parent.namespace
        self.policy_state: object = None  # what the eviction policy keeps per node, if anything
        #: the KV-event key of each of its pages (`RadixEvents`), kept only while someone listens
        self.page_keys: list[bytes] | None = None

    def __repr__(self) -> str:
        return f"RadixNode(#{self.node_id}, start={self.start}, len={len(self.key)}, lock={self.lock_ref})"


class EvictionQueue:
    """The eviction candidates (unlocked leaves), smallest policy key first.

    A binary heap of policy keys (tuples ending with their node) with lazy deletion: a node's
    current entry is the very tuple in `node.cand_key`; re-keying pushes a new tuple and
    removing clears `cand_key`, so the old entries go stale and are skipped when they reach
    the top. Every operation is O(log n) (a sorted list would pay a Python-level insert and
    search on each of the several re-keys per request). Keys are unique (they end with the
    node id), so the pop order is exactly the sorted order of the current keys. Stale entries
    are dropped whenever they outnumber the current ones (amortised O(1) per push).
    """

    __slots__ = ("_heap", "_live")

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._live = 0  # current entries (candidates); the rest of the heap is stale

    def add(self, node: RadixNode, key: tuple) -> None:
        """`node` (not a candidate) becomes one, under `key`."""
        node.cand_key = key
        self._live += 1
        heap = self._heap
        heappush(heap, key)
        if len(heap) > 2 * self._live + 64:  # `_push`'s compaction (inlined: unlock's every new leaf comes here)
            self._compact()

    def rekey(self, node: RadixNode, key: tuple) -> None:
        """Candidate `node`'s key is now `key` (its old entry goes stale)."""
        node.cand_key = key
        self._push(key)

    def remove(self, node: RadixNode) -> None:
        """Candidate `node` is no longer one (its entry goes stale)."""
        node.cand_key = None
        self._live -= 1

    def pop(self) -> RadixNode | None:
        """Remove and return the candidate with the smallest key (None when there is none)."""
        heap = self._heap
        while heap:
            key = heappop(heap)
            node = key[-1]
            if node.cand_key is key:
                node.cand_key = None
                self._live -= 1
                return node
        return None

    def _push(self, key: tuple) -> None:
        heap = self._heap
        heappush(heap, key)
        if len(heap) > 2 * self._live + 64:
            self._compact()

    def _compact(self) -> None:
        """The heap is mostly stale: keep only the current entries."""
        heap = self._heap
        heap[:] = [k for k in heap if k[-1].cand_key is k]
        heapify(heap)

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[tuple]:
        """The current keys, next evicted first (O(n log n): observation and tests)."""
        return iter(sorted(k for k in self._heap if k[-1].cand_key is k))

    def entries(self) -> list[tuple]:
        """The raw heap, stale entries included (for the invariant check)."""
        return self._heap


class TreeEvents(Protocol):
    """What the tree reports while someone listens to the cache's KV events
    (`backends.radix.RadixEvents`)."""

    def stored(self, leaf: RadixNode, tokens: np.ndarray, pos: int, end: int) -> None:
        """`leaf`, just created, holds `tokens[pos:end]` of a sequence: key its pages."""

    def removed(self, node: RadixNode) -> None:
        """`node` was just evicted."""


class RadixTree:
    """Radix tree over token ids with page-granular keys and policy-ordered leaf eviction."""

    #: the class of its nodes (a tiered tree's nodes carry a host copy too)
    node_class: type[RadixNode] = RadixNode

    def __init__(self, page_size: int, policy: EvictionPolicy) -> None:
        self.page_size = page_size
        self.policy = policy
        self._key: Callable[[RadixNode], tuple] = policy.key  # bound once: called on every re-key
        #: bound once, called for every new node; None where the policy keeps no state of its own
        self._created: Callable[[RadixNode], None] | None = policy.created if policy.tracks_creation else None
        self._rekey_on_lookup = policy.rekey_on_lookup  # read on every match
        self.roots: dict[tuple, RadixNode] = {}
        self.candidates = EvictionQueue()
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.num_nodes = 0  # excluding roots
        self.clock = 0
        self._next_id = 0
        self.on_evict: Callable[[tuple, int, np.ndarray], None] | None = None
        #: set while a listener subscribes to the cache's KV events: the tree then keeps each
        #: node's page keys and reports every node it creates or evicts (SGLang's
        #: `record_store` / `record_remove`); None costs one test per new leaf and per eviction
        self.events: TreeEvents | None = None

    # -- small helpers ----------------------------------------------------------------

    def _child_key(self, tokens: np.ndarray, pos: int):
        """The children-map key of the run starting at `pos`: its first page of tokens.
        (`match` and `insert` compute it inline, the same way.)"""
        if self.page_size == 1:
            return tokens.item(pos)
        return tokens[pos : pos + self.page_size].tobytes()

    @staticmethod
    def _node_key(tokens: np.ndarray, pos: int, end: int) -> np.ndarray:
        """The token key of a new node for `tokens[pos:end]`.

        A read-only view of the sequence's token buffer when it covers at least half of that
        buffer (a `Sequence` only ever appends: tokens it holds are never rewritten, and the
        view keeps no more than twice its size alive), else a copy, so a short key never pins
        a long buffer. A prompt's first insert is the common case: a view, no copy.
        """
        key = tokens[pos:end]
        base = key.base
        if base is None or 2 * key.size < base.size:
            return key.copy()
        return key

    @staticmethod
    def _node_pages(pages, lo: int, hi: int, beside=None):
        """A node's pages `pages[lo:hi]` of a table or of another node's pages.

        A list slice is a copy. An int32 array's slice (the radix cache's tables,
        `backends/radix_pages.py`) is a view, kept when it covers at least half of the
        buffer under it, else copied: the rule of `_node_key`, so no node pins more than
        twice its own ids. A short view is kept too when `beside` (the new node's parent's
        pages) views the same buffer: it pins nothing the parent does not, and the parent
        outlives it (a leaf is evicted before its parent; a split parent's parts view the
        buffer as it did). That is a request's finish-time leaf below its prompt's, while
        its table did not outgrow the buffer.
        """
        part = pages[lo:hi]
        if part.__class__ is np.ndarray:
            base = part.base
            if (
                base is not None
                and 2 * part.size < base.size
                and (beside.__class__ is not np.ndarray or beside.base is not base)
            ):
                return part.copy()
        return part

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def root(self, namespace: tuple, create: bool) -> RadixNode | None:
        node = self.roots.get(namespace)
        if node is None and create:
            node = self.node_class(np.empty(0, dtype=np.int32), [], None, self.clock, -1 - len(self.roots))
            node.namespace = namespace
            node.lock_ref = 1  # a root is never evicted (SGLang: root lock_ref = 1)
            self.roots[namespace] = node
        return node

    def pages_of(self, node: RadixNode) -> list[int]:
        """The node's page ids: its own list, or its slots of the table it borrows."""
        if node.lender is None:
            return node.pages
        lo = node.start // self.page_size
        return node.lender[lo : lo + len(node.key) // self.page_size]

    def page_ids(self, node: RadixNode) -> list[int]:
        """The node's page ids as a list of ints (observation: invariants, partitions)."""
        pages = self.pages_of(node)
        return pages.tolist() if pages.__class__ is np.ndarray else list(pages)

    def path_pages(self, node: RadixNode) -> list:
        """The pages of each node on root..`node`, top first."""
        runs = []
        while node.parent is not None:
            runs.append(self.pages_of(node))
            node = node.parent
        runs.reverse()
        return runs

    def copy_path_pages(self, node: RadixNode, out: np.ndarray) -> None:
        """Write the page ids of root..`node` into `out[:(node's end) / page_size]` (each
        node's run at its own offset: no list of runs, no join)."""
        ps = self.page_size
        while node.parent is not None:
            lo = node.start // ps
            hi = lo + len(node.key) // ps
            out[lo:hi] = node.pages if node.lender is None else node.lender[lo:hi]  # `pages_of`
            node = node.parent

    def _new_node(self, key: np.ndarray, pages: list[int] | None, parent: RadixNode, tick: int, edge) -> RadixNode:
        self._next_id += 1
        self.num_nodes += 1
        node = self.node_class(key, pages, parent, tick, self._next_id, edge)
        parent.children[edge] = node
        if self._created is not None:
            self._created(node)
        return node

    def _rekey(self, node: RadixNode) -> None:
        """The policy key of candidate `node` may have moved: re-sort it."""
        self.candidates.rekey(node, self._key(node))

    def _update_leaf_status(self, node: RadixNode) -> None:
        """Make `node` a candidate iff it is an unlocked leaf (roots are always locked)."""
        if node.lock_ref == 0 and not node.children:
            if node.cand_key is None:
                self.candidates.add(node, self._key(node))
        elif node.cand_key is not None:
            self.candidates.remove(node)

    def _touch(self, node: RadixNode, tick: int) -> None:
        node.last_access = tick
        if node.cand_key is not None:  # re-key: its policy key may have changed
            self._rekey(node)

    # -- walking ----------------------------------------------------------------------

    def _first_mismatch(self, key: np.ndarray, tokens: np.ndarray, pos: int, n: int) -> int:
        """How many leading tokens of `key[:n]` equal `tokens[pos:pos+n]`, rounded down to pages."""
        head = key[:n]
        run = tokens[pos : pos + n]
        if head.tobytes() == run.tobytes():
            # the common case, a walk through a whole node: two copies and a memcmp cost
            # less than numpy's element-wise compare and argmax (a fraction of it on short keys)
            return n
        i = int((head != run).argmax())  # the first differing token (argmax stops at the first True)
        return i - i % self.page_size

    def _split(self, child: RadixNode, m: int, tick: int) -> RadixNode:
        """Split `child` after `m` tokens into new_node -> child; returns new_node.

        Token and lock totals are unchanged; the new node inherits the lock count and the
        hit count and is created now (SGLang's `_split_node`).
        """
        parent = child.parent
        lender = child.lender
        if lender is None:
            cut = m // self.page_size
            upper_pages = self._node_pages(child.pages, 0, cut)
            child.pages = self._node_pages(child.pages, cut, len(child.pages))
        else:  # both parts borrow from the same table: their starts say which slots
            upper_pages = None
        new = self._new_node(child.key[:m], upper_pages, parent, tick, child.edge)
        new.lender = lender
        new.lock_ref = child.lock_ref
        new.hit_count = child.hit_count
        new.last_access = child.last_access
        child.edge = self._child_key(child.key, m)
        child.key = child.key[m:]
        child.start += m
        child.parent = new
        new.children[child.edge] = child
        self.policy.split(new, child)
        if child.page_keys is not None:  # the pages keep their keys (SGLang's split_node_hash_value)
            cut = m // self.page_size
            new.page_keys = child.page_keys[:cut]
            child.page_keys = child.page_keys[cut:]
        if self.policy.rekey_on_split and child.cand_key is not None:
            self._rekey(child)  # it starts deeper now
        return new

    def match(self, namespace: tuple, tokens: np.ndarray, limit: int) -> tuple[RadixNode | None, int]:
        """Longest cached prefix of `tokens[:limit]` (`limit` page-aligned): (last node, tokens).
        The node's path holds the pages (`path_pages`).

        Stamps the visited nodes, splits the last one where the match ends inside it.
        """
        root = self.roots.get(namespace)
        if root is None:
            if self._rekey_on_lookup:
                self.policy.lookup(None)
            return None, 0
        self.clock = t = self.clock + 1  # `tick`
        root.last_access = t
        ps = self.page_size
        node, pos = root, 0
        while pos < limit:
            # `_child_key` and `_touch` inlined: this loop runs for every node on the path
            child = node.children.get(tokens.item(pos) if ps == 1 else tokens[pos : pos + ps].tobytes())
            if child is None:
                break
            child.last_access = t
            if child.cand_key is not None:  # re-key: its policy key may have changed
                self._rekey(child)
            key = child.key
            klen = len(key)
            if klen <= limit - pos and key.tobytes() == tokens[pos : pos + klen].tobytes():
                m = klen  # the common case, the whole node (`_first_mismatch`'s own test)
            else:
                m = self._first_mismatch(key, tokens, pos, min(klen, limit - pos))
            if m < klen:
                node = self._split(child, m, t)
                pos += m
                break
            node = child
            pos += klen
        if self._rekey_on_lookup:
            self._lookup(node)
        return node, pos

    def _lookup(self, node: RadixNode) -> None:
        """Tell the policy a lookup reused root..`node`; re-key the candidates on that path."""
        self.policy.lookup(node)
        while node.parent is not None:
            if node.cand_key is not None:
                self._rekey(node)
            node = node.parent

    def insert(
        self, node: RadixNode, pos: int, tokens: np.ndarray, end: int, pages: list[int], count_from: int, lend: bool
    ) -> tuple[RadixNode, int, list[list[int]]]:
        """Insert `tokens[pos:end]` below `node` (which ends at `pos`); `pages[i]` holds page i of
        the whole sequence. Stamps the root..node path and what it walks, splits where needed.
        A new leaf borrows its pages from `pages` when `lend` (the caller's table, which stays
        put until the caller settles it), else copies them.

        The caller holds `node` (root..node is locked by it), and the insert moves that hold
        down to the node it returns: every node the walk enters or creates gains one lock
        (SGLang's `inc_lock_ref(new)` then `dec_lock_ref(old)`, net). A new leaf is therefore
        born locked and never passes through the eviction queue on its way.

        LFU hits follow SGLang 0.5.23's `_insert_helper`: a node on the walk (or created by it)
        gains one hit iff it ends beyond `count_from`, the length this request already
        inserted (`cache_inserted_len`), so one request counts each node once however many
        times it inserts (prefill chunks, the finish-time insert).

        Returns (the node ending at `end`, tokens already in the tree, tree page runs over
        `[pos, that)`) so the caller can free its duplicates.
        """
        self.clock = t = self.clock + 1  # `tick`
        # The path SGLang's walk from the root would take down to `node`, stamped (held by
        # the caller: locked, so not in the eviction queue). The nodes ending beyond
        # `count_from` gain a hit: they are the lowest ones (a parent ends before its child).
        x = node
        while x.parent is not None and x.start + len(x.key) > count_from:
            x.last_access = t
            x.hit_count += 1
            x = x.parent
        while x is not None:
            x.last_access = t
            x = x.parent
        ps = self.page_size
        runs: list[list[int]] = []
        while pos < end:
            edge = tokens.item(pos) if ps == 1 else tokens[pos : pos + ps].tobytes()  # `_child_key`
            child = node.children.get(edge)
            if child is None:
                break
            klen = len(child.key)
            m = self._first_mismatch(child.key, tokens, pos, min(klen, end - pos))
            if m < klen:
                self._touch(child, t)  # the part below the split keeps its place in the queue
                child = self._split(child, m, t)  # copies the hit count before this walk's
            else:
                child.last_access = t  # held next: it leaves the queue if it is there
            if pos + m > count_from:
                child.hit_count += 1
            self._hold(child)
            runs.append(self.pages_of(child))
            node = child
            pos += m
        matched = pos
        if pos < end:  # the walk stopped at a missing child: `edge` is the new leaf's
            leaf_pages = None if lend else self._node_pages(pages, pos // ps, end // ps, node.pages)
            leaf = self._new_node(self._node_key(tokens, pos, end), leaf_pages, node, t, edge)
            if lend:
                leaf.lender = pages
            leaf.hit_count = 1 if end > count_from else 0
            leaf.lock_ref = 1  # held by the caller from birth; `node` is held too (no candidate)
            self.protected_tokens += end - pos
            if self.events is not None:
                self.events.stored(leaf, tokens, pos, end)
            node = leaf
        return node, matched, runs

    # -- locks ------------------------------------------------------------------------

    def _hold(self, node: RadixNode) -> None:
        """lock_ref + 1 on `node` alone: an unlocked node's tokens turn protected and it
        leaves the eviction queue."""
        if node.lock_ref == 0:
            n = len(node.key)
            self.evictable_tokens -= n
            self.protected_tokens += n
            if node.cand_key is not None:
                self.candidates.remove(node)
        node.lock_ref += 1

    def lock(self, node: RadixNode) -> None:
        """lock_ref + 1 from `node` up to the root (SGLang's `inc_lock_ref`): `_hold` on each
        node, inlined (every admission locks its path; a tiered tree holds its own way)."""
        held = 0  # tokens turned protected, settled once
        while node.parent is not None:
            if node.lock_ref == 0:
                held += len(node.key)
                if node.cand_key is not None:
                    self.candidates.remove(node)
            node.lock_ref += 1
            node = node.parent
        self.evictable_tokens -= held
        self.protected_tokens += held

    def unlock(self, node: RadixNode) -> None:
        """lock_ref - 1 from `node` up to the root (SGLang's `dec_lock_ref`)."""
        freed = 0  # tokens turned evictable, settled once
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                freed += len(node.key)
                if not node.children:  # an unlocked leaf: it was locked, so not queued yet
                    cands = self.candidates  # `cands.add(node, key)`, inlined (every release)
                    node.cand_key = key = self._key(node)
                    cands._live += 1
                    heap = cands._heap
                    heappush(heap, key)
                    if len(heap) > 2 * cands._live + 64:
                        cands._compact()
            node = node.parent
        self.evictable_tokens += freed
        self.protected_tokens -= freed

    def unlocked_on_path(self, node: RadixNode) -> int:
        """Tokens on the root..node path that are unlocked (evictable now, protected once locked)."""
        total = 0
        while node.parent is not None and node.lock_ref == 0:
            total += len(node.key)
            node = node.parent
        return total

    # -- eviction ---------------------------------------------------------------------

    def evict(self, num_tokens: int, give: Callable[[list[int]], None]) -> int:
        """Pop unlocked leaves in policy order until `num_tokens` tokens are freed (whole
        nodes, so possibly more); each one's page list is handed to `give` (the pool).
        Returns tokens freed."""
        freed = evicted = 0
        cands = self.candidates
        heap = cands._heap  # `cands.pop()` and `cands.add()`, inlined: the queue's own heap
        on_evict, events = self.on_evict, self.events
        while freed < num_tokens and heap:
            key = heappop(heap)
            node = key[-1]
            if node.cand_key is not key:
                continue  # a stale entry
            node.cand_key = None
            assert node.lock_ref == 0 and not node.children and node.lender is None, f"radix: evicting {node}"
            parent = node.parent
            del parent.children[node.edge]
            freed += len(node.key)
            evicted += 1
            give(node.pages)
            if on_evict is not None:
                on_evict(node.namespace, node.start, node.key)
            if events is not None:
                events.removed(node)
            node.pages = None
            node.parent = None
            if not parent.children and parent.lock_ref == 0 and parent.parent is not None:
                # an unlocked leaf now (it had a child: not queued before); it replaces the
                # popped node among the candidates (the count of current entries stays)
                parent.cand_key = key = self._key(parent)
                heappush(heap, key)
            else:
                cands._live -= 1
        if len(heap) > 2 * cands._live + 64:  # `add`'s compaction, once for the pushes above
            cands._compact()
        self.evictable_tokens -= freed
        self.num_nodes -= evicted
        return freed

    # -- observation ------------------------------------------------------------------

    def nodes(self) -> Iterator[RadixNode]:
        """Every non-root node, depth first."""
        stack = list(self.roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                yield child
                stack.append(child)

    def path(self, node: RadixNode) -> list[RadixNode]:
        """root-exclusive path root..node, top first."""
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out
