"""`TierSteps`: a serving policy's side of timed tier transfers (`ServingConfig.time_transfers`).

A cache with memory tiers below the GPU, asked to `time_transfers`, reports each transfer it
decides; `TransferClock` (experiments/engine/transfers.py) prices them on one stream per
direction and acknowledges completed tickets. This object is what a policy asks around its
steps, so that no policy repeats it:

- `poll(now)` before a schedule: transfers decided since the last step start now (backups
  of released requests), completed tickets are acknowledged, and the finished requests
  whose stores are done are handed back to be released (vLLM's `delay_free_blocks`);
- `loads_wait(loaded)`: whether an admission whose hit needed a load waits for it out of
  the running list (`async` load timing, vLLM's offloading connector; the caller then
  `start_loads`), or loads inside its step (`layerwise` SGLang, LMCache's connector);
- `step_start(start)` and `step_seconds(compute, start)` around a step's compute: the
  blocking backups it waits for, and its load-backs overlapped layer by layer (or the
  connector's loads before and stores after it), with the stall and who loaded;
- `hold(request_id, at)` for a finished request: until when its blocks stay (stores in flight);
- `prefetch_ready(r, m, now)` / `prefetch_admitted(r, now)`: SGLang's storage prefetch
  policies (`best_effort`, `wait_complete`, `timeout`) on the storage -> host stream;
- `next_event(...)`: when a poll would act on something (a load, a ticket, held stores, a
  prefetch), for an empty step's wake-up and a decode window's bound.

The policy keeps its decisions (which request is admitted, which waits); this object keeps
the clock of the copies.
"""

from __future__ import annotations

from cachelib.interface import PrefixCache
from cachelib.tiers import PREFETCH_TIMEOUT_BASE_S, PREFETCH_TIMEOUT_PER_KI_TOKEN_S, TierTransfer
from cachelib.types import Match, Sequence
from experiments.engine.request import Request
from experiments.engine.transfers import TransferClock


class Prefetch:
    """One request's storage prefetch on the serving clock: its read (`transfer`), when it
    started and completes, the tokens it asked for, when it first held the request back
    and when it let it go, what had arrived then."""

    __slots__ = ("transfer", "start", "done", "asked", "blocked", "released", "arrived")

    def __init__(self, transfer: TierTransfer, start: float, done: float, asked: int) -> None:
        self.transfer = transfer
        self.start = start
        self.done = done
        self.asked = asked
        self.blocked: float | None = None
        self.released: float | None = None
        self.arrived = transfer.tokens

    @property
    def size(self) -> int:
        return self.transfer.tokens


class TierSteps:
    """One replica's timed tier transfers, as its policy meets them (module docstring)."""

    def __init__(self, cache: PrefixCache, layers: int) -> None:
        self.cache = cache
        self.clock = TransferClock(cache, layers)  # (calls cache.time_transfers)
        self.decided: list[TierTransfer] = []  # decided while scheduling, not yet issued
        self.held: list[tuple[float, Sequence]] = []  # finished, blocks kept until stores end
        self.prefetches: dict[str, Prefetch] = {}  # request id -> its storage prefetch in flight
        self.prefetched: set[str] = set()  # ids that prefetched once (a re-admission's starts when considered)

    # -- around a schedule ----------------------------------------------------------------

    def poll(self, now: float) -> list[Sequence]:
        """The poll before a schedule; returns the held sequences to release now."""
        tc = self.clock
        for t in self.decided:  # decided in a schedule that ran no step
            tc.issue(t, now)
        self.decided = []
        tc.issue_all(now)
        tc.poll(now)
        # the poll's acknowledgements may start storage writes (a backup's ack): from now
        self.decided += tc.issue_all(now)
        if not self.held:
            return []
        done = [seq for at, seq in self.held if at <= now]
        self.held = [(at, seq) for at, seq in self.held if at > now]
        return done

    def loads_wait(self, loaded: int) -> bool:
        """Whether an admission that loaded `loaded` tokens waits for them out of the running
        list (`async` load timing) rather than inside its step."""
        tc = self.clock
        return bool(loaded) and not tc.layerwise and not tc.connector

    def start_loads(self, start: float) -> None:
        """An admission's async load starts at `start`; its other transfers wait for the step."""
        for t in self.cache.take_transfers():
            if t.to_gpu:
                self.clock.issue(t, start)
            else:
                self.decided.append(t)

    def load_done_at(self, request_id: str) -> float:
        return self.clock.load_done_at(request_id)

    def loaded(self, request_id: str) -> None:
        """A waiting load was consumed: its request is scheduled."""
        self.clock.forget_load(request_id)

    # -- around a step ---------------------------------------------------------------------

    def step_start(self, start: float, now: float) -> float:
        """A step starts once the transfers the policy waits for are done (SGLang's write_back
        backups of evicted nodes, issued now)."""
        tc = self.clock
        self.decided.extend(self.cache.take_transfers())
        for t in self.decided:
            if t.blocking:
                tc.issue(t, now)
        self.decided = [t for t in self.decided if not t.blocking]
        return tc.after_blocking(start)

    def step_seconds(self, compute: float, start: float) -> tuple[float, float, set[str]]:
        """The step's seconds with its transfers, its load stall, and the requests that
        loaded in it (each is charged the stall): load-backs overlapped layer by layer
        (`layerwise`), or the connector's loads before and stores after the forward; backups
        and stores decided in this step start when its KV is written (its end)."""
        tc = self.clock
        decided, self.decided = self.decided, []
        loaders = {t.request_id for t in decided if t.to_gpu}
        if tc.connector:
            seconds, stall, _ = tc.connector_step_seconds(compute, decided, start)
            for rid in loaders:
                tc.forget_load(rid)  # done inside this step: nothing waits on it
            return seconds, stall, loaders
        seconds, stall = tc.step_seconds(compute, [t for t in decided if t.to_gpu], start)
        end = start + seconds
        for t in decided:
            if not t.to_gpu and not t.blocking:
                tc.issue(t, end)
        return seconds, stall, loaders

    def hold(self, request_id: str, seq: Sequence, at: float) -> bool:
        """A request finished at `at`: True (its blocks kept) when its stores are still in
        flight then (vLLM's `request_finished` -> `delay_free_blocks`)."""
        done = self.clock.stores_done_at(request_id)
        if done > at:
            self.held.append((done, seq))
            return True
        return False

    def next_event(self, arrival: float | None, loading: list[str], after: float | None = None) -> float | None:
        """The earliest of `arrival` and what a poll would act on: a load that completes (of
        the requests `loading`), a ticket, a held request's stores, a prefetch; with `after`,
        only what comes later than that (a prefetch that completed while its request did not
        fit is no event to wait for)."""
        tc = self.clock
        times = [t for t in (arrival, tc.next_completion()) if t is not None]
        times += [tc.load_done_at(rid) for rid in loading]
        times += [done for done, _ in self.held]
        if self.prefetches:
            times += self.prefetch_wake_times()
        if after is not None:
            times = [t for t in times if t > after]
        return min(times) if times else None

    def finish(self, now: float) -> list[Sequence]:
        """The run is over: the held sequences to release, and the transfers decided in a
        schedule that ran no step start now."""
        held = [seq for _, seq in self.held]
        self.held = []
        for t in self.decided:
            self.clock.issue(t, now)
        self.decided = []
        return held

    # -- storage prefetches (SGLang 0.5.23 HiCache storage) ---------------------------------

    def prefetch_ready(self, r: Request, m: Match, now: float) -> bool:
        """Whether `r` may be scheduled now as far as its storage prefetch goes (SGLang's
        `check_prefetch_progress`, `_can_terminate_prefetch`), telling the cache what
        arrived (`limit_prefetch`). The prefetch is the read the cache reports for `r`
        (`storage_prefetch`) queued on the one storage -> host stream from `r`'s arrival,
        when SGLang issues it (`_prefetch_kvcache`); it is placed when `r` is first
        considered, so its size is the one storage gives then. `best_effort` takes the whole
        pages arrived; `wait_complete` waits for all; `timeout` waits until
        `PREFETCH_TIMEOUT_BASE_S` + `PREFETCH_TIMEOUT_PER_KI_TOKEN_S` per 1024 tokens after
        the first poll it blocked, then takes what arrived."""
        rid = r.spec.request_id
        p = self.prefetches.get(rid)
        if p is None:
            p = self.start_prefetch(r, m, now)
            if p is None:
                return True
        if now >= p.done:
            p.arrived = p.size
        else:
            policy = self.cache.prefetch_policy
            if p.blocked is None:
                p.blocked = now
            if policy == "wait_complete":
                return False
            if policy == "timeout" and now < p.blocked + self.prefetch_timeout(p.asked):
                return False
            page = self.cache.page_size
            per_page = self.cache.tier_link_seconds("storage", "host", page)
            p.arrived = min(p.size, int((now - p.start) / per_page + 1e-9) * page)
        if p.blocked is not None and p.released is None:
            p.released = now  # what it waited for the prefetch (not for room after it)
        self.cache.limit_prefetch(r.seq, p.arrived)
        return True

    def start_prefetch(self, r: Request, m: Match, now: float) -> Prefetch | None:
        """The storage read `r` issues when first considered (None: it issues none)."""
        asked, size = self.cache.storage_prefetch(r.seq, m)
        if not size:
            return None
        rid = r.spec.request_id
        at = now if rid in self.prefetched else r.arrival
        self.prefetched.add(rid)
        seconds = self.cache.tier_link_seconds("storage", "host", size)
        read = TierTransfer("storage", "host", size)
        done = self.clock.issue(read, at)
        p = self.prefetches[rid] = Prefetch(read, done - seconds, done, asked)
        return p

    @staticmethod
    def prefetch_timeout(tokens: int) -> float:
        """SGLang's `timeout` budget for a prefetch asking for `tokens` tokens."""
        return PREFETCH_TIMEOUT_BASE_S + tokens / 1024 * PREFETCH_TIMEOUT_PER_KI_TOKEN_S

    def prefetch_admitted(self, r: Request, now: float) -> None:
        """`r` was admitted: its prefetch ends (what did not arrive is not read: the stream
        is freed if nothing queued behind it), its wait is recorded."""
        p = self.prefetches.pop(r.spec.request_id, None)
        if p is None:
            return
        if p.blocked is not None:
            r.prefetch_wait_s += p.released - p.blocked
        if p.arrived < p.size:  # terminated early (`terminate_prefetch`)
            self.clock.cut_short(p.transfer, p.done, p.arrived, now)

    def prefetch_wake_times(self) -> list[float]:
        """When a prefetch a waiting request is held for lets it go: its completion, or
        under `timeout` its deadline once it blocked."""
        timeout = self.cache.prefetch_policy == "timeout"
        out = []
        for p in self.prefetches.values():
            out.append(p.done)
            if timeout and p.blocked is not None:
                out.append(p.blocked + self.prefetch_timeout(p.asked))
        return out
