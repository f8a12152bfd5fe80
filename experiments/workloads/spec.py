"""`RequestSpec`: one request of a workload, and its plan, before any cache has seen it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cachelib.types import NO_EXTRA, ExtraKeys

#: Generated tokens get ids from here up (a counter), so no prompt ever matches them;
#: prompt token ids stay below it (the trace loaders refuse larger ones).
GENERATED_TOKEN_BASE = 2_000_000_000


class TraceFormatError(ValueError):
    """A trace file or line that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request: arrival time (s), prompt token ids, output length, extra keys, and its plan.

    `prompt_source` is the token array itself or a callable that builds it, so a long
    trace need not hold every prompt in memory at once. `prefix_id` names a declared
    prefix (for backends that share only what is declared); `n` is the number of parallel
    samples and `beam_width` the beam search width (1 = plain decoding). `after` names a
    request this one follows (a conversation's previous turn): the serving engine lets it
    arrive `think_time` seconds after that request finishes, whatever `arrival` says
    (`arrival` still orders the replay protocol).

    The per-request plan, which every engine follows exactly:
    - `sample_lens`: with `n > 1`, the output length of each sample (default: `output_len`
      each); sample 0 is the request itself.
    - `beam_parents`: with `beam_width > 1`, a `(steps, beam_width)` array; row t names the
      parent beam of each surviving beam at step t (beam search needs one).
    - `forced_output`: the token ids the request generates whatever a model samples (a
      conversation re-sends its answers, so their KV can be reused); default fresh ids.
    """

    request_id: str
    prompt_source: np.ndarray | Callable[[], np.ndarray]
    output_len: int
    arrival: float = 0.0
    extra: ExtraKeys = NO_EXTRA
    prefix_id: int | None = None
    n: int = 1
    beam_width: int = 1
    after: str | None = None
    think_time: float = 0.0
    sample_lens: tuple[int, ...] | None = None
    beam_parents: np.ndarray | None = None
    forced_output: np.ndarray | None = None

    @property
    def prompt(self) -> np.ndarray:
        src = self.prompt_source
        return src() if callable(src) else src

    @property
    def prompt_len(self) -> int:
        """Prompt tokens, without building a lazy prompt (lazy sources know their length)."""
        try:
            return len(self.prompt_source)  # type: ignore[arg-type]
        except TypeError:  # a plain callable: build it once
            return len(self.prompt)

    @property
    def output_lens(self) -> tuple[int, ...]:
        """Output length of each of the `n` samples (one entry for plain decoding)."""
        return self.sample_lens or (self.output_len,) * self.n
