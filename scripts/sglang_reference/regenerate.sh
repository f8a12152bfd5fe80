#!/usr/bin/env bash
# Regenerate every fixture in tests/fixtures/sglang_0_5_23 (about 30 minutes on one core).
# Needs the side venv (setup_venv.sh) for SGLang and the project's .venv for the generators.
set -euo pipefail
cd "$(dirname "$0")/../.."
SG=${SGLANG_PY:-/work/sglang-venv/bin/python}
PY=${PROJECT_PY:-.venv/bin/python}
OUT=tests/fixtures/sglang_0_5_23
RUN="$SG scripts/sglang_reference/run_sglang.py"

# the synthetic traces, exported once as token-id JSONL (the fixture is the file, not the seed)
if [[ "${1:-}" == "--export-traces" ]]; then
  $PY scripts/sglang_reference/make_synthetic_traces.py "$OUT"
fi

$RUN --trace mooncake:experiments/data/mooncake_conversation_2000.jsonl --capacity 200000 \
     --out $OUT/mooncake_conversation_2000.cap200000.golden.json.gz
$RUN --trace jsonl:$OUT/shared_doc_qa_s7.jsonl.gz --capacity 8192 \
     --trace-meta "$(cat $OUT/shared_doc_qa_s7.meta.json)" \
     --out $OUT/shared_doc_qa_s7.cap8192.golden.json.gz
$RUN --trace jsonl:$OUT/multi_turn_chat_s11.jsonl.gz --capacity 16384 \
     --trace-meta "$(cat $OUT/multi_turn_chat_s11.meta.json)" \
     --out $OUT/multi_turn_chat_s11.cap16384.golden.json.gz
# stress: in-flight requests crowd the pool (admission/decode finishes), and at 512 tokens
# some prompts cannot fit at all (hit -1) and some decodes not even alone (truncated)
$RUN --trace jsonl:$OUT/shared_doc_qa_s7.jsonl.gz --capacity 1024 \
     --trace-meta "$(cat $OUT/shared_doc_qa_s7.meta.json)" \
     --out $OUT/shared_doc_qa_s7.cap1024.golden.json.gz
$RUN --trace jsonl:$OUT/multi_turn_chat_s11.jsonl.gz --capacity 512 \
     --trace-meta "$(cat $OUT/multi_turn_chat_s11.meta.json)" \
     --out $OUT/multi_turn_chat_s11.cap512.golden.json.gz
