"""Eviction policies of the radix tree: which unlocked leaf goes first.

The tree keeps its eviction candidates (the unlocked leaves) in a sorted list and updates
it incrementally, so a policy is a *sort key that changes only at events the tree
reports*: a node touched by a walk (its `last_access` or `hit_count` moved: the tree
re-keys it), created, split, and, for policies that count them, referenced by a lookup.
Smallest key is evicted first. Every key ends with `node_id` (keys are unique, ties go to
the older node) and the node itself (the tree reads it back from `key[-1]`).

The five policies are SGLang 0.5.23's `evict_policy.py`, keyed exactly as it orders them
(LRU last access; LFU hit count, then last access; FIFO creation; MRU / FILO their
negations). The recency stamps and hit counts they read are the tree's node fields
(SGLang keeps them on its nodes too); a policy that needs its own per-node state keeps it
in `RadixNode.policy_state` (radix-aged's LRFU score, `backends/radix_aged.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

from cachelib.errors import InvalidRequestError

if TYPE_CHECKING:
    from backends.radix_tree import RadixNode


class EvictionPolicy(ABC):
    """The order in which a radix tree evicts its unlocked leaves (smallest key first)."""

    __slots__ = ()

    #: the name `stats().extra["eviction_policy"]` reports
    name: ClassVar[str] = ""
    #: `lookup` may change the keys of the nodes a match reused: the tree calls it after
    #: every match and re-keys the candidates among them (False: it is never called)
    rekey_on_lookup: ClassVar[bool] = False
    #: the key reads where the node lies or how long it is (`start`, `key`): a split moves
    #: the lower part deeper and shortens it, so the tree re-keys it
    rekey_on_split: ClassVar[bool] = False
    #: `created` keeps per-node state: the tree calls it for every node it creates (False:
    #: never called, one call less per new node for the policies that key on node fields)
    tracks_creation: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # the tree calls `created` only where it is declared: an undeclared one would never run
        if "created" in cls.__dict__ and not cls.tracks_creation:
            raise TypeError(
                f"{cls.__name__} defines created() but not tracks_creation = True: the tree would never call it"
            )

    @abstractmethod
    def key(self, node: RadixNode) -> tuple:
        """The node's sort key as a candidate; ends with `(node_id, node)`."""

    def created(self, node: RadixNode) -> None:  # noqa: B027 - an optional hook
        """An insert (or a split) just created `node` (not a candidate yet). Called only
        where the policy declares `tracks_creation`."""

    def split(self, upper: RadixNode, lower: RadixNode) -> None:  # noqa: B027 - an optional hook
        """`lower` was split: `upper` (just created) now holds its first tokens."""

    def lookup(self, node: RadixNode | None) -> None:  # noqa: B027 - an optional hook
        """A match reused the path root..`node` (None: the namespace has no tree yet)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRU(EvictionPolicy):
    """Least recently used first (SGLang's default)."""

    __slots__ = ()
    name = "lru"

    def key(self, node: RadixNode) -> tuple:
        return (node.last_access, node.node_id, node)


class LFU(EvictionPolicy):
    """Fewest hits first; among equal counts, least recently used."""

    __slots__ = ()
    name = "lfu"

    def key(self, node: RadixNode) -> tuple:
        return (node.hit_count, node.last_access, node.node_id, node)


class FIFO(EvictionPolicy):
    """Oldest created first."""

    __slots__ = ()
    name = "fifo"

    def key(self, node: RadixNode) -> tuple:
        return (node.creation, node.node_id, node)


class MRU(EvictionPolicy):
    """Most recently used first."""

    __slots__ = ()
    name = "mru"

    def key(self, node: RadixNode) -> tuple:
        return (-node.last_access, node.node_id, node)


class FILO(EvictionPolicy):
    """Newest created first."""

    __slots__ = ()
    name = "filo"

    def key(self, node: RadixNode) -> tuple:
        return (-node.creation, node.node_id, node)


#: the `eviction_policy` option of the radix backend -> its policy class
EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {p.name: p for p in (LRU, LFU, FIFO, MRU, FILO)}


def make_policy(name: object) -> EvictionPolicy:
    """A fresh policy for `name` (case-insensitive); `InvalidRequestError` names the choices."""
    cls = EVICTION_POLICIES.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise InvalidRequestError(f"unknown eviction policy {name!r}; choose one of {', '.join(EVICTION_POLICIES)}")
    return cls()
