"""`RequestSpec`: one request of a workload, and its plan, before any cache has seen it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from cachelib.errors import InvalidRequestError
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

    def __post_init__(self) -> None:
        """Refuse a spec no engine can run as written, naming the field (`InvalidRequestError`),
        when it is made, not when an engine reaches it mid-run. The trace loaders check
        their files' fields themselves (with the file and line); this guards specs built in
        code. The prompt's token ids are checked where it is built (`Sequence`): a lazy
        prompt is not built here."""
        rid = self.request_id
        if rid.__class__ is not str or not rid:
            raise InvalidRequestError(f"request id must be a non-empty str, got {rid!r}")
        src = self.prompt_source
        if src.__class__ is np.ndarray:
            if src.ndim != 1:
                raise InvalidRequestError(f"request {rid!r}: prompt must be 1-D token ids, got shape {src.shape}")
        elif not callable(src):
            raise InvalidRequestError(
                f"request {rid!r}: prompt_source must be a numpy array of token ids or a callable that builds "
                f"one, got {type(src).__name__}"
            )
        _count(rid, "output_len", self.output_len, 0)
        _seconds(rid, "arrival", self.arrival)
        if not isinstance(self.extra, ExtraKeys):
            raise InvalidRequestError(f"request {rid!r}: extra must be ExtraKeys, got {type(self.extra).__name__}")
        if self.prefix_id is not None:
            _count(rid, "prefix_id", self.prefix_id, 0)
        n = _count(rid, "n", self.n, 1)
        width = _count(rid, "beam_width", self.beam_width, 1)
        if n > 1 and width > 1:
            raise InvalidRequestError(
                f"request {rid!r}: n={n} parallel samples and beam_width={width}: a request does one or the other"
            )
        if self.after is not None and (self.after.__class__ is not str or not self.after):
            raise InvalidRequestError(
                f"request {rid!r}: after must name a request (a non-empty str), got {self.after!r}"
            )
        _seconds(rid, "think_time", self.think_time)
        if self.sample_lens is not None:
            lens = self.sample_lens
            if not isinstance(lens, tuple) or len(lens) != n:
                raise InvalidRequestError(
                    f"request {rid!r}: sample_lens must be a tuple of n={n} output lengths, got {lens!r:.80}"
                )
            for k in lens:
                _count(rid, "sample_lens", k, 0)
        if self.beam_parents is not None:
            self._check_beam_parents(width)
        if self.forced_output is not None:
            forced = np.asarray(self.forced_output)
            if forced.ndim != 1 or (forced.size and forced.dtype.kind not in "iu"):
                raise InvalidRequestError(
                    f"request {rid!r}: forced_output must be 1-D integer token ids, got shape {forced.shape} "
                    f"of {forced.dtype}"
                )

    def _check_beam_parents(self, width: int) -> None:
        """The beam schedule replay follows: `(output_len, beam_width)` parent indices, row 0
        all 0 (every beam extends the prompt), every entry a beam of the step before."""
        rid, parents = self.request_id, self.beam_parents
        if width == 1:
            raise InvalidRequestError(f"request {rid!r}: beam_parents given but beam_width is 1 (no beam search)")
        arr = np.asarray(parents)
        if arr.ndim != 2 or arr.shape != (self.output_len, width) or (arr.size and arr.dtype.kind not in "iu"):
            raise InvalidRequestError(
                f"request {rid!r}: beam_parents must be integer parent indices of shape (output_len, beam_width) = "
                f"({self.output_len}, {width}), got shape {arr.shape} of {arr.dtype}"
            )
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= width or np.count_nonzero(arr[0])):
            raise InvalidRequestError(
                f"request {rid!r}: beam_parents rows must name beams of the step before (row 0: the prompt, 0; "
                f"later rows: 0..{width - 1})"
            )

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


def _count(rid: str, field: str, value: object, lo: int) -> int:
    """`value` as an int of at least `lo` (a Python or numpy integer, not a bool)."""
    if value.__class__ is not int and (isinstance(value, bool) or not isinstance(value, Integral)):
        raise InvalidRequestError(f"request {rid!r}: {field} must be an int, got {value!r}")
    if value < lo:  # type: ignore[operator]
        raise InvalidRequestError(f"request {rid!r}: {field} must be >= {lo}, got {value}")
    return int(value)  # type: ignore[call-overload]


def _seconds(rid: str, field: str, value: object) -> None:
    """`value` must be a finite, non-negative number of seconds."""
    if value.__class__ is not float and (isinstance(value, bool) or not isinstance(value, Real)):
        raise InvalidRequestError(f"request {rid!r}: {field} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value >= 0):  # type: ignore[arg-type]
        raise InvalidRequestError(f"request {rid!r}: {field} must be finite and >= 0 seconds, got {value}")
