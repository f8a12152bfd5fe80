"""Benchmarks: not tests. Each reports medians over repeated runs and writes JSON.

Conventions shared by the scripts: a default output goes under `bench-results/` (untracked;
a committed report under reports/ is written by giving `--output` there), and a setting
has the same flag as in the main command: `--backend`, `--page-size`, `--eviction-policy`,
`--capacity-tokens`, `--trace`. The full Mooncake trace defaults to `traces/conversation_trace.jsonl`
(`FULL_TRACE`), where `make mooncake` looks for it.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: benchmarks' default output folder (gitignored)
RESULTS = ROOT / "bench-results"
#: the full FAST'25 conversation trace of the public Mooncake repository, once downloaded
FULL_TRACE = ROOT / "traces" / "conversation_trace.jsonl"
