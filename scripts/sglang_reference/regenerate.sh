#!/usr/bin/env bash
# Regenerate every fixture in tests/fixtures/sglang_0_5_23 (about 60 minutes on one core).
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

# HiCache goldens (--hicache: UnifiedRadixCache + a host tier; every write policy at page
# sizes 1 and 16). The conversation slice is exported with the project's venv first (the
# side venv lacks the hash package the Mooncake loader imports). Page-16 Mooncake configs
# take ~7 min each on one core.
TMP=$(mktemp -d)
$PY scripts/sglang_reference/export_mooncake.py experiments/data/mooncake_conversation_2000.jsonl 1000 "$TMP/mooncake1000.jsonl"
META='{"path": "experiments/data/mooncake_conversation_2000.jsonl", "kind": "mooncake", "expanded_by": "experiments.workloads.mooncake.load_mooncake(path, 1000), exported as token-id JSONL (sha256 fields are of that export)"}'
for ps in 16 1; do
  $RUN --trace jsonl:"$TMP/mooncake1000.jsonl" --name mooncake_conversation_2000_first1000 --trace-meta "$META" \
       --capacity 200000 --host-capacity 2000000 --hicache --policies lru --concurrency 1 --page-sizes $ps \
       --out $OUT/mooncake_conversation_1000.cap200000.host2000000.ps$ps.hicache-golden.json.gz
done
$RUN --trace jsonl:$OUT/shared_doc_qa_s7.jsonl.gz --capacity 1024 --host-capacity 4096 --hicache \
     --policies lru --concurrency 1 --trace-meta "$(cat $OUT/shared_doc_qa_s7.meta.json)" \
     --out $OUT/shared_doc_qa_s7.cap1024.host4096.hicache-golden.json.gz
$RUN --trace jsonl:$OUT/multi_turn_chat_s11.jsonl.gz --capacity 2048 --host-capacity 8192 --hicache \
     --policies lru --concurrency 1 --trace-meta "$(cat $OUT/multi_turn_chat_s11.meta.json)" \
     --out $OUT/multi_turn_chat_s11.cap2048.host8192.hicache-golden.json.gz
# stress: a host as small as the GPU (write_back drops what it cannot take), concurrency 1 and 4
$RUN --trace jsonl:$OUT/shared_doc_qa_s7.jsonl.gz --capacity 1024 --host-capacity 1024 --hicache \
     --policies lru --concurrency 1,4 --trace-meta "$(cat $OUT/shared_doc_qa_s7.meta.json)" \
     --out $OUT/shared_doc_qa_s7.cap1024.host1024.hicache-golden.json.gz
# the other eviction policies (one order for both tiers)
$RUN --trace jsonl:$OUT/multi_turn_chat_s11.jsonl.gz --capacity 2048 --host-capacity 8192 --hicache \
     --policies lfu,fifo,mru,filo --concurrency 1 --trace-meta "$(cat $OUT/multi_turn_chat_s11.meta.json)" \
     --out $OUT/multi_turn_chat_s11.cap2048.host8192.policies.hicache-golden.json.gz
# HiCache with the file storage backend under the host (--storage: a real HiCacheFile with
# its LRU evictor capped at --storage-capacity tokens; every write policy)
$RUN --trace jsonl:$OUT/multi_turn_chat_s11.jsonl.gz --capacity 2048 --host-capacity 2048 --hicache --storage \
     --storage-capacity 8192 --prefetch-threshold 64 --policies lru --concurrency 1 \
     --trace-meta "$(cat $OUT/multi_turn_chat_s11.meta.json)" \
     --out $OUT/multi_turn_chat_s11.cap2048.host2048.file8192.hicache-storage-golden.json.gz
$RUN --trace jsonl:$OUT/shared_doc_qa_s7.jsonl.gz --capacity 1024 --host-capacity 1024 --hicache --storage \
     --storage-capacity 4096 --prefetch-threshold 64 --policies lru --concurrency 1 \
     --trace-meta "$(cat $OUT/shared_doc_qa_s7.meta.json)" \
     --out $OUT/shared_doc_qa_s7.cap1024.host1024.file4096.hicache-storage-golden.json.gz
$RUN --trace jsonl:"$TMP/mooncake1000.jsonl" --name mooncake_conversation_2000_first1000 --trace-meta "$META" \
     --capacity 200000 --host-capacity 2000000 --hicache --storage --storage-capacity 16000000 \
     --policies lru --concurrency 1 --page-sizes 16 \
     --out $OUT/mooncake_conversation_1000.cap200000.host2000000.file16000000.ps16.hicache-storage-golden.json.gz
rm -r "$TMP"
