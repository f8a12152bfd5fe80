"""The measuring tools of issue 12's memory row: the repeated trace and the bounds bench."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.bench import bounds_memory
from experiments.bench.repeat_trace import repeated_lines, write_repeated
from experiments.bounds.oracle import infinite_hits
from experiments.workloads.mooncake import load_mooncake

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "experiments/data/mooncake_conversation_2000.jsonl"


def test_repeated_trace_copies_share_no_block_and_follow_in_time(tmp_path):
    src = tmp_path / "part.jsonl"
    src.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:60]))
    out = tmp_path / "x3.jsonl"
    assert write_repeated(src, 3, out) == 180
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines == list(repeated_lines(src, 3))
    copies = [lines[c * 60 : (c + 1) * 60] for c in range(3)]
    ids = [{h for obj in copy for h in obj["hash_ids"]} for copy in copies]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    stamps = [obj["timestamp"] for obj in lines]
    assert stamps == sorted(stamps)
    original = [json.loads(line) for line in src.read_text().splitlines()]
    assert all(
        {k: v for k, v in a.items() if k not in ("hash_ids", "timestamp")}
        == {k: v for k, v in b.items() if k not in ("hash_ids", "timestamp")}
        for copy in copies
        for a, b in zip(copy, original, strict=True)
    )
    # disjoint copies: a cache that never evicts hits each copy as it hit the original
    one, three = load_mooncake(src), load_mooncake(out)
    assert infinite_hits(three, 16)["hit_tokens"] == 3 * infinite_hits(one, 16)["hit_tokens"]


def test_bounds_memory_reports_and_checks_the_bounds(tmp_path, capsys):
    base = [
        "--trace",
        str(TRACE),
        "--limit",
        "200",
        "--capacity-tokens",
        "100000",
        "--output",
        str(tmp_path / "b.json"),
    ]
    out = bounds_memory.main(base)
    assert out["requests"] == 200 and out["peak_rss_mb"] > 0 and out["oracle_module"].endswith("oracle.py")
    expect = tmp_path / "results.json"
    expect.write_text(json.dumps({"bounds": out["bounds"]}))
    again = bounds_memory.main([*base, "--expect", str(expect)])
    assert again["equals_expected"] is True
    bad = json.loads(expect.read_text())
    bad["bounds"]["infinite"]["hit_tokens"] += 16
    expect.write_text(json.dumps(bad))
    assert bounds_memory.main([*base, "--expect", str(expect)])["equals_expected"] is False
