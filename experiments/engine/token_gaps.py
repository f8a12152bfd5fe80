"""`TokenGaps`: inter-token latency (ITL), every gap between two tokens a request received.

A token reaches its request when the step that sampled it ends (the virtual clock's step
end, as `first_token_at` and `finished_at` are read). A request's gaps are the times between
its consecutive tokens after the first, so a stall (a long prefill step of another request
in the batch, a step the token budget skipped it in, a preemption and its recompute) is in
the gap that spans it, as a streaming client would see it (`vllm bench serve`'s ITL).

Recorded exactly and cheaply, with no per-token list: a policy's delivery rule
(`kernels.deliver`) computes a step's gaps from when each request's last token came, and
tells `add_step` what they are, and a decode window's later steps `add_window_steps`. Gaps
are kept as (seconds, how many) pairs: the requests that also got a token in the replica's
previous step share one gap, the step's length, so a step adds one pair plus one per
request that missed steps, and a window one pair per step. Parallel samples are left out, as TTFT and TPOT leave them out (the caller
filters them). The distribution is `expanded()`: every gap once, for the mean and the
percentiles as `np.percentile` takes them over vLLM's list of ITLs.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class TokenGaps:
    """One replica's inter-token gaps (seconds), as (value, count) pairs."""

    __slots__ = ("values", "counts", "_last_step")

    def __init__(self) -> None:
        self.values: list[float] = []
        self.counts: list[int] = []
        self._last_step: float | None = None  # when this replica's last token-bearing step ended

    @property
    def last_step(self) -> float | None:
        """When this replica's last token-bearing step ended (None: none yet)."""
        return self._last_step

    def add_step(self, gaps: list[float], regular: int, at: float) -> None:
        """What a step ending at `at` adds: the `gaps` of the requests whose last token came
        before the previous step's end, one pair each in order, then the `regular` ones
        whose last token came at it, one pair (`kernels.deliver` computes them)."""
        if gaps:
            self.values.extend(gaps)
            self.counts.extend([1] * len(gaps))
        if regular:
            self.values.append(at - self._last_step)  # type: ignore[operator]  # regular > 0: a previous step
            self.counts.append(regular)
        self._last_step = at

    def add_window_steps(self, ends: np.ndarray, many: int) -> None:
        """What a decode window's steps after its first add (`ends`: every step's end):
        each one gap, the step's length, for the `many` requests that got a token at each."""
        if len(ends) > 1 and many:
            self.values.extend(np.diff(np.asarray(ends, dtype=float)).tolist())
            self.counts.extend([many] * (len(ends) - 1))
        self._last_step = float(ends[-1])

    def __eq__(self, other: object) -> bool:  # a ServingResult compares its fields
        if not isinstance(other, TokenGaps):
            return NotImplemented
        return (self.values, self.counts) == (other.values, other.counts)

    __hash__ = None  # type: ignore[assignment]  # mutable

    @property
    def total(self) -> int:
        """How many gaps."""
        return sum(self.counts)

    def expanded(self) -> np.ndarray:
        """Every gap once (seconds), in recording order."""
        return np.repeat(np.asarray(self.values, dtype=float), np.asarray(self.counts, dtype=np.int64))

    @classmethod
    def merged(cls, parts: Iterable[TokenGaps]) -> TokenGaps:
        """The gaps of several replicas as one distribution."""
        out = cls()
        for p in parts:
            out.values.extend(p.values)
            out.counts.extend(p.counts)
        return out
