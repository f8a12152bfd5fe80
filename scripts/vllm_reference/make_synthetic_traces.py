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

import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from experiments.workloads.registry import make_workload  # noqa: E402

TRACES = {
    "multi_turn_chat_s11": (
        "multi_turn_chat",
        11,
        dict(
            num_conversations=150,
            turns=8,
            system_len=64,
            user_turn_len=40,
            answer_len=40,
            answer_dist="exponential",
            rate=2.0,
            think_time=5.0,
            vocab_size=32000,
        ),
    ),
}


def export(name: str, out_dir: Path) -> Path:
    workload, seed, knobs = TRACES[name]
    w = make_workload(workload, seed, **knobs)
    path = out_dir / f"{name}.arrivals.jsonl.gz"
    with gzip.GzipFile(path, "wb", compresslevel=9, mtime=0) as raw:
        for spec in w.requests:
            assert spec.n == 1 and spec.beam_width == 1 and spec.prefix_id is None
            assert spec.extra.cache_salt is None and spec.extra.lora_id is None
            obj = {
                "id": spec.request_id,
                "prompt": spec.prompt.tolist(),
                "output_len": int(spec.output_len),
                "arrival": float(spec.arrival),
            }
            raw.write((json.dumps(obj, separators=(",", ":")) + "\n").encode())
    meta = {"workload": workload, "seed": seed, "knobs": knobs, "requests": len(w.requests), "arrivals": True}
    (out_dir / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return path


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "tests/fixtures/vllm_0_33")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TRACES:
        p = export(name, out_dir)
        print(f"{p} {p.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
