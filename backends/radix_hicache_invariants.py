"""The invariants of `radix-hicache`, O(cache): both tiers of every node, the device
closure, the device and host leaves, host pages (each once, never above capacity), the
locks and sequences as in `radix`, and (with `track_contents`) what device and host pages
hold. The shared page partition is checked by `cachelib.invariants`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from backends.radix_hicache_tree import on_device
from backends.radix_invariants import _check_queue, _check_sequences
from cachelib.errors import InvariantViolation

if TYPE_CHECKING:
    from backends.radix_hicache import HiRadixCache


def _fail(msg: str) -> None:
    raise InvariantViolation(f"radix-hicache: {msg}")


def check_hicache(cache: HiRadixCache) -> None:
    """Raise `InvariantViolation` on the first broken invariant. Read-only."""
    if cache._num_free != len(cache._free_pages()) or any(not run for run in cache._free_runs):
        _fail(f"free count {cache._num_free}, actual {len(cache._free_pages())} (or an empty run)")
    _check_tiers(cache)
    _check_sequences(cache, cache.ticket_locked_nodes())
    if cache.storage_tier is not None:
        _check_storage(cache)
    if cache._contents is not None:
        _check_contents(cache)


def _check_tiers(cache: HiRadixCache) -> None:
    tree = cache.tree
    ps = cache.page_size
    evictable = protected = nodes = 0
    candidates: set[int] = set()
    host_leaves = set()
    host_seen: list[int] = []
    for ns, root in tree.roots.items():
        if root.parent is not None or root.key.size or root.lock_ref != 1 or root.namespace != ns:
            _fail(f"root of namespace {ns} is malformed")
        if root.dev_children != sum(on_device(c) for c in root.children.values()):
            _fail(f"root of namespace {ns}: device-children count {root.dev_children} is wrong")
    for node in tree.nodes():
        nodes += 1
        parent = node.parent
        n = len(node.key)
        dev = on_device(node)
        if n == 0 or n % ps:
            _fail(f"{node}: key length {n} is not a positive multiple of {ps}")
        if node.pages is not None and node.lender is not None:
            _fail(f"{node}: both own pages and borrowed ones")
        if not dev and node.host_pages is None:
            _fail(f"{node}: on neither tier but still in the tree")
        if dev and len(tree.pages_of(node)) != n // ps:
            _fail(f"{node}: {n} tokens but device pages {tree.pages_of(node)!r:.60}")
        if node.host_pages is not None:
            if len(node.host_pages) != n // ps:
                _fail(f"{node}: {n} tokens but host pages {node.host_pages!r:.60}")
            host_seen += node.host_pages
        if dev and parent.parent is not None and not on_device(parent):
            _fail(f"{node}: on the device below a host-only parent (device nodes are closed upwards)")
        if node.edge != tree._child_key(node.key, 0) or parent.children.get(node.edge) is not node:
            _fail(f"{node}: not under its own first page in its parent's children map")
        if node.start != parent.start + len(parent.key) or node.namespace != parent.namespace:
            _fail(f"{node}: start {node.start} / namespace do not follow its parent")
        if node.lock_ref < 0 or node.host_lock < 0:
            _fail(f"{node}: negative lock")
        if node.lock_ref > 0 and parent.lock_ref <= 0:
            _fail(f"{node}: locked but its parent is not")
        if node.dev_children != sum(on_device(c) for c in node.children.values()):
            _fail(f"{node}: device-children count {node.dev_children} is wrong")
        if dev:
            if node.lock_ref:
                protected += n
            else:
                evictable += n
        is_cand = dev and node.lock_ref == 0 and node.dev_children == 0
        if is_cand != (node.cand_key is not None):
            _fail(f"{node}: device leaf={is_cand} but candidate={node.cand_key is not None}")
        if is_cand:
            if node.cand_key != tree.policy.key(node):
                _fail(f"{node}: stale candidate key")
            candidates.add(node.node_id)
        if not dev and not node.children and node.lock_ref == 0 and node.host_lock == 0:
            host_leaves.add(node.node_id)
        if node.load_pending and not (dev and node.host_pages is not None):
            _fail(f"{node}: a pending load-back into a node not on both tiers")
    if nodes != tree.num_nodes:
        _fail(f"node count {tree.num_nodes}, actual {nodes}")
    if (evictable, protected) != (tree.evictable_tokens, tree.protected_tokens):
        _fail(f"evictable/protected {tree.evictable_tokens}/{tree.protected_tokens}, actual {evictable}/{protected}")
    _check_queue(tree.candidates, candidates)
    if {x.node_id for x in tree.host_leaves} != host_leaves:
        _fail("the host leaves differ from the host-only, childless, unlocked nodes")
    # host pages: each once, in range, the rest free; never above capacity
    everything = host_seen + tree.host_free
    if len(set(everything)) != len(everything) or sorted(everything) != list(range(tree.host_pages)):
        _fail(
            f"host pages: {len(host_seen)} held + {len(tree.host_free)} free are not the {tree.host_pages} pages once each"
        )
    if len(host_seen) * ps > cache.host_tier.capacity_tokens:
        _fail(f"host tier holds {len(host_seen) * ps} tokens, above its capacity {cache.host_tier.capacity_tokens}")
    for nid, x in tree.dups.items():
        if x.node_id != nid or x.parent is None:
            _fail(f"duplicate tracking holds a removed or misfiled node #{nid}")


def _check_contents(cache: HiRadixCache) -> None:
    """Device pages of tree nodes and live tables, and host copies, hold their tokens."""
    tree = cache.tree
    ps = cache.page_size
    for node in tree.nodes():
        if on_device(node) and not np.array_equal(cache._contents[cache._slots(tree.pages_of(node))], node.key):
            _fail(f"{node}: its device pages hold other tokens than its key")
        if node.host_pages is not None and not np.array_equal(
            cache._host_contents[cache._slots(node.host_pages)], node.key
        ):
            _fail(f"{node}: its host copy holds other tokens than its key")
    for rid, held in cache._live.items():
        seq = held.seq
        t = np.arange(seq.num_computed)
        pages = np.asarray(seq.page_table, dtype=np.int64)[t // ps] if t.size else t
        if not np.array_equal(cache._contents[pages * ps + t % ps], seq.tokens[: seq.num_computed]):
            _fail(f"{rid}: its table points at pages holding other tokens")


def _check_storage(cache: HiRadixCache) -> None:
    """The storage tier within its capacity with its counts adding up, and every node's page
    keys the chain of its tokens from its parent's (what a prefetch looks up)."""
    storage = cache.storage_tier
    if cache.tree.storage is not storage:
        _fail("the tree and the cache name different storage tiers")
    used = storage.used_tokens
    if storage.capacity_tokens and used > storage.capacity_tokens:
        _fail(f"storage holds {used} tokens, above its capacity {storage.capacity_tokens}")
    if len(storage.keys()) != storage.written_pages - storage.evicted_pages:
        _fail(
            f"storage holds {len(storage.keys())} pages, but {storage.written_pages} were written "
            f"and {storage.evicted_pages} evicted"
        )
    tree = cache.tree
    hasher = tree._hasher
    ps = cache.page_size
    for node in tree.nodes():
        if node.page_keys is None:
            continue
        parent = node.parent
        if parent.parent is not None and parent.page_keys is None:
            _fail(f"{node} has page keys and its parent none")
        prior = parent.page_keys[-1] if parent.parent is not None else None
        extra = tree._extra_of(node.namespace)
        if node.start:
            extra = type(extra)(lora_id=extra.lora_id)
        if hasher.hash_blocks(node.key, extra, 0, len(node.key) // ps, prior) != node.page_keys:
            _fail(f"{node}: its page keys are not the chain of its tokens")
