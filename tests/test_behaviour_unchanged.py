"""The engine's numbers do not move: the example comparison reproduces reports/example exactly.

`reports/example/results.json` was written by `python -m experiments compare --output-dir
reports/example --no-progress`; the same command into a temporary folder must give every
number again (hit rates, evictions, TTFT quantiles, the pages timeline, ...), except what
is measured (cache seconds, µs per request, wall seconds) and what names the run (creation
time, commit, package and code version, command).

The example was regenerated when the document gained `schema_version`, `package`, `clocks`,
every cell's `kv_capacity` and `serving.latency`, and vLLM's throughput names (issue 15);
every number it held before stayed the same (`throughput_tokens_per_s` is now
`output_throughput`, the same values).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.__main__ import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "reports" / "example" / "results.json"
#: measured on the wall clock, or naming the run: never compared
NOT_COMPARED = frozenset(
    {
        "cache_seconds",
        "us_per_request",
        "cache_us_per_request",
        "wall_seconds",
        "created",
        "commit",
        "code_version",
        "package",
        "provenance",
        "command",
        "run_config",  # the options as run (output folder included); their values are compared under settings
    }
)


def differences(got: Any, want: Any, path: str = "") -> list[str]:
    """Every place where `got` and `want` differ, ignoring the keys in `NOT_COMPARED`."""
    if isinstance(got, dict) and isinstance(want, dict):
        out = []
        for key in sorted(set(got) | set(want), key=str):
            if key in NOT_COMPARED:
                continue
            if key not in got or key not in want:
                out.append(f"{path}/{key}: only in {'the new run' if key in got else 'the example'}")
            else:
                out += differences(got[key], want[key], f"{path}/{key}")
        return out
    if isinstance(got, list) and isinstance(want, list):
        if len(got) != len(want):
            return [f"{path}: {len(got)} items, the example has {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in differences(g, w, f"{path}[{i}]")]
    return [] if got == want else [f"{path}: {got!r}, the example has {want!r}"]


def test_example_compare_reproduces_every_number(tmp_path):
    want = json.loads(EXAMPLE.read_text())
    assert want["command"] == "python -m experiments compare --output-dir reports/example --no-progress"
    out = tmp_path / "example"
    assert main(["compare", "--output-dir", str(out), "--no-progress"]) == 0
    got = json.loads((out / "results.json").read_text())
    diff = differences(got, want)
    assert not diff, f"{len(diff)} numbers moved, first: " + "; ".join(diff[:10])


def test_the_comparison_ignores_only_timing_and_naming():
    a = {"cells": [{"replay": {"hit_rate": 0.5, "cache_seconds": 1.0}}], "created": "x"}
    b = {"cells": [{"replay": {"hit_rate": 0.5, "cache_seconds": 2.0}}], "created": "y"}
    assert differences(a, b) == []
    b["cells"][0]["replay"]["hit_rate"] = 0.6
    assert differences(a, b) == ["/cells[0]/replay/hit_rate: 0.5, the example has 0.6"]
