"""`RunningRows`: a serving policy's running requests as rows of counters.

The per-step rules (experiments/engine/kernels.py) read and write these rows as arrays, so a
step over a few hundred running requests is a handful of array operations rather than a
few hundred objects touched. A request's own object (`Request`) is brought up to date only
where something reads it: a cache call for it, its first token, its preemption or finish.
`gather` / `scatter` give the same fields for requests that are not running (a preempted
request whose token was still in flight), so the rules stay written once over arrays.
"""

from __future__ import annotations

import math
from typing import ClassVar

import numpy as np

from experiments.engine.request import Request


class RunningRows:
    """The running list's counters, one row per request in running order.

    `computed`, `known`, `generated`: vLLM's `num_computed_tokens`, `num_tokens` and the
    outputs delivered; `placeholders`, `in_flight`: its output placeholders and scheduled
    tokens not yet processed (async); `target`: outputs to generate; `capacity`: tokens its
    page table covers; `committed`: tokens published to the cache (`seq.num_computed`);
    `work`: tokens computed over its life (`Request.computed_tokens`); `prompt`: its
    sequence's prompt length (after a preemption, every token it had: what it recomputes);
    `total`: its request's prompt and outputs to generate; `admission`: its admission's number on this replica (increasing in
    running order: how an async step finds its rows again); `last`: when its last token
    came (NaN: none yet); `has_first`: it has its first token; `timed`: it counts in ITL
    (not a parallel sample); `private`: under a per-sequence lazy promise, the cache's
    `decode_steps_private` after the row's last call (True otherwise).

    Storage: the int fields are the rows of one int64 block, `last` a float block, the flags
    a bool block, each with room for more rows than run (doubled when full), and every field
    is a view of its block's live prefix, remade only when rows join or leave. A step may
    update a field in place (`rows.known += sampled`) or rebind it to a new array of the
    same length (`rows.known = rows.known + k`): a rebound field is copied back into its
    block before rows join or leave (`_settle`), so both forms are safe."""

    INT_FIELDS: ClassVar[tuple[str, ...]] = (
        "computed",
        "known",
        "placeholders",
        "in_flight",
        "generated",
        "target",
        "capacity",
        "committed",
        "work",
        "prompt",
        "total",
        "admission",
    )
    FLAG_FIELDS: ClassVar[tuple[str, ...]] = ("has_first", "timed", "private")
    #: every row field, in `_bind`'s order
    FIELDS: ClassVar[tuple[str, ...]] = (*INT_FIELDS, "last", *FLAG_FIELDS)

    def __init__(self, room: int = 64) -> None:
        self._n = 0
        self._ints = np.zeros((len(self.INT_FIELDS), max(room, 1)), dtype=np.int64)
        self._last = np.zeros(self._ints.shape[1], dtype=np.float64)
        self._flags = np.zeros((len(self.FLAG_FIELDS), self._ints.shape[1]), dtype=bool)
        self._bind()

    def _bind(self) -> None:
        """Point every field at its block's live prefix."""
        n = self._n
        views = (*self._ints[:, :n], self._last[:n], *self._flags[:, :n])
        self.__dict__.update(zip(self.FIELDS, views, strict=True))  # (one update: rows join and leave every few steps)
        self._views = views

    def _settle(self) -> None:
        """Copy a field rebound since the last `_bind` back into its block (its length must
        still be the row count: anything else is an engine bug, and raises)."""
        fields = self.__dict__
        for name, view in zip(self.FIELDS, self._views, strict=True):
            arr = fields[name]
            if arr is not view:
                if arr.shape != view.shape:
                    raise ValueError(f"row field {name!r} has {arr.shape} rows, the running list {view.shape}")
                view[...] = arr

    def __len__(self) -> int:
        return self._n

    def append(self, r: Request, computed: int, capacity: int, admission: int, private: bool = True) -> None:
        """A request joins the end of the running list with its object's current state."""
        self._settle()
        n = self._n
        if n == self._last.size:  # full: double the room (the live rows move once)
            self._grow(2 * n)
        c = r.counters
        self._ints[:, n] = (
            computed,
            c.known,
            c.placeholders,
            c.in_flight,
            r.generated,
            r.target,
            capacity,
            r.seq.num_computed,
            r.computed_tokens,
            r.seq.prompt_len,
            r.spec.prompt_len + r.target,
            admission,
        )
        self._last[n] = math.nan if r.last_token_at is None else r.last_token_at
        self._flags[:, n] = (r.first_token_at is not None, r.sample_of is None, private)
        self._n = n + 1
        self._bind()

    def _grow(self, room: int) -> None:
        n = self._n
        ints = np.zeros((self._ints.shape[0], room), dtype=np.int64)
        ints[:, :n] = self._ints[:, :n]
        last = np.zeros(room, dtype=np.float64)
        last[:n] = self._last[:n]
        flags = np.zeros((self._flags.shape[0], room), dtype=bool)
        flags[:, :n] = self._flags[:, :n]
        self._ints, self._last, self._flags = ints, last, flags

    def delete(self, where: int | np.ndarray) -> None:
        """Rows leave (finished or preempted; `where`: a row number or an array of them); the
        others keep their order (each block compacted once)."""
        self._settle()
        n = self._n
        if where.__class__ is int or (where.size == 1 and where.dtype.kind in "iu"):
            # one row (most finishes, every preemption): the rows after it move up one
            # place, three slice copies (numpy copies overlapping slices correctly) instead
            # of a mask and three gathers
            i = where if where.__class__ is int else where.item()
            if not 0 <= i < n:
                raise IndexError(f"row {i} is not among the {n} running")
            self._ints[:, i : n - 1] = self._ints[:, i + 1 : n]
            self._last[i : n - 1] = self._last[i + 1 : n]
            self._flags[:, i : n - 1] = self._flags[:, i + 1 : n]
            self._n = n - 1
            self._bind()
            return
        keep = np.ones(n, dtype=bool)
        keep[where] = False
        m = int(np.count_nonzero(keep))
        if m < n:
            self._ints[:, :m] = self._ints[:, :n][:, keep]
            self._last[:m] = self._last[:n][keep]
            self._flags[:, :m] = self._flags[:, :n][:, keep]
        self._n = m
        self._bind()

    def row_of(self, admission: int) -> int | None:
        """The row of the request admitted as `admission`, or None when it left."""
        i = int(np.searchsorted(self.admission, admission))
        return i if i < self._n and self.admission[i] == admission else None


class GatheredRows:
    """The delivery fields of some requests (running or not) as arrays, in a given order:
    a running request's from its row, another's from its object; `scatter` writes the
    arrays back where they came from. The rules then run on them as on `RunningRows`."""

    __slots__ = ("where", "requests", "known", "generated", "target", "has_first", "timed", "last")

    def __init__(self, rows: RunningRows, requests: list[Request], where: list[int | None]) -> None:
        self.where = where  # each request's row, or None: from its object
        self.requests = requests
        count = len(requests)
        self.known = np.empty(count, dtype=np.int64)
        self.generated = np.empty(count, dtype=np.int64)
        self.target = np.empty(count, dtype=np.int64)
        self.has_first = np.empty(count, dtype=bool)
        self.timed = np.empty(count, dtype=bool)
        self.last = np.empty(count, dtype=np.float64)
        for j, (r, i) in enumerate(zip(requests, where, strict=True)):
            if i is None:
                self.known[j], self.generated[j], self.target[j] = r.counters.known, r.generated, r.target
                self.has_first[j], self.timed[j] = r.first_token_at is not None, r.sample_of is None
                self.last[j] = math.nan if r.last_token_at is None else r.last_token_at
            else:
                self.known[j], self.generated[j], self.target[j] = rows.known[i], rows.generated[i], rows.target[i]
                self.has_first[j], self.timed[j], self.last[j] = rows.has_first[i], rows.timed[i], rows.last[i]

    def scatter(self, rows: RunningRows) -> None:
        for j, (r, i) in enumerate(zip(self.requests, self.where, strict=True)):
            if i is None:
                r.counters.known, r.generated = int(self.known[j]), int(self.generated[j])
                last = float(self.last[j])
                r.last_token_at = None if math.isnan(last) else last
            else:
                rows.known[i], rows.generated[i] = self.known[j], self.generated[j]
                rows.has_first[i], rows.last[i] = self.has_first[j], self.last[j]
