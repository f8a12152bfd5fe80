"""Random walks over the cache contract, with a shadow model of every sequence's KV.

One walk drives one cache (`WalkConfig`: backend, page size, pages, options, and whether
tier transfers complete at once or wait for tickets the walk finishes later) through the
calls an engine makes, and through every misuse a caller can commit. Its randomness comes
from a `Draws` object, so the same walk runs under two drivers:
- hypothesis (`tests/test_properties.py`): few steps, shrunk to a minimal failing sequence;
- a seeded `random.Random` (`tests/test_random_walks.py`): hundreds of thousands of calls
  in the suite's time, over every tier configuration.

A shadow KV store stands in for the GPU: every computed slot holds a value that identifies
the whole prefix up to it *and* the extra keys it was computed under, as real KV does. After
every step the backend's own invariants are checked (with content tracking on: apc
`verify_tokens`, radix `track_contents`), and so is the shadow: every live sequence's
computed tokens must read back their own prefix through its page table, and every match
must return pages holding exactly the matched prefix. Copy-on-write bugs, wrong hits, lost
pages and KV shared across salts or adapters all show up here.

Besides the ordinary calls a walk
- asks `can_admit` before every admit: it must give admit's answer (or raise admit's error),
- admits matches made many steps earlier (stale: `StaleMatchError`, or a hit still exact),
- misuses the contract every way a caller can (an impostor `Sequence` with a live id, a
  match made for other tokens / by another cache / forged, a fork into a child under other
  extra keys, wrong types, unknown transfer tickets, a negative transfer size, a released
  sequence's storage hits) and requires a `CacheError` and a *deep* snapshot of the cache
  (every object, order and count: `tests/snapshots.py`) unchanged,
- uses token ids across the whole int32 range (0 and 2**31 - 1), and a larger cache,
- with timed transfers (`time_transfers`, as the serving engine runs a tiered cache):
  collects every transfer's ticket and finishes them later, any subset in any order, and
  releases, evicts and admits while they are in flight.

Every contract call goes through a counting proxy (`Counted`), so a driver can report how
many operations it made.
"""

from __future__ import annotations

import hashlib
import random
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from cachelib import (
    CacheError,
    ExtraKeys,
    Sequence,
    StaleMatchError,
    StorageCopy,
    TierCopy,
    available_backends,
    create_cache,
)
from tests.snapshots import deep_state, first_difference

TOP = 2**31 - 1  # the largest int32 token id
PREFIXES = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9],
    [1, 2, 3, 7, 7],
    [4, 4, 4, 4, 4, 4],
    [0, TOP, 0, TOP, 5, 6, 0],
    [TOP, TOP - 1, TOP, TOP - 1],
    [],
]
EDGE_TOKENS = [0, TOP, TOP - 1]
EXTRAS = [ExtraKeys(), ExtraKeys(), ExtraKeys(cache_salt="t1"), ExtraKeys(lora_id=2)]
OTHER_EXTRAS = [ExtraKeys(cache_salt="t2"), ExtraKeys(lora_id=7), ExtraKeys(cache_salt="t1", lora_id=2)]
#: the calls counted: the contract's operations (docs/design.md §3), paged's prefix
#: declarations and the tiers' transfer calls; `stats`, `check_invariants` and
#: `take_transfers` (after every step) are tallied apart, as observation
OPERATIONS = frozenset(
    {
        "match",
        "can_admit",
        "admit",
        "grow",
        "commit",
        "prefill",
        "grow_commit",
        "fork",
        "release",
        "evict",
        "register_prefix",
        "unregister_prefix",
        "finish_transfers",
        "limit_prefetch",
        "storage_prefetch",
        "storage_hit_tokens",
        "tier_link_seconds",
    }
)
OBSERVATIONS = frozenset({"stats", "check_invariants", "take_transfers"})
MISUSES = ("impostor", "other_tokens", "foreign", "forged", "fork_extra", "types", "fused", "tiers")


class Draws(Protocol):
    """Where a walk's choices come from (hypothesis's `data`, or a seeded generator)."""

    def integer(self, lo: int, hi: int) -> int:
        """An int in [lo, hi]."""

    def boolean(self) -> bool: ...

    def pick(self, options: list | tuple):
        """One of `options`."""

    def tokens(self, min_size: int, max_size: int) -> list[int]:
        """Token ids: mostly small (so prompts share prefixes), sometimes the int32 edges."""


class RandomDraws:
    """`Draws` from a seeded `random.Random` (the fast driver)."""

    __slots__ = ("rng",)

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, lo: int, hi: int) -> int:
        return self.rng.randint(lo, hi)

    def boolean(self) -> bool:
        return self.rng.random() < 0.5

    def pick(self, options):
        return options[self.rng.randrange(len(options))]

    def tokens(self, min_size: int, max_size: int) -> list[int]:
        rng = self.rng
        n = rng.randint(min_size, max_size)
        return [rng.randint(0, 9) if rng.random() < 0.8 else EDGE_TOKENS[rng.randrange(3)] for _ in range(n)]


@dataclass(frozen=True)
class WalkConfig:
    """One cache a walk drives: `backend` with `options`, `num_pages` pages of `page_size`,
    prompts `scale` times longer (a larger cache holds long prompts of several pages), and
    `timed`: tier transfers are tickets finished later (`time_transfers`), not at once."""

    backend: str
    page_size: int
    num_pages: int
    options: dict = field(default_factory=dict)
    scale: int = 1
    timed: bool = False
    label: str = ""

    @property
    def name(self) -> str:
        mode = "timed" if self.timed else "instant"
        return f"{self.label or self.backend}-p{self.page_size}-n{self.num_pages}-{mode}"


class Counted:
    """The cache, with every contract call counted (attribute access = one call)."""

    def __init__(self, cache, tally: Counter) -> None:
        self._cache = cache
        self._tally = tally

    def __getattr__(self, name: str):
        if name in OPERATIONS or name in OBSERVATIONS:
            self._tally[name] += 1
        return getattr(self._cache, name)


class Misused(AssertionError):
    """A misuse that should have raised a CacheError was accepted."""


class ContractWalk:
    """The state of one walk: the cache (and a twin with the same history of prefixes, the
    source of foreign matches), the shadow KV, the live sequences, matches kept for later
    and, when timed, the transfer tickets in flight. `step(d)` makes one random operation;
    `check()` runs the invariants and the shadow; `teardown()` finishes and releases all."""

    def __init__(self, config: WalkConfig, tally: Counter) -> None:
        self.config = config
        self.backend = config.backend
        self.page_size = config.page_size
        self.num_pages = config.num_pages
        self.scale = config.scale
        self.raw = create_cache(self.backend, num_pages=self.num_pages, page_size=self.page_size, **config.options)
        self.tiered = len(self.raw.memory_tiers) > 1
        self.timed = config.timed
        if self.timed:
            self.raw.time_transfers()
        self.cache = Counted(self.raw, tally)
        self.tally = tally
        self.twin = Counted(
            create_cache(self.backend, num_pages=self.num_pages, page_size=self.page_size, **config.options), tally
        )
        self.kv: dict[int, list[bytes | None]] = {}
        self.host_kv: dict[int, list[bytes | None]] = {}  # a tiered cache's host pages
        self.storage_kv: dict[bytes, list[bytes | None]] = {}  # a storage tier's pages, by key
        self.live: dict[str, Sequence] = {}
        self.released: list[Sequence] = []  # a few finished sequences, for misuse
        self.pending: list = []  # (sequence, match) made earlier, admitted later
        self.values: dict[str, tuple] = {}  # request id -> (seq, running hash, prefix values)
        self.prefixes: dict[tuple, int] = {}  # paged: declared prefix tokens -> prefix id
        self.twin_prefixes: dict[tuple, int] = {}  # the same on the twin
        self.tickets: list[int] = []  # transfers in flight (timed)
        self.finished_tickets: list[int] = []  # a few completed, for misuse
        self.counter = 0
        if self.backend == "paged":
            for p in (PREFIXES[0], PREFIXES[3]):
                self._declare(p * self.scale)

    # -- the driver's interface -------------------------------------------------------

    def operations(self) -> list[str]:
        """The operations whose preconditions hold now."""
        ops = ["admit", "prefill", "match_for_later", "evict", "misuse"]
        if self.pending:
            ops.append("admit_stale")
        if self.live:
            ops += ["grow", "decode", "fork", "release"]
        if self.backend == "paged" and self.prefixes:
            ops.append("redeclare_prefix")
        if self.tickets:
            ops.append("finish_transfers")
        return ops

    def step(self, d: Draws) -> str:
        """One operation drawn among those that apply; returns its name."""
        op = d.pick(self.operations())
        getattr(self, f"op_{op}")(d)
        self._collect_tickets()
        return op

    def check(self) -> None:
        self.cache.check_invariants()
        for s in self.live.values():
            assert self._reads_back(s, s.page_table, s.num_computed), f"{s.request_id} lost its KV"
        st_ = self.cache.stats()
        assert st_.pages_free + st_.pages_cached + st_.pages_pinned == self.num_pages

    def teardown(self) -> None:
        """Every transfer completes and every sequence is released: nothing stays pinned."""
        for s in list(self.live.values()):
            self.cache.release(s)
        # a release inserts what the request computed, which may start backups: twice
        for _ in range(2):
            self._collect_tickets()
            if self.tickets:
                self.cache.finish_transfers(self.tickets)
                self.tickets = []
        self.cache.check_invariants()
        st_ = self.cache.stats()
        assert st_.pages_pinned == st_.extra.get("prefix_pages", 0), "pages stay pinned after every release"

    def _collect_tickets(self) -> None:
        if self.timed:
            for t in self.cache.take_transfers():
                if t.ticket is not None:
                    self.tickets.append(t.ticket)

    # -- shadow KV ------------------------------------------------------------------

    def _prefix_values(self, s: Sequence, n: int) -> list[bytes]:
        """What the KV at positions 0..n-1 of `s` holds: a function of tokens 0..t and the
        extra keys (causal attention under an adapter / a tenant's salt), memoised."""
        entry = self.values.get(s.request_id)
        if entry is None or entry[0] is not s:
            h = hashlib.blake2b(repr((s.extra.cache_salt, s.extra.lora_id)).encode(), digest_size=8)
            entry = (s, h, [])
            if self.live.get(s.request_id) is s:
                self.values[s.request_id] = entry
        _, h, vals = entry
        toks = s.tokens
        for t in range(len(vals), n):
            h.update(int(toks[t]).to_bytes(4, "little"))
            vals.append(h.copy().digest())
        return vals

    def _apply(self, ops) -> None:
        for op in ops:
            if isinstance(op, TierCopy):  # a tiered cache's move, in order
                for dev, host in zip(op.device_pages, op.host_pages, strict=True):
                    if op.to_host:
                        self.host_kv[host] = list(self.kv.get(dev, [None] * self.page_size))
                    else:
                        self.kv[dev] = list(self.host_kv[host])
            elif isinstance(op, StorageCopy):  # host <-> storage, by page key
                for host, key in zip(op.host_pages, op.keys, strict=True):
                    if op.to_storage:
                        self.storage_kv[key] = list(self.host_kv[host])
                    else:
                        self.host_kv[host] = list(self.storage_kv[key])
            else:
                self.kv[op.dst_page] = list(self.kv.get(op.src_page, [None] * self.page_size))

    def _write(self, s: Sequence, upto: int, start: int | None = None) -> None:
        """The KV of positions `start` (default: the computed count) .. `upto` - 1."""
        B = self.page_size
        vals = self._prefix_values(s, upto)
        for t in range(s.num_computed if start is None else start, upto):
            self.kv.setdefault(s.page_table[t // B], [None] * B)[t % B] = vals[t]

    def _reads_back(self, s: Sequence, pages, n: int) -> bool:
        B = self.page_size
        vals = self._prefix_values(s, n)
        empty = [None] * B
        return all(self.kv.get(pages[t // B], empty)[t % B] == vals[t] for t in range(n))

    def _new_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _declare(self, tokens: list[int]) -> None:
        pid = self.cache.register_prefix(tokens)
        if pid is None:
            return
        ps = self.cache.prefix_sequence(pid)
        self._write(ps, len(ps))
        self.cache.commit(ps, len(ps))
        self.prefixes[tuple(tokens)] = pid
        if tuple(tokens) not in self.twin_prefixes:  # declared once on the twin: its ids drift apart
            twin_pid = self.twin.register_prefix(tokens)
            tps = self.twin.prefix_sequence(twin_pid)
            self.twin.commit(tps, len(tps))
            self.twin_prefixes[tuple(tokens)] = twin_pid

    def _sequence(self, prefix, suffix, extra, rid: str | None = None) -> Sequence:
        tokens = list(prefix) * self.scale + list(suffix) * self.scale or [0]
        pid = None
        if self.backend == "paged" and extra == ExtraKeys():
            for p, i in self.prefixes.items():
                if tokens[: len(p)] == list(p):
                    pid = i
        return Sequence(rid or self._new_id(), tokens, extra, prefix_id=pid)

    def _draw_sequence(self, d: Draws) -> Sequence:
        return self._sequence(d.pick(PREFIXES), d.tokens(0, 8), d.pick(EXTRAS))

    def _limit_prefetch(self, d: Draws, s: Sequence, m) -> None:
        """Timed with storage: what of the prefetch arrived before the engine scheduled `s`
        (the engine's `storage_prefetch` + `limit_prefetch`), drawn."""
        if self.timed and self.raw.storage_tier is not None:
            wanted = self.cache.storage_prefetch(s, m)
            if wanted.tokens:
                self.cache.limit_prefetch(s, d.integer(0, wanted.tokens))

    def _admit(self, d: Draws, s: Sequence, m, n: int) -> bool:
        """Admit with `m`; on success check the hit, write and commit. False if it did not fit.
        `can_admit` first: the same answer, or the same error."""
        hit_ok = self._reads_back(s, m.pages, m.num_tokens)
        try:
            fits = self.cache.can_admit(s, m, n)
        except CacheError as exc:
            try:
                self.cache.admit(s, m, n)
            except type(exc):
                pass
            else:
                raise AssertionError(f"can_admit raised {exc!r}, admit did not") from None
            raise
        if fits:
            self._limit_prefetch(d, s, m)
        ops = self.cache.admit(s, m, n)
        assert (ops is not None) == fits, f"can_admit said {fits}, admit returned {ops!r}"
        if ops is None:
            return False
        assert hit_ok, "admit accepted a match whose pages hold other KV"
        if self.tiered:
            # a tiered cache may load more of the prefix back from the host inside admit
            # (whole pages; apc's host tier, as vLLM, may load the whole prompt and recompute
            # its last token); its TierCopy moves carry the KV
            assert m.num_tokens <= s.num_computed < n
            assert s.num_computed % self.page_size == 0 or (
                self.backend in ("apc", "apc-lmcache") and s.num_computed == len(s) - 1
            )
            stored = self.cache.storage_hit_tokens(s)
            assert 0 <= stored <= s.num_computed - m.num_tokens, f"storage hit {stored} beyond what was loaded"
        else:
            assert s.num_computed == m.num_tokens
        self._apply(ops)
        assert self._reads_back(s, s.page_table, s.num_computed), "the loaded-back prefix holds other KV"
        self.live[s.request_id] = s
        self._write(s, n)
        self.cache.commit(s, n)
        return True

    def _release(self, s: Sequence) -> None:
        self.cache.release(s)
        del self.live[s.request_id]
        self.values.pop(s.request_id, None)
        self.released.append(s)
        del self.released[:-3]

    def _finish_oldest(self, keep: Sequence | None = None) -> bool:
        """Release the oldest live sequence but `keep`, as the replay protocol makes room."""
        for q in self.live.values():
            if q is not keep:
                self._release(q)
                return True
        return False

    def _extend(self, s: Sequence, n: int, fused: bool = False) -> bool:
        """grow to `n` (finishing older sequences while it does not fit), write, commit;
        `fused`: in one `grow_commit` (the cache publishes before the shadow is written,
        which no read comes between)."""
        grow = self.cache.grow_commit if fused else self.cache.grow
        start = s.num_computed
        ops = grow(s, n)
        while ops is None:
            if not self._finish_oldest(keep=s):
                return False
            ops = grow(s, n)
        self._apply(ops)
        self._write(s, n, start)
        if not fused:
            self.cache.commit(s, n)
        return True

    def _refused(self, what: str, call, *objs, allow=CacheError) -> None:
        """`call` must raise `allow` and leave the cache (and `objs`) exactly as they were."""
        before = deep_state((self.raw, *objs))
        try:
            call()
        except allow:
            pass
        else:
            raise Misused(f"{self.backend}: {what} was accepted")
        after = deep_state((self.raw, *objs))
        assert after == before, f"{self.backend}: refused {what} changed state: {first_difference(before, after)}"
        self.tally["refused misuse"] += 1

    def _pick_live(self, d: Draws) -> Sequence:
        live = sorted(self.live.values(), key=lambda q: q.request_id)
        return live[d.integer(0, len(live) - 1)]

    # -- ordinary operations ----------------------------------------------------------

    def op_admit(self, d: Draws) -> None:
        """match, admit, commit; with a chunk size, a chunked prefill (grow + commit per chunk)."""
        s = self._draw_sequence(d)
        chunk = d.pick([0, 0, 1, 3, 5])
        while True:  # when it does not fit, finish the oldest request and match again
            m = self.cache.match(s)
            assert m.num_tokens <= len(s) - 1
            assert self._reads_back(s, m.pages, m.num_tokens), "match returned pages holding other KV"
            n = len(s) if not chunk else min(len(s), max(m.num_tokens, 1) + chunk)
            if self._admit(d, s, m, n):
                break
            if not self._finish_oldest():
                return
        while n < len(s):
            n = min(len(s), n + chunk)
            if not self._extend(s, n):
                return

    def op_prefill(self, d: Draws) -> None:
        """match, admit and commit of the whole prompt in one `prefill` call: its hit reads
        back its own prefix, and what it loaded back too, as `_admit` checks one by one."""
        s = self._draw_sequence(d)
        while True:
            m, ops, computed = self.cache.prefill(s)
            assert m.num_tokens <= len(s) - 1
            assert self._reads_back(s, m.pages, m.num_tokens), "prefill matched pages holding other KV"
            if ops is not None:
                break
            assert s.num_computed == 0 and not self.raw._live.get(s.request_id)
            if not self._finish_oldest():
                return
        assert m.num_tokens <= computed and s.num_computed == len(s)
        assert computed == m.num_tokens or self.tiered
        self._apply(ops)
        assert self._reads_back(s, s.page_table, computed), "the loaded-back prefix holds other KV"
        self.live[s.request_id] = s
        self._write(s, len(s), computed)

    def op_match_for_later(self, d: Draws) -> None:
        s = self._draw_sequence(d)
        self.pending.append((s, self.cache.match(s)))
        del self.pending[:-4]

    def op_admit_stale(self, d: Draws) -> None:
        """A match made steps ago: admitted exactly, or refused as stale with nothing changed."""
        s, m = self.pending.pop(d.integer(0, len(self.pending) - 1))
        before = deep_state((self.raw, s))
        try:
            self._admit(d, s, m, len(s))
        except StaleMatchError:
            after = deep_state((self.raw, s))
            assert after == before, f"a stale admit changed state: {first_difference(before, after)}"
            self.tally["refused stale match"] += 1

    def op_grow(self, d: Draws) -> None:
        s = self._pick_live(d)
        s.append(d.tokens(0, 6))
        self._extend(s, len(s))

    def op_decode(self, d: Draws) -> None:
        """Token by token, as an engine decodes: append, grow, write, commit (fused: grow and
        commit in one `grow_commit`)."""
        s = self._pick_live(d)
        new = d.tokens(1, 16)
        fused = d.boolean()
        for tok in new:
            if s.num_computed < len(s):  # an earlier grow did not fit: finish that first
                break
            s.append_token(tok)
            if not self._extend(s, len(s), fused):
                return

    def op_fork(self, d: Draws) -> None:
        parent = self._pick_live(d)
        child = parent.fork(self._new_id())
        ops = self.cache.fork(parent, child)
        if ops is None:
            return
        self._apply(ops)
        assert child.num_computed == parent.num_computed
        self.live[child.request_id] = child

    def op_release(self, d: Draws) -> None:
        self._release(self._pick_live(d))

    def op_evict(self, d: Draws) -> None:
        n = d.integer(0, 5)
        before = self.cache.stats().pages_cached
        freed = self.cache.evict(n)
        assert freed == min(n, before) or freed >= n
        assert self.cache.stats().pages_cached == before - freed

    def op_redeclare_prefix(self, d: Draws) -> None:
        """Unregister a declared prefix (its pending matches go stale) and declare it again."""
        tokens = d.pick(sorted(self.prefixes))
        self.cache.unregister_prefix(self.prefixes.pop(tokens))
        self._declare(list(tokens))

    def op_finish_transfers(self, d: Draws) -> None:
        """Some of the transfers in flight complete, in any order (streams run apart)."""
        k = d.integer(1, len(self.tickets))
        done = [self.tickets.pop(d.integer(0, len(self.tickets) - 1)) for _ in range(k)]
        self.cache.finish_transfers(done)
        self.finished_tickets = (self.finished_tickets + done)[-4:]

    # -- misuse: each must raise a CacheError and change nothing ------------------------

    def op_misuse(self, d: Draws) -> None:
        """One misuse of the contract (one operation, so ordinary calls keep most steps)."""
        kind = d.pick(MISUSES)
        if kind in ("impostor", "fork_extra", "fused") and not self.live:
            kind = "types"
        getattr(self, f"_misuse_{kind}")(d)

    def _misuse_impostor(self, d: Draws) -> None:
        """A second Sequence object carrying a live request id."""
        call = d.pick(["grow", "commit", "release", "fork", "storage_hit_tokens"])
        same = d.boolean()
        s = self._pick_live(d)
        imp = Sequence(s.request_id, s.tokens.copy() if same else np.asarray([TOP] * len(s)), s.extra)
        calls = {
            "grow": lambda: self.cache.grow(imp, len(imp)),
            "commit": lambda: self.cache.commit(imp, len(imp)),
            "release": lambda: self.cache.release(imp),
            "fork": lambda: self.cache.fork(imp, imp.fork(self._new_id())),
            "storage_hit_tokens": lambda: self.cache.storage_hit_tokens(imp),
        }
        self._refused(f"{call} with an impostor of {s.request_id}", calls[call], s, imp)

    def _misuse_other_tokens(self, d: Draws) -> None:
        """Admit a match made for other tokens under the same request id."""
        s = self._sequence(d.pick(PREFIXES), d.tokens(0, 8), ExtraKeys())
        other = d.tokens(1, 12)
        m = self.cache.match(s)
        s2 = self._sequence(other, [], ExtraKeys(), rid=s.request_id)
        n = m.num_tokens
        if n and (len(s2) <= n or not np.array_equal(s2.tokens[:n], s.tokens[:n])):
            self._refused("a match made for other tokens", lambda: self.cache.admit(s2, m, len(s2)), s2)
        else:  # a miss, or the same first n tokens: the match is true of s2 too
            before = deep_state((self.raw, s2))
            try:
                self._admit(d, s2, m, len(s2))
            except CacheError:  # refusing is fine (paged: s2 lacks the rest of the prefix)
                after = deep_state((self.raw, s2))
                assert after == before, f"a refused admit changed state: {first_difference(before, after)}"

    def _misuse_foreign(self, d: Draws) -> None:
        """Admit a match made by another cache instance (with the same prefixes declared)."""
        s = self._draw_sequence(d)
        twin_pid = None
        if s.prefix_id is not None:  # paged: name the twin's registration of the same prefix
            twin_pid = next(i for p, i in self.twin_prefixes.items() if s.tokens[: len(p)].tolist() == list(p))
        m = self.twin.match(Sequence(s.request_id, s.tokens, s.extra, prefix_id=twin_pid))
        self._refused("another cache's match", lambda: self.cache.admit(s, m, len(s)), s)

    def _misuse_forged(self, d: Draws) -> None:
        """Admit a match altered after it was made."""
        prefix = d.pick(PREFIXES)
        suffix = d.tokens(0, 8)
        how = d.pick(["longer", "page", "handle", "owner", "count"])
        ps = self.page_size
        s = self._sequence(prefix, list(suffix) + [0] * ps, ExtraKeys())  # longer than a page
        m = self.cache.match(s)
        if how == "longer":
            forged = m._replace(num_tokens=m.num_tokens + ps, pages=m.pages + (self.num_pages - 1,))
        elif how == "page":
            forged = m._replace(
                num_tokens=max(m.num_tokens, ps), pages=((m.pages[0] if m.pages else 0) + 1,) + m.pages[1:]
            )
            forged = forged._replace(pages=forged.pages[: -(-forged.num_tokens // ps)])
        elif how == "handle":
            forged = m._replace(handle=self.twin.match(s).handle if m.handle is None else None)
            if forged.handle == m.handle or (not m.num_tokens and not forged.handle):
                forged = forged._replace(num_tokens=ps, pages=(0,))
        elif how == "owner":
            forged = m._replace(owner=object())
        else:
            forged = m._replace(num_tokens=float(m.num_tokens))
        self._refused(f"a forged match ({how})", lambda: self.cache.admit(s, forged, len(s)), s)

    def _misuse_fused(self, d: Draws) -> None:
        """The fused calls out of order: `prefill` of a live sequence (refused before its
        lookup, which would refresh recency), `grow_commit` below the computed count (refused
        before its grow), of an impostor, or of a sequence never admitted."""
        s = self._pick_live(d)
        which = d.integer(0, 3)
        imp = Sequence(s.request_id, s.tokens.copy(), s.extra)
        fresh = Sequence(self._new_id(), [1, 2, 3, 4, 5])
        calls = [
            lambda: self.cache.prefill(s),
            lambda: self.cache.grow_commit(s, s.num_computed - 1),
            lambda: self.cache.grow_commit(imp, len(imp)),
            lambda: self.cache.grow_commit(fresh, 3),
        ]
        if which == 1 and not s.num_computed:
            which = 0
        self._refused(f"fused call #{which}", calls[which], s, imp, fresh)

    def _misuse_fork_extra(self, d: Draws) -> None:
        """Fork a live sequence into a child under other extra keys (salt, LoRA)."""
        extra = d.pick(OTHER_EXTRAS)
        parent = self._pick_live(d)
        if extra == parent.extra:
            return
        child = Sequence(self._new_id(), parent.tokens.copy(), extra)
        self._refused("a fork into other extra keys", lambda: self.cache.fork(parent, child), parent, child)

    def _misuse_types(self, d: Draws) -> None:
        """A call with an argument of the wrong type."""
        which = d.integer(0, 15)
        live = self._pick_live(d) if self.live else Sequence(self._new_id(), [1, 2, 3])
        fresh = Sequence(self._new_id(), [1, 2, 3, 4, 5])
        m = self.cache.match(fresh)
        renamed = Sequence(self._new_id(), [1, 2, 3])
        renamed.request_id = int(self.counter)  # mutated after validation
        c = self.cache
        calls = [
            lambda: c.match(None),
            lambda: c.admit(fresh, tuple(m), 3),
            lambda: c.admit(fresh, m, 3.0),
            lambda: c.admit(fresh, m, True),
            lambda: c.admit(renamed, m, 3),
            lambda: c.grow("r1", 3),
            lambda: c.grow(live, str(len(live))),
            lambda: c.commit(live, float(len(live))),
            lambda: c.commit(renamed, 1),
            lambda: c.fork(live, "child"),
            lambda: c.release(None),
            lambda: c.release(renamed),
            lambda: c.evict(1.0),
            lambda: live.append_token(1.5),
            lambda: c.prefill(None),
            lambda: c.grow_commit(live, float(len(live))),
        ]
        self._refused(f"wrong-type call #{which}", calls[which], live, fresh)

    def _misuse_tiers(self, d: Draws) -> None:
        """The tier calls misused: a ticket never issued or already finished, a negative or
        non-int transfer size, a link the cache does not have, the storage hits of a
        sequence that is not live (released, or never admitted)."""
        which = d.integer(0, 4)
        c = self.cache
        if which == 0:
            bogus = [d.pick(self.finished_tickets)] if self.finished_tickets else [10**9]
            if self.tickets and d.boolean():
                bogus = [self.tickets[0], *bogus]  # one good ticket beside it: still nothing done
            self._refused(f"finish_transfers({bogus})", lambda: c.finish_transfers(bogus))
        elif which == 1:
            tokens = d.pick([-1, -10, 1.5, True, "16", None])
            self._refused(f"tier_link_seconds of {tokens!r} tokens", lambda: c.tier_link_seconds("gpu", "host", tokens))
        elif which == 2:
            src, dst = d.pick([("gpu", "gpu"), ("gpu", "nvme"), ("storage", "gpu"), ("host", "storage")])
            if {src, dst} <= set(self.raw.memory_tiers) and src != dst and (src, dst) != ("storage", "gpu"):
                return  # a link the cache has: priced, not misuse
            self._refused(f"the tier link {src} -> {dst}", lambda: c.tier_link_seconds(src, dst, 16))
        else:
            gone = d.pick(self.released) if self.released and which == 3 else Sequence(self._new_id(), [1, 2, 3])
            self._refused("storage_hit_tokens of a sequence not live", lambda: c.storage_hit_tokens(gone), gone)


# -- the configurations --------------------------------------------------------------

#: (page size, pages, prompt scale): small caches evict all the time, the larger one holds
#: long prompts of several pages and many live sequences
SHAPES = [(1, 12, 1), (4, 10, 1), (4, 48, 3)]


def plain_configs() -> list[WalkConfig]:
    """Every registered backend under its property-test options (content tracking on, so
    check_invariants proves index entries hold their tokens)."""
    out = []
    for backend in available_backends():
        for ps, n, scale in SHAPES:
            out.append(WalkConfig(backend, ps, n, _plain_options(backend, ps, n), scale))
    return out


def _plain_options(backend: str, ps: int, n: int) -> dict:
    if backend == "apc":
        return {"verify_tokens": True}
    if backend == "apc-lmcache":  # chunks of two pages, host small, a disk below
        return {
            "lmcache_chunk_size": 2 * ps,
            "host_capacity_tokens": n // 2 * ps,
            "disk_capacity_tokens": 2 * n * ps,
            "save_unfull_chunk": True,
        }
    if backend.startswith("radix"):
        return {"track_contents": True}
    return {}


#: host tier sizes against the GPU's: smaller, equal, larger
HOST_RATIOS = {"host<gpu": 0.5, "host=gpu": 1.0, "host>gpu": 2.0}
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
STORAGE = ("none", "file", "shared")


def tier_configs(shapes=SHAPES, timed_modes=(False, True)) -> list[WalkConfig]:
    """Every tiered configuration: radix-hicache's write policies x host smaller, equal and
    larger than the GPU x no storage, a file or a shared storage tier; apc's host tier
    (vLLM's CPU offloading, LRU and ARC, host blocks of one and two pages) x the host sizes;
    apc-lmcache with and without a disk x the host sizes; each page shape, each transfer
    mode (at once, or tickets finished later)."""
    out = []
    for ps, n, scale in shapes:
        gpu = n * ps
        for timed in timed_modes:
            for hname, ratio in HOST_RATIOS.items():
                host = max(ps, int(gpu * ratio) // ps * ps)
                if "radix-hicache" in available_backends():
                    for policy in WRITE_POLICIES:
                        for storage in STORAGE:
                            opts = {"track_contents": True, "write_policy": policy, "host_capacity_tokens": host}
                            if storage != "none":  # an L3 as small as the GPU, prefetching any hit
                                opts |= {
                                    "storage_backend": storage,
                                    "storage_capacity_tokens": gpu,
                                    "prefetch_threshold": 0,
                                }
                            label = f"radix-hicache[{policy},{hname},{storage}]"
                            out.append(WalkConfig("radix-hicache", ps, n, opts, scale, timed, label))
                for eviction in ("lru", "arc"):
                    for block in (1, 2):
                        opts = {"host_capacity_tokens": host, "host_eviction": eviction, "host_block_size": block * ps}
                        label = f"apc[{eviction},block{block},{hname}]"
                        out.append(WalkConfig("apc", ps, n, opts, scale, timed, label))
                for disk in (False, True):
                    opts = {"lmcache_chunk_size": 2 * ps, "host_capacity_tokens": max(2 * ps, host)}
                    if disk:
                        opts |= {"disk_capacity_tokens": 2 * gpu, "save_unfull_chunk": True}
                    else:
                        opts |= {"save_decode_cache": True}
                    label = f"apc-lmcache[{'disk' if disk else 'host-only'},{hname}]"
                    out.append(WalkConfig("apc-lmcache", ps, n, opts, scale, timed, label))
    return out


def run_walks(config: WalkConfig, seed: int, walks: int, steps: int, tally: Counter) -> None:
    """`walks` walks of `steps` operations each on fresh caches, checked after every step.
    A failure names the configuration, seed, walk and step, and the operations before it."""
    for w in range(walks):
        d = RandomDraws(zlib.crc32(f"{seed}/{w}/{config.name}".encode()))
        walk = ContractWalk(config, tally)
        done: list[str] = []
        try:
            for _ in range(steps):
                done.append(walk.step(d))
                walk.check()
            walk.teardown()
        except Exception as exc:
            raise AssertionError(
                f"{config.name} {config.options}: walk {w} (seed {seed}) failed at step {len(done)}: "
                f"{type(exc).__name__}: {exc}\n  after: {' '.join(done[-30:])}"
            ) from exc


def operation_count(tally: Counter) -> int:
    return sum(n for name, n in tally.items() if name in OPERATIONS)
