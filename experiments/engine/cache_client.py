"""`CacheClient`: the one way the engine, the benchmarks and the tests call a `PrefixCache`.

It times every contract call (only time inside the cache counts, hashing included) into
`seconds`, as CPU time of the calling thread (`CPU_CLOCK`) unless given another clock, and holds each sequence to the contract's call order::

    match -> can_admit* -> admit -> (grow | commit | fork)* -> release

An `admit` of a sequence already admitted, a `grow`/`commit`/`fork`/`release` of one that
is not, or a `fork` into a child that is live raises `CallOrderError` before the cache is
touched. The check runs outside the timed region, so it never shows in `seconds`.

Calls an engine makes back to back share one timed region (`prefill`: the replay's match,
admit and commit of a prompt; `advance`: a running request's flush, grow and publish;
`advance_all`: those of every request a step calls for, in order): a region reads the clock twice, a system call each (about
1 µs in all, as much as a decode step's whole commit on the `none` backend). The engine's
own work (bringing requests up to date) runs before and after a region, never inside.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from cachelib.interface import PrefixCache
from cachelib.types import CopyOp, ExtraKeys, Match, Sequence

#: the clock of cache (and router) time in results: CPU time of the running thread. Wall
#: time (`time.perf_counter`) counts whatever else the machine runs meanwhile (the Mooncake
#: report's wall-clock cache times under load were 2–6x those of a quiet run), while thread
#: CPU time counts only this thread's work; a read costs about 0.5 µs (a system call), so it adds ~1 µs
#: per timed call, small against the tens of µs a request spends in the cache.
CPU_CLOCK: Callable[[], float] = time.thread_time


class CallOrderError(RuntimeError):
    """A contract call out of order for its sequence (an engine bug, not a cache error)."""


class CacheClient:
    """A `PrefixCache` behind a stopwatch (`seconds`) and a call-order check.

    `clock` is the timer read around each call (`CPU_CLOCK`, thread CPU time; a benchmark
    that wants wall time passes `time.perf_counter`).
    """

    __slots__ = ("cache", "seconds", "_clock", "_live", "_fused")

    def __init__(self, cache: PrefixCache, clock: Callable[[], float] = CPU_CLOCK) -> None:
        self.cache = cache
        self.seconds = 0.0
        self._clock = clock
        self._live: set[int] = set()  # id() of every admitted or forked, unreleased Sequence
        #: a `PrefixCache` makes the calls an engine makes back to back in one (`prefill`,
        #: `grow_commit`); a test's reference model of vLLM or SGLang has only the contract's
        #: single calls, made one by one here (the same calls, in the same order)
        self._fused = isinstance(cache, PrefixCache)

    # -- the contract, timed --------------------------------------------------------

    def match(self, seq: Sequence) -> Match:
        t0 = self._clock()
        m = self.cache.match(seq)
        self.seconds += self._clock() - t0
        return m

    def can_admit(self, seq: Sequence, match: Match, num_tokens: int) -> bool:
        """`cache.can_admit`: would `admit(seq, match, num_tokens)` fit now? Read-only."""
        if id(seq) in self._live:
            raise CallOrderError(f"can_admit {seq.request_id!r}: already admitted; release it first")
        t0 = self._clock()
        fits = self.cache.can_admit(seq, match, num_tokens)
        self.seconds += self._clock() - t0
        return fits

    def admit(self, seq: Sequence, match: Match, num_tokens: int) -> list[CopyOp] | None:
        """`cache.admit`; the sequence is live from here when it fits."""
        if id(seq) in self._live:
            raise CallOrderError(f"admit {seq.request_id!r}: already admitted; release it first")
        t0 = self._clock()
        ops = self.cache.admit(seq, match, num_tokens)
        self.seconds += self._clock() - t0
        if ops is not None:
            self._live.add(id(seq))
        return ops

    def prefill(self, seq: Sequence) -> tuple[Match, list[CopyOp] | None, int]:
        """`cache.prefill`: `match`, `admit` of the whole sequence and, when it fits, `commit`
        of it, in one call and one timed region (the replay protocol's prefill: one region
        reads the clock twice instead of three times two, and the cache validates the
        sequence once). Returns the match, the copies (None: it did not fit,
        nothing admitted or committed) and the sequence's computed count right after
        `admit` (the match, plus what a tiered cache loaded back)."""
        if id(seq) in self._live:
            raise CallOrderError(f"admit {seq.request_id!r}: already admitted; release it first")
        t0 = self._clock()
        if self._fused:
            m, ops, admitted = self.cache.prefill(seq)
        else:
            m, ops, admitted = self._prefill_one_by_one(seq)
        self.seconds += self._clock() - t0
        if ops is not None:
            self._live.add(id(seq))
        return m, ops, admitted

    def _prefill_one_by_one(self, seq: Sequence) -> tuple[Match, list[CopyOp] | None, int]:
        """`PrefixCache.prefill` as its three calls, for a cache model that has only those."""
        cache = self.cache
        m = cache.match(seq)
        ops = cache.admit(seq, m, len(seq))
        if ops is None:
            return m, None, 0
        admitted = seq.num_computed
        cache.commit(seq, len(seq))
        return m, ops, admitted

    # grow and commit run for a request every few decode steps: the live check is inlined
    # (`_require_live` only raises) and the clock read through a local

    def grow(self, seq: Sequence, num_tokens: int) -> list[CopyOp] | None:
        if id(seq) not in self._live:
            self._require_live(seq, "grow")
        clock = self._clock
        t0 = clock()
        ops = self.cache.grow(seq, num_tokens)
        self.seconds += clock() - t0
        return ops

    def commit(self, seq: Sequence, num_computed: int) -> None:
        if id(seq) not in self._live:
            self._require_live(seq, "commit")
        clock = self._clock
        t0 = clock()
        self.cache.commit(seq, num_computed)
        self.seconds += clock() - t0

    def advance(self, seq: Sequence, committed: int, num_tokens: int, published: int) -> list[CopyOp] | None:
        """A running sequence's calls for its next step, in one timed region (each region
        reads the clock twice, a system call each): `commit` to `committed` if that moves
        its count (decode tokens whose commit was batched), `grow` to `num_tokens`, then,
        if that fits, `commit` to `published` if that moves the count. The same calls in
        the same order as making them one by one; None (nothing grown, the first commit
        made) when the grow does not fit."""
        if id(seq) not in self._live:
            self._require_live(seq, "grow")
        cache, clock = self.cache, self._clock
        t0 = clock()
        if committed > seq.num_computed:
            cache.commit(seq, committed)
        ops = cache.grow(seq, num_tokens)
        if ops is not None and published > seq.num_computed:
            cache.commit(seq, published)
        self.seconds += clock() - t0
        return ops

    def advance_all(self, steps: list[tuple[Sequence, int, int | None, int]]) -> list[list[CopyOp] | None]:
        """`advance(seq, committed, num_tokens, published)` for each step in order, in one
        timed region (an engine's calls for the running requests of one step, with its own
        work done before and after); `num_tokens` None: no grow, only the commits. It stops
        after the first grow that does not fit: the result is then one shorter than the
        ones made, its last None, and no call after it is made. Every sequence is checked
        live before any call."""
        live = self._live
        for seq, _, _, _ in steps:
            if id(seq) not in live:
                self._require_live(seq, "grow")
        cache, clock = self.cache, self._clock
        out: list[list[CopyOp] | None] = []
        t0 = clock()
        for seq, committed, num_tokens, published in steps:
            if committed > seq.num_computed:
                cache.commit(seq, committed)
            ops = [] if num_tokens is None else cache.grow(seq, num_tokens)
            if ops is None:
                out.append(None)
                break
            if published > seq.num_computed:
                cache.commit(seq, published)
            out.append(ops)
        self.seconds += clock() - t0
        return out

    def grow_commit(self, seq: Sequence, num_tokens: int) -> list[CopyOp] | None:
        """`cache.grow_commit`: `grow` to `num_tokens` and, when it fits, `commit` them (a
        decode run whose KV the engine writes at once); one call, one timed region."""
        self._require_live(seq, "grow")
        cache = self.cache
        t0 = self._clock()
        if self._fused:
            ops = cache.grow_commit(seq, num_tokens)
        else:
            ops = cache.grow(seq, num_tokens)
            if ops is not None:
                cache.commit(seq, num_tokens)
        self.seconds += self._clock() - t0
        return ops

    def fork(self, parent: Sequence, child: Sequence) -> list[CopyOp] | None:
        """`cache.fork`; the child is live from here when it fits."""
        self._require_live(parent, "fork")
        if id(child) in self._live:
            raise CallOrderError(f"fork into {child.request_id!r}: the child is already live")
        t0 = self._clock()
        ops = self.cache.fork(parent, child)
        self.seconds += self._clock() - t0
        if ops is not None:
            self._live.add(id(child))
        return ops

    def release(self, seq: Sequence) -> None:
        self._require_live(seq, "release")
        t0 = self._clock()
        self.cache.release(seq)
        self.seconds += self._clock() - t0
        self._live.discard(id(seq))

    def register_prefix(self, tokens: np.ndarray, extra: ExtraKeys) -> tuple[int, Sequence] | None:
        """Declare a shared prefix (a backend that `declares_prefixes`): its id and the
        sequence that holds its pages, live from here (commit its KV through this client;
        it stays pinned, never released), or None when it does not fit."""
        t0 = self._clock()
        pid = self.cache.register_prefix(tokens, extra)  # type: ignore[attr-defined]
        seq = None if pid is None else self.cache.prefix_sequence(pid)  # type: ignore[attr-defined]
        self.seconds += self._clock() - t0
        if seq is None:
            return None
        self._live.add(id(seq))
        return pid, seq

    # -- helpers --------------------------------------------------------------------

    def is_live(self, seq: Sequence) -> bool:
        """True between a successful admit (or fork) of `seq` and its release."""
        return id(seq) in self._live

    @property
    def num_live(self) -> int:
        return len(self._live)

    def _require_live(self, seq: Sequence, call: str) -> None:
        if id(seq) not in self._live:
            raise CallOrderError(f"{call} {seq.request_id!r}: not admitted (match -> admit first) or already released")
