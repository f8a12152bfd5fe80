"""Every default setting of a run, in one place: the CLI, `CellConfig` and the README use these."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PAGE_SIZE = 16
#: the README's main job: documents x questions, a working set of about 200k tokens
WORKLOAD = "shared_doc_qa"
WORKLOAD_KNOBS: dict[str, Any] = {"num_documents": 100, "num_requests": 1000, "rate": 20.0}
#: workload -> the knobs the commands set over its generator's own defaults; `--knob K=V`
#: changes K alone and keeps the rest (`workloads` prints these as the defaults)
COMMAND_KNOBS: dict[str, dict[str, Any]] = {WORKLOAD: WORKLOAD_KNOBS}
CAPACITIES = (25_000, 50_000, 100_000, 200_000)
SEED = 0
PROTOCOL = "both"
EXECUTOR = "cost"
DEVICE = "h200"
MODEL = "llama3-8b"
ATTENTION = "auto"
TOKEN_BUDGET = 8192
MAX_RUNNING = 256
#: serving's scheduling policy: vLLM 0.33 V1's decisions
SCHEDULER = "vllm"
JOBS = 1
#: serving replicas of a cell (`--replicas`): one, single-replica serving; more run behind a router
REPLICAS = 1
OUTPUT_DIR = Path("reports/latest")
#: `replay`: requests in flight at most
CONCURRENCY = 1
