"""Routers that look at load only, never at the prompt: `round_robin`, `random`,
`least_load`, `power_of_two`.

Semantics from SGLang's router (sgl-model-gateway, `src/policies/round_robin.rs`,
`random.rs`, `least_load.rs`, `power_of_two.rs`); the ties are broken as stated, so a run is
deterministic (the random ones are seeded).
"""

from __future__ import annotations

import numpy as np

from experiments.engine.routers.base import ClusterView, Router
from experiments.workloads.spec import RequestSpec


def least_loaded(view: ClusterView, candidates: range | list[int] | None = None) -> int:
    """The candidate with the fewest outstanding tokens; ties: the lowest index (SGLang's
    strict `<` scan keeps the first)."""
    best, best_load = -1, 0
    for i in range(view.num_replicas) if candidates is None else candidates:
        load = view.outstanding_tokens(i)
        if best < 0 or load < best_load:
            best, best_load = i, load
    return best


class RoundRobin(Router):
    """Replica 0, 1, ..., n-1, 0, ...: SGLang's `round_robin` (a counter modulo the number of
    healthy workers; every replica is healthy here)."""

    name = "round_robin"

    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self.next = 0

    def route(self, request: RequestSpec, view: ClusterView) -> int:
        i = self.next % self.num_replicas
        self.next += 1
        return i


class RandomRouter(Router):
    """A uniformly random replica: SGLang's `random`, seeded (`seed`) so runs repeat."""

    name = "random"

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        super().__init__(num_replicas)
        self.rng = np.random.default_rng(seed)

    def route(self, request: RequestSpec, view: ClusterView) -> int:
        return int(self.rng.integers(self.num_replicas))


class LeastLoad(Router):
    """The replica with the fewest outstanding tokens (`ClusterView.outstanding_tokens`).
    SGLang's `least_load` counts the text length of the requests it sent and has not seen
    finish, or the token loads its monitor reports (`update_loads`); this reads the tokens
    the replicas still have to compute and generate. Ties: the lowest index."""

    name = "least_load"

    def route(self, request: RequestSpec, view: ClusterView) -> int:
        return least_loaded(view)


class PowerOfTwo(Router):
    """Power of two choices: two distinct replicas drawn at random, the one with fewer
    outstanding tokens wins, the first drawn on a tie. As SGLang's `power_of_two`: the first
    index uniform, the second `(first + 1 + uniform(0..n-2)) % n`, compared by the token
    loads its monitor reports (`load1 <= load2` keeps the first). Seeded (`seed`)."""

    name = "power_of_two"

    def __init__(self, num_replicas: int, seed: int = 0) -> None:
        super().__init__(num_replicas)
        self.rng = np.random.default_rng(seed)

    def route(self, request: RequestSpec, view: ClusterView) -> int:
        n = self.num_replicas
        if n == 1:
            return 0
        first = int(self.rng.integers(n))
        second = (first + 1 + int(self.rng.integers(n - 1))) % n
        return first if view.outstanding_tokens(first) <= view.outstanding_tokens(second) else second
