"""`RequestSpec`: one request of a workload, before any cache has seen it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cachelib.types import NO_EXTRA, ExtraKeys


class TraceFormatError(ValueError):
    """A trace file or line that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """A request: arrival time (s), prompt token ids, output length, extra keys.

    `prompt_source` is the token array itself or a callable that builds it, so a long
    trace need not hold every prompt in memory at once. `prefix_id` names a declared
    prefix (for backends that share only what is declared); `n` is the number of parallel
    samples and `beam_width` the beam search width (1 = plain decoding). `after` names a
    request this one follows (a conversation's previous turn): the serving engine lets it
    arrive `think_time` seconds after that request finishes, whatever `arrival` says
    (`arrival` still orders the replay protocol).
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

    @property
    def prompt(self) -> np.ndarray:
        src = self.prompt_source
        return src() if callable(src) else src
