"""Backend options: `--backend-opt`, its aliases and variants are typed by the backend's
constructor, checked against every selected backend before any work, and reach the cells,
the sweep keys, results.json, results.csv, the report's labels and replay's JSON."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

import experiments.cli.compare as cli_compare
import experiments.runs.sweep as sweep_mod
from experiments.cli.main import main
from experiments.errors import InputError, UsageError
from experiments.runs.backend_options import (
    BackendVariant,
    OptionGiven,
    parse_backend_opt,
    resolve_variants,
    split_backend_list,
    variant_label,
)
from experiments.runs.runner import CellConfig

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "experiments" / "data" / "mooncake_conversation_2000.jsonl"
SMALL = ["--workload", "shared_doc_qa", "--knob", "num_documents=4", "--knob", "num_requests=30", "--knob",
         "doc_len=200", "--knob", "question_len=20", "--knob", "output_len=4", "--no-progress"]  # fmt: skip
FAST = [*SMALL, "--protocol", "replay", "--no-bounds", "--capacity-tokens", "2400"]


def resolve(*specs: str, opts: tuple[str, ...] = (), pages: tuple[int, ...] = (16,)) -> list[BackendVariant]:
    return resolve_variants(list(specs), [parse_backend_opt(o) for o in opts], list(pages))


# -- parsing and typing ------------------------------------------------------------------


def test_backend_lists_keep_the_commas_of_a_variant():
    assert split_backend_list("apc, radix[eviction_policy=lfu,reserve_page=false] none") == [
        "apc", "radix[eviction_policy=lfu,reserve_page=false]", "none"
    ]  # fmt: skip
    for bad in ("radix[eviction_policy=lfu", "radix]x[", "radix[[a=1]]"):
        with pytest.raises(UsageError, match="unbalanced"):
            split_backend_list(bad)


@pytest.mark.parametrize("text", ["eviction_policy", "=lfu", ".eviction_policy=lfu"])
def test_malformed_backend_opt_is_a_usage_error(text):
    with pytest.raises(UsageError, match="KEY=VALUE"):
        parse_backend_opt(text)


def test_values_are_typed_by_the_constructor_with_the_knob_rules():
    (radix,) = resolve("radix", opts=("reserve_page=false", "track_contents=yes"))
    assert radix.options_dict() == {"reserve_page": False, "track_contents": True}
    (aged,) = resolve("radix-aged", opts=("half_life=inf", "cost_context=none"))
    assert aged.options_dict() == {"half_life": math.inf, "cost_context": None}
    (aged,) = resolve("radix-aged[half_life=500]")
    assert aged.options_dict() == {"half_life": 500.0} and isinstance(aged.options_dict()["half_life"], float)
    (apc,) = resolve("apc", opts=("verify_tokens=1", "hash_algorithm=sha256"))
    assert apc.options_dict() == {"hash_algorithm": "sha256", "verify_tokens": True}


@pytest.mark.parametrize(
    "spec, opts, message",
    [
        ("radix", ("reserve_page=maybe",), "option reserve_page expects bool, got 'maybe'"),
        ("radix-aged", ("half_life=soon",), "option half_life expects float, got 'soon'"),
        ("apc", ("hash_fn=md5",), "option hash_fn (HashFn | None) cannot be given as text"),
        ("radix", ("eviction_policy=random",), "radix[eviction_policy=random]: unknown eviction policy"),
        ("radix-aged", ("half_life=0",), "half_life must be a positive number"),
        ("radix", ("colour=red",), "backend 'radix' does not take --backend-opt colour=red (option colour); it takes"),
        ("lru9", (), "unknown backend 'lru9'"),
        ("radix", ("apc.verify_tokens=true",), "backend 'apc' is not selected"),
    ],
)
def test_bad_options_are_input_errors_naming_the_option(spec, opts, message):
    with pytest.raises(InputError) as info:
        resolve(spec, opts=opts)
    assert message in str(info.value)


def test_an_unqualified_option_must_be_taken_by_every_selected_backend():
    with pytest.raises(InputError) as info:
        resolve("radix", "apc", opts=("eviction_policy=lfu",))
    assert str(info.value) == (
        "backend 'apc' does not take --backend-opt eviction_policy=lfu (option eviction_policy); "
        "it takes: hash_algorithm, hash_kernel, hash_fn, verify_tokens, host_capacity_tokens, host_capacity_gb, host_eviction, "
        "host_block_size, offload_prompt_only, host_read_gbps, host_write_gbps, kv_bytes_per_token"
    )


def test_targeted_options_and_variants_the_more_specific_wins():
    got = resolve("radix", "radix[eviction_policy=fifo]", "apc", opts=("radix.eviction_policy=lfu",))
    assert [v.label for v in got] == ["radix[eviction_policy=lfu]", "radix[eviction_policy=fifo]", "apc"]
    got = resolve("radix", "radix-aged", opts=("track_contents=true", "radix.track_contents=false"))
    assert [v.label for v in got] == ["radix", "radix-aged[track_contents=true]"]


def test_defaults_are_dropped_so_one_configuration_is_one_variant():
    (radix,) = resolve("radix[eviction_policy=lru,reserve_page=true]")
    assert radix == BackendVariant("radix") and radix.label == "radix"
    with pytest.raises(UsageError, match="the same variant twice: radix"):
        resolve("radix", "radix[eviction_policy=lru]")


def test_labels_name_non_default_options_in_constructor_order_and_parse_back():
    (v,) = resolve("radix[admission_eviction=extend,eviction_policy=lfu]")
    assert v.label == "radix[eviction_policy=lfu,admission_eviction=extend]"
    assert resolve(v.label) == [v]
    assert variant_label("radix-aged", {"half_life": math.inf, "cost_context": None}) == (
        "radix-aged[half_life=inf,cost_context=none]"
    )


def test_a_refused_value_is_checked_at_every_page_size():
    assert resolve("radix[reserve_page=false]", pages=(1, 16, 32))
    given = [OptionGiven("eviction_policy", "lfu", "--eviction-policy")]
    assert resolve_variants(["radix"], given, [1, 16]) == [BackendVariant("radix", (("eviction_policy", "lfu"),))]


# -- through the command line ----------------------------------------------------------------


def _no_work(*args, **kwargs):
    raise AssertionError("work started before the options were checked")


@pytest.mark.parametrize("command", ["compare", "run", "sweep"])
def test_an_option_one_backend_does_not_take_fails_before_any_work(command, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_compare, "build_workload", _no_work)
    monkeypatch.setattr(sweep_mod, "build_workload", _no_work)
    backend = "radix" if command == "run" else "apc,radix"
    for extra in (["--eviction-policy", "lfu"], ["--backend-opt", "eviction_policy=lfu"]):
        argv = [command, *FAST, "--backend", "radix-aged" if command == "run" else backend, *extra]
        assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 3
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert "does not take" in err and "eviction_policy" in err and "it takes:" in err, err
        assert not (tmp_path / "out").exists()


def test_compare_no_longer_drops_an_option_for_the_backends_that_lack_it(tmp_path, capsys):
    """It used to be applied to radix and silently ignored for apc and radix-aged."""
    argv = ["compare", *FAST, "--eviction-policy", "lfu", "--output-dir", str(tmp_path / "out")]
    assert main(argv) == 3
    assert "backend 'none' does not take --eviction-policy" in capsys.readouterr().err


def _results(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())


def test_alias_and_generic_option_are_the_same_cells(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(["compare", *FAST, "--backend", "radix", "--eviction-policy", "lfu", "--output-dir", str(a)]) == 0
    assert main(["compare", *FAST, "--backend", "radix", "--backend-opt", "eviction_policy=lfu",
                 "--output-dir", str(b)]) == 0  # fmt: skip
    ca, cb = _results(a)["cells"][0], _results(b)["cells"][0]
    assert ca["config"] == cb["config"] and ca["config"]["backend_options"] == {"eviction_policy": "lfu"}
    assert ca["replay"]["hit_tokens"] == cb["replay"]["hit_tokens"]
    assert CellConfig(**ca["config"]).key() == CellConfig(**cb["config"]).key()


def test_two_variants_side_by_side_in_json_csv_and_report(tmp_path):
    out = tmp_path / "out"
    backends = "radix,radix[eviction_policy=mru],apc[verify_tokens=true]"
    pressure = [*FAST, "--knob", "num_documents=12", "--capacity-tokens", "1600"]  # radix evicts here
    argv = ["compare", *pressure, "--backend", backends, "--backend-opt", "radix.admission_eviction=extend"]
    assert main([*argv, "--output-dir", str(out)]) == 0
    labels = ["radix[admission_eviction=extend]", "radix[eviction_policy=mru,admission_eviction=extend]",
              "apc[verify_tokens=true]"]  # fmt: skip
    results = _results(out)
    assert results["backends"] == labels
    options = [c["config"]["backend_options"] for c in results["cells"]]
    assert options == [
        {"admission_eviction": "extend"},
        {"eviction_policy": "mru", "admission_eviction": "extend"},
        {"verify_tokens": True},
    ]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["label"] for r in rows] == labels and [r["backend"] for r in rows] == ["radix", "radix", "apc"]
    assert [json.loads(r["backend_options"]) for r in rows] == options
    md = (out / "report.md").read_text()
    assert all(f"| {label} |" in md for label in labels)
    # the two radix variants really ran differently configured caches
    hits = [c["replay"]["hit_tokens"] for c in results["cells"]]
    assert hits[0] != hits[1]
    # the labels come from results.json alone: `report` redraws the same tables and CSV
    assert main(["report", str(out), "--output-dir", str(tmp_path / "again")]) == 0
    for name in ("report.md", "results.csv"):
        assert (tmp_path / "again" / name).read_text() == (out / name).read_text()


def test_options_are_part_of_the_sweep_key(tmp_path, capsys):
    out = tmp_path / "sw"
    base = ["sweep", *FAST, "--output-dir", str(out)]
    assert main([*base, "--backend", "radix"]) == 0
    assert main([*base, "--backend", "radix", "--backend-opt", "eviction_policy=lfu"]) == 0
    err = capsys.readouterr().err
    assert "sweep: 1 cells, 0 already done, 1 to run" in err.split("sweep done")[1]  # a new cell, not a reuse
    cells = [json.loads(p.read_text()) for p in (out / "cells").glob("*.json")]
    assert sorted(json.dumps(c["config"]["backend_options"]) for c in cells) == ['{"eviction_policy": "lfu"}', "{}"]
    assert main([*base, "--backend", "radix[eviction_policy=lfu]"]) == 0
    assert "1 already done, 0 to run" in capsys.readouterr().err  # the same cell, however it is written


def test_replay_takes_the_generic_option_and_records_it(tmp_path, capsys):
    argv = ["replay", "--trace", str(TRACE), "--limit", "20", "--capacity-tokens", "20000", "--no-progress"]
    outs = []
    for extra in (["--backend", "radix", "--eviction-policy", "lfu"], ["--backend", "radix[eviction_policy=lfu]"]):
        out = tmp_path / f"r{len(outs)}.json"
        assert main([*argv, *extra, "--output", str(out)]) == 0
        outs.append(json.loads(out.read_text()))
    assert outs[0]["backend_options"] == outs[1]["backend_options"] == {"eviction_policy": "lfu"}
    assert outs[0]["hit_tokens"] == outs[1]["hit_tokens"]
    assert main([*argv, "--backend", "apc", "--backend-opt", "reserve_page=false"]) == 3
    assert "backend 'apc' does not take --backend-opt reserve_page=false" in capsys.readouterr().err
