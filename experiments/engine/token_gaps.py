"""`TokenGaps`: inter-token latency (ITL), every gap between two tokens a request received.

A token reaches its request when the step that sampled it ends (the virtual clock's step
end, as `first_token_at` and `finished_at` are read). A request's gaps are the times between
its consecutive tokens after the first, so a stall (a long prefill step of another request
in the batch, a step the token budget skipped it in, a preemption and its recompute) is in
the gap that spans it, as a streaming client would see it (`vllm bench serve`'s ITL).

Recorded exactly and cheaply, with no per-token list: a scheduler tells `step(requests, at)`
which requests got a token at a step's end, and `window(requests, ends)` the requests of a
decode window with each of its steps' ends. Each request remembers only when its last
token came (`Request.last_token_at`). Gaps are kept as (seconds, how many) pairs: the
requests that also got a token in the replica's previous step share one gap, the step's
length, so a step adds one pair plus one per request that missed steps, and a window one
pair per step. Parallel samples are left out, as TTFT and TPOT leave them out (the caller
filters them). The distribution is `expanded()`: every gap once, for the mean and the
percentiles as `np.percentile` takes them over vLLM's list of ITLs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from experiments.engine.request import Request


class TokenGaps:
    """One replica's inter-token gaps (seconds), as (value, count) pairs."""

    __slots__ = ("values", "counts", "_last_step")

    def __init__(self) -> None:
        self.values: list[float] = []
        self.counts: list[int] = []
        self._last_step: float | None = None  # when this replica's last token-bearing step ended

    def step(self, requests: Iterable[Request], at: float) -> None:
        """Each of `requests` got one token at `at` (a step's end)."""
        prev = self._last_step
        values, counts = self.values, self.counts
        regular = 0  # requests whose previous token came at the previous step's end
        for r in requests:
            last = r.last_token_at
            r.last_token_at = at
            if last is None:
                continue  # its first token: TTFT, not a gap
            if last == prev:
                regular += 1
            else:
                values.append(at - last)
                counts.append(1)
        if regular:
            values.append(at - prev)  # type: ignore[operator]  # regular > 0: prev is a time
            counts.append(regular)
        self._last_step = at

    def window(self, requests: Sequence[Request], ends: Sequence[float]) -> None:
        """Each of `requests` got one token at each of `ends` (a decode window's step ends,
        in order); its first gap runs from its previous token, the others are the steps'."""
        if not len(ends):
            return
        self.step(requests, ends[0])
        if len(ends) > 1 and requests:
            self.values.extend(np.diff(np.asarray(ends, dtype=float)).tolist())
            self.counts.extend([len(requests)] * (len(ends) - 1))
        last = float(ends[-1])
        for r in requests:
            r.last_token_at = last
        self._last_step = last

    def step_rows(self, last: np.ndarray, got: np.ndarray, at: float) -> np.ndarray:
        """`step` for requests held as rows (`vllm_rows.RunningRows`): `last` is each row's
        last token time (NaN: none yet), `got` the rows that got a token at `at`. The same
        pairs in the same order; `last` is updated in place (the rows that got one now say
        `at`) and returned."""
        at = float(at)
        prev = self._last_step
        came = last[got]
        if prev is None:
            regular, count = None, 0
        else:
            regular = came == prev  # NaN (no token yet) equals nothing
            count = int(np.count_nonzero(regular))
        gaps: list[float] = []
        if count < came.size:  # rows whose last token came earlier, or never
            odd = came if regular is None else came[~regular]
            gaps = (at - odd[~np.isnan(odd)]).tolist()
        self.add_step(gaps, count, at)
        last[got] = at
        return last

    @property
    def last_step(self) -> float | None:
        """When this replica's last token-bearing step ended (None: none yet)."""
        return self._last_step

    def add_step(self, gaps: list[float], regular: int, at: float) -> None:
        """What a step ending at `at` adds: the `gaps` of the requests whose last token came
        before the previous step's end, one pair each in order, then the `regular` ones
        whose last token came at it, one pair. `step_rows` computes them with numpy, the
        row scheduler's compiled path in one loop (experiments/engine/row_kernels.py)."""
        if gaps:
            self.values.extend(gaps)
            self.counts.extend([1] * len(gaps))
        if regular:
            self.values.append(at - self._last_step)  # type: ignore[operator]  # regular > 0: a previous step
            self.counts.append(regular)
        self._last_step = at

    def window_rows(self, last: np.ndarray, timed: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """`window` for rows: the `timed` rows got one token at each of `ends`; returns `last`."""
        if not len(ends):
            return last
        out = self.step_rows(last, timed, float(ends[0]))
        self.add_window_steps(ends, int(np.count_nonzero(timed)))
        out[timed] = float(ends[-1])
        return out

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
