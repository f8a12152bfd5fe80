"""What a multi-process `compare` leaves its parent process to do, and that it writes the
same bytes as before: the workload is pickled once for every task (`cell_pool.PickledOnce`),
a cell run in a child saves itself and sends back its per-request rows encoded
(`cell_runs.run_and_save`, `results.EncodedRows`), and with `--jobs` > 1 the figures are
drawn in two processes (`report.render`, `cell_pool.TaskBeside`)."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest

from experiments.__main__ import main
from experiments.engine.request import TIER_RECORD_KEYS
from experiments.report.render import render
from experiments.report.results import PER_REQUEST_FILE, EncodedRows, write_per_request
from experiments.runs.backend_options import BackendVariant
from experiments.runs.cell_pool import PickledOnce, Task, TaskBeside, TasksFailed
from experiments.runs.cell_runs import cells_for, run_cells
from experiments.runs.cell_store import CellStore
from experiments.runs.runner import PER_REQUEST, CellConfig, build_workload
from experiments.workloads.generators import Workload

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "experiments" / "data" / "mooncake_conversation_2000.jsonl"
SMALL = ["--workload", "shared_doc_qa", "--knob", "num_documents=4", "--knob", "num_requests=30", "--knob",
         "doc_len=300", "--knob", "question_len=20", "--knob", "output_len=6", "--no-progress",
         "--capacity-tokens", "1200", "4800"]  # fmt: skip


# -- per-request rows encoded where the cell ran ---------------------------------------------


def _records(n: int, tiered: bool, cluster: bool = False) -> list[dict]:
    """Engine-like per-request records, in finishing order (not by request), with strings
    that hold what the encoded rows are split on (quotes, `,"replica":`)."""
    out = []
    for i in reversed(range(n)):
        rec = {"request_index": i, "request_id": f'r{i},"replica":9"', "arrival": 0.5 * i, "prompt_tokens": 10 + i,
               "first_token_at": None if i == 1 else 0.5 * i + 0.25, "ttft": 0.25, "tpot": 1e-05 * i,
               "finished_at": None if i == 1 else 0.5 * i + 1.0, "aborted": i == 1, "sample_of": None}  # fmt: skip
        if tiered:
            rec.update({k: (i if k.endswith("tokens") else 0.125) for k in TIER_RECORD_KEYS})
        if cluster:
            rec["replica"] = i % 2
        out.append(rec)
    return out


def _cell(backend: str, replicas: int = 1) -> CellConfig:
    extra = {"replicas": replicas, "router": "round_robin", "protocol": "serving"} if replicas > 1 else {}
    return CellConfig(backend=backend, workload="mooncake", capacity_tokens=4096, **extra)


def _reference_rows(cells: list[CellConfig], results: list[dict]) -> str:
    """per_request.jsonl as it was written before the rows were encoded in the children:
    one json.dumps per row, tier keys on every row when a cell has them."""
    from experiments.report.results import TIME_KEYS

    tiered = any(TIER_RECORD_KEYS[0] in r for res in results for r in res.get(PER_REQUEST) or ())
    lines = []
    for cfg, res in zip(cells, results, strict=True):
        for rec in sorted(
            res.get(PER_REQUEST) or (), key=lambda r: (r["request_index"], r.get("sample_of") is not None)
        ):
            row = {"backend": cfg.backend_label, "capacity_tokens": cfg.capacity_tokens, "page_size": cfg.page_size,
                   "replicas": cfg.replicas, "router": cfg.router_label}  # fmt: skip
            for k, v in rec.items():
                if k != "replica":
                    row[TIME_KEYS.get(k, k)] = v
                    if k == "finished_at":
                        row["e2e_s"] = None if v is None else v - rec["arrival"]
            if tiered:
                for k in TIER_RECORD_KEYS:
                    row.setdefault(k, None)
            row["replica"] = rec.get("replica", 0)
            lines.append(json.dumps(row, separators=(",", ":"), allow_nan=False) + "\n")
    return "".join(lines)


@pytest.mark.parametrize("tiers", [(False, False), (True, False), (False, True), (True, True)])
def test_rows_encoded_in_the_children_are_the_rows_the_parent_writes(tmp_path, tiers):
    cells = [_cell("apc"), _cell("radix"), _cell("none"), _cell("radix", replicas=2)]
    records = [_records(5, tiers[0]), _records(4, tiers[1]), None, _records(3, False, cluster=True)]
    results = [{"config": {}} if r is None else {"config": {}, PER_REQUEST: r} for r in records]
    want = _reference_rows(cells, results)
    assert want.count("\n") == 12 and ("gpu_hit_tokens" in want) == any(tiers)
    # the parent encodes records (cells run in-process or reloaded from the store), a child
    # sends EncodedRows; any mix of the two writes the same bytes
    for encoded in ([], [0], [1, 3], [0, 1, 3]):
        mixed = copy.deepcopy(results)
        for i in encoded:
            mixed[i][PER_REQUEST] = EncodedRows.of(cells[i], mixed[i][PER_REQUEST])
        out = tmp_path / f"{'-'.join(map(str, encoded)) or 'none'}"
        out.mkdir()
        assert write_per_request(cells, mixed, out) == out / PER_REQUEST_FILE
        assert (out / PER_REQUEST_FILE).read_text() == want, encoded


def test_an_untiered_row_gets_the_tier_keys_before_its_replica_only():
    rows = EncodedRows.of(_cell("apc"), _records(2, False))
    assert rows.text_in(False) == rows.text
    tiered = rows.text_in(True).splitlines()
    nulls = ",".join(f'"{k}":null' for k in TIER_RECORD_KEYS)
    assert all(line.endswith(f',{nulls},"replica":0}}') for line in tiered)
    assert [json.loads(line)["request_id"] for line in tiered] == ['r0,"replica":9"', 'r1,"replica":9"']


# -- the workload pickled once ------------------------------------------------------------------


def _cells() -> list[CellConfig]:
    template = CellConfig(
        backend="apc", workload="mooncake", capacity_tokens=0, knobs={"path": str(TRACE), "limit": 60}
    )
    return cells_for(template, [BackendVariant("apc"), BackendVariant("radix")], [130_000, 600_000])


def _workload_seen(tag: str, workload: Workload) -> tuple[str, int, bytes]:
    """A side task: what it got."""
    return tag, len(workload), workload.requests[-1].prompt.tobytes()


def test_the_workload_is_pickled_once_and_reaches_every_task(tmp_path, monkeypatch):
    cells = _cells()
    workload = build_workload(cells[0])
    pickled = []
    reduce_ex = Workload.__reduce_ex__

    def counted(self, protocol):  # runs in this process only: the children unpickle
        pickled.append(protocol)
        return reduce_ex(self, protocol)

    monkeypatch.setattr(Workload, "__reduce_ex__", counted, raising=False)
    store = CellStore(tmp_path / "cells")
    side = Task("side", _workload_seen, ("bounds", workload))
    results, seen = run_cells(cells, 2, store, progress=False, side=side, workload=workload)
    assert len(pickled) == 1, f"the workload was pickled {len(pickled)} times for {len(cells) + 1} tasks"
    assert seen == ("bounds", len(workload), workload.requests[-1].prompt.tobytes())
    for cfg, res in zip(cells, results, strict=True):
        assert res["config"] == json.loads(json.dumps(cfg.as_dict()))
        assert res["workload_config"] == workload.config and res["serving"]["requests"] == len(workload)
        # the child saved the cell itself, records and all, and sent back its rows encoded
        saved = store.load(cfg)
        assert saved is not None and len(saved[PER_REQUEST]) == len(workload)
        assert isinstance(res[PER_REQUEST], EncodedRows)
        assert res[PER_REQUEST] == EncodedRows.of(cfg, saved[PER_REQUEST])
        summary = {k: v for k, v in res.items() if k != PER_REQUEST}
        assert json.loads(json.dumps(summary)) == {k: v for k, v in saved.items() if k != PER_REQUEST}


def _value(x: object) -> object:
    return x


def test_a_value_pickled_once_arrives_as_itself():
    value = {"a": [1, 2.5, None], "b": "x"}
    with TaskBeside(Task("t", _value, (PickledOnce(value),))) as beside:
        assert beside.result() == value


# -- a task beside the caller -------------------------------------------------------------------


def _fails() -> None:
    raise ValueError("no figure today")


def _sleeps(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def test_a_task_beside_returns_its_result_or_names_its_failure():
    with TaskBeside(Task("pid", _sleeps, (0.0,))) as beside:
        assert beside.result() != os.getpid()
    with (
        pytest.raises(TasksFailed, match="figures x: ValueError: no figure today"),
        TaskBeside(Task("figures x", _fails)) as t,
    ):
        t.result()


def _environ_and_mask(name: str) -> tuple[str | None, bool, object]:
    import signal

    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    return os.environ.get(name), blocked, signal.getsignal(signal.SIGINT)


def test_a_task_runs_in_the_parents_environment_of_its_start(monkeypatch):
    """A child sees the parent's environment as it is when the task starts, also when the
    fork server (started by an earlier task) was started with another one; it runs with
    SIGINT unblocked and ignored (the parent answers Ctrl-C)."""
    import signal

    name = "PCL_TEST_CHILD_ENV"
    monkeypatch.delenv(name, raising=False)
    with TaskBeside(Task("before", _environ_and_mask, (name,))) as beside:
        assert beside.result() == (None, False, signal.SIG_IGN)
    monkeypatch.setenv(name, "set after the first child")
    with TaskBeside(Task("after", _environ_and_mask, (name,))) as beside:
        assert beside.result()[0] == "set after the first child"
    monkeypatch.delenv(name)
    with TaskBeside(Task("gone", _environ_and_mask, (name,))) as beside:
        assert beside.result()[0] is None


def test_the_childrens_usage_reaches_the_callers_accounting(tmp_path):
    """A program that runs tasks in children exits with their CPU time counted in its own
    children's usage (`RUSAGE_CHILDREN`: what `/usr/bin/time` and `speed_targets --mooncake`
    read), as spawned children's always were: forked by the fork server, they are its
    children, and it is waited for at exit."""
    import resource
    import subprocess
    import sys

    script = tmp_path / "burn.py"
    script.write_text(
        "import time\n"
        "from experiments.runs.cell_pool import CellPool, Task\n"
        "def burn(s):\n"
        "    end = time.thread_time() + s\n"
        "    while time.thread_time() < end:\n"
        "        pass\n"
        "if __name__ == '__main__':\n"
        "    list(CellPool(2).results([Task('a', burn, (0.4,)), Task('b', burn, (0.4,))]))\n"
    )
    root = Path(__file__).resolve().parents[1]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, str(script)], check=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(root)})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime >= 0.75


def test_leaving_the_block_early_kills_the_task_beside():
    with pytest.raises(KeyboardInterrupt), TaskBeside(Task("slow", _sleeps, (60.0,))) as beside:
        process = beside._run.process
        raise KeyboardInterrupt
    assert not process.is_alive() and process.exitcode is not None and process.exitcode < 0


# -- figures drawn in two processes -------------------------------------------------------------


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("report") / "out"
    assert main(["compare", *SMALL, "--output-dir", str(out)]) == 0
    return json.loads((out / "results.json").read_text())


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("replay_only", [False, True])
def test_figures_drawn_in_two_processes_are_the_same_bytes(doc, tmp_path, replay_only):
    if replay_only:  # no TTFT, no pages: the hit rate figure alone
        doc = copy.deepcopy(doc)
        for cell in doc["cells"]:
            del cell["serving"]
    one, two = tmp_path / "one", tmp_path / "two"
    paths_one, paths_two = render(doc, one, jobs=1), render(doc, two, jobs=2)
    assert [p.name for p in paths_one] == [p.name for p in paths_two]
    assert len(paths_one) == (4 if replay_only else 8)
    assert _files(one) == _files(two)
