"""Export the first N requests of a Mooncake trace, expanded by the project's loader, as
token-id JSONL for `run_sglang.py --trace jsonl:...`.

Run with the project's venv: the side venv lacks the hash package the loader imports.

    .venv/bin/python scripts/sglang_reference/export_mooncake.py \\
        experiments/data/mooncake_conversation_2000.jsonl 1000 /tmp/mooncake1000.jsonl

The goldens made from it name the Mooncake file and the limit (`--trace-meta`); the test
loads the same requests with `load_mooncake(path, limit)`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from experiments.workloads.mooncake import load_mooncake  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, limit, out = Path(argv[0]), int(argv[1]), Path(argv[2])
    requests = load_mooncake(src, limit)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with tmp.open("w") as fh:
        for r in requests:
            fh.write(
                json.dumps({"id": r.request_id, "prompt": r.prompt.tolist(), "output_len": int(r.output_len)}) + "\n"
            )
    tmp.replace(out)
    print(f"wrote {out}: {len(requests)} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
