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


# -- the random walks' operation count, summed over the session (xdist workers included:
# `record_property` travels with each test's report to the controller) ----------------

_WALK_OPS = {"ops": 0, "cases": 0}


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and report.passed:
        for name, value in report.user_properties:
            if name == "contract_operations":
                _WALK_OPS["ops"] += value
                _WALK_OPS["cases"] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if _WALK_OPS["cases"]:
        terminalreporter.write_line(
            f"random walks: {_WALK_OPS['ops']:,} contract operations in {_WALK_OPS['cases']} configurations"
        )


def pytest_sessionfinish(session, exitstatus) -> None:
    """Every CI walk case ran and passed: their operations must reach the promised count."""
    if not _WALK_OPS["cases"]:
        return
    from tests.test_random_walks import CONFIGS, MIN_OPERATIONS

    if _WALK_OPS["cases"] == len(CONFIGS) and _WALK_OPS["ops"] < MIN_OPERATIONS and exitstatus == 0:
        session.config.get_terminal_writer().line(
            f"random walks made {_WALK_OPS['ops']:,} contract operations, fewer than {MIN_OPERATIONS:,}", red=True
        )
        session.exitstatus = 1
