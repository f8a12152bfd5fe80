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

The policy is an `EvictionPolicy` (`backends/radix_policy.py`) handed to the radix tree:
the tree tells it of node creation, splits and lookups and keeps its candidate list
sorted; nothing of the tree is overridden.

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

from backends.radix import RadixCache
from backends.radix_policy import EvictionPolicy
from backends.radix_tree import RadixNode
from cachelib.errors import InvalidRequestError
from cachelib.registry import register_backend

#: Llama-3-8B: 2 * (non-embedding params ~7e9) / (4 * 32 layers * 4096 hidden): the token
#: position where one token's attention FLOPs equal its linear-layer FLOPs
LLAMA3_8B_COST_CONTEXT = 27_000.0
DEFAULT_HALF_LIFE = 200.0


class LRFU(EvictionPolicy):
    """Lowest LRFU score evicted first. A node's `policy_state` is its aged log-frequency
    `A = log2 F(t_last) + t_last / half_life`; `now` counts lookups (the LRFU clock)."""

    __slots__ = ("half_life", "cost_context", "now")
    name = "aged"
    rekey_on_lookup = True  # a lookup references every node of the reused prefix
    rekey_on_split = True  # with cost weighting the key reads the node's position
    tracks_creation = True  # a new node starts with one reference now

    def __init__(self, half_life: float, cost_context: float | None) -> None:
        self.half_life = half_life
        self.cost_context = cost_context
        self.now = 0

    def __repr__(self) -> str:
        return f"LRFU(half_life={self.half_life}, cost_context={self.cost_context})"

    def key(self, node: RadixNode) -> tuple:
        score = node.policy_state
        if self.cost_context is not None:
            score += math.log2(1.0 + (node.start + 0.5 * len(node.key)) / self.cost_context)
        # ties (same score, e.g. siblings created by one request): least recently used first
        return (score, node.last_access, node.node_id, node)

    def created(self, node: RadixNode) -> None:
        node.policy_state = self.now / self.half_life  # created by a request: F = 1 now

    def split(self, upper: RadixNode, lower: RadixNode) -> None:
        upper.policy_state = lower.policy_state  # the upper part has had the same references

    def lookup(self, node: RadixNode | None) -> None:
        self.now += 1
        t = self.now / self.half_life
        while node is not None and node.parent is not None:  # every node of the reused prefix
            # one more reference now: F <- F * decay + 1, in log form (no overflow, no underflow)
            node.policy_state = t + math.log2(1.0 + 2.0 ** (node.policy_state - t))
            node = node.parent


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
        if not (isinstance(half_life, (int, float)) and not isinstance(half_life, bool) and half_life > 0):
            raise InvalidRequestError(f"half_life must be a positive number (inf allowed), got {half_life!r}")
        if cost_context is not None and not (
            isinstance(cost_context, (int, float)) and not isinstance(cost_context, bool) and cost_context > 0
        ):
            raise InvalidRequestError(f"cost_context must be a positive number or None, got {cost_context!r}")
        policy = LRFU(float(half_life), None if cost_context is None else float(cost_context))
        super().__init__(num_pages, page_size, eviction_policy=policy, track_contents=track_contents)
