"""Parallel sampling and beam search requests, shaped like Alpaca or ShareGPT (PagedAttention §6.3).

A seeded synthetic generator; no dataset is downloaded. Prompt and output lengths are
log-normal, `mu = ln(mean) - sigma^2 / 2` so the *unclipped* mean equals the dataset mean the
PagedAttention paper reports (Fig. 11: Alpaca 19.31 input / 58.45 output tokens, ShareGPT
161.31 / 337.99, i.e. 8.4x longer inputs and 5.8x longer outputs). The sigmas are our
assumptions about the shape (Alpaca: short, narrow instructions; ShareGPT: heavy-tailed
conversations), and lengths are rounded, then clipped (OPT-13B's 2048-token context bounds
prompt + output). `SHAPES` holds every parameter; `describe()` reports the realised means.

Every request carries the whole decoding schedule on its `RequestSpec`, so each backend replays exactly the same
sequence of forks and releases:
- parallel sampling (`n` samples): one output length per sample, drawn i.i.d. (sample j's
  from its own seeded stream, so a smaller n's samples are a prefix of a larger n's);
- beam search (`beam_width` k): one output length, and for every step the parent beam of
  each of the k surviving beams (`beam_parents[t]`, sorted). Step 0 expands the single
  prompt sequence into k beams. Afterwards the k best of the k * vocab candidates descend
  from high-scoring beams more often: each survivor's parent is the beam of rank r with
  probability proportional to `parent_decay ** r` (beams are kept in score order, so a
  parent's children take its place); with probability `stay` a survivor instead extends
  the beam at its own rank (beams that keep their lead; `stay = 1`: no fork after step 0).
  Beams drawn by no survivor are pruned (released). Defaults: decay 0.5, stay 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from experiments.workloads.spec import RequestSpec

VOCAB = 32_000  # prompt token ids are drawn from [0, VOCAB)


@dataclass(frozen=True)
class LengthShape:
    """Log-normal prompt and output lengths with stated means, sigmas and clipping."""

    name: str
    prompt_mean: float
    prompt_sigma: float
    output_mean: float
    output_sigma: float
    min_prompt: int = 4
    min_output: int = 2
    max_total: int = 2048  # prompt + output: OPT-13B's context, as in the paper

    def mu(self, mean: float, sigma: float) -> float:
        return math.log(mean) - sigma * sigma / 2


SHAPES: dict[str, LengthShape] = {
    "alpaca": LengthShape("alpaca", 19.31, 0.55, 58.45, 0.90),
    "sharegpt": LengthShape("sharegpt", 161.31, 1.10, 337.99, 0.90),
}


@dataclass(frozen=True)
class SamplingRequest:
    """A request and its decoding mode; the schedule itself is on the spec (its plan).
    `spec.output_len` is the longest branch."""

    spec: RequestSpec
    mode: str  # "parallel" or "beam"

    @property
    def sample_output_lens(self) -> tuple[int, ...]:
        """Parallel: one output length per sample (empty for beam search)."""
        return self.spec.sample_lens or ()

    @property
    def beam_parents(self) -> np.ndarray:
        """Beam: `(steps, k)` parent indices (empty for parallel sampling)."""
        parents = self.spec.beam_parents
        return parents if parents is not None else np.zeros((0, 0), dtype=np.int32)

    @property
    def width(self) -> int:
        return self.spec.n if self.mode == "parallel" else self.spec.beam_width


def _lengths(rng: np.random.Generator, shape: LengthShape, count: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` (prompt_len, output_len) pairs, rounded and clipped as documented."""
    p = rng.lognormal(shape.mu(shape.prompt_mean, shape.prompt_sigma), shape.prompt_sigma, count)
    o = rng.lognormal(shape.mu(shape.output_mean, shape.output_sigma), shape.output_sigma, count)
    prompt = np.clip(np.rint(p), shape.min_prompt, shape.max_total - shape.min_output).astype(np.int64)
    output = np.clip(np.rint(o), shape.min_output, shape.max_total - prompt).astype(np.int64)
    return prompt, output


def _sample_len(shape: LengthShape, seed: int, request: int, sample: int, prompt_len: int) -> int:
    o = np.random.default_rng([seed, 3, request, sample]).lognormal(
        shape.mu(shape.output_mean, shape.output_sigma), shape.output_sigma
    )
    return int(np.clip(np.rint(o), shape.min_output, shape.max_total - prompt_len))


def beam_schedule(
    rng: np.random.Generator, width: int, steps: int, parent_decay: float, stay: float = 0.0
) -> np.ndarray:
    """`(steps, width)` parent indices: row t says which current beam each survivor extends."""
    if width < 1 or steps < 0 or not 0 < parent_decay <= 1 or not 0 <= stay <= 1:
        raise ValueError(f"bad beam schedule: width={width}, steps={steps}, decay={parent_decay}, stay={stay}")
    out = np.zeros((steps, width), dtype=np.int32)  # step 0: every beam extends the prompt
    w = parent_decay ** np.arange(width)
    p = w / w.sum()
    for t in range(1, steps):
        drawn = rng.choice(width, size=width, p=p)
        out[t] = np.sort(np.where(rng.random(width) < stay, np.arange(width), drawn))
    return out


def generate(
    dataset: str,
    mode: str,
    width: int,
    num_requests: int,
    *,
    seed: int = 0,
    rate: float = 1.0,
    parent_decay: float = 0.5,
    stay: float = 0.0,
) -> list[SamplingRequest]:
    """`num_requests` parallel-sampling (`mode="parallel"`, n = width) or beam-search
    (`mode="beam"`, beam width = width) requests with `dataset`-shaped lengths.

    Arrivals are Poisson at `rate` requests/s. Equal arguments give equal requests; the
    lengths and prompts depend only on (dataset, seed, index), not on mode or width, so
    the n = 2, 4, 6 runs share their prompts.
    """
    if dataset not in SHAPES:
        raise ValueError(f"unknown dataset shape {dataset!r}; choose one of {sorted(SHAPES)}")
    if mode not in ("parallel", "beam"):
        raise ValueError(f"mode must be 'parallel' or 'beam', got {mode!r}")
    if width < 1 or num_requests < 0:
        raise ValueError(f"width must be >= 1 and num_requests >= 0, got {width}, {num_requests}")
    shape = SHAPES[dataset]
    base = np.random.default_rng([seed, 0])
    prompt_lens, output_lens = _lengths(base, shape, num_requests)
    arrivals = np.cumsum(base.exponential(1.0 / rate, num_requests))
    sched = np.random.default_rng([seed, 1, width])  # beam parents
    out: list[SamplingRequest] = []
    for i in range(num_requests):
        prompt = np.random.default_rng([seed, 2, i]).integers(0, VOCAB, int(prompt_lens[i]), dtype=np.int32)
        rid = f"{dataset}-{mode}{width}-{i}"
        if mode == "parallel":
            # sample 0 keeps the request's length; sample j's is drawn from (seed, i, j) only,
            # so the n = 4 run's samples are the first 4 of the n = 6 run's (common random
            # numbers: comparisons across n are not blurred by fresh draws)
            lens = (int(output_lens[i]), *(_sample_len(shape, seed, i, j, prompt.size) for j in range(1, width)))
            spec = RequestSpec(rid, prompt, max(lens), float(arrivals[i]), n=width, sample_lens=lens)
            out.append(SamplingRequest(spec, mode))
        else:
            steps = int(output_lens[i])
            parents = beam_schedule(sched, width, steps, parent_decay, stay)
            spec = RequestSpec(rid, prompt, steps, float(arrivals[i]), beam_width=width, beam_parents=parents)
            out.append(SamplingRequest(spec, mode))
    return out


def describe(dataset: str, requests: list[SamplingRequest]) -> dict:
    """The stated distribution and what the generated requests realise (for reports)."""
    s = SHAPES[dataset]
    prompts = [r.spec.prompt.size for r in requests]
    outputs = [x for r in requests for x in (r.sample_output_lens or (r.spec.output_len,))]
    return {
        "dataset_shape": dataset,
        "prompt_len": f"round(LogNormal(mu=ln({s.prompt_mean})-{s.prompt_sigma}^2/2, sigma={s.prompt_sigma})) "
        f"clipped to [{s.min_prompt}, {s.max_total - s.min_output}]",
        "output_len": f"round(LogNormal(mu=ln({s.output_mean})-{s.output_sigma}^2/2, sigma={s.output_sigma})) "
        f"clipped to [{s.min_output}, {s.max_total} - prompt_len]",
        "target_means": {"prompt": s.prompt_mean, "output": s.output_mean},
        "realised_means": {
            "prompt": float(np.mean(prompts)) if prompts else 0.0,
            "output": float(np.mean(outputs)) if outputs else 0.0,
        },
        "requests": len(requests),
    }
