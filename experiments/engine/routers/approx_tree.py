"""`ApproxTree`: the multi-tenant radix tree SGLang's cache-aware router keeps of the prompts it
routed (sgl-router `src/tree.rs`, later sgl-model-gateway `src/policies/tree.rs`).

One tree for the whole cluster; each node records which tenants (replicas) hold it and when
each last touched it. A tenant's size is the number of keys on the nodes it holds. What the
router needs from it, as SGLang's `Tree`:

- `insert(keys, tenant)`: the path of `keys` is held by `tenant` from now on (nodes split
  where the prompt leaves an edge, a new leaf for the rest), every node on it touched;
- `prefix_match(keys)`: how far `keys` follows the tree (whoever holds it) and one tenant of
  the node where the match ends; that tenant's path to the root is touched;
- `evict_by_size(max_size)`: every tenant above `max_size` gives up its least recently
  touched leaves (a node no child of which it holds) until it is within; nodes nobody holds
  any more leave the tree.

Where this differs from SGLang's: the keys are integers (a token, or a hash of a block of
tokens: `block_keys`), not characters; a touch is stamped with a counter, not the wall
clock in ms, so equal times cannot tie; and where the match ends on a node several tenants
hold, SGLang takes whichever its hash map yields first (an unspecified order), this the most
recently touched one (ties: the lowest index), so runs repeat.
"""

from __future__ import annotations

import heapq

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)
#: fixed odd multipliers of the block hash (any fixed odd constants: runs must repeat)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_POSITION = np.random.default_rng(20250613).integers(1, 2**63, 4096, dtype=np.uint64) | np.uint64(1)


def block_keys(tokens: np.ndarray, block_size: int) -> np.ndarray:
    """The tree's keys of a prompt: its tokens (`block_size` 1), or one 64-bit hash per full
    block of `block_size` tokens (a trailing partial block has no key). Hashing the blocks
    keeps the tree small on long traces; two different blocks collide with probability
    about 2**-64, which would only make the router believe in a match."""
    t = np.asarray(tokens, dtype=np.int64)
    if block_size == 1:
        return t
    if block_size > len(_POSITION):
        raise ValueError(f"block_size must be at most {len(_POSITION)}, got {block_size}")
    full = len(t) // block_size
    x = t[: full * block_size].reshape(full, block_size).astype(np.uint64) * _MIX
    x ^= x >> np.uint64(29)
    h = (x * _POSITION[:block_size]).sum(axis=1, dtype=np.uint64)
    h ^= h >> np.uint64(32)
    return h.view(np.int64)


def shared_length(edge: np.ndarray, keys: np.ndarray, start: int) -> int:
    """How many leading keys of `edge` equal `keys[start:]`."""
    m = min(len(edge), len(keys) - start)
    differ = np.flatnonzero(edge[:m] != keys[start : start + m])
    return int(differ[0]) if differ.size else m


class Node:
    """An edge of keys from its parent, its children by first key, its tenants' last touch."""

    __slots__ = ("children", "key", "parent", "tenants")

    def __init__(self, key: np.ndarray, parent: Node | None, tenants: dict[int, int]) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.tenants = tenants


class ApproxTree:
    """The router's tree over `num_tenants` replicas (see the module docstring)."""

    def __init__(self, num_tenants: int) -> None:
        # every tenant holds the root from the start (SGLang's `init_workers` inserts ""), so
        # an empty replica is a candidate for "the smallest tree"
        self.root = Node(_EMPTY, None, dict.fromkeys(range(num_tenants), 0))
        self.size = [0] * num_tenants  # keys per tenant
        self.stamp = 0

    def touch(self) -> int:
        self.stamp += 1
        return self.stamp

    def insert(self, keys: np.ndarray, tenant: int) -> None:
        stamp = self.touch()
        node, i = self.root, 0
        node.tenants[tenant] = stamp
        while i < len(keys):
            child = node.children.get(int(keys[i]))
            if child is None:
                leaf = Node(keys[i:].copy(), node, {tenant: stamp})
                node.children[int(keys[i])] = leaf
                self.size[tenant] += len(leaf.key)
                return
            n = shared_length(child.key, keys, i)
            if n < len(child.key):
                child = self.split(child, n)
            if tenant not in child.tenants:
                self.size[tenant] += len(child.key)
            child.tenants[tenant] = stamp
            node, i = child, i + n

    def split(self, node: Node, n: int) -> Node:
        """Cut `node`'s edge after `n` keys; returns the new upper node (same tenants)."""
        parent = node.parent
        upper = Node(node.key[:n].copy(), parent, dict(node.tenants))
        parent.children[int(node.key[0])] = upper  # type: ignore[union-attr]  # the root is never split
        node.key = node.key[n:].copy()
        node.parent = upper
        upper.children[int(node.key[0])] = node
        return upper

    def prefix_match(self, keys: np.ndarray) -> tuple[int, int]:
        """(keys matched, the tenant chosen at the node where the match ends)."""
        node, i = self.root, 0
        while i < len(keys):
            child = node.children.get(int(keys[i]))
            if child is None:
                break
            n = shared_length(child.key, keys, i)
            node, i = child, i + n
            if n < len(child.key):
                break
        tenant = max(node.tenants.items(), key=_recent_then_lowest)[0]
        stamp = self.touch()
        walk: Node | None = node
        while walk is not None:
            walk.tenants[tenant] = stamp
            walk = walk.parent
        return i, tenant

    def smallest_tenant(self) -> int:
        """The tenant holding the fewest keys (ties: the lowest index)."""
        return min(range(len(self.size)), key=self.size.__getitem__)

    def evict_by_size(self, max_size: int) -> None:
        """Each tenant above `max_size` keys drops its least recently touched leaves."""
        if max(self.size) <= max_size:
            return
        heap: list[tuple[int, int, int, Node]] = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            for tenant in self.leaf_tenants(node):
                heap.append((node.tenants[tenant], id(node), tenant, node))
        heapq.heapify(heap)
        while heap:
            _, _, tenant, node = heapq.heappop(heap)
            if self.size[tenant] <= max_size or node is self.root:
                continue
            self.drop(node, tenant)
            parent = node.parent
            if parent is not None and tenant in self.leaf_tenants(parent):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), tenant, parent))

    def drop(self, node: Node, tenant: int) -> None:
        """`tenant` no longer holds `node`; a node nobody holds leaves the tree."""
        del node.tenants[tenant]
        self.size[tenant] -= len(node.key)
        if not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[int(node.key[0])]

    @staticmethod
    def leaf_tenants(node: Node) -> list[int]:
        """Tenants holding `node` and none of its children."""
        below = {t for child in node.children.values() for t in child.tenants}
        return [t for t in node.tenants if t not in below]


def _recent_then_lowest(item: tuple[int, int]) -> tuple[int, int]:
    tenant, stamp = item
    return stamp, -tenant
