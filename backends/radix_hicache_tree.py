"""The radix tree with a host tier behind `radix-hicache` (SGLang 0.5.23 HiCache).

The tree of `backends/radix_tree.py`, whose nodes also carry a host copy: a node is on
the device (`pages` or `lender` set), on the host (`host_pages` set), or both; a node on
neither is removed from the tree. What SGLang 0.5.23 keeps in
`mem_cache/unified_cache/unified_tree_core.py` (`UnifiedTreeCore`, FULL component) and
`unified_radix_cache.py` (`UnifiedRadixCache`), and how it is kept here:

- Device nodes are closed upwards (a device node's parent is on the device): eviction
  only takes *device leaves* (`_is_device_leaf`: on the device, unlocked, no child on
  the device), and a load-back or an insert puts a whole path back. `dev_children`
  counts a node's children on the device, so a device leaf is known in O(1); the
  candidates queue of the base tree holds exactly the device leaves.
- Host leaves (`_is_host_leaf`: host copy, not on the device, no children, unlocked on
  both tiers) are kept in a set, and a host eviction orders them on demand by the
  eviction policy's key, as `FullComponent.drive_host_eviction` builds its heap.
- Hits are counted at insert (`_inc_hit_count_and_check`): each node the insert walks
  past or creates that ends beyond what the request inserted before gains one hit if it
  is on the device, except under `write_back` (never counted there); a node that reaches
  the threshold (1 `write_through`, 2 `write_through_selective`) without a host copy is
  backed up with every ancestor lacking one, root first (`_build_backup_kv_action`),
  stopping at the first that the host cannot take even after evicting for it
  (`_execute_and_commit_kv_backup` / `_execute_kv_backup`).
- Device eviction (`evict`): a device leaf with a host copy loses only its device copy
  (`_demote`); without one, under `write_back` it is backed up first (then demoted) or,
  if the host cannot take it, dropped with its host-only subtree (`drop_subtree_no_host`;
  declined while a node below is locked, or a storage write reads its host copy: see `evict`);
  otherwise it is deleted (`_delete_unbacked_device_leaf`).
- Host eviction (`evict_host`, `drive_host_eviction`): under `write_back` it first frees
  the host copies of nodes that are also on the device, in the order they became such
  duplicates (`_reclaim_full_host_duplicates`: a dict in insertion order, entries removed
  lazily, a first pass sparing device leaves), then host leaves in policy order.
- An insert walking over a host-only node (a host hit the request recomputed) puts it
  back on the device with the request's own pages (`_unevict_node_on_insert`).
- Storage (L3, optional: `storage`, a `cachelib.tiers.StorageTier`): every host backup is
  written on to storage once acknowledged (`_finish_write_through_ack` ->
  `write_backup_storage`, under every write policy: write_back's synchronous backup at
  eviction goes through the same ack), page by page under the node's chained page keys
  (`UnifiedTreeNode.hash_value`, here `page_keys`, computed from the parent's last key as
  `compute_node_hash_values` chains them). `prefetch` is the storage read
  (`prefetch_from_storage` -> the controller's hit query -> `_try_alloc_storage_hit` ->
  `_handle_prefetch_result` -> `insert_host`): the pages after the match, if at least
  the prefetch threshold, are looked up; a hit of at least the threshold gets host pages
  (evicting host copies for the whole hit when short, then taking what is free if that
  is still at least the threshold) and becomes a host-only node under the match's
  anchor, which the load-back then brings to the device.
- Transfers complete at once (the replay protocol's GPU-optimistic timing): a backup is
  acknowledged inside the call that issues it; a load-back is acknowledged at the next
  `finish_loads` (the cache calls it where SGLang's scheduler would poll, after the
  prefill's insert), which is when loaded nodes join the duplicates under `write_back`.

Recency is the base tree's logical clock (one tick per walk), which orders every pair
of candidates as SGLang's float counter does (two nodes one walk stamps lie on one root
path, and neither tier holds two leaves of one path).
"""

from __future__ import annotations

from collections.abc import Callable
from heapq import heapify, heappop, heappush
from typing import Protocol

import numpy as np

from backends.radix_policy import EvictionPolicy
from backends.radix_tree import RadixNode, RadixTree
from cachelib.hashing import BlockHash, BlockHasher
from cachelib.kv_events import DEVICE_MEDIUM, SGLANG_CPU_MEDIUM, PagesRemoved, PagesStored
from cachelib.tiers import StorageTier
from cachelib.types import ExtraKeys

#: SGLang's write policies (`--hicache-write-policy`) and their hit-count thresholds
#: (`init_hicache`: 1 for write_through, else 2; write_back never backs up at insert)
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

#: fewer host tokens than this are recomputed rather than loaded (`load_back_threshold`)
LOAD_BACK_THRESHOLD = 10


class TieredNode(RadixNode):
    """A radix node with a host copy (`host_pages`: host page ids, or None), the count of
    its children on the device, its host lock (`host_lock_ref`) and whether a load-back
    into it is still unacknowledged (`load_back_pending_id`)."""

    __slots__ = ("host_pages", "dev_children", "host_lock", "load_pending")

    def __init__(self, key, pages, parent, tick, node_id, edge=None) -> None:
        super().__init__(key, pages, parent, tick, node_id, edge)
        self.host_pages: list[int] | None = None
        self.dev_children = 0
        self.host_lock = 0
        self.load_pending = False


def on_device(node: RadixNode) -> bool:
    """Whether the node's KV is on the device (its own pages, or borrowed ones)."""
    return node.pages is not None or node.lender is not None


class TierMover(Protocol):
    """Where the tree's transfers land: the cache's page pool and its content record."""

    def give(self, pages: list[int]) -> None:
        """Device pages back to the pool."""

    def copied_to_host(self, device_pages: list[int], host_pages: list[int]) -> None:
        """A backup wrote `device_pages` into `host_pages`."""

    def demoted(self, device_pages: list[int], host_pages: list[int]) -> None:
        """A node's GPU copy in `device_pages` is about to be freed; its host copy stays."""

    def copied_to_device(self, host_pages: list[int], device_pages: list[int]) -> None:
        """A load-back wrote `host_pages` into `device_pages`."""

    def backup_issued(self, node: TieredNode | None, tokens: int, *, blocking: bool) -> None:
        """A timed backup of `node` (`tokens` tokens) started (`hold_backups`): a
        non-blocking one keeps `node` locked until the cache is told the copy completed."""

    def storage_write_issued(self, node: TieredNode, tokens: int) -> None:
        """A timed storage write of `tokens` new tokens of `node`'s host copy was decided."""

    def await_storage_writes(self, nodes: list[TieredNode]) -> None:
        """The storage writes in flight from `nodes`' host copies complete now (their host
        locks released; their tickets, when the engine names them, are already done)."""

    def stored_from_host(self, host_pages: list[int], keys: list[BlockHash]) -> None:
        """A demoted node's host copy is in the executor now: its pages under their storage keys."""

    def prefetched(self, keys: list[BlockHash], host_pages: list[int], tokens: np.ndarray) -> None:
        """A prefetch read the stored pages of `keys` (holding `tokens`) into `host_pages`."""


class TierTraffic:
    """What moved between the tiers, in tokens (the cache turns them into bytes)."""

    __slots__ = (
        "backed_up",
        "loaded",
        "host_evicted",
        "host_reclaimed",
        "demoted",
        "deleted",
        "dropped",
        "stored",
        "prefetched",
    )

    def __init__(self) -> None:
        self.backed_up = 0  # GPU -> host
        self.loaded = 0  # host -> GPU
        self.stored = 0  # host -> storage (pages newly written; a page already stored moves nothing)
        self.prefetched = 0  # storage -> host
        self.host_evicted = 0  # host copies evicted with their node (host leaves)
        self.host_reclaimed = 0  # host copies freed of nodes also on the device (write_back)
        self.demoted = 0  # device copies freed, host copy kept
        self.deleted = 0  # device copies freed with no host copy (the node is gone)
        self.dropped = 0  # host-only descendants dropped with an unbackable node (write_back)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class HiCacheEvents:
    """The KV events of SGLang 0.5.23's HiCache tree (`UnifiedTreeCore`, `kv_events.
    record_store` / `record_remove`, one key per page): a node stored on the GPU when it is
    created, put back at an insert or loaded back; removed from the GPU when its device
    copy is freed (demoted or deleted); stored on the host (`CPU_PINNED`) when its backup is
    acknowledged or a storage prefetch inserts it; removed from the host when its host copy
    is evicted or reclaimed, or dropped with an unbackable node (write_back). Keys are the
    node's page keys (`HiCacheTree.node_keys`, those of `RadixEvents`)."""

    __slots__ = ("tree", "emit")

    def __init__(self, tree: HiCacheTree, emit) -> None:
        self.tree = tree
        self.emit = emit  # the cache's listener call

    def stored(self, x: TieredNode, medium: str) -> None:
        parent = x.parent
        prior = self.tree.node_keys(parent)[-1] if parent.parent is not None else None
        self.emit(PagesStored(self.tree.node_keys(x), prior, medium))

    def removed(self, x: TieredNode, medium: str) -> None:
        self.emit(PagesRemoved(self.tree.node_keys(x), medium))


class HiCacheTree(RadixTree):
    """A radix tree over two tiers: device pages (the cache's pool) and `host_pages` host pages."""

    node_class = TieredNode

    def __init__(
        self,
        page_size: int,
        policy: EvictionPolicy,
        write_policy: str,
        host_pages: int,
        storage: StorageTier | None = None,
        prefetch_threshold: int = 256,
    ) -> None:
        super().__init__(page_size, policy)
        self.storage = storage
        #: SGLang's `max(prefetch_threshold, page_size)` (`attach_storage_backend`)
        self.prefetch_threshold = max(prefetch_threshold, page_size)
        self._hasher = BlockHasher(page_size)  # the keys `PageKeys(page_size, namespace_only=True)` names
        self._extra: dict[tuple, ExtraKeys] = {}
        self.write_policy = write_policy
        self.write_back = write_policy == "write_back"
        self.threshold = 1 if write_policy == "write_through" else 2
        self.host_pages = host_pages
        self.host_free: list[int] = list(range(host_pages - 1, -1, -1))  # popped from the end: 0 first
        self.host_leaves: set[TieredNode] = set()
        #: nodes on both tiers, in the order they became so (SGLang's `full_host_duplicates`;
        #: entries go stale and are swept lazily, as there); kept under write_back only,
        #: the only policy that reads it
        self.dups: dict[int, TieredNode] = {}
        self.pending_loads: list[TieredNode] = []  # anchors of unacknowledged load-backs
        self.traffic = TierTraffic()
        self.mover: TierMover | None = None  # set by the cache
        #: a serving clock times the transfers: a write-through backup keeps its node locked
        #: until the cache is told it completed (`time_transfers`); else it completes at once
        self.hold_backups = False
        #: set while someone listens to the cache's KV events: told of every node stored on
        #: or removed from a tier (`HiCacheEvents`)
        self.hi_events: HiCacheEvents | None = None

    # -- status ------------------------------------------------------------------------

    @property
    def host_used_tokens(self) -> int:
        return (self.host_pages - len(self.host_free)) * self.page_size

    def _refresh(self, x: TieredNode) -> None:
        """Recompute whether `x` is a device leaf (a candidate) and whether it is a host leaf."""
        if x.parent is None:
            return  # a root (or a node already removed)
        dev = x.pages is not None or x.lender is not None
        if dev and x.lock_ref == 0 and x.dev_children == 0:
            if x.cand_key is None:
                self.candidates.add(x, self._key(x))
        elif x.cand_key is not None:
            self.candidates.remove(x)
        if not dev and x.host_pages is not None and not x.children and x.lock_ref == 0 and x.host_lock == 0:
            self.host_leaves.add(x)
        else:
            self.host_leaves.discard(x)

    _update_leaf_status = _refresh

    def _track_dup(self, x: TieredNode) -> None:
        """SGLang's `_update_duplicate_tracking` (write_back only: nothing else reads it)."""
        if not self.write_back:
            return
        if on_device(x) and x.host_pages is not None and not x.load_pending:
            self.dups.setdefault(x.node_id, x)
        else:
            self.dups.pop(x.node_id, None)

    # -- locks: only device nodes move between evictable and protected ---------------

    def _hold(self, node: RadixNode) -> None:
        if node.lock_ref == 0:
            if node.pages is not None or node.lender is not None:
                n = len(node.key)
                self.evictable_tokens -= n
                self.protected_tokens += n
            if node.cand_key is not None:
                self.candidates.remove(node)
            self.host_leaves.discard(node)
        node.lock_ref += 1

    def lock(self, node: RadixNode) -> None:
        # `RadixTree.lock` inlines the one-tier `_hold`: this tree's own holds tier by tier
        while node.parent is not None:
            self._hold(node)
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                if node.pages is not None or node.lender is not None:
                    n = len(node.key)
                    self.evictable_tokens += n
                    self.protected_tokens -= n
                self._refresh(node)
            node = node.parent

    # -- device residency --------------------------------------------------------------

    def _to_device(self, x: TieredNode) -> None:
        """`x` (pages just set) is on the device now."""
        n = len(x.key)
        if x.lock_ref:
            self.protected_tokens += n
        else:
            self.evictable_tokens += n
        parent = x.parent
        parent.dev_children += 1
        self._refresh(parent)
        self._refresh(x)

    def _off_device(self, x: TieredNode) -> None:
        """`x` (unlocked, pages just cleared) is off the device now; the node stays."""
        self.evictable_tokens -= len(x.key)
        parent = x.parent
        parent.dev_children -= 1
        self._refresh(parent)
        self._refresh(x)

    def _remove(self, x: TieredNode) -> None:
        """Take `x` (no children) out of the tree, and out of both tiers' leaf sets."""
        parent = x.parent
        del parent.children[x.edge]
        self.num_nodes -= 1
        self.dups.pop(x.node_id, None)
        self.host_leaves.discard(x)
        if x.cand_key is not None:
            # a device leaf being evicted can be queued again while it is handled: write_back's
            # backup of it evicts its host-only children, and `_refresh` then finds it a device
            # leaf; left queued once removed, the next eviction would pop a node with no pages
            self.candidates.remove(x)
        if self.on_evict is not None:
            self.on_evict(x.namespace, x.start, x.key)
        x.parent = None
        self._refresh(parent)

    # -- walking -------------------------------------------------------------------------

    def _split(self, child: RadixNode, m: int, tick: int) -> RadixNode:
        """Split `child` after `m` tokens into new -> child; both tiers' pages are cut, the
        new node takes the lock, hit count, host lock, pending load and creation time
        (`UnifiedTreeCore._split_node` + `FullComponent.redistribute_on_node_split`)."""
        ps = self.page_size
        cut = m // ps
        parent = child.parent
        dev = on_device(child)
        lender = child.lender
        upper_pages = None
        if dev and lender is None:
            upper_pages = child.pages[:cut]
            child.pages = child.pages[cut:]
        new = self._new_node(child.key[:m], upper_pages, parent, tick, child.edge)
        new.lender = lender
        if child.host_pages is not None:
            new.host_pages = child.host_pages[:cut]
            child.host_pages = child.host_pages[cut:]
        if child.page_keys is not None:  # the pages keep their keys (`split_node_hash_value`)
            new.page_keys = child.page_keys[:cut]
            child.page_keys = child.page_keys[cut:]
        new.lock_ref = child.lock_ref
        new.hit_count = child.hit_count
        new.last_access = child.last_access
        new.creation = child.creation
        new.host_lock = child.host_lock
        new.load_pending = child.load_pending
        new.dev_children = 1 if dev else 0
        child.edge = self._child_key(child.key, m)
        child.key = child.key[m:]
        child.start += m
        child.parent = new
        new.children[child.edge] = child
        self.policy.split(new, child)
        if self.policy.rekey_on_split and child.cand_key is not None:
            self._rekey(child)
        self._track_dup(new)
        return new

    def match_tiers(
        self, namespace: tuple, tokens: np.ndarray, limit: int
    ) -> tuple[RadixNode | None, int, list[list[int]]]:
        """Longest prefix of `tokens[:limit]` on either tier (`_match_prefix_helper`): the
        deepest device node, its depth, and the device page runs. The walk goes on through
        host-only nodes, splits the last node where the match ends, and stamps the path."""
        root = self.roots.get(namespace)
        if root is None:
            return None, 0, []
        t = self.tick()
        root.last_access = t
        node, pos, runs = root, 0, []
        dev_node, dev_pos = root, 0
        while pos < limit:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            self._touch(child, t)
            klen = len(child.key)
            m = self._first_mismatch(child.key, tokens, pos, min(klen, limit - pos))
            split = m < klen
            if split:
                child = self._split(child, m, t)
            node = child
            pos += m
            if on_device(child):
                runs.append(self.pages_of(child))
                dev_node, dev_pos = child, pos
            if split:
                break
        return dev_node, dev_pos, runs

    def host_continuation(self, node: RadixNode, tokens: np.ndarray, limit: int) -> list[TieredNode]:
        """The host-only nodes below device node `node` along `tokens[:limit]`, top first
        (what `match_tiers` matched past the device: `best_match_node`'s segment)."""
        out: list[TieredNode] = []
        pos = node.start + len(node.key)
        while pos < limit:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None or on_device(child):
                break
            end = pos + len(child.key)
            if end > limit or child.key.tobytes() != tokens[pos:end].tobytes():
                break
            out.append(child)
            node, pos = child, end
        return out

    def insert(
        self, node: RadixNode, pos: int, tokens: np.ndarray, end: int, pages: list[int], count_from: int, lend: bool
    ) -> tuple[RadixNode, int, list[tuple[list[int], bool]]]:
        """`RadixTree.insert` over two tiers (`begin_insert` .. `_insert_tail_step`): the
        same walk, stamps, splits and lock move, with SGLang HiCache's hit counts and
        backups, and a host-only node on the way put back on the device with the request's
        pages (`lend`: borrowed from `pages`). Returns (the node ending at `end`, tokens
        already in the tree, per walked node its page run and whether it was adopted from
        the request rather than a duplicate of it)."""
        t = self.tick()
        x = node
        path = []
        while x is not None:  # root..node: held by the caller, walked from the root
            x.last_access = t
            if x.parent is not None:
                path.append(x)
            x = x.parent
        for x in reversed(path):
            if x.start + len(x.key) > count_from and self._count_hit(x):
                self._backup_chain(x)
        ps = self.page_size
        runs: list[tuple[list[int], bool]] = []
        while pos < end:
            edge = self._child_key(tokens, pos)
            child = node.children.get(edge)
            if child is None:
                break
            klen = len(child.key)
            m = self._first_mismatch(child.key, tokens, pos, min(klen, end - pos))
            if m < klen:
                self._touch(child, t)
                child = self._split(child, m, t)
            else:
                child.last_access = t
            self._hold(child)
            adopted = not on_device(child)
            if adopted:  # _unevict_node_on_insert: the request's fresh KV becomes the node's
                if lend:
                    child.lender = pages
                else:
                    child.pages = pages[pos // ps : (pos + m) // ps]
                self._to_device(child)
                self._track_dup(child)
                if self.hi_events is not None:
                    self.hi_events.stored(child, DEVICE_MEDIUM)
            if pos + m > count_from and self._count_hit(child):
                self._backup_chain(child)
            runs.append((self.pages_of(child), adopted))
            node = child
            pos += m
        matched = pos
        if pos < end:  # the walk stopped at a missing child: `edge` is the new leaf's
            leaf_pages = None if lend else pages[pos // ps : end // ps]
            leaf = self._new_node(self._node_key(tokens, pos, end), leaf_pages, node, t, edge)
            if lend:
                leaf.lender = pages
            leaf.lock_ref = 1  # held by the caller from birth
            self.protected_tokens += end - pos
            node.dev_children += 1
            node = leaf
            if self.hi_events is not None:
                self.hi_events.stored(leaf, DEVICE_MEDIUM)
            if end > count_from and self._count_hit(leaf):
                self._backup_chain(leaf)
        return node, matched, runs

    # -- HiCache decisions -------------------------------------------------------------

    def _count_hit(self, x: TieredNode) -> bool:
        """`_inc_hit_count_and_check`: one hit for a device node (none under write_back);
        True when it should be backed up now."""
        if not on_device(x) or self.write_back:
            return False
        x.hit_count += 1
        return x.host_pages is None and x.hit_count >= self.threshold

    def _backup_chain(self, x: TieredNode) -> None:
        """Back up `x` and every ancestor lacking a host copy, root first, stopping at the
        first the host cannot take (`_execute_and_commit_kv_backup`)."""
        chain = [x]
        a = x.parent
        while a.parent is not None and a.host_pages is None:
            chain.append(a)
            a = a.parent
        for y in reversed(chain):
            if y.host_pages is None:
                if not self._backup(y):
                    return
                if self.hold_backups:
                    # `_execute_and_commit_kv_backup`: a write-through backup locks its node
                    # (`inc_lock_ref`) until `writing_check` sees its copy done
                    self.lock(y)
                    self.mover.backup_issued(y, len(y.key), blocking=False)

    def _backup(self, y: TieredNode) -> bool:
        """Copy device node `y` to the host, evicting host copies for the shortfall
        (`_execute_kv_backup`); False (nothing changed but what was evicted) if short."""
        ps = self.page_size
        need = len(y.key) // ps
        free = len(self.host_free)
        if free < need:
            shortfall = (need - free) * ps
            if self.evict_host(shortfall) < shortfall:
                return False
        host = self.host_free[-need:]
        del self.host_free[-need:]
        y.host_pages = host
        self.traffic.backed_up += len(y.key)
        self.mover.copied_to_host(self.pages_of(y), host)
        self._track_dup(y)  # acknowledged at once
        if self.hi_events is not None:  # `finish_write_through`
            self.hi_events.stored(y, SGLANG_CPU_MEDIUM)
        if self.storage is not None:  # the ack's `write_backup_storage`, completed at once
            stored = self.storage.write(self.node_keys(y)) * ps
            self.traffic.stored += stored
            if self.hold_backups and stored:
                # serving: the write takes time on the host -> storage stream, the host copy
                # locked meanwhile (`write_backup_storage`: `inc_host_lock_ref` in `ongoing_backup`)
                self.mover.storage_write_issued(y, stored)
        return True

    def evict(self, num_tokens: int, give: Callable[[list[int]], None]) -> int:
        """Free at least `num_tokens` device tokens from device leaves in policy order
        (`_evict_components`); returns the device tokens freed.

        Under write_back a leaf the host cannot take and whose drop is declined stays on the
        device, and the walk goes on (SGLang: "subtree drop declined (node locked); ...
        stays device-resident until host space frees"). Past what SGLang 0.5.23 does: when
        the walk runs out of leaves short of `num_tokens`, SGLang's allocation after it stops
        the server ("Prefill out of memory"); a drop is declined only while a storage write
        still reads a host copy below (`ongoing_backup`'s host lock: nothing else holds a
        host-only node between calls), so the model waits for those writes, as write_back
        waits for its own backups, and evicts the passed-by leaves then, oldest first."""
        freed = 0
        cands = self.candidates
        passed: list[TieredNode] = []  # declined in this walk, in the order met
        stuck: list[TieredNode] = []  # declined again after the wait (not expected)
        while freed < num_tokens:
            x = cands.pop()
            if x is None:
                if not passed:
                    break
                x = passed.pop(0)
                self.mover.await_storage_writes(self._host_locked_below(x))
                if self._evict_write_back(x, give):
                    freed += len(x.key)
                else:
                    stuck.append(x)
                continue
            assert x.lock_ref == 0 and x.dev_children == 0 and x.lender is None, f"radix-hicache: evicting {x}"
            n = len(x.key)
            if x.host_pages is not None:
                self._demote(x, give)
            elif not self.write_back:
                self._delete_device_leaf(x, give)
            elif not self._evict_write_back(x, give):
                # the backup's host eviction may have queued it anew: out of this walk
                if x.cand_key is not None:
                    cands.remove(x)
                passed.append(x)
                continue
            freed += n
        for x in passed + stuck:
            self._refresh(x)
        return freed

    def _evict_write_back(self, x: TieredNode, give: Callable[[list[int]], None]) -> bool:
        """write_back, device leaf `x` without a host copy: back it up and demote it, or if
        the host cannot take it drop it with its host-only subtree; False (nothing changed
        but what the backup's host eviction freed) when the drop is declined."""
        if self._backup(x):
            if self.hold_backups:
                # write_back's backup at eviction is waited for at once
                # (`writing_check(write_back=True)` blocks): nothing stays locked
                self.mover.backup_issued(x, len(x.key), blocking=True)
            self._demote(x, give)
            return True
        return self._drop_subtree(x, give)

    @staticmethod
    def _host_locked_below(x: TieredNode) -> list[TieredNode]:
        out = []
        stack = list(x.children.values())
        while stack:
            d = stack.pop()
            if d.host_lock:
                out.append(d)
            stack.extend(d.children.values())
        return out

    def _demote(self, x: TieredNode, give: Callable[[list[int]], None]) -> None:
        """Free `x`'s device copy; its host copy stays (`_demote`)."""
        self.mover.demoted(x.pages, x.host_pages)
        if self.hi_events is not None:
            self.hi_events.removed(x, DEVICE_MEDIUM)
        if self.storage is not None:
            # the executor's bytes for the storage write decided at the backup: only now is
            # the host copy in the executor (see `HiRadixCache.demoted`)
            self.mover.stored_from_host(x.host_pages, self.node_keys(x))
        give(x.pages)
        x.pages = None
        self.traffic.demoted += len(x.key)
        self._off_device(x)

    def _delete_device_leaf(self, x: TieredNode, give: Callable[[list[int]], None]) -> None:
        """`x` has no host copy: it leaves the tree (`_delete_unbacked_device_leaf`)."""
        if self.hi_events is not None:
            self.hi_events.removed(x, DEVICE_MEDIUM)
        give(x.pages)
        x.pages = None
        self.traffic.deleted += len(x.key)
        self.evictable_tokens -= len(x.key)
        x.parent.dev_children -= 1
        self._remove(x)

    def _drop_subtree(self, x: TieredNode, give: Callable[[list[int]], None]) -> bool:
        """write_back, the host cannot take `x`: drop its host-only subtree and `x`
        (`drop_subtree_no_host`); False, changing nothing, when a node of it is locked on
        either tier or has a transfer in flight (a storage write holds a host lock), as
        SGLang declines."""
        if x.host_lock or x.load_pending:
            return False
        below = []
        stack = list(x.children.values())
        while stack:
            d = stack.pop()
            if d.lock_ref or d.host_lock or d.load_pending:
                return False
            below.append(d)
            stack.extend(d.children.values())
        for d in reversed(below):
            if self.hi_events is not None:
                self.hi_events.removed(d, SGLANG_CPU_MEDIUM)
            self.traffic.dropped += len(d.key)
            self._free_host(d)
            self._remove(d)
        self._delete_device_leaf(x, give)
        return True

    def _free_host(self, x: TieredNode) -> int:
        self.host_free += x.host_pages
        x.host_pages = None
        return len(x.key)

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host tokens (`drive_host_eviction`): under write_back
        the host copies of nodes also on the device first, then host leaves in policy
        order. Returns the host tokens freed."""
        freed = self._reclaim_dups(num_tokens) if self.write_back else 0
        if freed < num_tokens and self.host_leaves:
            key = self._key
            heap = [key(x) for x in self.host_leaves]
            heapify(heap)
            leaves = self.host_leaves
            while freed < num_tokens and heap:
                x = heappop(heap)[-1]
                if x not in leaves:
                    continue
                parent = x.parent
                if self.hi_events is not None:
                    self.hi_events.removed(x, SGLANG_CPU_MEDIUM)
                n = self._free_host(x)
                freed += n
                self.traffic.host_evicted += n
                self._remove(x)
                if parent in leaves:
                    heappush(heap, key(parent))
        return freed

    def _reclaim_dups(self, num_tokens: int) -> int:
        """`_reclaim_full_host_duplicates`: free host copies of nodes also on the device, in
        the order they became so; a first pass spares device leaves (about to be demoted)."""
        freed = 0
        swept: list[int] = []
        for spare_leaves in (True, False):
            if freed >= num_tokens:
                break
            for x in self.dups.values():
                if freed >= num_tokens:
                    break
                if not on_device(x) or x.host_pages is None:
                    swept.append(x.node_id)  # stale
                    continue
                if spare_leaves and x.cand_key is not None:
                    continue
                if x.host_lock or x.load_pending:
                    continue
                if self.hi_events is not None:
                    self.hi_events.removed(x, SGLANG_CPU_MEDIUM)
                n = self._free_host(x)
                freed += n
                self.traffic.host_reclaimed += n
                swept.append(x.node_id)
        for nid in swept:
            self.dups.pop(nid, None)
        return freed

    # -- load-back ---------------------------------------------------------------------

    def lock_host_segment(self, nodes: list[TieredNode]) -> None:
        """A load-back's lock on the host-only nodes it reads (`acquire_component_lock`
        locks the bottom evicted segment too), and the host lock on the last."""
        for x in nodes:
            self._hold(x)
        nodes[-1].host_lock += 1

    def release_host_segment(self, nodes: list[TieredNode], loaded: bool) -> None:
        """Undo `lock_host_segment`; a loaded segment keeps its locks as the request's."""
        nodes[-1].host_lock -= 1
        if not loaded:
            for x in reversed(nodes):
                x.lock_ref -= 1
                self._refresh(x)
        else:
            self._refresh(nodes[-1])

    def load(self, nodes: list[TieredNode], pages: list[int]) -> None:
        """Put the locked host-only `nodes` (top first) on the device in `pages`
        (`commit_load_back`); the host copies stay."""
        ps = self.page_size
        o = 0
        for x in nodes:
            k = len(x.key) // ps
            x.pages = pages[o : o + k]
            o += k
            self.mover.copied_to_device(x.host_pages, x.pages)
            if self.write_back:
                x.load_pending = True
            self._to_device(x)
            if self.hi_events is not None:  # `commit_load_back`
                self.hi_events.stored(x, DEVICE_MEDIUM)
            self.traffic.loaded += len(x.key)
        self.pending_loads.append(nodes[-1])

    def finish_loads(self) -> None:
        """Acknowledge every load-back (`loading_check` -> `finish_load_back`): under
        write_back the loaded nodes, deepest first, become tracked duplicates."""
        for anchor in self.pending_loads:
            self._finish_load(anchor)
        self.pending_loads.clear()

    def finish_load(self, anchor: TieredNode) -> None:
        """Acknowledge the one load-back ending at `anchor` (a timed transfer completed)."""
        self.pending_loads.remove(anchor)
        self._finish_load(anchor)

    def _finish_load(self, anchor: TieredNode) -> None:
        x = anchor
        while x is not None and x.parent is not None:
            if x.load_pending:
                x.load_pending = False
                self._track_dup(x)
            x = x.parent

    # -- storage (L3) ------------------------------------------------------------------

    def _extra_of(self, namespace: tuple) -> ExtraKeys:
        extra = self._extra.get(namespace)
        if extra is None:
            extra = self._extra[namespace] = ExtraKeys(cache_salt=namespace[0], lora_id=namespace[1])
        return extra

    def node_keys(self, x: TieredNode) -> list[BlockHash]:
        """The chained page keys of `x`'s pages, computed once from its parent's last key
        (`compute_node_hash_values`), ancestors first where they have none yet."""
        keys = x.page_keys
        if keys is not None:
            return keys
        path = []
        y = x
        while y.parent is not None and y.page_keys is None:
            path.append(y)
            y = y.parent
        prior = y.page_keys[-1] if y.parent is not None and y.page_keys else None
        ps = self.page_size
        hasher = self._hasher
        for y in reversed(path):
            extra = self._extra_of(y.namespace)
            if y.start:  # only the prefix's first page carries the salt
                extra = ExtraKeys(lora_id=extra.lora_id)
            y.page_keys = hasher.hash_blocks(y.key, extra, 0, len(y.key) // ps, prior)
            prior = y.page_keys[-1]
        return x.page_keys

    def prefetch_hit(
        self, anchor: RadixNode | None, namespace: tuple, tokens: np.ndarray, start: int, limit: int
    ) -> tuple[list[BlockHash], int]:
        """The page keys of `tokens[start:limit]` below `anchor` (None: a root not built yet)
        and the tokens storage holds of them from the first (`batch_exists`), 0 when SGLang
        would issue no prefetch (the anchor not backed up, the span shorter than the
        threshold, or a match made before the tree grew below it). Changes nothing: it
        reads no recency."""
        ps = self.page_size
        if anchor is not None and anchor.parent is not None and anchor.host_pages is None:
            return [], 0  # `_prefetch_kvcache`: the anchor must be backed up (or the root)
        if anchor is not None and self._child_key(tokens, start) in anchor.children:
            # A match made before another request inserted below its end (the contract
            # admits such a stale match as it was made, as radix does): a fresh one would
            # have gone on down that child. SGLang matches and prefetches at once, so it
            # never meets this; here the request computes those tokens, no prefetch.
            return [], 0
        if limit - start < self.prefetch_threshold:
            return [], 0  # `prefetch_from_storage`: declined_too_short
        prior = self.node_keys(anchor)[-1] if anchor is not None and anchor.parent is not None else None
        keys = self._hasher.hash_blocks(tokens, self._extra_of(namespace), start // ps, limit // ps, prior)
        return keys, self.storage.hit_pages(keys) * ps

    def prefetch(
        self, anchor: RadixNode, tokens: np.ndarray, start: int, limit: int, budget: int | None = None
    ) -> TieredNode | None:
        """The storage prefetch of `tokens[start:limit]` below `anchor` (the deepest node
        the match reached, ending at `start`), completed at once. Returns the host-only
        node holding what storage had, or None: a prefetch shorter than the threshold, no
        backed-up anchor, a hit shorter than the threshold, or too little host room even
        after evicting (SGLang revokes each of these and the request recomputes)."""
        storage = self.storage
        ps = self.page_size
        keys, hit = self.prefetch_hit(anchor, anchor.namespace, tokens, start, limit)
        if hit < self.prefetch_threshold:
            return None  # declined_too_short, below_threshold, or no backed-up anchor
        # `allocate_storage_hit`: the whole hit, else evict host copies for the whole hit
        # (not the shortfall), else what is free if still at least the threshold
        anchor.host_lock += 1  # `prefetch_from_storage`'s host lock on the anchor
        self._refresh(anchor)
        if len(self.host_free) * ps < hit:
            self.evict_host(hit)
        free = len(self.host_free) * ps
        got = hit if free >= hit else free
        anchor.host_lock -= 1
        self._refresh(anchor)
        if got < self.prefetch_threshold:
            return None  # host_capacity
        if budget is not None:
            # serving: the engine ended the prefetch (`best_effort` / `timeout`) with only
            # `budget` tokens arrived; SGLang keeps every completed page (`completed_tokens`
            # > 0, no threshold there) and releases the rest of the host pages it allocated
            got = min(got, budget // ps * ps)
            if got == 0:
                return None  # nothing arrived: the prefetch is revoked
        n = got // ps
        storage.read(keys[:n])
        self.traffic.prefetched += got
        host = self.host_free[-n:]
        del self.host_free[-n:]
        # `insert_host`: the match stopped at `anchor`, so no child continues the key
        edge = self._child_key(tokens, start)
        assert edge not in anchor.children, "radix-hicache: a prefetch below a node that continues the key"
        node = self._new_node(self._node_key(tokens, start, start + got), None, anchor, self.tick(), edge)
        node.host_pages = host
        node.page_keys = keys[:n]
        self.mover.prefetched(node.page_keys, host, node.key)
        if self.hi_events is not None:  # `insert_host`
            self.hi_events.stored(node, SGLANG_CPU_MEDIUM)
        self._refresh(node)
        self._refresh(anchor)
        return node
