"""`Workload`, what every generator and loader returns, and the helpers the generators share.

Generators are seeded: equal seed and knobs give equal requests (one `numpy` Generator per
call, consumed in a fixed order). Prompt token ids are `np.int32` arrays drawn uniformly
from `[0, vocab_size)`; arrivals follow a Poisson process of `rate` requests/s unless a
generator says otherwise (`rate=inf` puts every request at time 0, an offline batch).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cachelib.types import NO_EXTRA, ExtraKeys
from experiments.workloads.spec import RequestSpec

OUTPUT_DISTS = ("fixed", "uniform", "exponential")


@dataclass(frozen=True, eq=False)  # eq would compare numpy arrays elementwise
class Workload:
    """A named list of requests plus what a backend or engine needs beside them.

    - `requests`: in arrival order.
    - `declared_prefixes`: workload prefix id -> token ids. A request whose `prefix_id` is k
      starts with `declared_prefixes[k]`; a backend that shares only what is declared
      (`paged`) registers each one (its own ids may differ: map them) before the run.
    - `prefix_extra`: the extra keys a declared prefix is computed under (default
      `NO_EXTRA`); the requests naming it carry the same keys.
    - `config`: the knobs used (seed included), JSON-able, so a report can regenerate it.

    Each request's plan (samples, beams, forced outputs, which turn it follows) lives on its
    `RequestSpec`, not here.
    """

    name: str
    requests: list[RequestSpec]
    declared_prefixes: dict[int, np.ndarray] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    prefix_extra: dict[int, ExtraKeys] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[RequestSpec]:
        return iter(self.requests)

    def extra_of_prefix(self, prefix_id: int) -> ExtraKeys:
        return self.prefix_extra.get(prefix_id, NO_EXTRA)

    def check(self) -> None:
        """Raise `ValueError` if a request names an undeclared prefix or does not start with it."""
        for spec in self.requests:
            pid = spec.prefix_id
            if pid is None:
                continue
            if pid not in self.declared_prefixes:
                raise ValueError(f"{self.name}: request {spec.request_id!r} names undeclared prefix {pid}")
            pre, prompt = self.declared_prefixes[pid], spec.prompt
            if prompt.size < pre.size or not np.array_equal(prompt[: pre.size], pre):
                raise ValueError(f"{self.name}: request {spec.request_id!r} does not start with prefix {pid}")
            if spec.extra != self.extra_of_prefix(pid):
                raise ValueError(f"{self.name}: request {spec.request_id!r} extra keys differ from prefix {pid}'s")


class ConcatPrompt:
    """A prompt built on demand from shared parts (document + question, history + turn):
    a workload holds each shared part once instead of one full copy per request."""

    __slots__ = ("parts",)

    def __init__(self, parts: tuple[np.ndarray, ...]) -> None:
        self.parts = parts

    def __call__(self) -> np.ndarray:
        return np.concatenate(self.parts).astype(np.int32, copy=False)

    def __len__(self) -> int:
        return sum(int(p.size) for p in self.parts)


def json_config(seed: int | None, **knobs: Any) -> dict[str, Any]:
    """The knobs as a JSON-able dict (tuples become lists, inf becomes "inf")."""
    out: dict[str, Any] = {} if seed is None else {"seed": seed}
    for key, value in knobs.items():
        if isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, float) and math.isinf(value):
            value = "inf"
        out[key] = value
    return out


# -- knob checks: ValueError naming the knob ---------------------------------------------


def require_int(name: str, value: Any, lo: int = 1, hi: int | None = None) -> int:
    if (
        not isinstance(value, (int, np.integer))
        or isinstance(value, bool)
        or value < lo
        or (hi is not None and value > hi)
    ):
        bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ValueError(f"knob {name} must be an int {bound}, got {value!r}")
    return int(value)


def require_float(name: str, value: Any, lo: float = 0.0, *, strict: bool = False, finite: bool = False) -> float:
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and not math.isnan(value)
    if not ok or value < lo or (strict and value == lo) or (finite and math.isinf(value)):
        kind = "a finite number" if finite else "a number"
        raise ValueError(f"knob {name} must be {kind} {'>' if strict else '>='} {lo}, got {value!r}")
    return float(value)


def require_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"knob {name} must be one of {', '.join(choices)}, got {value!r}")
    return value


# -- draws ---------------------------------------------------------------------------------


def make_rng(seed: int, workload: str) -> np.random.Generator:
    """The generator of one workload: the name enters the seed, so two workloads built with
    the same seed draw different tokens (mixing them does not create accidental sharing)."""
    return np.random.default_rng([seed, zlib.crc32(workload.encode())])


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    """`n` token ids drawn uniformly from `[0, vocab_size)`, as int32."""
    return rng.integers(0, vocab_size, int(n), dtype=np.int32)


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival times (s) of `n` requests of a Poisson process with `rate` requests/s."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, n))


def sample_lengths(rng: np.random.Generator, n: int, mean: int, dist: str) -> np.ndarray:
    """`n` lengths >= 1 with mean about `mean`.

    `fixed`: all `mean`; `uniform`: integers in `[ceil(mean/2), mean + floor(mean/2)]`;
    `exponential`: `max(1, round(Exp(mean)))` (a long tail, like real answer lengths).
    """
    if dist == "fixed":
        return np.full(n, mean, dtype=np.int64)
    if dist == "uniform":
        return rng.integers(mean - mean // 2, mean + mean // 2 + 1, n).astype(np.int64)
    return np.maximum(1, np.rint(rng.exponential(mean, n))).astype(np.int64)


def zipf_weights(n: int, a: float) -> np.ndarray:
    """Probabilities of ranks 1..n proportional to `1 / rank**a` (`a = 0`: uniform)."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** a
    return w / w.sum()


def common_knobs(vocab_size: int, rate: float, output_len: int, output_dist: str) -> None:
    """Check the knobs every generator takes."""
    require_int("vocab_size", vocab_size, 2, 2**31 - 1)
    require_float("rate", rate, 0.0, strict=True)
    require_int("output_len", output_len, 1)
    require_choice("output_dist", output_dist, OUTPUT_DISTS)


def sort_by_arrival(specs: list[RequestSpec]) -> list[RequestSpec]:
    """Stable sort on arrival time (ties keep generation order)."""
    return sorted(specs, key=lambda s: s.arrival)
