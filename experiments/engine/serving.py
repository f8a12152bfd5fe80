"""The serving protocol's driver (docs/design.md §6): continuous batching on a virtual clock.

Arrivals come off the `VirtualClock` into one replica's policy (`--scheduler`: `vllm.VllmScheduler`);
each step advances the clock by what the executor says the step took (cost model) or took
(model); with nothing to run, the clock jumps to the next arrival. What a step decides is the
policy's; this module only drives it, synchronously (`drive`) or with vLLM's two batches in
flight (`drive_async`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import Any

from cachelib.interface import PrefixCache
from experiments.engine.cache_client import CacheClient
from experiments.engine.clock import VirtualClock
from experiments.engine.executors import Executor
from experiments.engine.request import ServingConfig, ServingResult
from experiments.engine.vllm import StepPlan, VllmScheduler
from experiments.workloads.spec import RequestSpec

DEFAULT_CONFIG = ServingConfig()
#: vLLM's `max_concurrent_batches` with async scheduling (batch queue size)
ASYNC_BATCHES = 2
#: `ServingConfig.scheduler` -> the policy's class
SCHEDULER_POLICIES: dict[str, type[VllmScheduler]] = {"vllm": VllmScheduler}


def scheduler_class(config: ServingConfig) -> type[VllmScheduler]:
    """The class of `config.scheduler`, the policy every replica runs."""
    return SCHEDULER_POLICIES[config.scheduler]


def serve(
    cache: PrefixCache | CacheClient,
    requests: Seq[RequestSpec],
    executor: Executor,
    config: ServingConfig = DEFAULT_CONFIG,
    *,
    progress: bool = False,
    keep_outputs: bool = False,
) -> ServingResult:
    """Run `requests` through `cache` and `executor`; returns per-request metrics and the timeline.

    A request with `n > 1` (parallel sampling) forks `n - 1` samples from its prompt when its
    first token is sampled (`cache.fork`); sample j generates `spec.sample_lens[j]` tokens
    (default: `output_len` each). A sample that cannot fork for want of pages waits to be
    admitted like a preempted request (recompute). Beam search is not run here: it runs
    under the replay protocol and in `experiments/bench/sharing_memory.py`. A request's
    `forced_output` is what it generates (whatever the executor samples), so that a
    conversation's next turn can reuse its KV.

    Under the `vllm` policy (the default) a request with `n > 1` arrives as `n` requests
    sharing its prompt through the cache, as vLLM's front end fans it out.
    """
    refuse_beams(requests)
    client = cache if isinstance(cache, CacheClient) else CacheClient(cache)
    clock = VirtualClock(requests)
    scheduler = scheduler_class(config)(client, executor, config, clock, keep_outputs=keep_outputs)
    bar = progress_bar(len(requests), f"serve {client.cache.name}") if progress else None
    index_of = {s.request_id: i for i, s in enumerate(requests)}
    if config.async_scheduling:
        drive_async(clock, scheduler, index_of, bar)
    else:
        drive(clock, scheduler, index_of, bar)
    if bar is not None:
        bar.close()
    res = scheduler.result
    res.makespan = clock.now
    finish_transfers(scheduler, res)
    res.cache_seconds = client.seconds
    return res


def drive(clock: VirtualClock, scheduler: VllmScheduler, index_of: dict[str, int], bar: Any = None) -> None:
    """Step `scheduler` until every request, arrived or not, has finished (vLLM's
    `EngineCore.step` loop: arrivals due by now join before each step; an idle engine
    jumps to the next arrival). `index_of`: request id -> trace line."""
    while clock.has_arrivals or scheduler.has_work:
        for arrival, spec in clock.arrived():
            scheduler.add(spec, arrival, index_of.get(spec.request_id, -1))
        if not scheduler.has_work:
            clock.now = clock.next_arrival()  # type: ignore[assignment]  # idle: jump ahead
            continue
        end = scheduler.step()
        if bar is not None and len(scheduler.result.requests) > bar.n:
            bar.update(len(scheduler.result.requests) - bar.n)
        if end is not None:
            clock.now = end
        elif clock.has_arrivals:
            clock.now = max(clock.now, clock.next_arrival())  # type: ignore[type-var]


def drive_async(clock: VirtualClock, scheduler: VllmScheduler, index_of: dict[str, int], bar: Any = None) -> None:
    """vLLM's async loop (`EngineCore.step_with_batch_queue`, two batches in flight): a
    step is scheduled and launched while the previous one runs; the loop blocks on the
    oldest only when both slots are taken, or when there is nothing more to schedule."""
    queue: deque[StepPlan] = deque()  # in flight, newest first
    while clock.has_arrivals or scheduler.has_requests or queue:
        for arrival, spec in clock.arrived():
            scheduler.add(spec, arrival, index_of.get(spec.request_id, -1))
        if not scheduler.has_requests and not queue:
            clock.now = max(clock.now, clock.next_arrival())  # type: ignore[type-var]  # idle: jump ahead
            continue
        if scheduler.has_requests:
            plan = scheduler.schedule()
            if not queue and scheduler.stuck(plan):
                scheduler.give_up_on_head()
                continue
            scheduler.execute(plan)
            queue.appendleft(plan)
            if len(queue) < ASYNC_BATCHES and (not plan.empty or scheduler.has_requests):
                continue  # launch the next one before waiting on this
        plan = queue.pop()  # nothing more to schedule, or both slots taken: wait on the oldest
        clock.now = max(clock.now, plan.end)
        scheduler.process(plan)
        if bar is not None and len(scheduler.result.requests) > bar.n:
            bar.update(len(scheduler.result.requests) - bar.n)


def finish_transfers(scheduler: VllmScheduler, res: ServingResult) -> None:
    """After the run: what finished requests held for their stores is released, the
    transfers still in flight complete, and the timed transfers' totals go to the result
    (`ServingResult.transfers`)."""
    if scheduler.tiers is not None:
        scheduler.release_held()
        scheduler.tiers.clock.drain()
        res.transfers = scheduler.tiers.clock.summary()


def refuse_beams(requests: Seq[RequestSpec]) -> None:
    """Beam search is not served (see `serve`): refused before any work."""
    beams = [s.request_id for s in requests if s.beam_width > 1]
    if beams:
        raise ValueError(
            f"the serving engine runs parallel sampling, not beam search (request {beams[0]!r}); use experiments.bench.sharing_memory"
        )


def progress_bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    # disable=None: quiet when stderr is not a terminal (a log file, CI, a pipe), as the bar
    # would write a line per refresh there
    return tqdm(total=total, desc=desc, unit="req", leave=False, mininterval=0.5, disable=None)
