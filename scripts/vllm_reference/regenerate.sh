#!/usr/bin/env bash
# Regenerate every golden in tests/fixtures/vllm_0_33/ (about 2 min on two cores).
# Usage: scripts/vllm_reference/regenerate.sh [--export-traces]   (VLLM_VENV=/work/vllm-venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${VLLM_VENV:-/work/vllm-venv}/bin/python
F=tests/fixtures/vllm_0_33
R=scripts/vllm_reference/run_vllm.py
if [[ "${1:-}" == "--export-traces" ]]; then
    .venv/bin/python scripts/vllm_reference/make_synthetic_traces.py $F
fi
M=mooncake:experiments/data/mooncake_conversation_2000.jsonl
$PY $R --trace $M --name mooncake_conversation_2000 --limit 1000 --capacity 200000 \
    --out $F/mooncake_conversation_2000.first1000.cap200000.sync.golden.json.gz
$PY $R --trace $M --name mooncake_conversation_2000 --limit 1000 --capacity 1000000 \
    --out $F/mooncake_conversation_2000.first1000.cap1000000.sync.golden.json.gz
$PY $R --trace $M --name mooncake_conversation_2000 --limit 1000 --capacity 200000 --async-scheduling \
    --out $F/mooncake_conversation_2000.first1000.cap200000.async.golden.json.gz
S=jsonl:$F/multi_turn_chat_s11.arrivals.jsonl.gz
for c in 2048 4096; do
    $PY $R --trace $S --name multi_turn_chat_s11 --capacity $c \
        --out $F/multi_turn_chat_s11.cap$c.sync.golden.json.gz
done
$PY $R --trace $S --name multi_turn_chat_s11 --capacity 4096 --async-scheduling \
    --out $F/multi_turn_chat_s11.cap4096.async.golden.json.gz
