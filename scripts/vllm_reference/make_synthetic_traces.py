"""Export the synthetic trace(s) of the vLLM goldens as token-id JSONL (gzip'd), WITH arrivals.

Run with the project's venv (it uses the project's workload generators):

    .venv/bin/python scripts/vllm_reference/make_synthetic_traces.py tests/fixtures/vllm_0_33

Same generator call as the SGLang goldens' multi_turn_chat_s11
(scripts/sglang_reference/make_synthetic_traces.py), but `arrival` (seconds, the generator's
conversation arrivals + think times) is kept, since the vLLM goldens are timed. Fields written:
`id`, `prompt`, `output_len`, `arrival` (experiments/workloads/jsonl.py format). The fixture is
the exported file, not the generator call.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "sglang_reference"))

# one definition of the generator calls and of the export, shared with the SGLang goldens
from make_synthetic_traces import export  # noqa: E402

TRACES = ("multi_turn_chat_s11",)


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "tests/fixtures/vllm_0_33")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TRACES:
        p = export(name, out_dir, arrivals=True)
        print(f"{p} {p.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
