"""`precise`: llm-d's precise prefix-cache scheduling (llm-d-inference-scheduler, now
llm-d-router, at 520af478 of May 2026, after v0.8.0; its kv-cache indexer llm-d-kv-cache
v0.8.1), as `deploy/config/epp-precise-prefix-cache-config.yaml` configures the endpoint
picker: the `precise-prefix-cache-scorer` at weight 2, the `kv-cache-utilization-scorer`
and the `queue-scorer` at weight 1 each, and the `max-score-picker`.

Per decision, each replica gets the weighted sum of its scorers' scores, each in [0, 1]
(`scheduler_profile.go`: `weightedScorePerEndpoint += score * weight`):

- prefix (`preciseprefixcache`): the longest run of the prompt's full pages, from the first,
  that the replica's cache holds, over the prompt's full pages (`absoluteScoredPods`: matched
  / total, 0 when the prompt has no full page). The cache state is exact: rebuilt from the
  replica's KV events (`KvIndex`, as llm-d's `kvevents.Pool` feeds its `kvblock.Index`),
  the prompt's keys computed as the backend computes them; the run is llm-d's
  `LongestPrefixScorer` (consecutive keys from the first, a replica dropping out at its
  first miss). llm-d v0.8.0 and earlier min-max normalised the raw match counts instead
  (every pod 1.0 on a cold cluster); this follows the later absolute score (llm-d PR 1107).
- queue (`queuedepth`): `(max - q) / (max - min)` over the replicas' waiting requests q
  (`ClusterView.waiting`, vLLM's `num_requests_waiting`), 1.0 for every replica when all
  are equal.
- KV utilization (`kvcacheutilization`): `1 - kv_usage` (`ClusterView.kv_usage`, vLLM's
  `kv_cache_usage_perc`: pages pinned by running requests over all pages).

The picker takes the highest total; ties are broken at random (llm-d shuffles the
candidates before a stable sort), seeded here (`seed`). Options: `prefix_weight` (2.0),
`load_weight` (1.0, each load scorer's weight), `load_scorers` (`queue+kv_usage`, the sample
configuration; or `queue`, or `kv_usage`). `counters`: `prefix_hit` (some replica holds the
prompt's first page) / `no_hit`, and `tie` (several replicas had the best score).
"""

from __future__ import annotations

import math

import numpy as np

from experiments.engine.routers.base import ClusterView
from experiments.engine.routers.kv_index import EventIndexRouter
from experiments.workloads.spec import RequestSpec

LOAD_SCORERS = ("queue+kv_usage", "queue", "kv_usage")


def prefix_scores(matched: list[int], total: int) -> list[float]:
    """llm-d's `absoluteScoredPods`: matched pages over the prompt's pages, 0 without any."""
    if total <= 0:
        return [0.0] * len(matched)
    return [min(m / total, 1.0) for m in matched]


def queue_scores(view: ClusterView) -> list[float]:
    """llm-d's `QueueScorer`: fewer waiting requests score higher, min-max normalised."""
    queues = [view.waiting(i) for i in range(view.num_replicas)]
    lo, hi = min(queues), max(queues)
    if hi == lo:
        return [1.0] * len(queues)
    return [(hi - q) / (hi - lo) for q in queues]


def kv_usage_scores(view: ClusterView) -> list[float]:
    """llm-d's `KVCacheUtilizationScorer`: `1 - usage`."""
    return [1.0 - view.kv_usage(i) for i in range(view.num_replicas)]


class Precise(EventIndexRouter):
    """llm-d's precise prefix-cache scorer with its load scorers (see the module docstring)."""

    name = "precise"

    def __init__(
        self,
        num_replicas: int,
        prefix_weight: float = 2.0,
        load_weight: float = 1.0,
        load_scorers: str = "queue+kv_usage",
        seed: int = 0,
    ) -> None:
        super().__init__(num_replicas)
        for what, w in (("prefix_weight", prefix_weight), ("load_weight", load_weight)):
            if not (0.0 <= w < math.inf):
                raise ValueError(f"{what} is a scorer weight, finite and >= 0; got {w}")
        if load_scorers not in LOAD_SCORERS:
            raise ValueError(f"load_scorers is one of {', '.join(LOAD_SCORERS)}; got {load_scorers!r}")
        self.prefix_weight = prefix_weight
        self.load_weight = load_weight
        self.load_scorers = load_scorers.split("+")
        self.rng = np.random.default_rng(seed)

    def route(self, request: RequestSpec, view: ClusterView) -> int:
        matched, total = self.index.overlaps(request)
        self.count("prefix_hit" if max(matched) > 0 else "no_hit")
        return self.pick(self.weighted(matched, total, view))

    def scores(self, request: RequestSpec, view: ClusterView) -> list[float]:
        """Each replica's score for `request` now (read-only: what `route` would compare)."""
        return self.weighted(*self.index.overlaps(request), view)

    def weighted(self, matched: list[int], total: int, view: ClusterView) -> list[float]:
        """Each replica's weighted sum of the scorers' scores."""
        totals = [self.prefix_weight * s for s in prefix_scores(matched, total)]
        for scorer in self.load_scorers:
            load = queue_scores(view) if scorer == "queue" else kv_usage_scores(view)
            totals = [t + self.load_weight * s for t, s in zip(totals, load, strict=True)]
        return totals

    def pick(self, totals: list[float]) -> int:
        """llm-d's `MaxScorePicker`: the highest score, a tie drawn at random (seeded)."""
        best = max(totals)
        tied = [i for i, t in enumerate(totals) if t == best]
        if len(tied) == 1:
            return tied[0]
        self.count("tie")
        return tied[int(self.rng.integers(len(tied)))]
