"""Shared fixtures: the shipped trace loaded once per session, the tiny model, one torch thread."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the first 2,000 requests of the Mooncake conversation trace, shipped with the project
SHIPPED_TRACE = ROOT / "experiments" / "data" / "mooncake_conversation_2000.jsonl"


@pytest.fixture(scope="session")
def shipped_trace() -> list:
    """Every request of the shipped trace slice (`RequestSpec`s with lazy prompts); read-only."""
    from experiments.workloads.mooncake import load_mooncake

    return load_mooncake(SHIPPED_TRACE, 2000)


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny Llama-style model, seed 0, torch attention (weights are never written)."""
    from attention.model import LlamaModel

    return LlamaModel("tiny", seed=0, attention="torch")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny tensors: one intra-op thread is ~4x faster than two on a 2-core runner."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
