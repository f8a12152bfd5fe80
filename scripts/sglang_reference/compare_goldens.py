"""Compare two golden files config by config (per-request hits and evictions).

    python scripts/sglang_reference/compare_goldens.py A.json.gz B.json.gz

Exit status 1 if any shared config differs. Used to cross-check the RadixCache goldens
against UnifiedRadixCache runs (run_sglang.py --cache unified:python|unified:rust).
"""

from __future__ import annotations

import gzip
import json
import sys


def load(path: str) -> dict:
    with gzip.open(path, "rt") as fh:
        doc = json.load(fh)
    return {(c["policy"], c["page_size"], c["concurrency"], c["capacity_tokens"]): c for c in doc["configs"]}


def main() -> int:
    a, b = load(sys.argv[1]), load(sys.argv[2])
    bad = 0
    for key in sorted(set(a) & set(b)):
        ca, cb = a[key], b[key]
        diffs = [
            f
            for f in ("per_request_hits", "evicted_tokens_after_request", "evicted_tokens", "total_hit_tokens")
            if ca[f] != cb[f]
        ]
        if diffs:
            bad += 1
            first = next(
                (
                    i
                    for i, (x, y) in enumerate(zip(ca["per_request_hits"], cb["per_request_hits"], strict=False))
                    if x != y
                ),
                None,
            )
            print(f"{key}: DIFFER in {diffs}; first differing request {first}")
        else:
            print(f"{key}: identical (hits {ca['total_hit_tokens']:,}, evicted {ca['evicted_tokens']:,})")
    only = sorted(set(a) ^ set(b))
    if only:
        print(f"configs in only one file: {only}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
