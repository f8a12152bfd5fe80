"""Parallel sampling and beam search workloads (PagedAttention §6.3), as `Workload`s.

Thin wrappers over `sampling.generate`: the decoding schedule of each request is on its
`RequestSpec` (`sample_lens`, `beam_parents`).
"""

from __future__ import annotations

from experiments.workloads import sampling
from experiments.workloads.generators import Workload, json_config, require_float, require_int


def _workload(name: str, reqs: list[sampling.SamplingRequest], config: dict) -> Workload:
    # config stays exactly the knobs (so make_workload(name, **config) rebuilds it);
    # sampling.describe(dataset, schedules) gives the realised length statistics
    return Workload(name, [r.spec for r in reqs], config=config)


def parallel_sampling(
    seed: int = 0,
    *,
    dataset: str = "alpaca",
    n: int = 4,
    num_requests: int = 100,
    rate: float = 1.0,
) -> Workload:
    """Parallel sampling: each request asks for n samples forked from one prompt.

    Knobs:
    - dataset ("alpaca"): length shape, alpaca | sharegpt (log-normal, paper means).
    - n (4): samples per request (RequestSpec.n); one output length per sample (RequestSpec.sample_lens).
    - num_requests (100): requests generated.
    - rate (1.0): Poisson arrival rate, requests/s.
    Prompt ids come from a fixed 32000-token vocabulary.
    """
    config = json_config(**locals())  # first, so locals() holds exactly the knobs
    require_int("n", n)
    require_int("num_requests", num_requests, 0)
    require_float("rate", rate, 0.0, strict=True)
    reqs = sampling.generate(dataset, "parallel", n, num_requests, seed=seed, rate=rate)
    return _workload("parallel_sampling", reqs, config)


def beam_search(
    seed: int = 0,
    *,
    dataset: str = "alpaca",
    beam_width: int = 4,
    num_requests: int = 100,
    rate: float = 1.0,
    parent_decay: float = 0.5,
) -> Workload:
    """Beam search: each request keeps beam_width beams that fork and prune every step.

    Knobs:
    - dataset ("alpaca"): length shape, alpaca | sharegpt (log-normal, paper means).
    - beam_width (4): beams per request (RequestSpec.beam_width).
    - num_requests (100): requests generated.
    - rate (1.0): Poisson arrival rate, requests/s.
    - parent_decay (0.5): a survivor extends the beam of rank r with probability
      proportional to parent_decay**r (1 = uniform parents, small = one dominant beam).
    Prompt ids come from a fixed 32000-token vocabulary.
    """
    config = json_config(**locals())  # first, so locals() holds exactly the knobs
    require_int("beam_width", beam_width)
    require_int("num_requests", num_requests, 0)
    require_float("rate", rate, 0.0, strict=True)
    reqs = sampling.generate(dataset, "beam", beam_width, num_requests, seed=seed, rate=rate, parent_decay=parent_decay)
    return _workload("beam_search", reqs, config)
