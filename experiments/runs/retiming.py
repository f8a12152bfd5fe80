"""Serving's arrivals re-timed before a run, as `vllm bench serve` and SGLang's `bench_serving` do.

- `--time-scale X`: every time of the workload's timeline × X: arrival times, and the
  think time before a conversation's next turn. X = 2 replays a trace at half its speed,
  0.5 at twice (SGLang `bench_serving --mooncake-slowdown-factor` scales a trace's
  timestamps so, counted from its first one; the FAST'25 traces start at 0).
- `--request-rate R`: the requests that arrive on their own (all but a turn that follows
  another of the workload, `RequestSpec.after`) get new arrival times, in their order of
  arrival, from a Poisson process at R requests/s as `vllm bench serve --request-rate`
  draws them (`get_request`, `vllm/benchmarks/serve.py`, burstiness 1): exponential gaps of
  mean 1/R cumulated, the first request after the first gap, then all scaled so the last
  arrives at exactly N / R seconds (vLLM's `target_total_delay_s`: the mean rate is R
  whatever the draws). The draws are seeded by the run's `--seed` (their own stream, not the
  workload's). `inf` sends every one at time 0. A dependent turn keeps its semantics: it
  arrives its (unscaled) think time after its predecessor finishes.

The two are not combined (`CellConfig` refuses both): a rate replaces the arrival times,
leaving nothing to scale, and vLLM's bench has the rate alone. Replay ignores time, so only
the serving protocol is re-timed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from experiments.workloads.spec import RequestSpec

#: the Poisson draws' stream, beside the run's seed (so they never repeat a workload's own draws)
POISSON_STREAM = 0x7E71


def retime(
    requests: Sequence[RequestSpec],
    *,
    time_scale: float | None = None,
    request_rate: float | None = None,
    seed: int = 0,
) -> list[RequestSpec]:
    """`requests` re-timed by `time_scale` or `request_rate` (see the module docstring);
    unchanged when neither is given."""
    if time_scale is not None and request_rate is not None:
        raise ValueError("re-time by a time scale or a request rate, not both")
    if time_scale is not None:
        return scaled(requests, time_scale)
    if request_rate is not None:
        return poisson(requests, request_rate, seed)
    return list(requests)


def scaled(requests: Sequence[RequestSpec], x: float) -> list[RequestSpec]:
    """Every arrival and think time × `x` (a positive, finite number)."""
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"a time scale is a positive, finite number, got {x!r}")
    return [dataclasses.replace(s, arrival=s.arrival * x, think_time=s.think_time * x) for s in requests]


def on_their_own(requests: Sequence[RequestSpec]) -> list[int]:
    """Positions of the requests the clock schedules by their arrival (none follows another
    request of `requests`), in the order they arrive (time, then position)."""
    ids = {s.request_id for s in requests}
    own = [i for i, s in enumerate(requests) if s.after is None or s.after not in ids]
    return sorted(own, key=lambda i: requests[i].arrival)  # stable: ties keep their order


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """`n` arrival times of vLLM's Poisson process at `rate` requests/s (inf: all 0)."""
    if not rate > 0:  # also NaN
        raise ValueError(f"a request rate is positive (or inf), got {rate!r}")
    if n == 0 or rate == math.inf:
        return np.zeros(n)
    rng = np.random.default_rng([seed, POISSON_STREAM])
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    return times * ((n / rate) / times[-1])  # the last arrives at n / rate, as vLLM rescales


def poisson(requests: Sequence[RequestSpec], rate: float, seed: int) -> list[RequestSpec]:
    """`requests` with the arrivals on their own re-drawn at `rate` (see the module docstring)."""
    own = on_their_own(requests)
    out = list(requests)
    for i, t in zip(own, poisson_arrivals(len(own), rate, seed).tolist(), strict=True):
        out[i] = dataclasses.replace(out[i], arrival=t)
    return out
