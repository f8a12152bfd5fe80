"""`cache_aware`: SGLang's cache-aware router (sgl-router `src/policies/cache_aware.rs`, as
`python -m sglang_router.launch_router --policy cache_aware` runs it).

Per decision:

1. Load is the requests each replica has in flight (`ClusterView.requests`, SGLang's
   `worker.load()`). The cluster is imbalanced when `max - min > balance_abs_threshold` and
   `max > min * balance_rel_threshold`: then the least loaded replica takes the request
   (ties: the lowest index).
2. Otherwise the prompt is matched against the router's *approximate* tree of the prompts it
   routed (`ApproxTree`, never the replicas' real caches): when the matched share of the
   prompt is above `cache_threshold` (strictly, as SGLang), the replica holding the match
   takes it; else the replica whose tree is smallest.
3. Either way the prompt is inserted into the chosen replica's tree.

Every `eviction_interval_s` seconds (SGLang's background thread; here on the run's clock,
before the first decision at or after each multiple) each replica's tree is pruned to
`max_tree_size` tokens, least recently used leaves first; 0 never prunes.

Defaults are those of SGLang's launcher (`sglang_router/router_args.py`: 0.3, 64, 1.5, 120 s,
2**26); its library default (`CacheAwareConfig::default`: 0.5, 32, 1.1, 30 s, 10,000) differs.
SGLang's tree holds characters; this one holds tokens, or with `block_size` > 1 one key per
block of that many tokens (a trailing partial block is never matched), so a tree of a long
trace stays small: the matched share is then counted in whole blocks. Later SGLang versions
(sgl-model-gateway) send a low match to the least loaded replica instead of the smallest
tree; Ray Serve's `PrefixCacheAffinityRouter` follows the same plan with a 10% match
threshold and power-of-two choices as its fallback. `counters`: `imbalanced`,
`prefix_match`, `smallest_tree`.
"""

from __future__ import annotations

import math

from experiments.engine.routers.approx_tree import ApproxTree, block_keys
from experiments.engine.routers.base import ClusterView, Router
from experiments.workloads.spec import RequestSpec


class CacheAware(Router):
    """SGLang's `cache_aware` policy (see the module docstring)."""

    name = "cache_aware"

    def __init__(
        self,
        num_replicas: int,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        eviction_interval_s: float = 120.0,
        max_tree_size: int = 2**26,
        block_size: int = 16,
    ) -> None:
        super().__init__(num_replicas)
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold is a share of the prompt, in [0, 1]; got {cache_threshold}")
        if balance_abs_threshold < 0 or not balance_rel_threshold >= 0:
            raise ValueError("balance_abs_threshold and balance_rel_threshold must be >= 0")
        if not 0 <= eviction_interval_s < math.inf or max_tree_size < 0 or block_size < 1:
            raise ValueError(
                f"eviction_interval_s must be finite and >= 0 (0: never prune), max_tree_size >= 0 and "
                f"block_size >= 1; got {eviction_interval_s}, {max_tree_size}, {block_size}"
            )
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs_threshold
        self.balance_rel = balance_rel_threshold
        self.interval = eviction_interval_s
        self.max_keys = max_tree_size // block_size  # the tree counts keys, one per block
        self.block_size = block_size
        self.tree = ApproxTree(num_replicas)
        self.next_eviction = eviction_interval_s

    def route(self, request: RequestSpec, view: ClusterView) -> int:
        self.prune_if_due(view.now)
        keys = block_keys(request.prompt, self.block_size)
        loads = [view.requests(i) for i in range(self.num_replicas)]
        if self.imbalanced(loads):
            self.count("imbalanced")
            choice = loads.index(min(loads))
        else:
            choice = self.by_prefix(keys, request.prompt_len)
        self.tree.insert(keys, choice)
        return choice

    def imbalanced(self, loads: list[int]) -> bool:
        """SGLang's test: both the absolute and the relative spread are over their thresholds."""
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs and hi > lo * self.balance_rel

    def by_prefix(self, keys, prompt_len: int) -> int:
        """The replica holding the longest match when it covers more than `cache_threshold`
        of the prompt, else the one with the smallest tree."""
        matched, tenant = self.tree.prefix_match(keys)
        rate = matched * self.block_size / prompt_len if prompt_len else 0.0
        if rate > self.cache_threshold:
            self.count("prefix_match")
            return tenant
        self.count("smallest_tree")
        return self.tree.smallest_tenant()

    def prune_if_due(self, now: float) -> None:
        """SGLang's periodic eviction, on the run's clock."""
        if self.interval <= 0 or now < self.next_eviction:
            return
        self.tree.evict_by_size(self.max_keys)
        self.next_eviction = (math.floor(now / self.interval) + 1) * self.interval
