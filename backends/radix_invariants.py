"""The radix backend's own invariants, O(cache): the tree's structure, locks, sizes and
candidates, each sequence's path, and (with `track_contents`) what its pages hold. The page
partition (free / cached / pinned, every page once) is checked for every backend by
`cachelib.invariants`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cachelib.errors import InvariantViolation
from cachelib.types import ExtraKeys

if TYPE_CHECKING:
    from backends.radix import RadixCache


def _fail(msg: str) -> None:
    raise InvariantViolation(f"radix: {msg}")


def check_radix(cache: RadixCache) -> None:
    """Raise `InvariantViolation` on the first broken invariant. Read-only."""
    if cache._num_free != len(cache._free_pages()) or cache._num_free != cache._pool.num_free:
        _fail(f"free count {cache._num_free}, pool {cache._pool.num_free}, actual {len(cache._free_pages())}")
    _check_tree(cache)
    _check_sequences(cache)
    if cache.tree.events is not None:
        _check_page_keys(cache)
    if cache._contents is not None:
        _check_contents(cache, cache._contents)


def _check_tree(cache: RadixCache) -> None:
    """Keys, children maps, pages, lock refs, the evictable/protected sizes, the candidates."""
    tree = cache.tree
    ps = cache.page_size
    evictable = protected = nodes = 0
    candidates = set()
    for ns, root in tree.roots.items():
        if root.parent is not None or root.key.size or root.lock_ref != 1 or root.namespace != ns:
            _fail(f"root of namespace {ns} is malformed")
    for node in tree.nodes():
        nodes += 1
        parent = node.parent
        n = len(node.key)
        if n == 0 or n % ps:
            _fail(f"{node}: key length {n} is not a positive multiple of {ps}")
        if (node.pages is None) == (node.lender is None):
            _fail(f"{node}: pages {node.pages!r:.40} and lender {node.lender!r:.40}: exactly one must be set")
        if len(tree.pages_of(node)) != n // ps:
            _fail(f"{node}: {n} tokens but pages {tree.pages_of(node)!r:.60}")
        if node.edge != tree._child_key(node.key, 0) or parent.children.get(node.edge) is not node:
            _fail(f"{node}: not under its own first page in its parent's children map")
        if node.start != parent.start + len(parent.key) or node.namespace != parent.namespace:
            _fail(f"{node}: start {node.start} / namespace do not follow its parent")
        if node.lock_ref < 0:
            _fail(f"{node}: negative lock_ref")
        kept = cache._match_pages.get(node)
        if kept is not None:
            ids = [p for x in tree.path(node) for p in tree.page_ids(x)]
            if list(kept) != ids:
                _fail(f"{node}: kept match pages {kept!r:.60} are not its path's pages {ids!r:.60}")
        if node.lock_ref > 0 and parent.lock_ref <= 0:
            _fail(f"{node}: locked but its parent is not")
        if node.lock_ref:
            protected += n
        else:
            evictable += n
        is_cand = node.lock_ref == 0 and not node.children
        if is_cand != (node.cand_key is not None):
            _fail(f"{node}: unlocked leaf={is_cand} but candidate={node.cand_key is not None}")
        if is_cand:
            if node.cand_key != tree.policy.key(node):
                _fail(f"{node}: stale candidate key")
            candidates.add(node.node_id)
    if nodes != tree.num_nodes:
        _fail(f"node count {tree.num_nodes}, actual {nodes}")
    if (evictable, protected) != (tree.evictable_tokens, tree.protected_tokens):
        _fail(f"evictable/protected {tree.evictable_tokens}/{tree.protected_tokens}, actual {evictable}/{protected}")
    _check_queue(tree.candidates, candidates)


def _check_queue(queue, candidates: set[int]) -> None:
    """The eviction queue: a heap whose current entries (each node's `cand_key`, by identity)
    are exactly the unlocked leaves, once each, and number what it counts."""
    heap = queue.entries()
    for i in range(1, len(heap)):
        if heap[i] < heap[(i - 1) // 2]:
            _fail(f"eviction queue is not a heap at entry {i}")
    current = [k for k in heap if k[-1].cand_key is k]
    ids = [k[-1].node_id for k in current]
    if len(ids) != len(set(ids)) or len(ids) != len(queue):
        _fail(f"eviction queue: {len(ids)} current entries for {len(set(ids))} nodes, counted {len(queue)}")
    if set(ids) != candidates:
        _fail("candidate list differs from the unlocked leaves")


def _check_sequences(cache: RadixCache, held_nodes: list | tuple = ()) -> None:
    """Each live sequence's lock path, table and protected length; lock refs = holders
    (`held_nodes`: nodes whose path something else locks, a backup in flight)."""
    tree = cache.tree
    ps = cache.page_size
    expected_locks: dict[int, int] = {}
    for node in held_nodes:
        for x in tree.path(node):
            expected_locks[x.node_id] = expected_locks.get(x.node_id, 0) + 1
    lent: set[int] = set()  # nodes borrowing from the table of a live sequence whose path they are on
    for rid, held in cache._live.items():
        seq = held.seq
        table = seq.page_table
        if seq.num_computed > len(table) * ps:
            _fail(f"{rid}: computed {seq.num_computed} beyond its {len(table)} pages")
        if held.protected % ps or held.protected > seq.num_computed:
            _fail(f"{rid}: protected length {held.protected} is unaligned or beyond what it computed")
        node = held.node
        if node.pages is None and node.lender is None:
            _fail(f"{rid}: holds an evicted node")
        path = tree.path(node)
        lent.update(x.node_id for x in path if x.lender is table)
        end = node.start + len(node.key)
        if end != held.protected:
            _fail(f"{rid}: its node ends at {end}, protected length is {held.protected}")
        tree_pages = [p for x in path for p in tree.page_ids(x)]
        if list(table[: len(tree_pages)]) != tree_pages:
            _fail(f"{rid}: table does not point at the tree's pages of its prefix")
        if path and not np.array_equal(np.concatenate([x.key for x in path]), seq.tokens[:end]):
            _fail(f"{rid}: its locked path holds other tokens than its prefix")
        if path and path[0].namespace != seq.extra.namespace:
            _fail(f"{rid}: locked a node of another namespace")
        for x in path:
            expected_locks[x.node_id] = expected_locks.get(x.node_id, 0) + 1
    for node in tree.nodes():
        if node.lock_ref != expected_locks.get(node.node_id, 0):
            _fail(f"{node}: lock_ref {node.lock_ref}, held by {expected_locks.get(node.node_id, 0)} sequences")
        if node.lender is not None and node.node_id not in lent:
            _fail(f"{node}: borrows pages from a table that is no live sequence's on its path")


def _check_contents(cache: RadixCache, contents: np.ndarray) -> None:
    """Tree entries and tables point only at pages holding their tokens (`track_contents`)."""
    tree = cache.tree
    ps = cache.page_size
    for node in tree.nodes():
        slots = (np.asarray(tree.pages_of(node), dtype=np.int64)[:, None] * ps + np.arange(ps)).reshape(-1)
        if not np.array_equal(contents[slots], node.key):
            _fail(f"{node}: its pages hold other tokens than its key")
    for rid, held in cache._live.items():
        seq = held.seq
        t = np.arange(seq.num_computed)
        pages = np.asarray(seq.page_table, dtype=np.int64)[t // ps] if t.size else t
        if not np.array_equal(contents[pages * ps + t % ps], seq.tokens[: seq.num_computed]):
            _fail(f"{rid}: its table points at pages holding other tokens")


def _check_page_keys(cache: RadixCache) -> None:
    """While someone listens to KV events: every node's page keys are the cache's
    `page_keys()` of the tokens on its root path, under its namespace (what its
    `PagesStored` said and its `PagesRemoved` will say)."""
    tree = cache.tree
    scheme = cache.page_keys()
    ps = cache.page_size
    for node in tree.nodes():
        path = tree.path(node)
        tokens = np.concatenate([x.key for x in path])
        salt, lora = node.namespace
        want = scheme.keys(tokens, ExtraKeys(cache_salt=salt, lora_id=lora))[node.start // ps :]
        if node.page_keys != want:
            _fail(f"{node}: page keys are not the chained keys of its prefix")
