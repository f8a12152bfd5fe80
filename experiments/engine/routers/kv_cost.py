"""`kv_cost`: NVIDIA Dynamo's KV router (`python -m dynamo.frontend --router-mode kv`;
`lib/kv-router/src/scheduling/selector.rs` `DefaultWorkerSelector`, the cost of
`docs/architecture/kv_cache_routing.md`), with KV events on (`KvIndexer`).

Per decision, each replica's cost (Dynamo's logit), lowest wins:

    cost = overlap_weight * prefill_blocks + decode_blocks

- `prefill_blocks`: the prefill tokens the replica would have, over the page size: the
  prompt tokens still to prefill there (`ClusterView.prefill_tokens`; Dynamo tracks the
  prefill tokens of the requests it routed until their first token, `track_prefill_tokens`
  on by default) plus this prompt's tokens past its cached prefix there
  (`prompt - overlap * page_size`, the overlap counted in full pages from the first by the
  index rebuilt from the replica's KV events, `KvIndex`).
- `decode_blocks`: the replica's active blocks plus this request's: the full pages of the
  prompts of its requests in flight (`ClusterView.active_pages`; Dynamo's
  `router_track_active_blocks`, with output blocks not tracked by default) plus this
  prompt's full pages. Dynamo counts a block shared by two active requests once and
  credits the new request with the blocks its prompt shares with them; this counts each
  request's pages (a simplification: it ignores sharing among the running requests).

`temperature` 0 (Dynamo's default `router_temperature`): the lowest cost; a tie goes to the
replica whose cache holds the fewest pages (Dynamo's tree size), then at random (seeded,
`seed`). Above 0, Dynamo's softmax sampling over the normalised costs: all equal, uniform;
else `p_i ∝ exp(-(c_i - min) / ((max - min) * temperature))`, drawn with one uniform number
(seeded) against the cumulative probabilities in replica order. `overlap_weight` is
Dynamo's `kv_overlap_score_weight` (1.0); its newest releases split it into
`overlap_score_credit` and `prefill_load_scale` (the deprecated weight sets the scale).
`counters`: `lowest_cost`, `tie` (broken by cache size or at random), `sampled`.
"""

from __future__ import annotations

import math

import numpy as np

from experiments.engine.routers.base import ClusterView
from experiments.engine.routers.kv_index import EventIndexRouter
from experiments.workloads.spec import RequestSpec


def softmax_pick(costs: list[float], temperature: float, sample: float) -> int:
    """Dynamo's `softmax_sample_with_sample`: lower cost, higher probability; `sample` in
    [0, 1) against the cumulative probabilities (the last replica if rounding leaves it)."""
    lo, hi = min(costs), max(costs)
    if lo == hi:
        weights = [1.0] * len(costs)
    else:
        scale = -1.0 / ((hi - lo) * temperature)
        weights = [math.exp(c * scale - lo * scale) for c in costs]
    total = sum(weights)
    cumulative = 0.0
    for i, w in enumerate(weights):
        cumulative += w / total
        if sample <= cumulative:
            return i
    return len(costs) - 1


class KvCost(EventIndexRouter):
    """Dynamo's KV router cost (see the module docstring)."""

    name = "kv_cost"

    def __init__(self, num_replicas: int, overlap_weight: float = 1.0, temperature: float = 0.0, seed: int = 0) -> None:
        super().__init__(num_replicas)
        if not (0.0 <= overlap_weight < math.inf) or not (0.0 <= temperature < math.inf):
            raise ValueError(
                f"overlap_weight and temperature must be finite and >= 0; got {overlap_weight}, {temperature}"
            )
        self.overlap_weight = overlap_weight
        self.temperature = temperature
        self.rng = np.random.default_rng(seed)

    def route(self, request: RequestSpec, view: ClusterView) -> int:
        costs = self.costs(request, view)
        if self.temperature > 0:
            self.count("sampled")
            return softmax_pick(costs, self.temperature, float(self.rng.random()))
        return self.lowest(costs)

    def costs(self, request: RequestSpec, view: ClusterView) -> list[float]:
        """Each replica's `overlap_weight * prefill_blocks + decode_blocks`."""
        matched, total = self.index.overlaps(request)
        size = view.page_size
        prompt = request.prompt_len
        return [
            self.overlap_weight * (view.prefill_tokens(i) + prompt - matched[i] * size) / size
            + view.active_pages(i)
            + total
            for i in range(self.num_replicas)
        ]

    def lowest(self, costs: list[float]) -> int:
        """The lowest cost; among equal ones the smallest cache (Dynamo's tree size), then a
        seeded draw."""
        best = min(costs)
        tied = [i for i, c in enumerate(costs) if c == best]
        if len(tied) == 1:
            self.count("lowest_cost")
            return tied[0]
        self.count("tie")
        smallest = min(self.index.sizes[i] for i in tied)
        tied = [i for i in tied if self.index.sizes[i] == smallest]
        return tied[0] if len(tied) == 1 else tied[int(self.rng.integers(len(tied)))]
