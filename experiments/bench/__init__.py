"""Benchmarks: not tests. Each reports medians over repeated runs and writes JSON.

Conventions shared by the scripts: a default output goes under `bench-results/` (untracked;
a committed report under reports/ is written by giving `--output` there), and a setting
has the same flag in every script and as in the main command: `--backend`, `--page-size`,
`--eviction-policy`, `--capacity-tokens`, `--trace`, `--limit`, `--runs`, `--clock
{perf,thread}`, `--output` (older spellings stay as aliases). Every option has help text
and `--help` shows its default (`HelpFormatter`). The full Mooncake trace defaults to
`traces/conversation_trace.jsonl` (`FULL_TRACE`), where `make mooncake` looks for it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments.runs.output_dir import write_file_atomically

ROOT = Path(__file__).resolve().parents[2]
#: benchmarks' default output folder (gitignored)
RESULTS = ROOT / "bench-results"
#: the full FAST'25 conversation trace of the public Mooncake repository, once downloaded
FULL_TRACE = ROOT / "traces" / "conversation_trace.jsonl"
#: the 2,000-request slice of the conversation trace shipped with the package
SHIPPED_TRACE = ROOT / "experiments" / "data" / "mooncake_conversation_2000.jsonl"

#: `--clock`: perf is the wall clock; thread is the CPU time of the calling thread, which does
#: not count time spent waiting for a core (a shared, loaded machine)
CLOCKS = {"perf": time.perf_counter, "thread": time.thread_time}
CLOCK_HELP = (
    "clock read around each cache call: perf = wall clock (time.perf_counter); thread = this thread's "
    "CPU time (time.thread_time), which leaves out time spent waiting for a core on a loaded machine"
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """`--help` shows every option's default after its help text. An option whose default is
    None (or that is required) says in its own help what leaving it out means, so no
    '(default: None)' is appended to it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.required or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def write_output(path: Path, text: str) -> None:
    """Write a benchmark's output file atomically, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(path, text)
