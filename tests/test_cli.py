"""The command line as an interface: `replay`'s flags and JSON fields are pinned (scripts read
them), only user-input errors are one line (a bug shows its traceback), and the CLI modules
import without cycles or each other's private names."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import experiments.cli.compare as cli_compare
from experiments.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "experiments" / "data" / "mooncake_conversation_2000.jsonl"
FAST = ["--workload", "no_sharing", "--knob", "num_requests=6", "--protocol", "replay", "--no-bounds",
        "--capacity-tokens", "20000", "--no-progress"]  # fmt: skip

#: what `replay --output` writes: scripts read these names; add fields, never rename or drop one
REPLAY_FIELDS = [
    "backend", "page_size", "num_pages", "capacity_tokens", "concurrency", "requests", "scheduled",
    "prompt_tokens", "hit_tokens", "computed_prompt_tokens", "hit_rate", "evicted_pages", "unschedulable",
    "truncated", "cache_seconds", "us_per_request", "metadata_bytes_end", "per_request_hits", "trace", "capacity",
    "backend_options",
]  # fmt: skip
#: `replay`'s flags, as scripts call it
REPLAY_FLAGS = [
    "--backend", "--trace", "--limit", "--mooncake-block-size", "--page-size", "--capacity-tokens", "--num-pages", "--concurrency",
    "--eviction-policy", "--hash-algorithm", "--verify-tokens", "--output", "--no-progress", "--backend-opt",
    "--config",
]  # fmt: skip


def _flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {s for a in sub.choices[command]._actions for s in a.option_strings if s.startswith("--")} - {"--help"}


def test_replay_json_fields_are_pinned(tmp_path):
    out = tmp_path / "r.json"
    argv = ["replay", "--backend", "apc", "--trace", str(TRACE), "--limit", "10", "--capacity-tokens", "100000"]
    assert main([*argv, "--no-progress", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result) == REPLAY_FIELDS
    assert len(result["per_request_hits"]) == result["requests"] == 10
    assert result["capacity"] == 100000 and result["backend_options"] == {}
    assert isinstance(result["evicted_pages"], int) and isinstance(result["us_per_request"], float)


def test_replay_flags_are_pinned():
    assert _flags("replay") == set(REPLAY_FLAGS)


def test_replay_takes_one_backend(capsys):
    assert main(["replay", "--backend", "apc,radix", "--trace", str(TRACE), "--no-progress"]) == 2
    assert "replay takes one --backend, got 'apc,radix'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["replay", "run", "compare", "sweep"])
def test_every_command_that_builds_a_cache_takes_backend_options(command):
    assert {"--backend-opt", "--eviction-policy", "--hash-algorithm", "--verify-tokens"} <= _flags(command)


def test_an_internal_error_shows_its_traceback(tmp_path, monkeypatch):
    def bug(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'requests'")

    monkeypatch.setattr(cli_compare, "build_workload", bug)
    with pytest.raises(AttributeError):  # not turned into a one-line "error:"
        main(["compare", *FAST, "--backend", "apc", "--output-dir", str(tmp_path / "out")])


@pytest.mark.parametrize("error", [AttributeError, ValueError])  # a bare ValueError is a bug too
def test_a_bug_inside_a_cell_shows_its_traceback(tmp_path, monkeypatch, capsys, error):
    def bug(*args, **kwargs):
        raise error("'NoneType' object has no attribute 'requests'")

    monkeypatch.setattr("experiments.runs.cell_runs.run_cell", bug)
    assert main(["compare", *FAST, "--backend", "apc", "--output-dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in bug" in err
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"error: cell apc @ 20,000 tokens, page 16, no_sharing: {error.__name__}")
    )


def test_a_setting_a_cell_does_not_run_is_bad_input(tmp_path, capsys):
    """Beam search under serving: the cell refuses it with a `ConfigError`, one line, exit 3."""
    argv = ["compare", "--workload", "beam_search", "--knob", "num_requests=3", "--protocol", "serving"]
    argv += ["--no-bounds", "--capacity-tokens", "20000", "--no-progress", "--backend", "apc"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err
    assert "Traceback" not in err and "beam search runs under the replay protocol only" in err


def test_an_internal_error_from_the_command_line_is_a_traceback(tmp_path):
    """Through `python -m experiments`: a traceback and exit 1, as Python gives for a bug."""
    code = (
        "import sys, experiments.cli.compare as c\n"
        "def bug(*a, **k): raise AttributeError('boom')\n"
        "c.build_workload = bug\n"
        "from experiments.cli.main import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = ["compare", *FAST, "--backend", "apc", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr and "AttributeError: boom" in proc.stderr


def test_python_dash_m_experiments_still_works():
    proc = subprocess.run([sys.executable, "-m", "experiments", "workloads"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "shared_doc_qa:" in proc.stdout


# -- import structure ----------------------------------------------------------------------

#: the command line and the modules it drives (experiments/cli/ and the output layer)
CLI_MODULES = [
    "experiments.__main__", "experiments.cli.main", "experiments.cli.args", "experiments.cli.compare",
    "experiments.cli.sweep", "experiments.cli.replay", "experiments.cli.report", "experiments.cli.workloads",
    "experiments.runs.backend_options", "experiments.runs.cell_runs", "experiments.runs.sweep", "experiments.report.results",
    "experiments.report.render", "experiments.runs.cell_pool", "experiments.runs.cell_store", "experiments.runs.output_dir",
    "experiments.runs.provenance", "experiments.errors", "experiments.runs.defaults", "experiments.runs.ray_runner",
]  # fmt: skip
#: private names a CLI module may import across modules: none
ALLOWED_PRIVATE: set[tuple[str, str, str]] = set()


def _module_file(name: str) -> Path:
    path = ROOT / Path(*name.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(name: str) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for every `experiments` import of module `name`,
    at any depth (an import inside a function still runs when it is called)."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(_module_file(name).read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name.startswith("experiments")]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("experiments"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.append((sub, None) if _module_file(sub).exists() else (node.module, a.name))
    return out


def test_cli_modules_have_no_import_cycles():
    graph = {m: sorted({t for t, _ in _imports(m) if t in CLI_MODULES and t != m}) for m in CLI_MODULES}
    state: dict[str, int] = {}  # 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in graph[m]:
            assert state.get(t) != 1, f"import cycle: {' -> '.join([*path, m, t])}"
            if t not in state:
                visit(t, [*path, m])
        state[m] = 2

    for m in CLI_MODULES:
        if m not in state:
            visit(m, [])


def test_cli_modules_import_no_private_names():
    private = [
        (m, t, n)
        for m in CLI_MODULES
        for t, n in _imports(m)
        if n is not None and n.startswith("_") and n != "__version__"
    ]
    assert set(private) <= ALLOWED_PRIVATE, private


@pytest.mark.parametrize("module", CLI_MODULES)
def test_each_cli_module_imports_alone_in_a_fresh_interpreter(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
