"""Errors raised by caches. Every error leaves the cache exactly as it was before the call."""

from __future__ import annotations


class CacheError(Exception):
    """Base class of every error a prefix cache raises."""


class InvalidRequestError(CacheError, ValueError):
    """Bad input: empty prompt, ids out of range, bad sizes, a call out of order."""


class UnknownSequenceError(CacheError, KeyError):
    """The sequence is not held by this cache (never admitted, or already released)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown sequence"


class StaleMatchError(CacheError):
    """The `Match` was computed before a change that may have invalidated it; match again."""


class UnknownBackendError(CacheError, KeyError):
    """No backend is registered under that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown backend"


class InvariantViolation(CacheError, AssertionError):
    """`check_invariants()` found a broken invariant: a bug in the backend."""
