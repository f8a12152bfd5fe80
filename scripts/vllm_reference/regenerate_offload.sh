#!/usr/bin/env bash
# Regenerate the host-tier goldens in tests/fixtures/vllm_0_33/offload/ (*.offload.golden.json.gz):
# vLLM 0.33's OffloadingConnector + CPUOffloadingManager under the replay protocol
# (scripts/vllm_reference/run_vllm_offload.py). The two Mooncake ones take ~8-9 min each on
# one core, the synthetic ones ~20 s each.
# Usage: scripts/vllm_reference/regenerate_offload.sh [--synthetic-only]   (VLLM_VENV=/work/vllm-venv)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${VLLM_VENV:-/work/vllm-venv}/bin/python
PROJECT_PY=${PROJECT_PY:-.venv/bin/python}
F=tests/fixtures/vllm_0_33/offload
S0=tests/fixtures/vllm_0_33/multi_turn_chat_s11.arrivals.jsonl.gz
R=scripts/vllm_reference/run_vllm_offload.py
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
# the synthetic multi-turn trace: small GPU (2048 tokens) and host tiers, so both evict all the time
zcat $S0 > "$TMP/mtc.jsonl"
S="jsonl:$TMP/mtc.jsonl --source $S0 --name multi_turn_chat_s11 --capacity 2048"
for p in lru arc; do
    for hb in 16 64; do
        $PY $R --trace $S --host 8192 --host-block $hb --policy $p \
            --out $F/multi_turn_chat_s11.cap2048.host8192.b$hb.$p.offload.golden.json.gz
    done
    # a host tier smaller than many prompts: refused stores
    $PY $R --trace $S --host 256 --policy $p --out $F/multi_turn_chat_s11.cap2048.host256.b16.$p.offload.golden.json.gz
    # offload_prompt_only=False: decode blocks are offered one step at a time
    $PY $R --trace $S --host 8192 --policy $p --all-tokens \
        --out $F/multi_turn_chat_s11.cap2048.host8192.b16.$p.alltokens.offload.golden.json.gz
done
[[ "${1:-}" == "--synthetic-only" ]] && exit 0
# the issue's configuration: first 1000 conversation requests, GPU 200k tokens, host 2M, page 16
M=experiments/data/mooncake_conversation_2000.jsonl
$PROJECT_PY - "$M" "$TMP/mc1000.jsonl" <<'PYEOF'
import json, sys
from experiments.workloads.mooncake import load_mooncake
with open(sys.argv[2], "w") as f:
    for s in load_mooncake(sys.argv[1], 1000):
        f.write(json.dumps(dict(prompt=[int(x) for x in s.prompt], output_len=int(s.output_len), arrival=float(s.arrival))) + "\n")
PYEOF
for p in lru arc; do
    $PY $R --trace jsonl:$TMP/mc1000.jsonl --source $M --name mooncake_conversation_2000 --limit 1000 \
        --capacity 200000 --host 2000000 --policy $p \
        --out $F/mooncake_conversation_2000.first1000.cap200000.host2000000.b16.$p.offload.golden.json.gz
done
