"""Workloads: seeded generators and trace loaders, all producing `RequestSpec`s."""

from __future__ import annotations

from experiments.workloads.spec import RequestSpec, TraceFormatError

__all__ = ["RequestSpec", "TraceFormatError"]
