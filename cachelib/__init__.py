"""The prefix-cache contract and what every backend shares.

Nothing here knows about tensors, schedulers or attention kernels: a cache hands out
page ids and `CopyOp`s; the executor moves KV.
"""

from __future__ import annotations

from cachelib.errors import (
    CacheError,
    InvalidRequestError,
    InvariantViolation,
    StaleMatchError,
    UnknownBackendError,
    UnknownSequenceError,
)
from cachelib.interface import PrefixCache
from cachelib.kv_events import KvEvent, KvEventListener, PageKeys, PagesRemoved, PagesStored
from cachelib.registry import available_backends, create_cache, default_backends, get_backend, register_backend
from cachelib.types import CacheStats, CopyOp, ExtraKeys, Match, MultiModalSpan, Sequence, StorageCopy, TierCopy

__all__ = [
    "CacheError",
    "CacheStats",
    "CopyOp",
    "ExtraKeys",
    "InvalidRequestError",
    "InvariantViolation",
    "KvEvent",
    "KvEventListener",
    "Match",
    "MultiModalSpan",
    "PageKeys",
    "PagesRemoved",
    "PagesStored",
    "PrefixCache",
    "Sequence",
    "StaleMatchError",
    "StorageCopy",
    "TierCopy",
    "UnknownBackendError",
    "UnknownSequenceError",
    "available_backends",
    "create_cache",
    "default_backends",
    "get_backend",
    "register_backend",
]
