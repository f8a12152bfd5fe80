"""Issue 11's plumbing: `--scheduler`, `--async-scheduling` and `--executor fixed --step-ms`
reach every cell of `run`, `compare` and `sweep` (results.json, results.csv, report.md); every
contradictory combination is refused before any work, naming it; per_request.jsonl holds one
row per request per serving cell, with the keys the README documents."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

import experiments.cli.compare as cli_compare
import experiments.runs.sweep as sweep_mod
from experiments.__main__ import main
from experiments.cli.main import build_parser
from experiments.engine import FixedStepExecutor
from experiments.report.results import PER_REQUEST_FILE
from experiments.runs.cell_store import CellStore
from experiments.runs.runner import PER_REQUEST, CellConfig, ConfigError, make_executor, run_cell

ROOT = Path(__file__).resolve().parents[1]
N = 6  # requests of the tiny workloads
TINY = ["--workload", "shared_doc_qa", "--knob", "num_documents=2", "--knob", f"num_requests={N}", "--knob",
        "doc_len=64", "--knob", "question_len=8", "--knob", "output_len=3", "--no-bounds", "--no-progress"]  # fmt: skip
FIXED = ["--executor", "fixed", "--step-ms", "20"]
#: per_request.jsonl's keys, in order: the cell, then the engine's record (times in seconds)
PER_REQUEST_FIELDS = [
    "backend", "capacity_tokens", "page_size", "replicas", "router", "request_index", "request_id", "arrival_s",
    "prompt_tokens", "output_tokens", "hit_tokens_first", "hit_tokens_all_admissions", "computed_tokens",
    "generated", "first_token_step", "finish_step", "first_token_at_s", "ttft_s", "tpot_s", "finished_at_s", "e2e_s",
    "preemptions", "aborted", "sample_of", "replica",
]  # fmt: skip


def _flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return {s for a in sub.choices[command]._actions for s in a.option_strings}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _no_work(monkeypatch) -> None:
    """Any command that gets as far as building its workload fails the test."""

    def started(*args, **kwargs):
        pytest.fail("work started before the settings were checked")

    monkeypatch.setattr(cli_compare, "build_workload", started)
    monkeypatch.setattr(sweep_mod, "build_workload", started)


# -- the flags ------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["run", "compare", "sweep"])
def test_serving_commands_take_the_scheduler_flags(command):
    assert {"--scheduler", "--async-scheduling", "--step-ms"} <= _flags(command)


def test_replay_has_no_scheduler():
    """`replay` is the sequential replay protocol: nothing to schedule."""
    assert not {"--scheduler", "--async-scheduling", "--step-ms", "--executor"} & _flags("replay")


def test_help_names_the_schedulers_and_the_fixed_executor(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "vllm = vLLM 0.33 V1 scheduler's decisions (the default)" in text
    assert "legacy" not in text and "--ordering" not in text  # retired (issue 31)
    assert "fixed = a constant --step-ms per non-empty step" in text and "two batches in flight" in text


def test_the_flags_reach_the_cell(tmp_path):
    out = tmp_path / "out"
    argv = ["compare", *TINY, "--backend", "apc,none", "--capacity-tokens", "4000", "--protocol", "serving"]
    assert main([*argv, *FIXED, "--scheduler", "vllm", "--async-scheduling", "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    want = {"scheduler": "vllm", "async_scheduling": True, "executor": "fixed", "step_ms": 20.0}
    for cell in results["cells"]:
        assert {k: cell["config"][k] for k in want} == want
        assert cell["serving"]["finished"] == N
    assert {k: results["settings"][k] for k in want} == want
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [(r["scheduler"], r["async_scheduling"], r["executor"], r["step_ms"]) for r in rows] == [
        ("vllm", "True", "fixed", "20.0")
    ] * 2
    assert "executor fixed (20 ms per step), scheduler vllm with async scheduling" in (out / "report.md").read_text()


def test_the_defaults_reach_the_cell(tmp_path):
    out = tmp_path / "out"
    argv = ["run", *TINY, "--backend", "radix", "--capacity-tokens", "4000", "--protocol", "serving"]
    assert main([*argv, "--output-dir", str(out)]) == 0
    cfg = json.loads((out / "results.json").read_text())["cells"][0]["config"]
    assert (cfg["scheduler"], cfg["async_scheduling"], cfg["executor"], cfg["step_ms"]) == ("vllm", False, "cost", None)
    assert "ordering" not in cfg


def test_a_fixed_step_is_what_the_serving_clock_advances_by():
    cfg = CellConfig("apc", "no_sharing", 20000, knobs={"num_requests": 3}, protocol="serving", executor="fixed",
                     step_ms=20.0)  # fmt: skip
    executor = make_executor(cfg, 1250)
    assert isinstance(executor, FixedStepExecutor) and executor.step_seconds == pytest.approx(0.02)
    res = run_cell(cfg)
    assert res["serving"]["steps"] > 0
    for rec in res[PER_REQUEST]:  # from its first token to its finish it runs whole 20 ms steps
        steps = (rec["finished_at"] - rec["first_token_at"]) / 0.02
        assert steps == pytest.approx(round(steps), abs=1e-6)


# -- refused before any work ----------------------------------------------------------------

#: contradictory settings: exit 3, one line naming the problem
BAD_COMBINATIONS = [
    (["--executor", "fixed"], "executor 'fixed' needs --step-ms MS"),
    (["--step-ms", "20"], "is for executor 'fixed' only; executor 'cost'"),
    (["--executor", "model", "--model", "tiny", "--step-ms", "20"], "is for executor 'fixed' only; executor 'model'"),
]
#: malformed values: exit 2, as argparse refuses them
MALFORMED = [
    (["--executor", "fixed", "--step-ms", "0"], "--step-ms: must be positive and finite"),
    (["--executor", "fixed", "--step-ms", "-20"], "--step-ms: must be positive and finite"),
    (["--executor", "fixed", "--step-ms", "nan"], "--step-ms: must be positive and finite"),
    (["--executor", "fixed", "--step-ms", "inf"], "--step-ms: must be positive and finite"),
    (["--executor", "fixed", "--step-ms", "20ms"], "--step-ms: expected a number, got '20ms'"),
    (["--scheduler", "sglang"], "--scheduler: invalid choice: 'sglang'"),
    (["--executor", "roofline"], "--executor: invalid choice: 'roofline'"),
]


@pytest.mark.parametrize("command", ["run", "compare", "sweep"])
@pytest.mark.parametrize("extra, message", BAD_COMBINATIONS)
def test_a_contradiction_is_refused_before_any_work(command, extra, message, tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    out = tmp_path / "out"
    argv = [command, *TINY, "--backend", "apc", "--capacity-tokens", "4000", *extra, "--output-dir", str(out)]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and not (tmp_path / "out.lock").exists()


@pytest.mark.parametrize("command", ["run", "compare", "sweep"])
@pytest.mark.parametrize("extra, message", MALFORMED)
def test_a_malformed_value_is_bad_usage(command, extra, message, tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        main([command, *TINY, "--backend", "apc", "--capacity-tokens", "4000", *extra, "--output-dir", str(out)])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"scheduler": "sglang"}, "unknown scheduler 'sglang'; choose one of vllm"),
        ({"scheduler": "legacy"}, "the legacy scheduler was retired (issue 31)"),
        ({"executor": "fixed"}, "executor 'fixed' needs --step-ms"),
        ({"executor": "fixed", "step_ms": 0.0}, "positive, finite step time"),
        ({"executor": "fixed", "step_ms": -1}, "positive, finite step time"),
        ({"executor": "fixed", "step_ms": math.nan}, "positive, finite step time"),
        ({"executor": "fixed", "step_ms": math.inf}, "positive, finite step time"),
        ({"executor": "fixed", "step_ms": True}, "positive, finite step time"),
        ({"executor": "fixed", "step_ms": "20"}, "positive, finite step time"),
        ({"step_ms": 20.0}, "is for executor 'fixed' only"),
        ({"executor": "model", "step_ms": 20.0}, "is for executor 'fixed' only"),
        ({"async_scheduling": "yes"}, "async_scheduling is true or false"),
    ],
)
def test_cell_config_refuses_contradictions(settings, message):
    with pytest.raises(ConfigError) as exc:
        CellConfig("apc", "no_sharing", 20000, **settings)
    assert message in str(exc.value)


def test_cell_config_takes_every_consistent_combination():
    for asynchronous in (False, True):
        for executor, step in [("cost", None), ("model", None), ("fixed", 20.0), ("fixed", 1)]:
            cfg = CellConfig("apc", "no_sharing", 20000, executor=executor, step_ms=step,
                             async_scheduling=asynchronous)  # fmt: skip
            assert cfg.as_dict()["scheduler"] == "vllm"
    base = CellConfig("apc", "no_sharing", 20000)
    keys = {base.key(), CellConfig("apc", "no_sharing", 20000, async_scheduling=True).key(),
            CellConfig("apc", "no_sharing", 20000, executor="fixed", step_ms=20).key(),
            CellConfig("apc", "no_sharing", 20000, executor="fixed", step_ms=25).key()}  # fmt: skip
    assert len(keys) == 4  # each setting is part of the cell's key: no stale reuse


# -- per_request.jsonl ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[Path, dict, list[dict]]:
    out = tmp_path_factory.mktemp("cmp") / "out"
    argv = ["compare", *TINY, "--backend", "apc,none,radix[eviction_policy=lfu]", "--capacity-tokens", "1000", "4000"]
    # --jobs 2: the records travel back from child processes too
    assert main([*argv, *FIXED, "--jobs", "2", "--output-dir", str(out)]) == 0
    return out, json.loads((out / "results.json").read_text()), _rows(out / PER_REQUEST_FILE)


def test_per_request_has_one_row_per_request_per_cell(compared):
    _, results, rows = compared
    cells = [(c["config"]["capacity_tokens"], label) for c, label in
             zip(results["cells"], results["backends"] * 2, strict=True)]  # fmt: skip
    assert len(rows) == N * len(cells) == N * 6
    got = [(r["capacity_tokens"], r["backend"]) for r in rows]
    assert got == [cell for cell in cells for _ in range(N)]  # by cell, in the cells' order
    assert {r["backend"] for r in rows} == {"apc", "none", "radix[eviction_policy=lfu]"}
    for i, cell in enumerate(results["cells"]):
        mine = rows[i * N : (i + 1) * N]
        assert [r["request_index"] for r in mine] == list(range(N))  # the trace lines, in order
        assert sum(r["hit_tokens_first"] for r in mine) == cell["serving"]["hit_tokens"]
        assert sum(r["preemptions"] for r in mine) == cell["serving"]["preemptions"]
        assert all(r["page_size"] == 16 and not r["aborted"] and r["sample_of"] is None for r in mine)
        assert all(r["first_token_step"] <= r["finish_step"] < cell["serving"]["steps"] for r in mine)
        assert all(r["ttft_s"] == pytest.approx(r["first_token_at_s"] - r["arrival_s"]) for r in mine)
        assert all(r["e2e_s"] == pytest.approx(r["finished_at_s"] - r["arrival_s"]) for r in mine)
        assert all((r["replicas"], r["router"], r["replica"]) == (1, None, 0) for r in mine)
        # the per-request rows add up to the cell's summary (the E2E mean of serving.latency)
        e2e_ms = [r["e2e_s"] * 1000 for r in mine]
        assert sum(e2e_ms) / len(e2e_ms) == pytest.approx(cell["serving"]["latency"]["e2e_ms"]["mean"])


def test_per_request_keys_are_the_documented_ones(compared):
    _, _, rows = compared
    assert all(list(r) == PER_REQUEST_FIELDS for r in rows)
    usage = (ROOT / "docs" / "usage.md").read_text()  # (the README points there for the output files)
    undocumented = [k for k in PER_REQUEST_FIELDS if f"`{k}`" not in usage]
    assert not undocumented, f"docs/usage.md does not document {undocumented}"


def test_per_request_reads_as_json_lines(compared):
    out, _, _ = compared
    for line in (out / PER_REQUEST_FILE).read_text().splitlines():
        assert isinstance(json.loads(line), dict)


def test_per_request_reads_with_pandas(compared):
    pd = pytest.importorskip("pandas")
    out, _, rows = compared
    frame = pd.read_json(out / PER_REQUEST_FILE, lines=True)
    assert list(frame.columns) == PER_REQUEST_FIELDS and len(frame) == len(rows)
    by_backend = frame.groupby(["backend", "capacity_tokens"])["hit_tokens_first"].sum()
    assert by_backend.loc[("none", 1000)] == 0 and len(by_backend) == 6


def test_results_json_stays_lean(compared):
    out, results, _ = compared
    assert all(PER_REQUEST not in c for c in results["cells"])
    assert (out / "results.json").stat().st_size < 200_000


def test_run_writes_per_request_too(tmp_path):
    out = tmp_path / "out"
    argv = ["run", *TINY, "--backend", "apc", "--capacity-tokens", "4000", "--output-dir", str(out)]
    assert main(argv) == 0
    rows = _rows(out / PER_REQUEST_FILE)
    assert [r["request_index"] for r in rows] == list(range(N)) and {r["backend"] for r in rows} == {"apc"}


def test_samples_follow_their_request(tmp_path):
    out = tmp_path / "out"
    argv = ["run", "--workload", "parallel_sampling", "--knob", "num_requests=3", "--knob", "n=2", "--backend", "apc",
            "--protocol", "serving", "--no-bounds", "--no-progress", "--capacity-tokens", "20000"]  # fmt: skip
    assert main([*argv, "--output-dir", str(out)]) == 0
    rows = _rows(out / PER_REQUEST_FILE)
    assert [(r["request_index"], r["sample_of"] is not None) for r in rows] == [
        (i, sample) for i in range(3) for sample in (False, True)
    ]
    assert all(rows[i + 1]["sample_of"] == rows[i]["request_id"] for i in range(0, 6, 2))


def test_a_replay_only_run_writes_no_per_request_and_drops_an_old_one(tmp_path):
    out = tmp_path / "out"
    base = ["compare", *TINY, "--backend", "apc", "--capacity-tokens", "4000", "--output-dir", str(out)]
    assert main(base) == 0 and (out / PER_REQUEST_FILE).is_file()
    assert main([*base, "--protocol", "replay"]) == 0
    assert not (out / PER_REQUEST_FILE).exists()  # never a file of another run beside this report


def test_report_carries_the_per_request_file_of_its_results(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    base = ["compare", *TINY, "--capacity-tokens", "4000"]
    assert main([*base, "--backend", "apc", "--output-dir", str(a)]) == 0
    assert main([*base, "--backend", "none", "--output-dir", str(b)]) == 0
    want = (a / PER_REQUEST_FILE).read_text()
    assert main(["report", str(a)]) == 0  # in place: kept
    assert (a / PER_REQUEST_FILE).read_text() == want
    assert main(["report", str(a / "results.json"), "--output-dir", str(b)]) == 0  # b's own rows go
    assert (b / PER_REQUEST_FILE).read_text() == want


def test_a_stored_serving_cell_without_its_records_is_run_again(tmp_path):
    cfg = CellConfig("apc", "no_sharing", 20000, knobs={"num_requests": 3}, protocol="serving")
    res = run_cell(cfg)
    store = CellStore(tmp_path / "cells")
    store.save(cfg, res)
    assert store.load(cfg)[PER_REQUEST] == res[PER_REQUEST]
    store.save(cfg, {k: v for k, v in res.items() if k != PER_REQUEST})
    assert store.load(cfg) is None


def test_sweep_reports_carry_per_request(tmp_path):
    out = tmp_path / "sw"
    argv = ["sweep", *TINY, "--backend", "apc,none", "--capacity-tokens", "4000", "--page-size", "16", "32"]
    assert main([*argv, *FIXED, "--scheduler", "vllm", "--output-dir", str(out)]) == 0
    for page in (16, 32):
        rows = _rows(out / f"shared_doc_qa-p{page}" / PER_REQUEST_FILE)
        assert [(r["backend"], r["page_size"], r["request_index"]) for r in rows] == [
            (b, page, i) for b in ("apc", "none") for i in range(N)
        ]
        cfg = json.loads((out / f"shared_doc_qa-p{page}" / "results.json").read_text())["cells"][0]["config"]
        assert (cfg["scheduler"], cfg["executor"], cfg["step_ms"]) == ("vllm", "fixed", 20.0)
