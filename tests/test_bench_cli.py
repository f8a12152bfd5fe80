"""The benchmark scripts' command lines: every option has help text and `--help` shows its
default, settings have the same flag in every script (older spellings only as aliases of
it), and default outputs go to the untracked bench-results/ folder. Nothing is run."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path

import pytest

import experiments.bench as bench_pkg
from experiments.bench import RESULTS

ROOT = Path(__file__).resolve().parents[1]
#: experiments/bench/gpu_attention_bench.py has its own command line (GPU only), checked by its owner's tests;
#: gpu_timing.py is its timing library, not a script
SKIP = {"gpu_attention_bench", "gpu_timing"}
MODULES = sorted(m.name for m in pkgutil.iter_modules(bench_pkg.__path__) if m.name not in SKIP)

#: the flags a script must have, where the setting applies to it
SHARED = {
    "bounds_memory": {"--trace", "--limit", "--page-size", "--capacity-tokens", "--output"},
    "half_life_sweep": {"--page-size", "--output"},
    "instructions": {"--limit", "--output"},
    "lmcache_timing": {"--trace", "--limit", "--page-size", "--capacity-tokens", "--output"},
    "mooncake_breakdown": {"--trace", "--limit", "--page-size", "--capacity-tokens", "--backend", "--output"},
    "oracle_bench": {"--trace", "--limit", "--page-size", "--capacity-tokens", "--backend", "--output"},
    "radix_bench": {
        "--trace",
        "--limit",
        "--page-size",
        "--capacity-tokens",
        "--eviction-policy",
        "--runs",
        "--clock",
        "--output",
    },
    "repeat_trace": {"--output"},
    "same_results": {"--output"},
    "replay_bench": {
        "--trace",
        "--limit",
        "--page-size",
        "--capacity-tokens",
        "--backend",
        "--runs",
        "--clock",
        "--output",
    },
    "sharing_memory": {"--page-size", "--backend", "--output"},
    "speed_targets": {"--trace", "--runs", "--clock", "--output"},
}
#: older or other spellings: allowed only as an alias of the shared flag (same destination)
ALIASES = {
    "--backends": "--backend",
    "--policy": "--eviction-policy",
    "--page-sizes": "--page-size",
    "--trace-full": "--trace",
    "--cpu-clock": "--clock",
    "--out": "--output",
    "--repeats": "--runs",
    "--reps": "--runs",
    "--capacity": "--capacity-tokens",
    "--capacities": "--capacity-tokens",
}


def parser_of(name: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"experiments.bench.{name}")
    return module.build_parser()


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


def by_flag(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {flag: a for a in options(parser) for flag in a.option_strings}


def test_every_script_is_covered():
    assert set(MODULES) == set(SHARED), "a new benchmark script needs its row in SHARED"


@pytest.mark.parametrize("name", MODULES)
def test_every_option_has_help_text_and_help_shows_its_default(name, capsys):
    parser = parser_of(name)
    assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    formatter = parser._get_formatter()
    dests_with_default = {a.dest for a in options(parser) if a.default is not None}
    for action in options(parser):
        label = "/".join(action.option_strings) or action.dest
        assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), f"{name} {label}: no help"
        shown = formatter._get_help_string(action) or ""
        if action.required:
            continue
        if action.default is None and action.dest in dests_with_default:
            # an alias storing into another option's destination (e.g. --cpu-clock): that option shows the default
            assert "same as" in shown, f"{name} {label}: an alias should say which option it stands for"
            continue
        assert "default" in shown, f"{name} {label}: --help does not show the default ({shown!r})"
    module = importlib.import_module(f"experiments.bench.{name}")
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    for action in options(parser):
        for flag in action.option_strings:
            assert flag in text, f"{name}: {flag} missing from --help"
    assert "default:" in text


@pytest.mark.parametrize("name", MODULES)
def test_settings_have_the_shared_flag_names(name):
    flags = by_flag(parser_of(name))
    missing = SHARED[name] - set(flags)
    assert not missing, f"{name} lacks {sorted(missing)}"
    for alias, canonical in ALIASES.items():
        if alias in flags:
            assert canonical in flags, f"{name}: {alias} without {canonical}"
            assert flags[alias].dest == flags[canonical].dest, f"{name}: {alias} is not an alias of {canonical}"
    if "--clock" in flags:
        assert set(flags["--clock"].choices) == {"perf", "thread"}


@pytest.mark.parametrize("name", MODULES)
def test_default_output_is_under_the_untracked_results_folder(name):
    action = by_flag(parser_of(name))["--output"]
    if action.required:
        return  # repeat_trace writes a trace, and only where it is told
    assert action.default is not None, f"{name}: no default output"
    assert Path(action.default).resolve().is_relative_to(RESULTS), f"{name}: default output {action.default}"


def test_results_folder_is_gitignored():
    assert RESULTS == ROOT / "bench-results"
    lines = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    assert lines & {"/bench-results/", "bench-results/", "/bench-results", "bench-results"}


def test_old_spellings_parse_as_the_new_ones():
    radix = parser_of("radix_bench")
    assert radix.parse_args(["--cpu-clock"]).clock == radix.parse_args(["--clock", "thread"]).clock == "thread"
    assert radix.parse_args([]).clock == "perf"
    assert radix.parse_args(["--policy", "lfu"]).policy == radix.parse_args(["--eviction-policy", "lfu"]).policy
    sharing = parser_of("sharing_memory")
    assert sharing.parse_args(["--backends", "apc"]).backends == sharing.parse_args(["--backend", "apc"]).backends
    speed = parser_of("speed_targets")
    assert speed.parse_args(["--trace-full", "x"]).trace_full == speed.parse_args(["--trace", "x"]).trace_full


def test_speed_rows_report_the_clock_regions_they_measure():
    """A speed row says how many timed regions a replayed request opens (a counting clock's
    pass: a prefill, a decode's grow and commit, a release, and the releases an eviction
    forces) and what an empty region measures, so a reader can tell the clock from the cache."""
    from experiments.bench.speed_targets import CountingClock, Row, empty_region_us, measure_row

    clock = CountingClock()
    clock(), clock()
    assert clock.reads == 2
    r = measure_row(Row("tiny", "radix", 16, 40, 200_000, 25.0, "none"), runs=1, clock="perf")
    assert 2.5 <= r["timed_regions_per_request"] < 4  # (a one-token answer has no decode region)
    assert r["clock_us_per_request"] == round(r["timed_regions_per_request"] * r["empty_region_us"], 2)
    assert 0 <= empty_region_us("perf", repeats=100) < 50


def test_a_speed_row_measured_on_a_baseline_checkout(tmp_path, capsys):
    """`--baseline DIR` replays a row with DIR's own code (a child started there): here this
    very checkout stands in for an older one, so its figures must look like the row's; a
    folder that is not a checkout of the project is refused before anything runs."""
    from experiments.bench.speed_targets import ROOT, Row, main, measure_baseline_row

    tiny = Row("tiny", "radix", 16, 40, 200_000, 25.0, "none")
    b = measure_baseline_row(tiny, runs=2, clock="thread", folder=ROOT)
    assert b["checkout"] == str(ROOT) and len(b["runs_us_per_request"]) == 2
    assert b["commit"] is None or len(b["commit"]) == 40
    assert 0 < b["median_us_per_request"] < 10_000
    with pytest.raises(SystemExit):
        main(["--rows", "radix16", "--baseline", str(tmp_path), "--output", str(tmp_path / "x.json")])
    assert "not a checkout of this project" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def _callgrind_or_skip():
    import shutil

    if shutil.which("valgrind") is None or shutil.which("gcc") is None:
        pytest.skip("needs valgrind and gcc")


@pytest.mark.slow  # valgrind: a minute on a 2-core machine
def test_instruction_counts_of_a_speed_row(tmp_path):
    """`instructions` counts what `speed_targets` times: the instructions inside the timed
    regions (a prefill, a decode's grow and commit, a release per request), the clock's
    share reported beside them."""
    _callgrind_or_skip()
    from experiments.bench.instructions import Callgrind, count_row
    from experiments.bench.speed_targets import ROOT, ROWS

    r = count_row(Callgrind(tmp_path), ROOT, ROWS["radix16"], limit=3)
    assert r["requests"] == 3 and r["checkout"] == str(ROOT)
    assert 2.5 <= r["timed_regions_per_request"] < 4
    # a replayed request costs tens of thousands of instructions in the cache, far more than its clock reads
    assert 10_000 < r["instructions_per_request"] < 5_000_000
    assert 0 < r["clock_instructions_per_request"] < r["instructions_per_request"] / 3
    # (both figures rounded: they agree to an instruction or two)
    assert (
        abs(r["clock_instructions_per_request"] - r["timed_regions_per_request"] * r["empty_region_instructions"]) <= 2
    )


@pytest.mark.slow
def test_instruction_counts_repeat_exactly(tmp_path):
    """The same code on the same requests counts the same instructions (the reason for the
    measure: this machine's clocks move by up to 4x between sessions)."""
    _callgrind_or_skip()
    from experiments.bench.instructions import Callgrind, count_row
    from experiments.bench.speed_targets import ROOT, ROWS

    grind = Callgrind(tmp_path)
    a, b = (count_row(grind, ROOT, ROWS["radix16"], limit=5) for _ in range(2))
    assert abs(a["instructions"] - b["instructions"]) <= a["instructions"] * 1e-4


def test_instruction_counts_refuse_before_work(tmp_path, capsys, monkeypatch):
    """No valgrind (or gcc), a baseline that is not a checkout, a bad limit: refused, nothing written."""
    from experiments.bench import instructions

    out = tmp_path / "x.json"
    for argv, message in (
        (["--baseline", str(tmp_path)], "not a checkout of this project"),
        (["--limit", "0"], "--limit must be >= 1"),
    ):
        with pytest.raises(SystemExit):
            instructions.main([*argv, "--output", str(out)])
        assert message in capsys.readouterr().err
    monkeypatch.setattr(instructions.shutil, "which", lambda tool: None)
    with pytest.raises(SystemExit):
        instructions.main(["--rows", "radix16", "--output", str(out)])
    assert "need valgrind and gcc" in capsys.readouterr().err
    assert not out.exists()
