"""radix-aged: RadixAttention with frequency-aged (LRFU) eviction, optionally cost-weighted.

The worked example of adding a backend (docs/adding_a_backend.md). Everything but the
eviction order is the `radix` backend: same tree, same locks, same admission and insert.

Each node keeps a *combined reference recency-frequency* (LRFU, Lee et al., IEEE TC 2001):
every reference adds 1, and the sum decays by half every `half_life` references to the
cache::

    F(t) = sum over the node's references at times t_k of 2 ** (-(t - t_k) / half_life)

A reference is a lookup (`match`) whose reused prefix runs through the node, and the request
that creates the node. Time `t` counts lookups, so `half_life` is in requests.
`half_life -> 0` is LRU, `half_life = inf` is LFU (a plain count); in between, a prefix
asked for often stays even after a run of one-off prompts (a scan), and one that was hot
long ago fades.

Why the candidate list stays incremental: between two references every node's F decays by
the same factor, so the *order* of F never changes with time alone. In logs,
`log2 F(t) = A - t / half_life` with `A = log2 F(t_last) + t_last / half_life`, and `A`
changes only when the node is referenced. `A` is the static sort key, refreshed on touch,
exactly like LRU's last-access stamp.

Cost weighting (`cost_context`, GDSF-like): evicting a node loses the recompute of its
tokens, per token `linear + attention * position`. Its key adds
`log2(1 + mid / cost_context)` where `mid` is the node's middle token position and
`cost_context` is the position where attention FLOPs equal the linear layers' (about 27k
tokens for Llama-3-8B shapes: 2 * 7e9 / (4 * 32 layers * 4096)); `None` turns it off. The
key then orders by expected future work saved per token freed.
"""

from __future__ import annotations

import math

import numpy as np

from backends.radix import RadixCache
from backends.radix_tree import RadixNode, RadixTree
from cachelib.errors import InvalidRequestError
from cachelib.registry import register_backend

#: Llama-3-8B: 2 * (non-embedding params ~7e9) / (4 * 32 layers * 4096 hidden): the token
#: position where one token's attention FLOPs equal its linear-layer FLOPs
LLAMA3_8B_COST_CONTEXT = 27_000.0
DEFAULT_HALF_LIFE = 200.0


class AgedNode(RadixNode):
    """A radix node with its aged log-frequency `aged = log2 F(t_last) + t_last / half_life`."""

    __slots__ = ("aged",)


class AgedRadixTree(RadixTree):
    """`RadixTree` whose candidate leaves are ordered by LRFU score (lowest evicted first)."""

    def __init__(self, page_size: int, half_life: float, cost_context: float | None) -> None:
        super().__init__(page_size, "lru")
        self.policy = "aged"
        self.half_life = half_life
        self.cost_context = cost_context
        self.now = 0  # lookups so far: the LRFU clock
        self._key_fn = self._aged_key

    def _aged_key(self, n: AgedNode) -> tuple:
        score = n.aged
        if self.cost_context is not None:
            score += math.log2(1.0 + (n.start + 0.5 * len(n.key)) / self.cost_context)
        # ties (same score, e.g. siblings created by one request): least recently used first
        return (score, n.last_access, n.node_id, n)

    def _rekey(self, n: AgedNode) -> None:
        if n.cand_key is not None:
            self.candidates.remove(n.cand_key)
            n.cand_key = self._aged_key(n)
            self.candidates.add(n.cand_key)

    def _reference(self, n: AgedNode) -> None:
        """One more reference now: F <- F * decay + 1, in log form (no overflow, no underflow)."""
        t = self.now / self.half_life
        n.aged = t + math.log2(1.0 + 2.0 ** (n.aged - t))
        self._rekey(n)

    # -- the tree's hooks ------------------------------------------------------------

    def _new_node(self, key: np.ndarray, pages: list[int], parent: RadixNode, tick: int) -> AgedNode:
        self._next_id += 1
        self.num_nodes += 1
        node = AgedNode(key, pages, parent, tick, self._next_id)
        node.aged = self.now / self.half_life  # created by a request: F = 1 now
        return node

    def _split(self, child: RadixNode, m: int, tick: int) -> RadixNode:
        new = super()._split(child, m, tick)
        new.aged = child.aged  # the upper part has had the same references
        if self.cost_context is not None:
            self._rekey(child)  # the lower part now starts deeper: its cost changed
        return new

    def match(self, namespace: tuple, tokens: np.ndarray, limit: int):
        self.now += 1
        node, pos, runs = super().match(namespace, tokens, limit)
        x = node
        while x is not None and x.parent is not None:  # every node of the reused prefix
            self._reference(x)
            x = x.parent
        return node, pos, runs


@register_backend("radix-aged")
class AgedRadixCache(RadixCache):
    """SGLang RadixAttention with LRFU eviction (see the module docstring).

    `half_life`: references decay by half every this many lookups (`math.inf` = LFU).
    `cost_context`: tokens at which attention recompute equals the linear part, for the
    position-weighted cost; `None` = every token costs the same.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        *,
        half_life: float = DEFAULT_HALF_LIFE,
        cost_context: float | None = LLAMA3_8B_COST_CONTEXT,
        track_contents: bool = False,
    ) -> None:
        super().__init__(num_pages, page_size, track_contents=track_contents)
        if not (isinstance(half_life, (int, float)) and not isinstance(half_life, bool) and half_life > 0):
            raise InvalidRequestError(f"half_life must be a positive number (inf allowed), got {half_life!r}")
        if cost_context is not None and not (
            isinstance(cost_context, (int, float)) and not isinstance(cost_context, bool) and cost_context > 0
        ):
            raise InvalidRequestError(f"cost_context must be a positive number or None, got {cost_context!r}")
        self.tree = AgedRadixTree(page_size, float(half_life), None if cost_context is None else float(cost_context))
        self.eviction_policy = "aged"
