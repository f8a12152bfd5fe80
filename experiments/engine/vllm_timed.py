"""`TimedVllmScheduler`: the `vllm` policy, also recording when each token reaches its request.

`VllmScheduler` (vllm_scheduler.py) makes vLLM's decisions; this subclass changes none of
them. It wraps the two places where tokens are delivered and tells the replica's
`TokenGaps` (ServingResult.itl) who got a token when:

- `process(plan)` (vLLM's `update_from_output`) delivers, at the step's end, the token of
  every item that sampled one, except a request that finished while the step was in flight
  (async): exactly the rule `VllmScheduler.process` applies, read before it runs;
- `run_decode_window(plan, k)` delivers k tokens to every item, one at each step's end; the
  ends are the window's own (`np.cumsum` of the executor's step times from now, as the window
  accumulates them), checked against the end it returns, so a change there cannot go
  unnoticed.

The serving drivers use this class for `--scheduler vllm` (serving.SCHEDULER_POLICIES).
"""

from __future__ import annotations

import numpy as np

from experiments.engine.vllm_scheduler import StepPlan, VllmScheduler


class TimedVllmScheduler(VllmScheduler):
    """`VllmScheduler` whose result's `itl` holds every inter-token gap (see the module docstring)."""

    def process(self, plan: StepPlan) -> None:
        self.result.itl.step(
            (
                r
                for (r, _, _), tok in zip(plan.items, plan.tokens, strict=True)
                if tok is not None and r.finished_at is None and r.sample_of is None
            ),
            plan.end,
        )
        super().process(plan)

    def run_decode_window(self, plan: StepPlan, k: int) -> float:
        now = self.clock.now
        end = super().run_decode_window(plan, k)
        computed = np.array([s for _, _, s in plan.items], dtype=np.int64)
        ends = np.cumsum(np.concatenate(([now], self.executor.decode_step_seconds(computed, k))))[1:]
        if float(ends[-1]) != end:
            raise RuntimeError(
                f"decode window of {k} steps ended at {end!r} s, its steps' times add up to {float(ends[-1])!r} s: "
                "the token clock no longer follows VllmScheduler.run_decode_window"
            )
        self.result.itl.window([r for r, _, _ in plan.items if r.sample_of is None], ends.tolist())
        return end
