"""`experiments.bench.same_results`: two compare documents decided the same, timing aside."""

from __future__ import annotations

import copy
import json

import pytest

from experiments.bench.same_results import differences, main

DOC = {
    "created": "2026-11-30T10:00:00",
    "commit": "aaa",
    "wall_seconds": 12.5,
    "bounds": {"belady": [0.25, 0.37]},
    "cells": [
        {
            "config": {"backend": "apc", "knobs": {"path": "/here/trace.jsonl"}},
            "replay": {"hit_rate": 0.054, "cache_seconds": 1.5, "us_per_request": 20.0},
            "serving": {"ttft_p50": 1.25, "cache_us_per_request": 140.0, "tpot_p50": float("nan"), "steps": 17819},
        }
    ],
}


def test_timing_and_run_fields_are_not_differences():
    other = copy.deepcopy(DOC)
    other.update(created="2026-12-01T00:00:00", commit="bbb", wall_seconds=99.0)
    cell = other["cells"][0]
    cell["config"]["knobs"]["path"] = "/elsewhere/trace.jsonl"
    cell["replay"].update(cache_seconds=9.0, us_per_request=1.0)
    cell["serving"]["cache_us_per_request"] = 1.0
    assert differences(DOC, other) == []  # NaN equals NaN here: the same computed result


@pytest.mark.parametrize(
    "change, where",
    [
        (lambda d: d["cells"][0]["replay"].update(hit_rate=0.0541), ".cells[0].replay.hit_rate"),
        (lambda d: d["cells"][0]["serving"].update(steps=17820), ".cells[0].serving.steps"),
        (lambda d: d["cells"][0]["serving"].update(steps=17819.0), ".cells[0].serving.steps"),  # int became float
        (lambda d: d["bounds"]["belady"].append(0.4), ".bounds.belady"),
        (lambda d: d["cells"][0]["serving"].pop("ttft_p50"), ".cells[0].serving.ttft_p50"),
        (lambda d: d["cells"][0]["serving"].update(tpot_p50=0.0), ".cells[0].serving.tpot_p50"),
    ],
)
def test_a_changed_result_is_named_by_its_path(change, where):
    other = copy.deepcopy(DOC)
    change(other)
    found = differences(DOC, other)
    assert len(found) == 1 and found[0].startswith(where + ":"), found


def test_the_command_exits_1_on_a_difference_0_without_and_2_without_a_file(tmp_path, capsys):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(DOC))
    new.write_text(json.dumps(DOC))
    out = ["--output", str(tmp_path / "same.json")]
    assert main([str(old), str(new), *out]) == 0
    assert json.loads((tmp_path / "same.json").read_text())["same"] is True
    changed = copy.deepcopy(DOC)
    changed["cells"][0]["replay"]["hit_rate"] = 0.5
    new.write_text(json.dumps(changed))
    assert main([str(old), str(new), *out]) == 1
    assert ".cells[0].replay.hit_rate: 0.054 != 0.5" in capsys.readouterr().out
    assert json.loads((tmp_path / "same.json").read_text())["differences"] == [
        ".cells[0].replay.hit_rate: 0.054 != 0.5"
    ]
    assert main([str(old), str(tmp_path / "missing.json"), *out]) == 2
