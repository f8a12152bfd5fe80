"""The conditional lazy rule (`PrefixCache.decode_noops_when`) changes nothing but the calls.

paged promises that a decode step inside a held block is a no-op for a sequence whose
writable blocks are its own (`DECODE_NOOPS_IF_PRIVATE`: not after a fork, not in a declared
prefix's shared partial block); radix with its one-page reserve, that it is one while a page
is free (`DECODE_NOOPS_WHILE_FREE`: a step finding none evicts). The serving policy, by each
path of its rules (compiled, and numpy), runs each workload twice: lazily, and eagerly with
the promise withdrawn (a grow and a commit every step, as before the promise). Everything
either run reports must be equal: every request record, the ITL pairs, the page timeline,
the step and preemption counts, the cache's counters and figures, the step at which each KV
event came, and every evicted node in order with the step that evicted it. Each case also
proves it tested something: the lazy run made fewer cache calls, and the eager run hit the
condition's other side (paged copied blocks on write; radix evicted inside a decode grow).
"""

from __future__ import annotations

from typing import ClassVar

import pytest

from backends.paged import PagedCache
from backends.radix import RadixCache
from cachelib import create_cache
from cachelib.errors import InvalidRequestError
from cachelib.hashing import numba_installed
from cachelib.interface import DECODE_NOOPS_IF_PRIVATE, DECODE_NOOPS_WHILE_FREE
from cachelib.types import Sequence
from experiments.engine import CostModelExecutor, ServingConfig
from experiments.engine.cache_client import CacheClient
from experiments.engine.clock import VirtualClock
from experiments.engine.serving import drive
from experiments.engine.vllm import VllmScheduler
from experiments.runs.runner import _declare_prefixes
from experiments.workloads.registry import make_workload

#: the paths of the policy's rules (experiments/engine/compiled.py)
LOOPS = ["numpy", *(["numba"] if numba_installed() else [])]


class NoWindows(CostModelExecutor):
    """The cost model, every step taken one by one (no decode windows)."""

    supports_decode_windows: ClassVar[bool] = False


def withdraw_lazy(cache) -> None:
    """Take back every lazy promise of this instance: the engine calls grow and commit every step."""
    cache.decode_steps_are_noops = False
    cache.decode_noops_when = None


class CountingClient(CacheClient):
    """A client that counts the cache's grow and commit calls, however the engine makes them
    (one by one, or several in one timed region through `advance`/`advance_all`, which call
    the cache directly), and knows whether a decode grow is in progress."""

    __slots__ = ("grows", "commits", "decode_grow")

    def __init__(self, cache) -> None:
        super().__init__(cache)
        self.grows = self.commits = 0
        self.decode_grow = False
        cache.grow = self.counted_grow  # instance attributes: the class's methods are called below
        cache.commit = self.counted_commit

    def counted_grow(self, seq, num_tokens):
        self.grows += 1
        # a decode step: the table holds the token already (the grow takes no page)
        self.decode_grow = num_tokens > seq.prompt_len and num_tokens <= len(seq.page_table) * self.cache.page_size
        try:
            return type(self.cache).grow(self.cache, seq, num_tokens)
        finally:
            self.decode_grow = False

    def counted_commit(self, seq, num_computed):
        self.commits += 1
        return type(self.cache).commit(self.cache, seq, num_computed)


class Log:
    """Every KV event and evicted node, with the step count when it came (page keys left
    out: generated pages hash fresh token ids, drawn in another order by lazy syncs)."""

    def __init__(self, client: CountingClient) -> None:
        self.client = client
        self.scheduler: VllmScheduler | None = None
        self.entries: list[tuple] = []
        self.decode_evictions = 0

    def on_kv_event(self, event) -> None:
        self.entries.append((self.scheduler.result.steps, type(event).__name__, len(event.keys)))

    def on_evict(self, namespace, start, key) -> None:
        self.entries.append((self.scheduler.result.steps, "evict", namespace, start, len(key)))
        self.decode_evictions += self.client.decode_grow


def run(
    loop: str,
    make_cache,
    requests,
    *,
    eager: bool,
    windows: bool = True,
    declare=None,
    loud: bool = False,
    budget: int = 512,
) -> tuple[dict, CountingClient, Log]:
    """One run; `eager`: every lazy promise withdrawn; `loud`: only the quiet-fill one
    (`commit_publishes_decode` set True: a decode step that fills a page calls)."""
    cache = make_cache()
    if eager:
        withdraw_lazy(cache)
    if loud:
        cache.commit_publishes_decode = True
    executor = CostModelExecutor() if windows else NoWindows()
    if declare is not None:
        requests, _ = _declare_prefixes(cache, declare, executor)
    client = CountingClient(cache)
    clock = VirtualClock(requests)
    config = ServingConfig(token_budget=budget, max_running=16)
    s = VllmScheduler(client, executor, config, clock, kernel=loop)
    log = Log(client)
    log.scheduler = s
    if cache.emits_kv_events:
        cache.subscribe(log)
    if isinstance(cache, RadixCache):
        cache.on_evict = log.on_evict
    drive(clock, s, {spec.request_id: i for i, spec in enumerate(requests)})
    cache.check_invariants()
    res = s.result
    outcome = {
        "records": sorted(res.requests, key=lambda rec: rec["request_id"]),
        "itl": (res.itl.values, res.itl.counts),
        "timeline": res.timeline,
        "steps": res.steps,
        "preemptions": res.preemptions,
        "aborted": res.aborted,
        "peak": res.peak_pages,
        "stats": cache.stats(),
        "now": clock.now,
        "log": log.entries,
    }
    return outcome, client, log


def assert_same(lazy: dict, eager: dict) -> None:
    for key in eager:
        assert lazy[key] == eager[key], key


def both(loop, make_cache, requests, **kw):
    (a, ca, la), (b, cb, lb) = (run(loop, make_cache, requests, eager=e, **kw) for e in (False, True))
    assert_same(a, b)
    assert any(not rec["aborted"] for rec in b["records"])
    assert ca.grows + ca.commits < cb.grows + cb.commits, "the lazy run skipped no call"
    return a, lb


# -- radix: a page free, or a decode step evicts --------------------------------------


def _mooncake(limit: int):
    return make_workload("mooncake", seed=0, limit=limit).requests


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("capacity", [40_000, 200_000])
def test_radix_lazy_equals_eager_where_decode_steps_evict(loop, capacity):
    """The shipped Mooncake slice at capacities where decode steps inside held pages find no
    page free and evict (SGLang's one-page over-estimate): those steps must still call."""
    requests = _mooncake(120)
    a, eager_log = both(loop, lambda: create_cache("radix", num_pages=capacity // 16, page_size=16), requests)
    assert a["stats"].evicted_pages > 0
    assert eager_log.decode_evictions > 0, "no decode step evicted: the condition's other side went untested"


def test_radix_lazy_equals_eager_step_by_step():
    """The same without decode windows: every step one by one."""
    requests = _mooncake(60)
    _, eager_log = both(
        "numpy", lambda: create_cache("radix", num_pages=40_000 // 16, page_size=16), requests, windows=False
    )
    assert eager_log.decode_evictions > 0


#: small synthetic workloads where free pages run out inside decode windows and steps
SYNTHETIC = {
    # long answers to a few hot documents, everything at once
    "docs": ("shared_doc_qa", dict(num_documents=4, doc_len=300, num_requests=60, output_len=200, output_dist="uniform", rate=200.0, vocab_size=5000)),
    # conversations whose next turn re-sends the recorded answer
    "chat": ("multi_turn_chat", dict(num_conversations=8, turns=4, user_turn_len=60, answer_len=30, answer_dist="exponential", think_time=0.5, rate=20.0, vocab_size=5000)),
}  # fmt: skip


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("workload,pages", [("docs", 30), ("docs", 60), ("chat", 40)])
@pytest.mark.parametrize("backend", ["radix", "radix-aged"])
def test_radix_lazy_equals_eager_under_pressure(loop, workload, pages, backend):
    """Free pages run out in the middle of decode windows (the row loop's window rule) and
    of steps (every loop's step rule). radix-aged inherits the promise (its LRFU clock
    moves on lookups, never on a decode step)."""
    name, knobs = SYNTHETIC[workload]
    requests = make_workload(name, seed=3, **knobs).requests
    _, eager_log = both(loop, lambda: create_cache(backend, num_pages=pages, page_size=16), requests)
    assert eager_log.decode_evictions > 0


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("policy", ["lfu", "mru"])
def test_radix_lazy_equals_eager_under_other_policies(loop, policy):
    """Eviction order under other policies is the same lazily (a policy reads recency and
    hits, which a skipped decode step never changes)."""
    requests = _mooncake(60)
    make = lambda: create_cache("radix", num_pages=30_000 // 16, page_size=16, eviction_policy=policy)  # noqa: E731
    both(loop, make, requests)


@pytest.mark.parametrize("loop", LOOPS)
def test_radix_page_size_one_keeps_its_unconditional_promise(loop):
    """At page size 1 there is no reserve: the promise is unconditional (and every decode
    step takes a page, so nothing is excused; lazy and eager still agree)."""
    requests = _mooncake(40)
    cache = create_cache("radix", num_pages=40_000, page_size=1)
    assert cache.decode_steps_are_noops and cache.decode_noops_when is None
    a, _, _ = run(loop, lambda: create_cache("radix", num_pages=40_000, page_size=1), requests, eager=False)
    b, _, _ = run(loop, lambda: create_cache("radix", num_pages=40_000, page_size=1), requests, eager=True)
    assert_same(a, b)


# -- quiet fills: a decode step filling a page, on a backend whose commit publishes nothing --

QUIET = {
    "none": lambda pages: create_cache("none", num_pages=pages, page_size=16),
    "radix": lambda pages: create_cache("radix", num_pages=pages, page_size=16),
    "radix-unreserved": lambda pages: create_cache("radix", num_pages=pages, page_size=16, reserve_page=False),
    "radix-aged": lambda pages: create_cache("radix-aged", num_pages=pages, page_size=16),
    "radix-page-1": lambda pages: create_cache("radix", num_pages=pages * 16, page_size=1),
}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    "workload,pages,budget",
    [("docs", 30, 512), ("docs", 30, 17), ("chat", 40, 512), ("chat", 40, 17), ("mooncake", 2_500, 512)],
)
@pytest.mark.parametrize("backend", sorted(QUIET))
def test_quiet_fills_change_nothing_but_the_calls(loop, budget, workload, pages, backend):
    """none and radix commit nothing past the prompt (`commit_publishes_decode` False), so the
    vLLM loops also skip a decode step that fills a page (vLLM's scheduler would publish
    it: apc keeps calling). The run equals the eager one and the lazy one that calls at each
    fill, and makes fewer commits than the latter. A budget of 17 splits prompts into chunks
    that end on page boundaries one token at a time (those inside the prompt must call: radix
    inserts there)."""
    if workload == "mooncake":
        requests = _mooncake(40)
    else:
        name, knobs = SYNTHETIC[workload]
        requests = make_workload(name, seed=3, **knobs).requests
    make = lambda: QUIET[backend](pages)  # noqa: E731
    quiet, cq, _ = run(loop, make, requests, eager=False, budget=budget)
    loud, cl, _ = run(loop, make, requests, eager=False, loud=True, budget=budget)
    eager, _, _ = run(loop, make, requests, eager=True, budget=budget)
    assert_same(quiet, eager)
    assert_same(loud, eager)
    assert cq.commits <= cl.commits
    if workload == "chat" and backend != "radix-page-1":  # (at page size 1 every step takes a page)
        assert cq.commits < cl.commits, "no fill was skipped"
    assert cq.grows <= cl.grows


def test_apc_and_the_tiers_keep_calling_at_fills():
    """apc publishes a block as it fills (vLLM); a tiered radix acknowledges load-backs at
    commit: neither declares quiet fills."""
    assert create_cache("apc", num_pages=8, page_size=16).commit_publishes_decode
    hi = create_cache("radix-hicache", num_pages=8, page_size=1, host_capacity_tokens=256)
    assert hi.decode_steps_are_noops and hi.commit_publishes_decode  # page 1: the promise, not the quiet one
    assert not create_cache("radix", num_pages=8, page_size=16).commit_publishes_decode
    assert not create_cache("none", num_pages=8, page_size=16).commit_publishes_decode


def test_radix_declares_the_condition_only_with_its_reserve():
    assert create_cache("radix", num_pages=8, page_size=16).decode_noops_when == DECODE_NOOPS_WHILE_FREE
    plain = create_cache("radix", num_pages=8, page_size=16, reserve_page=False)
    assert plain.decode_steps_are_noops and plain.decode_noops_when is None
    hi = create_cache("radix-hicache", num_pages=8, page_size=16, host_capacity_tokens=256)
    assert not hi.decode_steps_are_noops and hi.decode_noops_when is None  # not extended to tiers


def test_radix_pages_free_is_the_free_count():
    cache = create_cache("radix", num_pages=8, page_size=4)
    seq = Sequence("a", list(range(10)))
    assert cache.admit(seq, cache.match(seq), 10) is not None
    assert cache.pages_free() == cache.stats().pages_free == 5  # 3 pages taken


# -- paged: shared blocks (forks, declared prefixes) copy on write ---------------------


def _paged(num_pages: int, page_size: int = 16):
    return lambda: create_cache("paged", num_pages=num_pages, page_size=page_size)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("pages", [40, 400])
def test_paged_lazy_equals_eager_with_declared_prefixes(loop, pages):
    """Declared documents of 300 tokens: the partial last prefix block is shared and copied on
    the first write; memory pressure at 40 pages preempts."""
    wl = make_workload(
        "shared_doc_qa",
        seed=3,
        num_documents=4,
        doc_len=300,
        num_requests=60,
        output_len=40,
        output_dist="uniform",
        rate=50.0,
        vocab_size=5000,
        declare_documents=True,
    )
    longest = max(s.prompt_len + s.output_len for s in wl.requests)
    num_pages = max(pages, -(-longest // 16) + 1 + 4 * 19)  # the prefixes stay pinned
    a, _ = both(loop, _paged(num_pages), wl.requests, declare=wl)
    assert a["stats"].copied_pages > 0 and a["stats"].hit_tokens > 0


def test_paged_lazy_equals_eager_step_by_step_on_mooncake():
    requests = _mooncake(60)
    both("numpy", _paged(40_000 // 16), requests, windows=False)


class Watchful(PagedCache):
    """paged that withholds its per-sequence promise from a sequence writing every third
    block (a test-only cache: a sequence's answer still changes only through a call naming
    it, as the contract says) and logs each grow of a sequence it withheld it from. An
    engine that honours the answer makes those grows lazily exactly as eagerly."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self.watched: list[tuple[str, int]] = []

    def decode_steps_private(self, seq) -> bool:
        return super().decode_steps_private(seq) and (seq.num_computed // self.page_size) % 3 != 1

    def _grow(self, seq, table, num_tokens):
        if not self.decode_steps_private(seq):
            self.watched.append((seq.request_id, num_tokens))
        return super()._grow(seq, table, num_tokens)


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("workload,pages", [("docs", 60), ("docs", 400), ("chat", 40)])
def test_the_engine_calls_every_step_of_a_sequence_the_cache_does_not_approve(loop, workload, pages):
    name, knobs = SYNTHETIC[workload]
    requests = make_workload(name, seed=3, **knobs).requests
    made: list[Watchful] = []

    def make() -> Watchful:
        made.append(Watchful(pages, 16))
        return made[-1]

    both(loop, make, requests)
    lazy, eager = made
    assert lazy.watched == eager.watched
    assert len(eager.watched) > 30


def test_paged_private_answer_follows_forks_and_copies():
    """`decode_steps_private` is False exactly while a block the sequence may write is shared."""
    cache = create_cache("paged", num_pages=16, page_size=4)
    assert cache.decode_noops_when == DECODE_NOOPS_IF_PRIVATE
    a = Sequence("a", list(range(10)))
    cache.admit(a, cache.match(a), 10)
    cache.commit(a, 10)
    assert cache.decode_steps_private(a)
    b = a.fork("b")
    cache.fork(a, b)  # blocks 0-2 shared; a's partial block 2 too (granted == computed)
    assert not cache.decode_steps_private(a) and not cache.decode_steps_private(b)
    a.append_token(99)
    ops = cache.grow(a, 11)
    assert len(ops) == 1  # the shared partial block is copied for a
    assert cache.decode_steps_private(a)  # blocks 0-1 are shared, but a writes from block 2 on
    assert cache.decode_steps_private(b)  # a left the shared block: b holds it alone
    c = b.fork("c")
    cache.fork(b, c)
    assert not cache.decode_steps_private(b)  # a fork shares its parent's blocks again
    cache.release(c)
    assert cache.decode_steps_private(b)  # the last other holder let go
    with pytest.raises(InvalidRequestError):
        create_cache("apc", num_pages=4, page_size=4).decode_steps_private(a)


def test_an_unknown_condition_is_refused():
    cache = create_cache("paged", num_pages=8, page_size=4)
    cache.decode_noops_when = "sometimes"
    with pytest.raises(ValueError, match="unknown decode_noops_when"):
        VllmScheduler(CacheClient(cache), CostModelExecutor(), ServingConfig(), VirtualClock([]))
