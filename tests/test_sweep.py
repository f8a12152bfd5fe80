"""`sweep`: one JSON per cell, one report per (workload, page size), resumable; the same
numbers on a local Ray instance (skipped without the ray extra)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from experiments.__main__ import main
from experiments.runs.runner import CellConfig

WORKLOAD = [
    "--workload",
    "shared_doc_qa",
    "--knob",
    "num_documents=5",
    "--knob",
    "num_requests=40",
    "--knob",
    "doc_len=200",
]
GRID = ["--capacity-tokens", "20000", "40000", "--backend", "apc,none", "--protocol", "both", "--no-progress"]
#: wall-clock measurements: differ run to run, everything else is deterministic
TIMING = {"wall_seconds", "cache_seconds", "us_per_request", "cache_us_per_request"}


def sweep(out: Path, capsys, *extra: str) -> tuple[int, int]:
    """Run a sweep; returns (already done, ran) from its summary line."""
    capsys.readouterr()
    assert main(["sweep", *WORKLOAD, *GRID, "--output-dir", str(out), *extra]) == 0
    err = capsys.readouterr().err
    m = re.search(r"sweep: (\d+) cells, (\d+) already done, (\d+) to run", err)
    assert m, err
    total, done, todo = map(int, m.groups())
    assert done + todo == total
    return done, todo


def cell_files(out: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted((out / "cells").glob("*.json"))}


def numbers(cell: dict) -> dict:
    """A cell's result without the wall-clock timings."""
    return {
        k: ({kk: vv for kk, vv in v.items() if kk not in TIMING} if isinstance(v, dict) else v)
        for k, v in cell.items()
        if k not in TIMING
    }


def test_sweep_writes_cells_and_reports_and_resumes(tmp_path, capsys):
    out = tmp_path / "sw"
    assert sweep(out, capsys, "--page-size", "16", "32") == (0, 8)
    files = cell_files(out)
    assert len(files) == 8  # 2 page sizes x 2 capacities x 2 backends
    for name, path in files.items():
        cell = json.loads(path.read_text())
        assert name == CellConfig(**cell["config"]).key() + ".json"
        assert {"replay", "serving"} <= set(cell)
    for page in (16, 32):
        sub = out / f"shared_doc_qa-p{page}"
        assert (sub / "report.md").is_file()
        results = json.loads((sub / "results.json").read_text())
        assert {c["config"]["page_size"] for c in results["cells"]} == {page}
        assert len(results["cells"]) == 4
        assert results["command"].startswith("python -m experiments ")
    mtimes = {n: p.stat().st_mtime_ns for n, p in files.items()}

    # a rerun runs nothing and touches no cell file
    assert sweep(out, capsys, "--page-size", "16", "32") == (8, 0)
    assert {n: p.stat().st_mtime_ns for n, p in cell_files(out).items()} == mtimes

    # one deleted cell: exactly that one runs again, with the same numbers
    victim = sorted(files)[3]
    before = json.loads(files[victim].read_text())
    files[victim].unlink()
    assert sweep(out, capsys, "--page-size", "16", "32") == (7, 1)
    after = cell_files(out)
    assert set(after) == set(files)
    assert numbers(json.loads(after[victim].read_text())) == numbers(before)
    assert {n: p.stat().st_mtime_ns for n, p in after.items() if n != victim} == {
        n: t for n, t in mtimes.items() if n != victim
    }

    # a torn cell file (an interrupted write) is not taken as finished
    after[victim].write_text('{"config": {"backe')
    assert sweep(out, capsys, "--page-size", "16", "32") == (7, 1)

    # nor an empty one, nor one without results (an error in place of a result): each is
    # rerun, never reported as a row of "—"
    config = json.loads(after[victim].read_text())["config"]
    for text in ("", json.dumps({"config": config, "error": "boom"}), json.dumps({"config": config, "replay": {}})):
        after[victim].write_text(text)
        assert sweep(out, capsys, "--page-size", "16", "32") == (7, 1)
        reported = json.loads((out / f"shared_doc_qa-p{config['page_size']}" / "results.json").read_text())["cells"]
        assert all({"replay", "serving"} <= set(c) for c in reported)

    # a different setting is a different cell, never a stale one
    assert sweep(out, capsys, "--page-size", "16", "32", "--seed", "1") == (0, 8)


def test_sweep_knobs_reach_every_workload_that_takes_them(tmp_path, capsys):
    out = tmp_path / "multi"
    assert main(["sweep", "--workloads", "shared_doc_qa", "no_sharing", "--knob", "num_requests=30", "--knob", "doc_len=200",
                 "--knob", "num_documents=5", "--capacity-tokens", "20000", "--backend", "apc", "--protocol", "replay",
                 "--no-progress", "--no-bounds", "--output-dir", str(out)]) == 0  # fmt: skip
    cells = {c["config"]["workload"]: c for c in (json.loads(p.read_text()) for p in cell_files(out).values())}
    # the commands' defaults for shared_doc_qa (rate 20.0) stay; each given knob replaces one
    assert cells["shared_doc_qa"]["config"]["knobs"] == {"num_requests": "30", "doc_len": "200", "num_documents": "5",
                                                         "rate": 20.0}  # fmt: skip
    assert cells["no_sharing"]["config"]["knobs"] == {"num_requests": "30"}  # doc_len is not its knob
    assert cells["no_sharing"]["replay"]["requests"] == 30
    assert (out / "no_sharing-p16" / "report.md").is_file()
    # a knob that no workload of the grid takes is an error (exit 3), not silently dropped
    assert main(["sweep", "--workloads", "shared_doc_qa", "no_sharing", "--knob", "turns=3", "--backend", "apc",
                 "--output-dir", str(out)]) == 3  # fmt: skip


@pytest.fixture
def ray_mod(monkeypatch):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        ray.shutdown()
    return ray


def test_sweep_on_local_ray_matches_local_processes(tmp_path, capsys, ray_mod):
    local, on_ray = tmp_path / "local", tmp_path / "ray"
    assert sweep(local, capsys) == (0, 4)
    assert sweep(on_ray, capsys, "--ray", "local") == (0, 4)
    assert not ray_mod.is_initialized()  # the instance it started is shut down
    a, b = cell_files(local), cell_files(on_ray)
    assert set(a) == set(b) and len(a) == 4
    for name in a:
        ca, cb = json.loads(a[name].read_text()), json.loads(b[name].read_text())
        assert numbers(ca) == numbers(cb), name
        assert ca["replay"]["hit_rate"] == cb["replay"]["hit_rate"]
        assert ca["serving"]["hit_rate"] == cb["serving"]["hit_rate"]
        assert ca["serving"]["ttft_p99"] == cb["serving"]["ttft_p99"]
    ra = json.loads((local / "shared_doc_qa-p16" / "results.json").read_text())
    rb = json.loads((on_ray / "shared_doc_qa-p16" / "results.json").read_text())
    assert ra["bounds"] == rb["bounds"]
    # resuming works the same way on Ray: nothing left to run
    assert sweep(on_ray, capsys, "--ray", "local") == (4, 0)


def test_ray_cell_error_names_the_cell_and_keeps_the_others(ray_mod):
    from experiments.runs.ray_runner import CellFailed, run_on_ray

    good = CellConfig(
        backend="apc", workload="no_sharing", capacity_tokens=20000, knobs={"num_requests": 10}, protocol="replay"
    )
    bad = CellConfig(backend="apc", workload="no_sharing", capacity_tokens=20000, knobs={"num_requests": 10}, protocol="replay",
                     backend_options={"no_such_option": 1})  # fmt: skip
    got = []
    with pytest.raises(CellFailed) as info:
        run_on_ray([good, bad], "local", lambda cfg, res: got.append((cfg, res)))
    assert bad.key() in str(info.value) and good.key() not in str(info.value)
    assert "no_such_option" in str(info.value)
    assert len(info.value.failures) == 1
    assert [cfg for cfg, _ in got] == [good] and got[0][1]["replay"]["requests"] == 10
    assert not ray_mod.is_initialized()
