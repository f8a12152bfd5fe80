"""Deliberately naive models of vLLM 0.33's CPU-offloading eviction policies, written from
rules R7 (LRU) and R8 (ARC) of backends/apc_offload.py and kept simple on purpose: ranks
are `(R, -end)` pairs in a dict and every eviction sorts every evictable chunk; ARC's lists
are plain Python lists scanned from the front. The backend's policies must decide exactly
as these do (tests/test_apc_offload_policies.py drives both with the same random calls)."""

from __future__ import annotations


class NaiveLru:
    """R7: a request's rank R at its first access; a chunk it stores or first touches gets
    `(R, -end)` when that is higher; at finish, tail first, a fresh `(rank, 0)`. Eviction
    takes the n lowest-ranked evictable chunks outside `protected`, or nothing."""

    def __init__(self) -> None:
        self.ranks: dict[bytes, tuple[int, int]] = {}
        self.pinned: set[bytes] = set()
        self.request_rank: dict[str, int] = {}
        self.counter = 0

    def _rank_of(self, rid: str) -> int:
        if rid not in self.request_rank:
            self.counter += 1
            self.request_rank[rid] = self.counter
        return self.request_rank[rid]

    def insert(self, key: bytes, rid: str, end: int, pinned: bool) -> None:
        self.ranks[key] = (self._rank_of(rid), -end)
        if pinned:
            self.pinned.add(key)

    def access(self, keys: list[tuple[bytes, int]], rid: str) -> None:
        r = self._rank_of(rid)
        for key, end in keys:
            if key in self.ranks and self.ranks[key] < (r, -end):
                self.ranks[key] = (r, -end)

    def finish(self, ordered: list[bytes]) -> None:
        for key in reversed(ordered):
            if key in self.ranks:
                self.counter += 1
                self.ranks[key] = (self.counter, 0)

    def order(self) -> list[bytes]:
        return sorted((k for k in self.ranks if k not in self.pinned), key=lambda k: self.ranks[k])

    def evict(self, n: int, protected: set[bytes]) -> list[bytes] | None:
        candidates = [k for k in self.order() if k not in protected]
        if len(candidates) < n:
            return None
        for key in candidates[:n]:
            del self.ranks[key]
        return candidates[:n]
