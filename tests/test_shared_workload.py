"""`compare` builds its workload once and hands it to every cell and to the bounds
(`cell_runs.run_cells(..., workload=...)`, `bounds_of(..., workload)`) instead of each
re-reading the trace: the results must be those of cells that build their own, number for
number (only what is measured on a clock may differ), in this process and in child
processes (where the workload travels pickled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiments.runs.backend_options import BackendVariant
from experiments.runs.cell_runs import bounds_of, cells_for, run_cells
from experiments.runs.cell_store import CellStore
from experiments.runs.runner import PER_REQUEST, CellConfig, build_workload, run_cell
from tests.test_behaviour_unchanged import differences

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "experiments" / "data" / "mooncake_conversation_2000.jsonl"


def _cells() -> list[CellConfig]:
    template = CellConfig(
        backend="apc", workload="mooncake", capacity_tokens=0, knobs={"path": str(TRACE), "limit": 120}
    )
    variants = [BackendVariant("apc"), BackendVariant("radix"), BackendVariant("none")]
    return cells_for(template, variants, [130_000, 600_000])


def _run(tmp_path: Path, name: str, jobs: int, shared: bool) -> tuple[list[dict], dict]:
    cells = _cells()
    workload = build_workload(cells[0]) if shared else None
    store = CellStore(tmp_path / name)
    results, _ = run_cells(cells, jobs, store, progress=False, workload=workload)
    return results, bounds_of(cells[0], [130_000, 600_000], cells, workload)


@pytest.mark.parametrize("jobs", [1, 2])
def test_cells_given_the_workload_give_the_same_numbers(tmp_path, jobs):
    own, own_bounds = _run(tmp_path, "own", jobs, shared=False)
    shared, shared_bounds = _run(tmp_path, "shared", jobs, shared=True)
    assert len(own) == len(shared) == 6
    for a, b in zip(own, shared, strict=True):
        assert a[PER_REQUEST], "a serving cell records every request"
        diff = differences(b, a)
        assert not diff, f"{len(diff)} numbers moved, first: " + "; ".join(diff[:5])
    assert shared_bounds == own_bounds


def test_a_shared_workload_is_not_changed_by_the_cells_that_ran_on_it():
    cells = _cells()
    workload = build_workload(cells[0])
    before = [(s.request_id, s.prompt.tobytes(), s.output_len, s.arrival) for s in workload.requests]
    for cfg in cells[:3]:
        run_cell(cfg, workload)
    after = [(s.request_id, s.prompt.tobytes(), s.output_len, s.arrival) for s in workload.requests]
    assert after == before
