"""What a `Scheduler` schedules and reports: its knobs, a request's state, the run's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachelib.types import Sequence
from experiments.engine.token_gaps import TokenGaps
from experiments.workloads.spec import RequestSpec

ORDERINGS = ("fcfs", "lpf")
#: scheduling policies (`--scheduler`): `vllm` makes vLLM 0.33's V1 decisions (the default);
#: `legacy` is this project's scheduler before it (kept to reproduce older reports; it alone
#: takes `ordering="lpf"`)
SCHEDULERS = ("vllm", "legacy")


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """Scheduler knobs. `token_budget`: tokens computed per step (decodes + prefill chunks);
    `max_running`: requests in the batch at most; `ordering`: fcfs | lpf (longest prefix
    first, `legacy` only); `scheduler`: the policy (`SCHEDULERS`); `async_scheduling`: vLLM's
    two batches in flight (`vllm` only); `time_transfers`: a tiered cache's transfers cost
    time on the serving clock (`vllm` only; False: instant, as under replay)."""

    token_budget: int = 8192
    max_running: int = 256
    ordering: str = "fcfs"
    scheduler: str = "vllm"
    async_scheduling: bool = False
    #: tier transfers cost time on the serving clock (`vllm` scheduler, a cache with memory
    #: tiers: experiments/engine/transfers.py); False: they complete at once, as under replay
    time_transfers: bool = True

    def __post_init__(self) -> None:
        if self.token_budget < 1 or self.max_running < 1:
            raise ValueError("token_budget and max_running must be positive")
        if self.ordering not in ORDERINGS:
            raise ValueError(f"unknown ordering {self.ordering!r}; choose one of {', '.join(ORDERINGS)}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; choose one of {', '.join(SCHEDULERS)}")
        if self.scheduler == "vllm" and self.ordering != "fcfs":
            raise ValueError(
                f"the vllm scheduler is FCFS (vLLM's default policy); ordering {self.ordering!r} needs --scheduler legacy"
            )
        if self.async_scheduling and self.scheduler != "vllm":
            raise ValueError("async scheduling is vLLM's engine loop: it needs --scheduler vllm")


@dataclass(slots=True, eq=False)  # identity: `in running` must not compare fields
class Request:
    """A request inside the scheduler: its sequence and what happened to it so far."""

    spec: RequestSpec
    #: None while it waits for its first admission: its tokens are built when the scheduler
    #: first considers it (`Scheduler.sequence`), not at arrival (a queue of thousands of
    #: waiting requests would hold every prompt's tokens)
    seq: Sequence | None
    generated: int = 0
    first_admit_hit: int | None = None
    hit_tokens: int = 0  # over every admission, re-admissions after preemption included
    #: of `hit_tokens`, those loaded back from a lower memory tier (the rest were on the GPU)
    host_hit_tokens: int = 0
    #: of `host_hit_tokens`, those loaded from the storage tier (L3; `storage_hit_tokens`)
    storage_hit_tokens: int = 0
    #: serving with timed tier transfers: seconds its steps took beyond their compute waiting
    #: on load-backs (`layerwise`), and seconds it waited for its load out of the running
    #: list (`async`); experiments/engine/transfers.py
    load_stall_s: float = 0.0
    load_wait_s: float = 0.0
    #: of `host_hit_tokens`, those its storage prefetches brought up (L3), and the seconds
    #: it was held back waiting for a prefetch (`wait_complete`, `timeout`; serving, timed)
    storage_hit_tokens: int = 0
    prefetch_wait_s: float = 0.0
    computed_tokens: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    preempted: int = 0
    #: tokens generated so far; `VllmRowScheduler` fills it only where something reads it
    #: (`keep_outputs`, a forced output) and leaves it empty otherwise
    output: list[int] = field(default_factory=list)
    arrival: float = 0.0  # when it joined the queue (after its predecessor, for a dependent turn)
    target: int = 0  # tokens to generate (0: the spec's output_len)
    lag: int = 0  # decode tokens computed but not yet committed (batched commits)
    sample_of: str | None = None  # parallel sampling: the request this sample was forked from
    forced: list[int] | None = None  # the spec's forced output as ints (the request itself only)
    group: list[Sequence] | None = None  # replay: what it releases at finish (None: just `seq`)
    truncated: int = 0  # replay: outputs (its own, its samples') cut short for want of room
    index: int = -1  # position in the requests given to the engine (trace line); samples: their parent's
    first_token_step: int | None = None  # 0-based index among non-empty steps that sampled its first token
    finish_step: int | None = None  # ... and its last
    vllm: Any = None  # the vllm policy's counters (`vllm_scheduler.VllmCounters`)
    last_token_at: float | None = None  # when its latest token came (`TokenGaps`, ITL)

    def __post_init__(self) -> None:
        if not self.target:
            self.target = max(self.spec.output_len, 1)
        if self.forced is None and self.sample_of is None and self.spec.forced_output is not None:
            self.forced = np.asarray(self.spec.forced_output, dtype=np.int64).tolist()

    def prefill_left(self) -> int:
        """Prompt tokens whose KV it has not computed: all of them while it waits without a
        sequence, again after a preemption (a replica's load, `Scheduler.loads`)."""
        prompt = self.spec.prompt_len
        seq = self.seq
        return prompt if seq is None else prompt - min(seq.num_computed + self.lag, prompt)


@dataclass
class ServingResult:
    """Per-request outcomes and the run's timeline."""

    requests: list[dict[str, Any]] = field(default_factory=list)
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, pages pinned)
    steps: int = 0
    preemptions: int = 0
    aborted: int = 0
    cache_seconds: float = 0.0
    makespan: float = 0.0
    peak_pages: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)  # with keep_outputs=True
    itl: TokenGaps = field(default_factory=TokenGaps)  # every inter-token gap of its requests (not samples)
    #: timed tier transfers (`TransferClock.summary`): tokens and bytes per direction, stall;
    #: None when the cache has no tiers or transfers were instant
    transfers: dict[str, Any] | None = None


#: a step's batch: each request and the tokens it computes this step
Batch = list[tuple[Request, int]]


def request_record(r: Request, aborted: bool) -> dict[str, Any]:
    """One finished (or aborted) request as the results record it."""
    spec = r.spec
    ttft = None if r.first_token_at is None else r.first_token_at - r.arrival
    tpot = None
    if r.first_token_at is not None and r.finished_at is not None and r.generated > 1:
        tpot = (r.finished_at - r.first_token_at) / (r.generated - 1)
    return {
        "request_index": r.index,
        "request_id": spec.request_id,
        "arrival": r.arrival,
        "prompt_tokens": spec.prompt_len,
        "output_tokens": r.target,
        "hit_tokens_first": r.first_admit_hit or 0,
        "hit_tokens_all_admissions": r.hit_tokens,
        "computed_tokens": r.computed_tokens,
        "generated": r.generated,
        "first_token_step": r.first_token_step,
        "finish_step": r.finish_step,
        "first_token_at": r.first_token_at,
        "ttft": ttft,
        "tpot": tpot,
        "finished_at": r.finished_at,
        "preemptions": r.preempted,
        "aborted": aborted,
        "sample_of": r.sample_of,
    }


#: what a request record adds when its cache has memory tiers below the GPU
TIER_RECORD_KEYS = (
    "gpu_hit_tokens",
    "host_hit_tokens",
    "load_stall_s",
    "load_wait_s",
    "storage_hit_tokens",
    "prefetch_wait_s",
)


def tier_record(r: Request) -> dict[str, Any]:
    """A request's reuse by tier over its admissions (GPU hit; loaded from below the GPU, and
    of that from storage) and the time it lost to loads (`Request.load_stall_s`,
    `load_wait_s`)."""
    return {
        "gpu_hit_tokens": r.hit_tokens - r.host_hit_tokens,
        "host_hit_tokens": r.host_hit_tokens,
        "load_stall_s": r.load_stall_s,
        "load_wait_s": r.load_wait_s,
        "storage_hit_tokens": r.storage_hit_tokens,
        "prefetch_wait_s": r.prefetch_wait_s,
    }
