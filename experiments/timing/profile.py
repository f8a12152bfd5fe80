"""Measured step profiles: the table format, its validation, and interpolation.

A profile is a CSV file of measured operator times for one model on one GPU kind, at one
or more tensor-parallel degrees, after `#` header lines that say where the numbers come
from. Format (docs/timing.md has it with an example):

    # model: llama3-8b                 (a zoo name or Hugging Face id)
    # device: a100                     (a zoo GPU name)
    # source: where it was measured (repository and file, or "own GPU run on <date>")
    # engine: the software that was timed, with its version
    # license: the data's license
    op,tp,tokens,context,ms
    linear,1,1,0,0.0712
    ...

Rows (`ms`: the median milliseconds of one occurrence):

- `linear`: one decoder layer's work outside attention for a step of `tokens` tokens (the
  norms, Q/K/V and output projections, rotary embedding, MLP, residual add), as vidur's
  `mlp.csv` times them; `context` is 0. Required, at least two token counts per degree.
- `all_reduce`: one all-reduce of `tokens` tokens' hidden states at degree `tp` (two per
  layer, after attention and after the MLP, as Megatron-style sharding does). Required for
  each degree above 1 that a run uses; absent at degree 1.
- `attn_prefill`: one layer's attention for a prefill chunk of `tokens` new tokens over
  `context` tokens already cached; `attn_decode`: one layer's decode attention of a batch of
  `tokens` requests with `context` KV tokens each. Optional: without them the executor takes
  attention from the roofline (and says so in its description).

Interpolation is piecewise linear in `tokens` (and, for attention, bilinear over a full grid
of `tokens` x `context`), extended linearly past the last measured point by its last
segment's slope: a table replays its own grid exactly.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from experiments.errors import InputError
from experiments.timing.zoo import ModelSpec, ZooError, resolve_gpu, resolve_model

COLUMNS = ("op", "tp", "tokens", "context", "ms")
OPS = ("linear", "all_reduce", "attn_prefill", "attn_decode")
HEADER_KEYS = ("model", "device", "source", "engine", "license")
#: where the shipped tables live (package data)
SHIPPED_DIR = Path(__file__).parent / "profiles"


class ProfileError(InputError, ValueError):
    """A profile table that cannot be used: the message names the file, and the row or
    column that is wrong."""


@dataclass(frozen=True)
class Curve:
    """Times measured at increasing `x`, read between points linearly and past the last
    point along the last segment; below the first point, the first point's time (a
    smaller step or message than any measured costs what the smallest did: launch and
    latency dominate there)."""

    x: np.ndarray
    y: np.ndarray

    def __call__(self, at: np.ndarray | float) -> np.ndarray:
        at = np.asarray(at, dtype=np.float64)
        out = np.interp(at, self.x, self.y)  # (flat outside the points)
        hi = at > self.x[-1]
        if hi.any():
            slope = (self.y[-1] - self.y[-2]) / (self.x[-1] - self.x[-2])
            out = np.where(hi, self.y[-1] + (at - self.x[-1]) * max(slope, 0.0), out)
        return out


@dataclass(frozen=True)
class Grid:
    """Times on a full grid of `tokens` x `context`, read bilinearly (each axis extended as
    `Curve` extends it)."""

    tokens: np.ndarray
    context: np.ndarray
    ms: np.ndarray  # [len(tokens), len(context)]

    def __call__(self, tokens: float, context: float) -> float:
        along = np.array([Curve(self.context, row)(context) for row in self.ms], dtype=np.float64)
        return float(Curve(self.tokens, along)(tokens)) if self.tokens.size > 1 else float(along[0])


@dataclass
class StepProfile:
    """One validated table: the header, and per tensor-parallel degree its curves."""

    path: str
    header: dict[str, str]
    model: ModelSpec
    device: str
    linear: dict[int, Curve] = field(default_factory=dict)
    all_reduce: dict[int, Curve] = field(default_factory=dict)
    attn_prefill: dict[int, Grid] = field(default_factory=dict)
    attn_decode: dict[int, Grid] = field(default_factory=dict)

    @property
    def degrees(self) -> list[int]:
        return sorted(self.linear)

    def check_degree(self, tp: int) -> None:
        """The table can time degree `tp`; else a clear error."""
        if tp not in self.linear:
            raise ProfileError(
                f"{self.path}: no linear rows at tp {tp} (the table has tp {', '.join(map(str, self.degrees))})"
            )
        if tp > 1 and tp not in self.all_reduce:
            raise ProfileError(f"{self.path}: no all_reduce rows at tp {tp}, which a step at tp {tp} needs")

    def describe(self) -> str:
        return f"{self.header.get('source', '?')} ({self.header.get('engine', '?')})"


def load_profile(path: str | Path) -> StepProfile:
    """Read and validate a profile table."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ProfileError(f"profile {p}: cannot be read ({exc.strerror or exc})") from None
    return parse_profile(text, str(p))


def parse_profile(text: str, name: str) -> StepProfile:
    header, body_start, lines = _header(text, name)
    model, device = _identity(header, name)
    rows = list(csv.reader(io.StringIO("\n".join(lines[body_start:]))))
    if not rows or tuple(c.strip() for c in rows[0]) != COLUMNS:
        got = ",".join(rows[0]) if rows else "nothing"
        raise ProfileError(
            f"{name}: the first line after the header must be the columns {','.join(COLUMNS)}, got {got!r}"
        )
    points: dict[tuple[str, int], dict[tuple[int, int], float]] = {}
    for number, row in enumerate(rows[1:], start=body_start + 2):
        if not row or all(not c.strip() for c in row):
            continue
        op, tp, tokens, context, ms = _row(row, number, name)
        at = points.setdefault((op, tp), {})
        if (tokens, context) in at:
            raise ProfileError(
                f"{name}, line {number}: a second {op} row at tp {tp}, tokens {tokens}, context {context}"
            )
        at[(tokens, context)] = ms
    profile = StepProfile(name, header, model, device)
    for (op, tp), at in sorted(points.items()):
        _add(profile, op, tp, at, name)
    if not profile.linear:
        raise ProfileError(f"{name}: no linear rows (one layer's work outside attention is required)")
    return profile


def _header(text: str, name: str) -> tuple[dict[str, str], int, list[str]]:
    lines = text.splitlines()
    header: dict[str, str] = {}
    i = 0
    while i < len(lines) and lines[i].startswith("#"):
        key, sep, value = lines[i][1:].partition(":")
        if sep:
            header[key.strip().lower()] = value.strip()
        i += 1
    missing = [k for k in HEADER_KEYS if not header.get(k)]
    if missing:
        raise ProfileError(
            f"{name}: the header lacks {', '.join('# ' + k + ': ...' for k in missing)} (where the numbers come from)"
        )
    return header, i, lines


def _identity(header: dict[str, str], name: str) -> tuple[ModelSpec, str]:
    try:
        device = (
            "cpu" if header["device"] == "cpu" else resolve_gpu(header["device"]).name
        )  # (cpu: a test machine's table)
        return resolve_model(header["model"]), device
    except ZooError as exc:
        raise ProfileError(f"{name}: {exc}") from None


def _row(row: list[str], number: int, name: str) -> tuple[str, int, int, int, float]:
    if len(row) != len(COLUMNS):
        raise ProfileError(f"{name}, line {number}: {len(row)} fields, the columns are {','.join(COLUMNS)}")
    op = row[0].strip()
    if op not in OPS:
        raise ProfileError(f"{name}, line {number}: unknown op {op!r} in column op (one of {', '.join(OPS)})")
    values = []
    for col, raw in zip(COLUMNS[1:4], row[1:4], strict=True):
        try:
            v = int(raw)
        except ValueError:
            raise ProfileError(
                f"{name}, line {number}: column {col} must be a whole number, got {raw.strip()!r}"
            ) from None
        if v < (1 if col != "context" else 0):
            raise ProfileError(
                f"{name}, line {number}: column {col} must be {'>= 0' if col == 'context' else '>= 1'}, got {v}"
            )
        values.append(v)
    try:
        ms = float(row[4])
    except ValueError:
        raise ProfileError(f"{name}, line {number}: column ms must be a number, got {row[4].strip()!r}") from None
    if not (math.isfinite(ms) and ms > 0):
        raise ProfileError(f"{name}, line {number}: column ms must be a positive, finite time, got {row[4].strip()!r}")
    if op in ("linear", "all_reduce") and values[2] != 0:
        raise ProfileError(f"{name}, line {number}: column context must be 0 for {op} rows, got {values[2]}")
    return op, values[0], values[1], values[2], ms


def _add(profile: StepProfile, op: str, tp: int, at: dict[tuple[int, int], float], name: str) -> None:
    if op in ("linear", "all_reduce"):
        if len(at) < 2:
            raise ProfileError(
                f"{name}: {op} at tp {tp} has {len(at)} row; interpolation needs at least 2 token counts"
            )
        tokens = sorted(t for t, _ in at)
        curve = Curve(np.array(tokens, dtype=np.float64), np.array([at[(t, 0)] for t in tokens]))
        (profile.linear if op == "linear" else profile.all_reduce)[tp] = curve
        return
    tokens = sorted({t for t, _ in at})
    contexts = sorted({c for _, c in at})
    missing = [(t, c) for t in tokens for c in contexts if (t, c) not in at]
    if missing:
        t, c = missing[0]
        raise ProfileError(f"{name}: {op} at tp {tp} is not a full grid: no row at tokens {t}, context {c}")
    if len(contexts) < 2:
        raise ProfileError(f"{name}: {op} at tp {tp} needs at least 2 context values to interpolate")
    ms = np.array([[at[(t, c)] for c in contexts] for t in tokens], dtype=np.float64)
    grid = Grid(np.array(tokens, dtype=np.float64), np.array(contexts, dtype=np.float64), ms)
    (profile.attn_prefill if op == "attn_prefill" else profile.attn_decode)[tp] = grid


def shipped_profiles() -> dict[tuple[str, str], Path]:
    """(model, device) -> the shipped table's path."""
    out = {}
    for path in sorted(SHIPPED_DIR.glob("*.csv")):
        header, _, _ = _header(path.read_text(), str(path))
        model, device = _identity(header, str(path))
        out[(model.name, device)] = path
    return out


def shipped_profile(model: str, device: str) -> StepProfile:
    """The shipped table for `model` on `device`, or an error listing those there are."""
    m, g = resolve_model(model).name, resolve_gpu(device).name
    tables = shipped_profiles()
    if (m, g) not in tables:
        have = ", ".join(f"{a} on {b}" for a, b in sorted(tables))
        raise ProfileError(f"no shipped profile for {m} on {g} (shipped: {have}); give your own with --profile FILE")
    return load_profile(tables[(m, g)])
