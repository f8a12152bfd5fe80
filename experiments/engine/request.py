"""What a serving policy schedules and reports: its knobs, a request's state, the run's result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachelib.types import Sequence
from experiments.engine.token_gaps import TokenGaps
from experiments.workloads.spec import RequestSpec

#: serving policies (`--scheduler`): `vllm` makes vLLM 0.33's V1 decisions
SCHEDULERS = ("vllm",)

#: most token slots a request's `Sequence` reserves for its output up front (`output_room`):
#: a trace may declare outputs of up to ~147M tokens, which a run may never generate; past
#: this the buffer doubles as tokens come, as without room
MAX_OUTPUT_ROOM = 1 << 16


def output_room(spec: RequestSpec) -> int:
    """Token slots to reserve for `spec`'s output in its `Sequence`."""
    return min(spec.output_len, MAX_OUTPUT_ROOM)


def new_sequence(spec: RequestSpec) -> Sequence:
    """The `Sequence` a request of `spec` runs as: its prompt's tokens (built now, for a
    trace's lazy prompt), with room for its output."""
    return Sequence(spec.request_id, spec.prompt, spec.extra, prefix_id=spec.prefix_id, room=output_room(spec))


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """Policy knobs. `token_budget`: tokens computed per step (decodes + prefill chunks);
    `max_running`: requests in the batch at most; `scheduler`: the policy (`SCHEDULERS`);
    `async_scheduling`: vLLM's two batches in flight; `time_transfers`: a tiered cache's
    transfers cost time on the serving clock (experiments/engine/tiered.py; False: they
    complete at once, as under replay)."""

    token_budget: int = 8192
    max_running: int = 256
    scheduler: str = "vllm"
    async_scheduling: bool = False
    time_transfers: bool = True

    def __post_init__(self) -> None:
        for name in ("token_budget", "max_running"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; choose one of {', '.join(SCHEDULERS)}")


@dataclass(slots=True)
class VllmCounters:
    """vLLM's per-request counters (`vllm.v1.request.Request`) while the request is not
    running; a running request's live in its row (`RunningRows`) and come back here when it
    leaves the running list."""

    known: int  # num_tokens: prompt + outputs delivered
    computed: int = 0  # num_computed_tokens: scheduled so far, in-flight steps included
    placeholders: int = 0  # num_output_placeholders: sampled in flight, not delivered (async)
    in_flight: int = 0  # num_in_flight_tokens: scheduled in steps not yet processed (async)
    stale: int = 0  # num_stale_output_tokens: in flight when preempted (async)
    admission: int = -1  # while running: the number of its admission on its replica (its row's)


@dataclass(slots=True, eq=False)  # identity: `in running` must not compare fields
class Request:
    """A request inside a serving policy: its sequence, its counters and what happened to it."""

    spec: RequestSpec
    #: None while it waits for its first admission: its tokens are built when the policy
    #: first considers it (`new_sequence`), not at arrival (a queue of thousands of waiting
    #: requests would hold every prompt's tokens)
    seq: Sequence | None
    arrival: float = 0.0  # when it joined the queue (after its predecessor, for a dependent turn)
    index: int = -1  # position in the requests given to the engine (trace line); samples: their parent's
    sample_of: str | None = None  # parallel sampling: the request this sample was forked from
    target: int = 0  # tokens to generate (0: the spec's output_len)
    forced: list[int] | None = None  # the spec's forced output as ints (the request itself only)
    counters: VllmCounters | None = None  # the policy's counters while it is not running
    generated: int = 0
    first_admit_hit: int | None = None
    hit_tokens: int = 0  # over every admission, re-admissions after preemption included
    #: of `hit_tokens`, those loaded back from a lower memory tier (the rest were on the GPU),
    #: and of those the ones from the storage tier (L3; `PrefixCache.storage_hit_tokens`)
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    #: timed tier transfers: seconds its steps took beyond their compute waiting on
    #: load-backs (`layerwise`), seconds it waited for its load out of the running list
    #: (`async`), seconds it was held back waiting for a storage prefetch
    load_stall_s: float = 0.0
    load_wait_s: float = 0.0
    prefetch_wait_s: float = 0.0
    computed_tokens: int = 0
    first_token_at: float | None = None
    first_token_step: int | None = None  # 0-based index among non-empty steps that sampled its first token
    last_token_at: float | None = None  # when its latest token came (`TokenGaps`, ITL)
    finished_at: float | None = None
    finish_step: int | None = None  # ... and its last
    preempted: int = 0
    #: tokens generated so far, filled only where something reads it (`keep_outputs`, a
    #: forced output, the model executor's samples)
    output: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.target:
            self.target = max(self.spec.output_len, 1)
        if self.forced is None and self.sample_of is None and self.spec.forced_output is not None:
            self.forced = np.asarray(self.spec.forced_output, dtype=np.int64).tolist()


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
