"""Compatibility names: the executors live in `experiments.engine.executors`."""

from __future__ import annotations

from experiments.engine.executors import (
    DEVICE_PROFILES,
    CostModelExecutor,
    DeviceProfile,
    Executor,
    ModelExecutor,
    ModelShape,
    llama3_8b_shape,
)

__all__ = [
    "DEVICE_PROFILES",
    "CostModelExecutor",
    "DeviceProfile",
    "Executor",
    "ModelExecutor",
    "ModelShape",
    "llama3_8b_shape",
]
