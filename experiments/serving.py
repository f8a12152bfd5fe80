"""Compatibility names: the serving protocol lives in `experiments.engine` (serving.py,
scheduler.py); this module re-exports what callers imported from here."""

from __future__ import annotations

from experiments.engine.scheduler import ORDERINGS, ServingConfig, ServingResult
from experiments.engine.serving import serve

__all__ = ["ORDERINGS", "ServingConfig", "ServingResult", "serve"]
