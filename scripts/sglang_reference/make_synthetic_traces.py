"""Export the synthetic traces of the SGLang goldens as token-id JSONL (gzip'd).

Run with the project's venv (it uses the project's workload generators):

    .venv/bin/python scripts/sglang_reference/make_synthetic_traces.py tests/fixtures/sglang_0_5_23

The fixtures are the exported files, not the generator calls: a test replays exactly these
requests even if a generator changes later. Only `id`, `prompt` and `output_len` are written
(the project's jsonl format, experiments/workloads/jsonl.py; `arrival` and think times are
dropped, recorded chat answers are not kept: the replay generates fresh ids).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from experiments.workloads.registry import make_workload  # noqa: E402

# name -> (workload, seed, knobs); capacities are chosen in regenerate.sh
TRACES = {
    "shared_doc_qa_s7": (
        "shared_doc_qa",
        7,
        dict(
            num_documents=40,
            doc_len=300,
            question_len=20,
            zipf_a=1.0,
            num_requests=1500,
            output_len=24,
            output_dist="exponential",
            vocab_size=32000,
        ),
    ),
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


def export(name: str, out_dir: Path, *, arrivals: bool = False) -> Path:
    """Write trace `name` as `<name>.jsonl.gz` (or `<name>.arrivals.jsonl.gz` with each
    request's `arrival` in seconds, for timed goldens) and its generator call as `.meta.json`."""
    workload, seed, knobs = TRACES[name]
    w = make_workload(workload, seed, **knobs)
    path = out_dir / f"{name}{'.arrivals' if arrivals else ''}.jsonl.gz"
    with gzip.GzipFile(path, "wb", compresslevel=9, mtime=0) as raw:
        for spec in w.requests:
            assert spec.n == 1 and spec.beam_width == 1 and spec.prefix_id is None
            assert spec.extra.cache_salt is None and spec.extra.lora_id is None
            obj = {"id": spec.request_id, "prompt": spec.prompt.tolist(), "output_len": int(spec.output_len)}
            if arrivals:
                obj["arrival"] = float(spec.arrival)
            raw.write((json.dumps(obj, separators=(",", ":")) + "\n").encode())
    meta = {"workload": workload, "seed": seed, "knobs": knobs, "requests": len(w.requests)}
    if arrivals:
        meta["arrivals"] = True
    (out_dir / f"{name}.meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return path


def main() -> int:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "tests/fixtures/sglang_0_5_23")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TRACES:
        p = export(name, out_dir)
        print(f"{p} {p.stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
