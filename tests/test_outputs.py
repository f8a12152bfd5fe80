"""Outputs are never mixed or half-written: one run per output folder at a time (OUT.lock),
reports swapped in whole, an interrupt leaves the previous output, an unwritable output
fails before any work, a killed worker is named and its finished siblings are kept, cell
keys follow the code and the trace, exit codes as documented."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import experiments.cli.compare as cli_compare
import experiments.runs.sweep as sweep_mod
from experiments.__main__ import main
from experiments.report.results import REPORT_ENTRIES
from experiments.runs import provenance
from experiments.runs.interrupts import DeferredInterrupts
from experiments.runs.output_dir import StagedDir
from experiments.runs.runner import KILL_CELL_ENV

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--workload", "shared_doc_qa", "--knob", "num_documents=4", "--knob", "num_requests=30", "--knob",
         "doc_len=200", "--knob", "question_len=20", "--knob", "output_len=4", "--no-progress"]  # fmt: skip
FAST = [*SMALL, "--protocol", "replay", "--no-bounds"]


def _interruptible() -> None:
    """In the child: Ctrl-C as a terminal delivers it. A suite started in the background by a
    shell (`nohup make test &`) inherits SIGINT ignored, which a child would keep."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`python -m experiments ...` in a child process, stderr captured."""
    return subprocess.Popen(
        [sys.executable, "-m", "experiments", *argv],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,
        env={**os.environ, **(env or {})},
    )


def siblings(out: Path) -> list[str]:
    """Everything beside `out` that a run left: temporary folders, partial cells."""
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name and p.name != out.name + ".lock")


def test_staged_dir_replaces_the_whole_folder_or_nothing(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), StagedDir(out) as stage:
        (stage.path / "new.txt").write_text("half")
        raise RuntimeError("the run failed before publishing")
    assert [p.name for p in out.iterdir()] == ["old.txt"] and siblings(out) == []
    with StagedDir(out) as stage:
        (stage.path / "new.txt").write_text("new")
        stage.publish()
    assert [p.name for p in out.iterdir()] == ["new.txt"] and siblings(out) == []


def test_staged_dir_carries_over_what_the_run_does_not_own(tmp_path):
    out = tmp_path / "out"
    (out / "notes").mkdir(parents=True)
    for name in ("results.json", "stale_plot.png", "replay_apc.json", "notes/n.txt"):
        (out / name).write_text("old")
    with StagedDir(out, owned=REPORT_ENTRIES) as stage:
        (stage.path / "results.json").write_text("new")
        stage.publish()
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == [
        "notes", "notes/n.txt", "replay_apc.json", "results.json"
    ]  # fmt: skip
    assert (out / "results.json").read_text() == "new" and (out / "replay_apc.json").read_text() == "old"


def test_a_folder_that_is_not_a_previous_output_is_never_replaced(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_compare, "build_workload", lambda *a, **k: pytest.fail("work started"))
    (tmp_path / "precious.txt").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    for out in (".", str(tmp_path)):
        assert main(["compare", *FAST, "--output-dir", out]) == 3
        assert "is not a previous output" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_staged_dir_without_the_exchange_falls_back_to_two_renames(tmp_path, monkeypatch):
    monkeypatch.setattr("experiments.runs.output_dir._exchange", lambda a, b: False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with StagedDir(out) as stage:
        (stage.path / "new.txt").write_text("new")
        stage.publish()
    assert [p.name for p in out.iterdir()] == ["new.txt"] and siblings(out) == []


def test_an_interrupt_inside_a_critical_section_lands_after_it():
    # Python's own Ctrl-C handler, even when the suite was started with SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _critical_section_defers_the_interrupt()
    finally:
        signal.signal(signal.SIGINT, previous)


def _critical_section_defers_the_interrupt() -> None:
    finished = False
    with pytest.raises(KeyboardInterrupt), DeferredInterrupts():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # a signal not held back would interrupt here
        finished = True
    assert finished
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_run_into_a_locked_output_fails_at_once(tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from experiments.runs.output_dir import "
         "OutputLock; lock = OutputLock(Path(sys.argv[1])).__enter__(); print('locked', flush=True); time.sleep(60)",
         str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        started = time.perf_counter()
        assert main(["compare", *FAST, "--capacity-tokens", "2400", "--output-dir", str(out)]) == 3
        assert time.perf_counter() - started < 5
        assert "in use by another run" in capsys.readouterr().err
        assert main(["sweep", *FAST, "--capacity-tokens", "2400", "--output-dir", str(out)]) == 3
        assert not out.exists()
    finally:
        holder.kill()  # SIGKILL: the kernel drops the lock with the process
        holder.wait()
    assert main(["compare", *FAST, "--capacity-tokens", "2400", "--output-dir", str(out)]) == 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_leaves_the_previous_output_intact(tmp_path, signum):
    out = tmp_path / "out"
    assert main(["compare", *FAST, "--backend", "apc", "--capacity-tokens", "2400", "--output-dir", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    caps = [str(1200 * k) for k in range(2, 40)]  # many cells: still running when the signal comes
    proc = cli("compare", *SMALL, "--jobs", "2", "--capacity-tokens", *caps, "--output-dir", str(out))
    partial = tmp_path / "out.partial"
    deadline = time.monotonic() + 60
    while not list(partial.glob("*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["interrupted: outputs were left complete or unchanged, never half-written"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert siblings(out) == ["out.partial"]  # no temporary folder; the finished cells, for a rerun
    assert list(partial.glob("*.json"))


def test_an_unwritable_output_fails_before_any_work(tmp_path, monkeypatch, capsys):
    def no_work(*args, **kwargs):
        raise AssertionError("work started before the output was checked")

    monkeypatch.setattr(cli_compare, "build_workload", no_work)
    monkeypatch.setattr(sweep_mod, "build_workload", no_work)
    monkeypatch.setattr("experiments.cli.replay.load_mooncake", no_work)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    (tmp_path / "results.json").write_text("{}")
    for argv in (
        ["compare", *FAST, "--output-dir", str(blocker / "out")],
        ["run", "--backend", "apc", *FAST, "--output-dir", str(blocker / "out")],
        ["sweep", *FAST, "--output-dir", str(blocker / "out")],
        ["compare", *FAST, "--output-dir", str(blocker)],  # the output folder is a file
        ["report", str(tmp_path), "--output-dir", str(blocker / "out")],
    ):
        assert main(argv) == 3, argv
        err = capsys.readouterr().err
        assert err.startswith("error: output") and len(err.strip().splitlines()) == 1, err
    trace = ROOT / "experiments" / "data" / "mooncake_conversation_2000.jsonl"
    assert main(["replay", "--backend", "apc", "--trace", str(trace), "--output", str(blocker / "r.json")]) == 3
    assert "not writable" in capsys.readouterr().err


def test_a_killed_worker_is_named_and_finished_cells_are_kept(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    argv = ["compare", *FAST, "--backend", "apc,none", "--jobs", "2", "--capacity-tokens", "1200", "2400", "4800",
            "--output-dir", str(out)]  # fmt: skip
    monkeypatch.setenv(KILL_CELL_ENV, "none@2400")  # the declared test seam: that cell SIGKILLs itself
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "cell none @ 2,400 tokens, page 16, shared_doc_qa: its process was killed by SIGKILL" in err
    assert "rerunning the same command resumes" in err
    assert not out.exists()  # no report that silently lacks a cell
    assert len(list((tmp_path / "out.partial").glob("*.json"))) == 5
    monkeypatch.delenv(KILL_CELL_ENV)
    assert main(argv) == 0
    assert "5 of 6 cells reused" in capsys.readouterr().err
    assert len(json.loads((out / "results.json").read_text())["cells"]) == 6
    assert siblings(out) == []  # the partial cells are gone once the report is in place


def test_a_killed_sweep_worker_is_named_and_the_sweep_resumes(tmp_path, monkeypatch, capsys):
    argv = ["sweep", *FAST, "--backend", "apc,none", "--jobs", "2", "--capacity-tokens", "1200", "2400",
            "--output-dir", str(tmp_path / "sw")]  # fmt: skip
    monkeypatch.setenv(KILL_CELL_ENV, "none@2400")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "cell none @ 2,400 tokens, page 16, shared_doc_qa: its process was killed by SIGKILL" in err
    assert "finished cells are kept" in err
    assert len(list((tmp_path / "sw" / "cells").glob("*.json"))) == 3
    assert not (tmp_path / "sw" / "shared_doc_qa-p16").exists()
    monkeypatch.delenv(KILL_CELL_ENV)
    assert _sweep_counts(argv, capsys) == (3, 1)


def _sweep_counts(argv: list[str], capsys) -> tuple[int, int]:
    capsys.readouterr()
    assert main(argv) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("sweep: "))
    _, done, todo = (int(w) for w in line.replace(",", "").split() if w.isdigit())
    return done, todo


def test_sweep_keys_follow_the_trace_content_and_the_code_version(tmp_path, monkeypatch, capsys):
    trace = tmp_path / "t.jsonl"
    line = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}
    trace.write_text(json.dumps(line) + "\n")
    argv = ["sweep", "--trace", str(trace), "--backend", "apc", "--capacity-tokens", "2000", "--protocol", "replay",
            "--no-bounds", "--no-progress", "--output-dir", str(tmp_path / "sw")]  # fmt: skip
    assert _sweep_counts(argv, capsys) == (0, 1)
    assert _sweep_counts(argv, capsys) == (1, 0)
    trace.write_text(json.dumps({**line, "hash_ids": [1, 3]}) + "\n")  # same path, new content
    assert _sweep_counts(argv, capsys) == (0, 1)
    monkeypatch.setattr(provenance, "code_version", lambda: "9.9.9+gnewcode")
    assert _sweep_counts(argv, capsys) == (0, 1)
    cells = [json.loads(p.read_text()) for p in (tmp_path / "sw" / "cells").glob("*.json")]
    assert {c["config"]["provenance"]["code"] for c in cells} >= {"9.9.9+gnewcode"}


def test_the_commit_is_the_packages_own_not_the_current_directorys(tmp_path, monkeypatch):
    expected = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    monkeypatch.chdir(tmp_path)  # not a git checkout
    if expected.returncode != 0:
        pytest.skip("the package is not in a git checkout")
    assert provenance.git_commit() == expected.stdout.strip()


def test_exit_codes(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}) + "\n")
    # nothing schedulable: bad input, as compare's capacity check
    assert main(["replay", "--backend", "apc", "--trace", str(trace), "--capacity-tokens", "32", "--no-progress"]) == 3
    assert "nothing was schedulable" in capsys.readouterr().err
    # a missing required option: bad usage
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--backend", "apc"])
    assert exc.value.code == 2
    assert main(["run", *FAST, "--output-dir", str(tmp_path / "o")]) == 2
    assert main(["sweep", *FAST, "--knob", "oops", "--output-dir", str(tmp_path / "o")]) == 2
