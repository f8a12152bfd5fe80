"""Imported by a process that will run serving cells (the cell pool's fork server): the
policy's compiled rules are loaded now, once, from numba's on-disk cache (~0.3 s), instead
of in every child. Only imported where numba is installed."""

from __future__ import annotations

from experiments.engine.compiled import engine_kernels

RULES = engine_kernels("numba")
