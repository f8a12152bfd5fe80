"""The `PrefixCache` contract every backend implements (docs/design.md §3).

A cache owns `num_pages` physical pages of `page_size` token slots and the index that says
which pages hold the KV of which token prefix. It never touches tensors: it hands out page
ids and asks the executor, through `CopyOp`s, to copy a page before it is written.

Every call either succeeds or leaves the cache exactly as it was (an error, or `None` for
"does not fit"). Calls on one sequence come in this order::

    m = cache.match(seq)              # read-only lookup
    cache.can_admit(seq, m, n)        # optional, any number of times: would admit fit now?
    cache.admit(seq, m, n)            # pin the hit, allocate pages for n tokens
    cache.commit(seq, k)              # KV of the first k tokens is written: publish it
    cache.grow(seq, n2); cache.commit(seq, k2) ...   # decode / next prefill chunk
    cache.release(seq)                # finished or preempted

    cache.prefill(seq)                # = match, admit(len(seq)), commit(len(seq)): validated once
    cache.grow_commit(seq, n)         # = grow(n), commit(n)

The public calls are template methods: this class validates the arguments, finds the
sequence's live state (the exact `Sequence` object admitted), refuses a stale, foreign or
forged `Match`, keeps the counters every backend keeps alike, and only then calls the
backend's hook (`_match`, `_can_admit`, `_admit`, `_grow`, `_commit`, `_fork`, `_release`,
`_evict`, `_occupancy`, `_check_invariants`). A hook gets arguments that are already proven sane.

`can_admit(seq, m, n)` is a read-only query, allowed between `match` and `admit` any number
of times (and skipped freely): `True` iff `admit(seq, m, n)` would succeed now (return a
list, not `None`). It validates exactly as `admit` does, so it raises the same errors, and
changes nothing: no eviction, no recency refresh, no counter. A scheduler uses it for an
admission rule stricter than the allocation it makes: vLLM V1 admits a waiting request only
if its whole prompt fits (`can_admit(seq, m, len(seq))`) while it allocates the first chunk
(`admit(seq, m, chunk)`). Each backend's `_admit` decides fit through the same predicate
(`_can_admit`, or one helper both call), so the two never disagree.

A backend that declares `emits_kv_events` (apc, radix) tells listeners (`subscribe`) of the
pages it publishes and evicts, as vLLM's and SGLang's KV events do (cachelib/kv_events.py);
with no listener nothing is computed for them, and with one no decision changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

import numpy as np

from cachelib.errors import InvalidRequestError, InvariantViolation, StaleMatchError, UnknownSequenceError
from cachelib.kv_events import KvEvent, KvEventFanout, KvEventListener, PageKeys
from cachelib.tiers import NO_PREFETCH, StoragePrefetch
from cachelib.types import CacheStats, CopyOp, Match, Sequence

#: `PrefixCache.decode_noops_when`: decode steps inside held pages are no-ops while a page is free
DECODE_NOOPS_WHILE_FREE = "while_a_page_is_free"
#: `PrefixCache.decode_noops_when`: they are for a sequence `decode_steps_private` approves
DECODE_NOOPS_IF_PRIVATE = "if_sequence_private"
#: every condition `decode_noops_when` may name
DECODE_NOOPS_CONDITIONS = (DECODE_NOOPS_WHILE_FREE, DECODE_NOOPS_IF_PRIVATE)
#: builds a `Match` from its fields' tuple without the namedtuple's Python-level `__new__`
_new_match = tuple.__new__


def _cow_copies(ops: list) -> int:
    """The copy-on-write copies among `ops` (a tiered cache adds `TierCopy` moves)."""
    return sum(1 for op in ops if op.__class__ is CopyOp)


class LiveState:
    """What a backend keeps per admitted sequence. `seq` is the very object admitted (or
    forked): calls find the state by request id, then insist on that object."""

    __slots__ = ("seq",)

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq


class Occupancy(NamedTuple):
    """A backend's answer to `_occupancy`: pages free and cached-unpinned (the rest are
    pinned), modelled index bytes, and backend-specific figures for `CacheStats.extra`."""

    pages_free: int
    pages_cached: int
    metadata_bytes: int
    extra: dict[str, Any]


class PagePartition(NamedTuple):
    """Every page id by state, gathered from a backend's own structures (free lists, index,
    tables), never from its counters: what the shared invariant check compares them with."""

    free: list[int]
    cached: list[int]
    pinned: list[int]


class PrefixCache(ABC):
    """Abstract prefix cache over a pool of `num_pages` pages of `page_size` tokens."""

    #: registry name (`--backend NAME`)
    name: ClassVar[str] = "abstract"
    #: True when, for a sequence whose page table already holds its next generated token,
    #: `grow` is a no-op and `commit` publishes nothing before the page fills. An engine may
    #: then batch those decode steps: it calls `commit` before the next `grow`, `fork` or
    #: `release` of the sequence. False (the safe default) = call both every step.
    decode_steps_are_noops: ClassVar[bool] = False
    #: The same promise under a condition, for a backend that cannot make it always
    #: (`decode_steps_are_noops` False). For a decode step of a sequence whose table already
    #: holds its next token, a grow and a commit are no-ops (but for the counts the later
    #: ones bring up to date) when:
    #: - `DECODE_NOOPS_WHILE_FREE`: at least one page is free (`pages_free() > 0`) at the
    #:   moment the grow would come (radix with its one-page reserve: a step finding no page
    #:   free evicts);
    #: - `DECODE_NOOPS_IF_PRIVATE`: `decode_steps_private(seq)` says so (paged: a write into
    #:   a shared block copies it).
    #: An engine may skip such a step's calls exactly when the condition holds, and calls
    #: `commit` before the sequence's next `grow`, `fork` or `release`. None: no condition.
    decode_noops_when: ClassVar[str | None] = None
    #: False when a commit ending past the prompt publishes nothing (only the computed count
    #: moves): none never publishes; radix inserts decode tokens at release, as SGLang's
    #: `cache_finished_req` does. Under one of the decode promises above an engine may then
    #: also skip a decode step whose token fills a page (True, the safe default: apc
    #: publishes a block as it fills, as vLLM's scheduler does), committing before the
    #: sequence's next grow, fork or release as always.
    commit_publishes_decode: ClassVar[bool] = True
    #: True when `match` can return a hit: the backend then overrides `_verify_match`
    reuses_kv: ClassVar[bool] = False
    #: True when `prefill` proves the match it has just made (`_prove_match`) before
    #: admitting it, as `admit` proves any match: apc's proof prepares its admission. False
    #: for a backend whose proof only checks (it prepares nothing `_admit` reads), so that of
    #: its own match, made in the same call with nothing in between, it can only pass (radix
    #: and its subclasses: radix recognises the match by the memo `_match` just wrote)
    proves_fresh_match: ClassVar[bool] = True
    #: True when the backend takes declared prefixes (`register_prefix`, `prefix_sequence`,
    #: `unregister_prefix`, and `Sequence.prefix_id`): paged
    declares_prefixes: ClassVar[bool] = False
    #: True when the backend publishes KV events to a listener (`subscribe`, `page_keys`):
    #: "pages stored" as it publishes full pages, "pages removed" as it evicts them
    #: (cachelib/kv_events.py). apc and radix do; none and paged publish nothing
    emits_kv_events: ClassVar[bool] = False
    #: the memory tiers the cache keeps KV on, GPU first (cachelib/tiers.py `TIER_NAMES`).
    #: A cache with more than the GPU may load part of a hit back from a lower tier inside
    #: `admit`: `seq.num_computed` after `admit` is then the match plus what was loaded
    #: (every token not recomputed), and `tier_traffic` reports what moved
    memory_tiers: ClassVar[tuple[str, ...]] = ("gpu",)
    #: with tiers: how its loads meet the forward pass (`cachelib.tiers.LOAD_TIMINGS`), read
    #: by a serving engine that charges transfer time (`take_transfers`); None: no tiers
    load_timing: ClassVar[str | None] = None
    #: its loads and stores are those of LMCache's vLLM connector: a step waits for the loads
    #: and stores decided in it, whatever its `load_timing` (experiments/engine/transfers.py
    #: `connector_step_seconds`)
    connector_steps: ClassVar[bool] = False
    #: the L3 tier (`cachelib.tiers.StorageTier`) when `"storage"` is in `memory_tiers`
    #: (an instance may add it: radix-hicache with `storage_backend`), else None
    storage_tier: Any = None
    #: run by a comparison that names no backend (`cachelib.registry.default_backends`)
    compared_by_default: ClassVar[bool] = True

    def __init__(self, num_pages: int, page_size: int) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise InvalidRequestError(f"page_size must be a positive int, got {page_size!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise InvalidRequestError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        #: stamped on every `Match` this cache makes (`Match.owner`): one `is` tells a match
        #: from another cache instance apart before anything else is looked at
        self.match_token = object()
        #: request id -> the backend's `LiveState` of each admitted sequence
        self._live: dict[str, Any] = {}
        #: a backend bumps this when a change may invalidate matches made before (an
        #: eviction, an unregistered prefix); a match from an older epoch is stale
        self._epoch = 0
        self._counters = dict(
            lookups=0, lookup_tokens=0, admitted=0, admitted_tokens=0, hit_tokens=0, evicted_pages=0, copied_pages=0
        )
        #: who hears this cache's KV events (`subscribe`); None = no one, and then the only
        #: cost of events on the hot path is this attribute tested against None
        self._kv_listener: KvEventListener | None = None

    # -- the contract ---------------------------------------------------------------

    def match(self, seq: Sequence) -> Match:
        """Longest cached prefix of `seq` that can be reused. Pins nothing.

        At most `len(seq) - 1` tokens: the last token is always computed, for its logits.
        A backend may reorganise its index (split a node, refresh recency); it never
        changes which pages are free, cached or pinned.
        """
        if seq.__class__ is not Sequence and not isinstance(seq, Sequence):
            raise InvalidRequestError(f"expected a Sequence, got {type(seq).__name__}")
        num_tokens, pages, handle = self._match(seq)
        c = self._counters
        c["lookups"] += 1
        c["lookup_tokens"] += seq.num_tokens  # `len(seq)` less its Python call
        # `Match(...)` less its generated `__new__` (a Python call): the same tuple
        return _new_match(Match, (seq.request_id, num_tokens, pages, handle, self._epoch, self.match_token))

    def admit(self, seq: Sequence, match: Match, num_tokens: int) -> list[CopyOp] | None:
        """Pin `match`'s pages and allocate pages so the table covers `num_tokens` tokens.

        Evicts unpinned cached pages as the design does. Returns the copies the executor
        must do first, or `None` (and changes nothing) when the pages do not fit.
        Raises `StaleMatchError` if the cache changed since `match` was made (an eviction,
        an unregistered prefix): match again.
        """
        self._check_new(seq)
        self._check_match(seq, match)
        hit = match.num_tokens
        if num_tokens.__class__ is not int or not (hit or 1) <= num_tokens <= seq.num_tokens:
            self._check_num_tokens(seq, num_tokens, hit or 1)  # raises (its fast path, inlined)
        admitted = self._admit(seq, match, num_tokens)
        if admitted is None:
            return None
        state, ops = admitted
        self._record_admission(seq, state, ops, hit)
        return ops

    def _record_admission(self, seq: Sequence, state: Any, ops: list, hit: int) -> None:
        """What `admit` (and `prefill`) keep of an admission that fit: the live state under
        the request id, and the counters."""
        self._live[seq.request_id] = state
        c = self._counters
        c["admitted"] += 1
        c["admitted_tokens"] += seq.num_tokens
        c["hit_tokens"] += hit
        if ops:
            c["copied_pages"] += _cow_copies(ops)

    def can_admit(self, seq: Sequence, match: Match, num_tokens: int) -> bool:
        """Would `admit(seq, match, num_tokens)` succeed right now (return copies, not `None`)?

        Read-only: it evicts nothing, refreshes no recency, moves no counter, so it may be
        called between `match` and `admit` any number of times. It validates exactly as
        `admit` does and raises the same errors (`StaleMatchError` for a stale match,
        `InvalidRequestError` for an admitted sequence, a foreign or forged match, or
        `num_tokens` outside `[max(hit, 1), len(seq)]`).
        """
        self._check_new(seq)
        self._check_match(seq, match)
        self._check_num_tokens(seq, num_tokens, match.num_tokens or 1)
        return self._can_admit(seq, match, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> list[CopyOp] | None:
        """Extend an admitted sequence's table to cover `num_tokens` tokens; `None` if no room."""
        state = self._check_live(seq)
        if num_tokens.__class__ is not int or not 0 <= num_tokens <= seq.num_tokens:
            self._check_num_tokens(seq, num_tokens, 0)  # raises (its fast path, inlined)
        ops = self._grow(seq, state, num_tokens)
        if ops:
            self._counters["copied_pages"] += _cow_copies(ops)
        return ops

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """The KV of the first `num_computed` tokens is written; publish what the design publishes.

        The count never goes back and never passes the pages the table covers."""
        state = self._commit_state(seq)
        if num_computed.__class__ is not int or not seq.num_computed <= num_computed <= seq.num_tokens:
            self._check_num_tokens(seq, num_computed, seq.num_computed)  # raises (its fast path, inlined)
        if num_computed > len(seq.page_table) * self.page_size:
            raise InvalidRequestError(
                f"request {seq.request_id!r}: {num_computed} tokens computed but pages cover "
                f"{len(seq.page_table) * self.page_size}"
            )
        self._commit(seq, state, num_computed)

    # -- two calls the engines make back to back, validated once ---------------------------

    def prefill(self, seq: Sequence) -> tuple[Match, list[CopyOp] | None, int]:
        """`match(seq)`, then `admit(seq, m, len(seq))` and, when that fits, `commit(seq,
        len(seq))`: a whole prompt computed in one step (the replay protocol's prefill).

        The same hooks in the same order as the three calls, so the same decisions, counters
        and errors. What cannot fail is not checked again: the match is this call's own, so
        of `_check_match` only the proof against the index runs (`_prove_match`, where a
        backend may prepare its admission; skipped where the backend declares its own fresh
        match needs none, `proves_fresh_match`), not the tests for a foreign, forged or
        stale match; commit needs no live-state lookup (admit just made the state) and no range
        test (the count is the whole sequence). A sequence already admitted is refused
        before the lookup, which would refresh recency: a refused call changes nothing.
        Returns (the match, the copies or None when it does not fit, the sequence's
        computed count right after admit: the match plus what a tiered cache loaded
        back)."""
        self._check_new(seq)
        m = self.match(seq)
        n = seq.num_tokens
        if self.proves_fresh_match:
            self._prove_match(seq, m)
        admitted = self._admit(seq, m, n)
        if admitted is None:
            return m, None, 0
        state, ops = admitted
        self._record_admission(seq, state, ops, m.num_tokens)
        computed = seq.num_computed
        if n > len(seq.page_table) * self.page_size:
            self._refuse_uncovered(seq, n)
        self._commit(seq, state, n)
        return m, ops, computed

    def grow_commit(self, seq: Sequence, num_tokens: int) -> list[CopyOp] | None:
        """`grow(seq, num_tokens)` and, when that fits, `commit(seq, num_tokens)`: tokens whose
        KV is written by the step that allocates their pages (a decode run, a prefill
        chunk). `num_tokens` must be in commit's range, `[seq.num_computed, len(seq)]`,
        checked before the grow: a call that would fail grows nothing. The same hooks,
        decisions and counters as the two calls."""
        state = self._check_live(seq)
        if num_tokens.__class__ is not int or not seq.num_computed <= num_tokens <= seq.num_tokens:
            self._check_num_tokens(seq, num_tokens, seq.num_computed)  # raises (its fast path, inlined)
        ops = self._grow(seq, state, num_tokens)
        if ops is None:
            return None
        if ops:
            self._counters["copied_pages"] += _cow_copies(ops)
        if num_tokens > len(seq.page_table) * self.page_size:
            self._refuse_uncovered(seq, num_tokens)
        self._commit(seq, state, num_tokens)
        return ops

    def _refuse_uncovered(self, seq: Sequence, num_tokens: int) -> None:
        """An admit or grow to `num_tokens` fit but left the table short of them: the
        backend is wrong, not its caller (commit would refuse the count)."""
        raise InvariantViolation(
            f"{self.name}: request {seq.request_id!r} was given pages for "
            f"{len(seq.page_table) * self.page_size} tokens when it asked for {num_tokens}"
        )

    def fork(self, parent: Sequence, child: Sequence) -> list[CopyOp] | None:
        """Let `child` continue from `parent`'s computed tokens and KV (sampling, beam search).

        `child` must hold the parent's computed tokens under the same extra keys and must
        not be admitted. Returns the copies to do, or `None` when the pages for them do not fit.
        """
        state = self._check_live(parent)
        self._check_new(child)
        self._check_fork(parent, child)
        forked = self._fork(parent, state, child)
        if forked is None:
            return None
        child_state, ops = forked
        self._live[child.request_id] = child_state
        if ops:
            self._counters["copied_pages"] += _cow_copies(ops)
        return ops

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was preempted: unpin its pages. Releasing twice raises."""
        state = self._check_live(seq)
        self._release(seq, state)
        del self._live[seq.request_id]

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` unpinned cached pages if there are that many; returns
        how many were freed. `evict(0)` is always safe and frees nothing."""
        if num_pages.__class__ is not int or num_pages < 0:
            raise InvalidRequestError(f"evict: num_pages must be a non-negative int, got {num_pages!r}")
        return self._evict(num_pages) if num_pages else 0

    def stats(self) -> CacheStats:
        """Counters and occupancy. Read-only."""
        occ = self._occupancy()
        return CacheStats(
            backend=self.name,
            num_pages=self.num_pages,
            page_size=self.page_size,
            pages_free=occ.pages_free,
            pages_cached=occ.pages_cached,
            pages_pinned=self.num_pages - occ.pages_free - occ.pages_cached,
            metadata_bytes=occ.metadata_bytes,
            extra=occ.extra,
            **self._counters,
        )

    def check_invariants(self) -> None:
        """Raise `InvariantViolation` on any broken invariant. Read-only, O(size of cache).

        The shared part (`cachelib.invariants`: every page exactly one of free / cached /
        pinned, the counts `stats()` reports, pinned pages exactly those of live tables and
        registrations) runs first, then the backend's own `_check_invariants`."""
        from cachelib.invariants import check_shared

        check_shared(self)
        self._check_invariants()

    def tier_traffic(self) -> dict[str, int]:
        """Tokens (and bytes) moved between memory tiers so far; empty with one tier."""
        return {}

    def tier_capacities(self) -> dict[str, int]:
        """The most tokens of KV each of `memory_tiers` holds, GPU first; 0 for a tier
        without a cap (SGLang's file storage by default). Their sum is the capacity the
        tiered Belady bound is taken at (experiments/runs/runner.py `tiered_bounds`): no policy
        moving KV between these tiers reuses more than one cache of that size; with an
        uncapped tier the bound is the infinite cache's."""
        return {"gpu": self.num_pages * self.page_size}

    def storage_hit_tokens(self, seq: Sequence) -> int:
        """Of the tokens the admission of the live `seq` loaded back from a lower tier (its
        `num_computed` after `admit` less its match), those that came from storage (L3); the
        rest came from host memory. 0 for a cache without a storage tier. A sequence that is
        not live (released, never admitted, an impostor) is refused: its admission is gone,
        and 0 would read as "nothing came from storage"."""
        self._check_live(seq)
        return self._storage_hit_tokens(seq)

    def _storage_hit_tokens(self, seq: Sequence) -> int:
        """`storage_hit_tokens` of a live `seq` (checked)."""
        return 0

    def storage_prefetch(self, seq: Sequence, match: Match) -> StoragePrefetch:
        """The storage (L3) prefetch `seq` would issue now, past `match` and whatever lower
        tier continues it (`cachelib.tiers.StoragePrefetch`: tokens asked, tokens read);
        changes nothing. A serving engine times that read from the request's arrival and
        tells `limit_prefetch` what arrived. (0, 0) for a cache without a storage tier."""
        return NO_PREFETCH

    def limit_prefetch(self, seq: Sequence, tokens: int) -> None:
        """The next `admit` of `seq` takes at most `tokens` tokens (whole pages) of its
        storage prefetch: what arrived by the time the engine scheduled it. Without a call
        the whole prefetch is taken (the replay protocol: transfers are instantaneous)."""
        raise InvalidRequestError(f"a {self.name} cache has no storage tier to prefetch from")

    # -- transfer timing (serving): the cache says what moved, the engine prices it -------

    def time_transfers(self) -> None:
        """From now on, record every transfer between tiers for `take_transfers`, and hold
        what a transfer in flight holds in the reference (a node being backed up stays
        locked) until `finish_transfers` names its ticket: a serving engine that charges
        transfer time calls this before the first request. Without it (the replay protocol)
        transfers complete inside the call that issues them. A one-tier cache refuses."""
        raise InvalidRequestError(f"a {self.name} cache has no memory tiers below the GPU: no transfers to time")

    def take_transfers(self) -> list:
        """The `cachelib.tiers.TierTransfer`s decided since the last call, in decision order
        (empty unless `time_transfers` was called)."""
        return []

    def finish_transfers(self, tickets: list[int]) -> None:
        """The transfers with these tickets completed: release what they held. Each ticket
        must be one in flight, named once; otherwise nothing is done and the call is refused."""
        if not isinstance(tickets, (list, tuple)) or any(
            isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in tickets
        ):
            raise InvalidRequestError(f"finish_transfers: tickets must be a list of ints, got {tickets!r:.80}")
        self._finish_transfers([int(t) for t in tickets])

    def _finish_transfers(self, tickets: list[int]) -> None:
        """`finish_transfers` of a checked list of ints."""
        if tickets:
            raise InvalidRequestError(f"a {self.name} cache issued no transfer tickets, got {tickets!r:.80}")

    def tier_bytes(self, tokens: int) -> int:
        """Bytes of KV in `tokens` tokens, as the tiers count them (`HostTier.bytes_of`)."""
        raise InvalidRequestError(f"a {self.name} cache has no memory tiers below the GPU")

    def tier_link_seconds(self, src: str, dst: str, tokens: int) -> float:
        """Seconds to move `tokens` tokens of KV from tier `src` to tier `dst` at this cache's
        tier bandwidths (what a serving engine charges; the tier objects of
        `cachelib/tiers.py` hold the figures). `tokens` must be a non-negative int and the
        link one of this cache's (`memory_tiers`): anything else is refused, never priced."""
        if isinstance(tokens, bool) or not isinstance(tokens, (int, np.integer)) or tokens < 0:
            raise InvalidRequestError(f"tier_link_seconds: tokens must be a non-negative int, got {tokens!r}")
        if src == dst or src not in self.memory_tiers or dst not in self.memory_tiers:
            raise InvalidRequestError(
                f"a {self.name} cache has no tier link {src!r} -> {dst!r} (its tiers: {', '.join(self.memory_tiers)})"
            )
        return self._tier_link_seconds(src, dst, int(tokens))

    def _tier_link_seconds(self, src: str, dst: str, tokens: int) -> float:
        """`tier_link_seconds` of a checked link and count."""
        raise InvalidRequestError(f"a {self.name} cache has no tier link {src} -> {dst}")

    def use_storage_pool(self, pool: Any) -> None:
        """Read and write `pool` (a `cachelib.tiers.StorageTier` of another replica) as this
        cache's storage tier: a pool shared by a cluster. Only a cache whose `storage_tier`
        is shared takes one."""
        raise InvalidRequestError(f"a {self.name} cache has no storage tier to share")

    def pages_pinned(self) -> int:
        """Pages held by live sequences (or pinned registrations): `stats().pages_pinned`.
        Engines ask this every step; a backend whose `_occupancy()` is not O(1) overrides it."""
        occ = self._occupancy()
        return self.num_pages - occ.pages_free - occ.pages_cached

    def pages_free(self) -> int:
        """Pages free now (`stats().pages_free`): what a `DECODE_NOOPS_WHILE_FREE` promise
        reads. A backend whose `_occupancy()` is not O(1) overrides it."""
        return self._occupancy().pages_free

    def decode_steps_private(self, seq: Sequence) -> bool:
        """For a `DECODE_NOOPS_IF_PRIVATE` backend: True when a grow or commit of the live
        `seq` within the pages its table holds copies nothing and publishes nothing (no
        block a write from `seq.num_computed` on can land in is shared). Read-only. The
        answer holds until the next call that names `seq` (grow, commit, fork as parent or
        child, release): no call on another sequence can share the blocks `seq` writes."""
        raise InvalidRequestError(
            f"a {self.name} cache makes no per-sequence decode promise (its decode_noops_when is "
            f"{self.decode_noops_when!r})"
        )

    def pages_reclaimable(self) -> int:
        """Pages an allocation can get without touching a live sequence: free + cached."""
        occ = self._occupancy()
        return occ.pages_free + occ.pages_cached

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    # -- KV events --------------------------------------------------------------------

    def subscribe(self, listener: KvEventListener) -> None:
        """From now on, tell `listener` of every page this cache publishes (`PagesStored`)
        and every published page it evicts (`PagesRemoved`), as each happens, inside the
        call that does it (cachelib/kv_events.py). Decisions do not change: events only
        report them. More listeners may subscribe; each hears every event.

        Subscribe before the cache publishes its first page: a listener rebuilds the
        cache's content from events alone, so one that missed a `PagesStored` could not
        place the `PagesRemoved` that follows. A backend that does not emit
        (`emits_kv_events` False) refuses."""
        if not self.emits_kv_events:
            raise InvalidRequestError(f"a {self.name} cache publishes no KV events (its emits_kv_events is False)")
        self._kv_subscribed()
        current = self._kv_listener
        if current is None:
            self._kv_listener = listener
        elif isinstance(current, KvEventFanout):
            self._kv_listener = KvEventFanout(*current.listeners, listener)
        else:
            self._kv_listener = KvEventFanout(current, listener)

    def page_keys(self) -> PageKeys:
        """How this cache's events name pages: a router computes a request's page keys with
        it to look them up in what the events told it. Only for `emits_kv_events` backends."""
        raise InvalidRequestError(f"a {self.name} cache publishes no KV events, hence no page keys")

    def _emit_kv_event(self, event: KvEvent) -> None:
        """Tell the listeners (a backend calls this only after testing `_kv_listener`)."""
        self._kv_listener.on_kv_event(event)

    def _kv_subscribed(self) -> None:
        """A listener is subscribing (emitting backends override this): refuse if a page is
        published already, and start keeping what events need."""
        raise InvalidRequestError(f"a {self.name} cache publishes no KV events")

    # -- what a backend implements ------------------------------------------------------

    @abstractmethod
    def _match(self, seq: Sequence) -> tuple[int, tuple[int, ...], Any]:
        """(hit tokens, their pages, the backend's handle) for `seq`; the base stamps the
        request id, the epoch and this cache's `match_token` on the `Match`."""

    @abstractmethod
    def _can_admit(self, seq: Sequence, match: Match, num_tokens: int) -> bool:
        """Whether `_admit(seq, match, num_tokens)` (arguments proven sane) would succeed
        now. Read-only. `_admit` must decide fit through this same predicate (call it, or a
        helper both call), so that `can_admit` and `admit` never disagree."""

    @abstractmethod
    def _admit(self, seq: Sequence, match: Match, num_tokens: int) -> tuple[LiveState, list[CopyOp]] | None:
        """Pin the proven `match`, set `seq.page_table` over `num_tokens` tokens and
        `seq.num_computed`; return (the new live state, copies), or `None` changing nothing
        (exactly when `_can_admit` says no)."""

    @abstractmethod
    def _grow(self, seq: Sequence, state: LiveState, num_tokens: int) -> list[CopyOp] | None:
        """Extend the table of the live `seq` to `num_tokens` (already in range)."""

    @abstractmethod
    def _commit(self, seq: Sequence, state: LiveState, num_computed: int) -> None:
        """Set `seq.num_computed` (checked: not backwards, within the table) and publish."""

    @abstractmethod
    def _fork(self, parent: Sequence, state: LiveState, child: Sequence) -> tuple[LiveState, list[CopyOp]] | None:
        """Map the checked `child` onto `parent`'s KV; (the child's live state, copies) or `None`."""

    @abstractmethod
    def _release(self, seq: Sequence, state: LiveState) -> None:
        """Unpin the live `seq`'s pages (the base then forgets its state)."""

    @abstractmethod
    def _evict(self, num_pages: int) -> int:
        """Free at least `num_pages` (> 0) cached pages if there are that many; how many freed."""

    @abstractmethod
    def _occupancy(self) -> Occupancy:
        """Pages free and cached, index bytes, extra figures (for `stats`). Read-only."""

    @abstractmethod
    def _page_partition(self) -> PagePartition:
        """Every page by state, from the backend's structures (for `check_invariants`)."""

    @abstractmethod
    def _check_invariants(self) -> None:
        """The backend's own invariants (the shared ones are checked already)."""

    def _registered_pages(self) -> list[int]:
        """Pages pinned without a live sequence (paged's declared prefixes). Default none."""
        return []

    def _verify_match(self, seq: Sequence, match: Match) -> None:
        """Prove a match against the index (backends with `reuses_kv` override this).

        Called for a hit (`num_tokens > 0`) and for a miss that carries a handle (None and
        an empty list are no handle). The default is for backends that never return either:
        such a match is another cache's, or forged."""
        raise InvalidRequestError(
            f"request {seq.request_id!r}: a {self.name} cache never reuses KV, but the match claims "
            f"{match.num_tokens} cached tokens / handle {match.handle!r:.40} (made by another cache, or forged)"
        )

    # -- the checks, once for every backend ---------------------------------------------

    def _check_new(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence) or not isinstance(seq.request_id, str):
            raise InvalidRequestError(f"expected a Sequence with a str request id, got {seq!r}")
        if seq.request_id in self._live:
            raise InvalidRequestError(f"request {seq.request_id!r} is already admitted")

    def _check_live(self, seq: Sequence) -> Any:
        """The live state of `seq`; raises unless `seq` is the very object admitted.

        A second `Sequence` carrying a live id (another request, a re-created one) would
        otherwise grow, publish or free pages through a table that is not its own."""
        try:
            state = self._live[seq.request_id]
        except (AttributeError, KeyError, TypeError):
            state = None
        if state is None or state.seq is not seq:
            self._refuse_live(seq)
        return state

    #: the state `commit` writes through: the live one (paged overrides it to take a declared
    #: prefix's own sequence too, which is never admitted); an alias, not a wrapper, since
    #: commit runs every decode step
    _commit_state = _check_live

    def _refuse_live(self, seq: object) -> None:
        """Raise the error that says why `seq` is not a live sequence of this cache."""
        if not isinstance(seq, Sequence) or not isinstance(seq.request_id, str):
            raise InvalidRequestError(f"expected a Sequence with a str request id, got {seq!r}")
        if seq.request_id not in self._live:
            raise UnknownSequenceError(f"request {seq.request_id!r} is not admitted (never, or already released)")
        raise InvalidRequestError(
            f"request {seq.request_id!r} is admitted as another Sequence object; pass the one given to admit/fork"
        )

    def _check_fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` must continue `parent`: its computed tokens, under the same extra keys
        (salt, LoRA, multimodal inputs change the KV, so a child under other keys cannot
        share a single page of it)."""
        computed = parent.num_computed
        if len(child) < computed or not np.array_equal(child.tokens[:computed], parent.tokens[:computed]):
            raise InvalidRequestError(
                f"fork: {child.request_id!r} does not hold {parent.request_id!r}'s computed tokens"
            )
        if child.extra is not parent.extra and child.extra != parent.extra:
            raise InvalidRequestError(
                f"fork: {child.request_id!r} has other extra keys than {parent.request_id!r} "
                f"({child.extra} vs {parent.extra}); its KV cannot come from the parent's"
            )

    def _check_num_tokens(self, seq: Sequence, num_tokens: int, lo: int) -> None:
        if num_tokens.__class__ is int and lo <= num_tokens <= len(seq):
            return  # the hot path: one type check, one comparison
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
            raise InvalidRequestError(f"num_tokens must be an int, got {num_tokens!r}")
        raise InvalidRequestError(f"request {seq.request_id!r}: num_tokens {num_tokens} outside [{lo}, {len(seq)}]")

    def _check_match(self, seq: Sequence, match: Match) -> None:
        """Refuse a `Match` that does not describe `seq`'s prefix in this cache now.

        The generic part (type, request id, owner, a sane token count and page tuple, the
        epoch) is checked here; `_verify_match` then proves the hit against the backend's
        own index, so a match made for other tokens under the same id, by another cache, or
        forged can never pin a page that does not hold `seq`'s KV. A match made stale by
        the cache changing in between raises `StaleMatchError`.
        """
        if match.__class__ is not Match:
            raise InvalidRequestError(f"request {seq.request_id!r}: expected a Match, got {type(match).__name__}")
        rid, n, pages, handle, epoch, owner = match  # one unpack: this runs on every admit
        if rid != seq.request_id:
            raise InvalidRequestError(f"match does not belong to request {seq.request_id!r}")
        if owner is not self.match_token:
            raise InvalidRequestError(f"request {seq.request_id!r}: the match was made by another cache (or forged)")
        if (
            n.__class__ is not int
            or not 0 <= n < len(seq)
            or pages.__class__ is not tuple
            or len(pages) != -(-n // self.page_size)
        ):
            raise InvalidRequestError(
                f"request {seq.request_id!r}: match of {n!r} tokens over {len(pages) if isinstance(pages, tuple) else pages!r} "
                f"pages is not a match of this {len(seq)}-token sequence"
            )
        if epoch != self._epoch:
            raise StaleMatchError(f"request {seq.request_id!r}: the cache changed since this match; match again")
        self._prove_match(seq, match)

    def _prove_match(self, seq: Sequence, match: Match) -> None:
        """`_verify_match` for a hit, or a miss with a handle (radix's namespace root): neither
        may smuggle a node or blocks of another cache, sequence or namespace into admit."""
        handle = match.handle
        if match.num_tokens or (handle is not None and not (handle.__class__ is list and not handle)):
            self._verify_match(seq, match)
