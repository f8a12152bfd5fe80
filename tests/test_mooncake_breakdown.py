"""experiments/bench/mooncake_breakdown.py times every part of make mooncake's work; on a
slice of the shipped trace its JSON holds one row per backend x capacity and adds up."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.bench.mooncake_breakdown import main

TRACE = Path(__file__).resolve().parents[1] / "experiments" / "data" / "mooncake_conversation_2000.jsonl"


def test_breakdown_rows_and_total(tmp_path):
    out = tmp_path / "b.json"
    argv = ["--trace", str(TRACE), "--limit", "40", "--backend", "apc", "none", "--capacity-tokens", "150000", "600000"]
    assert main([*argv, "--output", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == 40
    assert [(c["backend"], c["capacity_tokens"]) for c in doc["cells"]] == [
        ("apc", 150000), ("none", 150000), ("apc", 600000), ("none", 600000)
    ]  # fmt: skip
    for c in doc["cells"]:
        assert c["serving_steps"] > 0
        assert 0 <= c["replay_cache_s"] <= c["replay_cpu_s"]
        assert 0 <= c["serving_cache_s"] <= c["serving_cpu_s"]
    parts = doc["load_cpu_s"] + doc["bounds_cpu_s"] + sum(c["replay_cpu_s"] + c["serving_cpu_s"] for c in doc["cells"])
    assert abs(doc["total_cpu_s"] - parts) < 0.01
