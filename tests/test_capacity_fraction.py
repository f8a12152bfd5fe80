"""Capacities as a fraction of the workload's working set (distinct pages), as libCacheSim
sizes caches: resolved before any work and recorded in each cell's `kv_capacity`."""

from __future__ import annotations

import json
import math

import pytest

from experiments.cli.main import main
from experiments.runs.runner import CellConfig, ConfigError, build_workload, kv_capacity

KNOBS = {"num_documents": "4", "num_requests": "30", "doc_len": "100", "question_len": "10", "output_len": "4"}
ARGS = [a for k, v in KNOBS.items() for a in ("--knob", f"{k}={v}")]


def _distinct_pages(workload, page: int) -> int:
    """Distinct full prompt pages, each named by every token up to its end (a chain), counted by hand."""
    seen = set()
    for spec in workload.requests:
        tokens = tuple(spec.prompt.tolist())
        seen.update(tokens[: (i + 1) * page] for i in range(len(tokens) // page))
    return len(seen)


def test_fractions_of_the_working_set_are_resolved_and_recorded(tmp_path):
    out = tmp_path / "out"
    argv = ["compare", *ARGS, "--backend", "apc", "--protocol", "replay", "--no-bounds", "--no-progress",
            "--capacity-fraction", "0.5", "1", "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    wl = build_workload(CellConfig("apc", "shared_doc_qa", 1, knobs={**KNOBS, "rate": 20.0}))
    pages = _distinct_pages(wl, 16)
    doc = json.loads((out / "results.json").read_text())
    assert doc["capacities"] == [math.floor(0.5 * pages) * 16, pages * 16]
    for cell in doc["cells"]:
        cap = cell["kv_capacity"]
        assert cap["given"] == "capacity_fraction" and cap["working_set_pages"] == pages
        assert cell["config"]["capacity_fraction"] in (0.5, 1.0)
    half, full = (next(c for c in doc["cells"] if c["config"]["capacity_fraction"] == f)["replay"] for f in (0.5, 1.0))
    assert full["hit_rate"] > half["hit_rate"] > 0


def test_two_ways_and_out_of_range_fractions_are_refused(tmp_path, capsys):
    base = ["compare", *ARGS, "--backend", "apc", "--no-progress", "--output-dir", str(tmp_path / "o")]
    assert main([*base, "--capacity-fraction", "0.5", "--capacity-tokens", "5000"]) == 3
    assert "--capacity-tokens and --capacity-fraction each set the KV capacity" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main([*base, "--capacity-fraction", "1.5"])
    assert exc.value.code == 2 and "must be at most 1 (a share)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_cell_whose_tokens_disagree_with_its_fraction_is_refused():
    cfg = CellConfig("apc", "shared_doc_qa", 160, knobs=KNOBS, capacity_fraction=0.5)
    wl = build_workload(cfg)
    with pytest.raises(ConfigError, match="is not what capacity_fraction 0.5 gives"):
        kv_capacity(cfg, wl)
    with pytest.raises(ConfigError, match="--capacity-gb and --capacity-fraction both given"):
        CellConfig("apc", "shared_doc_qa", 160, knobs=KNOBS, capacity_fraction=0.5, capacity_gb=1.0)


def test_a_sweep_sizes_each_workload_by_its_own_working_set(tmp_path):
    out = tmp_path / "sw"
    assert main(["sweep", "--workloads", "shared_doc_qa", "no_sharing", *ARGS, "--backend", "apc", "--protocol",
                 "replay", "--no-bounds", "--no-progress", "--capacity-fraction", "0.5", "--output-dir", str(out)]) == 0  # fmt: skip
    caps = {d.name: json.loads((d / "results.json").read_text())["cells"][0]["kv_capacity"] for d in out.glob("*-p16")}
    assert caps["shared_doc_qa-p16"]["working_set_pages"] != caps["no_sharing-p16"]["working_set_pages"]
    for kv in caps.values():
        assert kv["tokens"] == math.floor(0.5 * kv["working_set_pages"]) * 16
