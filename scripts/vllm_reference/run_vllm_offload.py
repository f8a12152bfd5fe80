"""Ground truth for apc's host tier: vLLM 0.33's CPU KV offloading under the replay protocol.

Runs vLLM 0.33.0's own V1 `Scheduler` (vllm/v1/core/sched/scheduler.py) with its real
`KVCacheManager` / `BlockPool` (prefix caching on) and a real `OffloadingConnector` in the
scheduler role (distributed/kv_transfer/kv_connector/v1/offloading_connector.py ->
offloading/scheduler.py `OffloadingConnectorScheduler` -> v1/kv_offload/cpu/spec.py
`CPUOffloadingSpec` -> cpu/manager.py `CPUOffloadingManager` with the `lru` or `arc` policy),
unmodified, on CPU. It does NOT import this project's backends or engine (only
`experiments.workloads.mooncake.load_mooncake`, through run_vllm.py's `load_trace`, to expand
the trace exactly as the project does). Its output is what tests/test_apc_offload_fidelity.py
compares apc's host tier with, per request.

The replay protocol (docs/design.md §6) in vLLM terms
----------------------------------------------
One request at a time, in trace order: `Scheduler.add_request`, then engine steps
(`schedule` -> fake model runner -> `update_from_output`, as `EngineCore.step`) until
`scheduler.has_requests()` is False, i.e. the request finished *and* the step that flushes
its `finished_req_ids` ran (the connector's final store offer and `on_request_finished`), as
the real engine does when nothing else is queued. The token budget (10**7) lets a prompt
prefill in one step, as the replay admits a whole prompt at once.

What is stubbed (nothing in the scheduler, KV cache manager, block pool, connector
scheduler, offloading manager or policies)
---------------------------------------------------------------------------------------
- `VllmConfig`, model config, structured-output manager: as run_vllm.py (its `make_vllm_config`
  pieces are copied here, plus `kv_transfer_config` = real `KVTransferConfig(kv_connector=
  "OffloadingConnector", kv_role="kv_both", kv_connector_extra_config={"cpu_bytes_to_use": B,
  "eviction_policy": lru|arc, "block_size": host block})`), and the model config gets the
  `model`/`dtype` names `build_offloading_config` reads.
- KV cache: one full-attention group, `FullAttentionSpec(block_size=16, num_kv_heads=1,
  head_size=1, float32)` = 128 bytes per block; `cpu_bytes_to_use` = host chunks x the chunk's
  bytes rounded up to `SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT` (mmap.PAGESIZE), so that
  `CPUOffloadingSpec` computes exactly the wanted number of host chunks (checked).
- The worker side (no GPU): the fake model runner reports every load and store job of a
  step as completed in that step's `KVConnectorOutput` (`kv_connector_worker_meta =
  OffloadingWorkerMetadata(completed_jobs={job: 1})`, `finished_recving` = the requests whose
  load completed), i.e. instantaneous transfers; that is what `OffloadingConnectorWorker`
  reports once its copies finish (offloading/worker.py: `get_finished`,
  `build_connector_worker_meta`).
- Observation only (decisions unchanged): the connector's `get_num_new_matched_tokens`,
  `update_state_after_alloc` and the manager's `prepare_store` are wrapped to record each
  request's GPU hit, loaded tokens, chunks stored and chunks evicted.

Records (per request, trace order): gpu (the block-aligned local hit the connector was given),
loaded (tokens the connector loaded: `num_external_tokens` of `update_state_after_alloc`),
hit (`num_computed_tokens` when first scheduled to compute: every prompt token not
recomputed), stored / evicted (host chunks stored / evicted while it ran).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from dataclasses import MISSING, fields
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run_vllm import OUT_BASE, REPO, Clock, load_trace, sha256_file  # noqa: E402

BYTES_PER_BLOCK_TOKEN = 2 * 1 * 1 * 4  # K and V, 1 head of size 1, float32


def make_scheduler(
    capacity_tokens: int, block_size: int, host_tokens: int, host_block: int, policy: str, prompt_only: bool = True
):
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ObservabilityConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    max_model_len = 10**7
    budget = 10**7
    vc = object.__new__(VllmConfig)
    for f in fields(VllmConfig):
        if f.default is not MISSING:
            v = f.default
        elif f.default_factory is not MISSING:
            v = f.default_factory()
        else:
            v = None
        if type(v).__name__ == "FieldInfo":
            try:
                v = v.default_factory() if v.default_factory is not None else v.default
            except Exception:
                v = None
        object.__setattr__(vc, f.name, v)
    sc = SchedulerConfig(
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=budget,
        max_num_seqs=256,
        enable_chunked_prefill=True,
        async_scheduling=False,
    )
    num_blocks = capacity_tokens // block_size + 1  # + BlockPool's null block
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cc.num_gpu_blocks = num_blocks
    mc = SimpleNamespace(
        max_model_len=max_model_len,
        uses_mrope=False,
        is_encoder_decoder=False,
        runner_type="generate",
        is_diffusion=False,
        supports_multimodal_inputs=False,
        return_sampling_mask=False,
        multimodal_config=None,
        is_hybrid=False,
        is_multimodal_model=False,
        model="fake",
        served_model_name="fake",
        dtype=torch.float32,
        use_mla=False,
        get_total_num_kv_heads=lambda: 1,
    )
    blocks_per_chunk = host_block // block_size
    chunk_bytes = block_size * BYTES_PER_BLOCK_TOKEN * blocks_per_chunk
    align = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    aligned = -(-chunk_bytes // align) * align
    want_chunks = host_tokens // host_block
    ktc = KVTransferConfig(
        kv_connector="OffloadingConnector",
        kv_role="kv_both",
        engine_id="reference",
        kv_connector_extra_config={
            "cpu_bytes_to_use": want_chunks * aligned,
            "eviction_policy": policy,
            "block_size": host_block,
            "offload_prompt_only": prompt_only,
        },
    )
    for name, v in (
        ("scheduler_config", sc),
        ("cache_config", cc),
        ("parallel_config", ParallelConfig()),
        ("observability_config", ObservabilityConfig()),
        ("model_config", mc),
        ("kv_transfer_config", ktc),
    ):
        object.__setattr__(vc, name, v)
    kv = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32),
            )
        ],
    )
    som = SimpleNamespace(
        should_advance=lambda *a, **k: False,
        grammar_init=lambda *a, **k: None,
        clear_backend=lambda *a, **k: None,
        accept_tokens=lambda request, new_token_ids: True,
        validate_tokens=lambda request, spec_tokens: spec_tokens,
        grammar_bitmask=lambda *a, **k: None,
    )
    sched = Scheduler(
        vllm_config=vc, kv_cache_config=kv, structured_output_manager=som, block_size=block_size, log_stats=False
    )
    manager = sched.connector.scheduler.manager
    assert manager._num_chunks == want_chunks, (manager._num_chunks, want_chunks)
    return sched, num_blocks


def run(reqs, capacity, host_tokens, host_block, policy, block_size=16, progress=False, prompt_only=True):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    sched, num_blocks = make_scheduler(capacity, block_size, host_tokens, host_block, policy, prompt_only)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    cs = sched.connector.scheduler
    manager = cs.manager
    rec: list[dict] = []
    current: dict = {}

    # -- observation wrappers (they record; every decision is vLLM's own) --
    orig_match, orig_alloc, orig_store = (
        cs.get_num_new_matched_tokens,
        cs.update_state_after_alloc,
        manager.prepare_store,
    )

    def get_num_new_matched_tokens(request, num_computed_tokens, max_num_new_tokens=None):
        ext, is_async = orig_match(request, num_computed_tokens, max_num_new_tokens)
        current["gpu"] = num_computed_tokens
        return ext, is_async

    def update_state_after_alloc(request, blocks, num_external_tokens):
        current["loaded"] += num_external_tokens  # (called again with 0 once the loaded request is scheduled)
        return orig_alloc(request, blocks, num_external_tokens)

    def prepare_store(keys, req_context):
        out = orig_store(keys, req_context)
        if out is not None:
            current["stored"] += len(out.keys_to_store)
            current["evicted"] += len(out.evicted_keys)
        else:
            current["failed"] += 1
        return out

    cs.get_num_new_matched_tokens = get_num_new_matched_tokens
    cs.update_state_after_alloc = update_state_after_alloc
    manager.prepare_store = prepare_store

    counter = 0
    steps = 0
    t0 = last = time.time()
    for i, (prompt, out_len, _arrival) in enumerate(reqs):
        current.clear()
        current.update(gpu=None, loaded=0, hit=None, stored=0, evicted=0, failed=0)
        r = Request(str(i), prompt, SamplingParams(max_tokens=out_len, ignore_eos=True), None, block_hasher=hasher)
        sched.add_request(r)
        while sched.has_requests():
            so = sched.schedule(False)
            steps += 1
            for nr in so.scheduled_new_reqs:
                if current["hit"] is None:
                    current["hit"] = nr.num_computed_tokens
            meta = so.kv_connector_metadata
            jobs = {**meta.load_jobs, **meta.store_jobs} if meta is not None else {}
            recv = {job.req_id for jid, job in meta.load_jobs.items()} if meta is not None else set()
            req_ids, sampled = [], []
            for rid in so.num_scheduled_tokens:
                req = sched.requests[rid]
                req_ids.append(rid)
                if not req.is_prefill_chunk:
                    sampled.append([OUT_BASE + counter])
                    counter += 1
                else:
                    sampled.append([])
            kvo = KVConnectorOutput(
                finished_recving=recv or None,
                kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs={j: 1 for j in jobs})
                if jobs
                else None,
            )
            out = ModelRunnerOutput(
                req_ids=req_ids,
                req_id_to_index={x: k for k, x in enumerate(req_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kvo,
            )
            sched.update_from_output(so, out)
        assert r.is_finished(), i
        rec.append(dict(current))
        if progress and time.time() - last > 10:
            last = time.time()
            print(f"  request {i + 1}/{len(reqs)}", file=sys.stderr)
    totals = dict(
        requests=len(reqs),
        gpu_hit_tokens=sum(x["gpu"] for x in rec),
        host_loaded_tokens=sum(x["loaded"] for x in rec),
        hit_tokens=sum(x["hit"] for x in rec),
        stored_chunks=sum(x["stored"] for x in rec),
        evicted_chunks=sum(x["evicted"] for x in rec),
        failed_stores=sum(x["failed"] for x in rec),
        host_chunks_end=manager._num_allocated_chunks - len(manager._free_list),
        steps=steps,
        runtime_s=round(time.time() - t0, 1),
    )
    return rec, totals, num_blocks, manager._num_chunks


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, help="mooncake:PATH or jsonl:PATH[.gz]")
    ap.add_argument("--name", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--capacity", type=int, required=True, help="GPU KV capacity in tokens (usable blocks * 16)")
    ap.add_argument("--host", type=int, required=True, help="host tier capacity in tokens")
    ap.add_argument(
        "--host-block", type=int, default=16, help="offloaded block size in tokens (extra config block_size)"
    )
    ap.add_argument("--policy", choices=("lru", "arc"), default="lru")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--all-tokens",
        action="store_true",
        help="offload_prompt_only=False: offload decode blocks too (vLLM default: prompt only)",
    )
    ap.add_argument(
        "--source",
        default=None,
        help="the trace a jsonl:PATH was exported from (recorded with its sha256; regenerate_offload.sh "
        "exports the Mooncake trace with the project's .venv, whose hashing needs xxhash, which this venv lacks)",
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", action="store_true")
    a = ap.parse_args()
    import vllm

    kind, path, reqs = load_trace(a.trace, a.limit, Clock("float"))
    rec, totals, num_blocks, host_chunks = run(
        reqs, a.capacity, a.host, a.host_block, a.policy, a.block_size, a.progress, not a.all_tokens
    )
    rt = totals.pop("runtime_s")
    source = Path(a.source) if a.source else path
    if not source.is_absolute():
        source = REPO / source
    try:
        rel = str(source.relative_to(REPO))
    except ValueError:
        rel = str(source)
    golden = dict(
        vllm_version=vllm.__version__,
        generator="scripts/vllm_reference/run_vllm_offload.py",
        command="run_vllm_offload.py " + " ".join(x for x in sys.argv[1:] if not x.startswith("jsonl:/")),
        trace=dict(
            name=a.name or path.name.split(".")[0],
            kind=kind,
            path=rel,
            sha256=sha256_file(source),
            exported_as_jsonl=a.source is not None,
            requests=len(reqs),
            limit=a.limit,
        ),
        config=dict(
            capacity_tokens=a.capacity,
            block_size=a.block_size,
            num_gpu_blocks=num_blocks,
            usable_blocks=num_blocks - 1,
            host_tokens=a.host,
            host_block_size=a.host_block,
            host_chunks=host_chunks,
            eviction_policy=a.policy,
            offload_prompt_only=not a.all_tokens,
            protocol="replay (one request at a time, whole prompt in one step, instantaneous transfers)",
        ),
        totals=totals,
        # per request: [gpu, loaded, hit, stored, evicted, failed]
        requests=[[x["gpu"], x["loaded"], x["hit"], x["stored"], x["evicted"], x["failed"]] for x in rec],
    )
    with gzip.GzipFile(a.out, "wb", compresslevel=9, mtime=0) as f:  # byte-reproducible
        f.write(json.dumps(golden, separators=(",", ":")).encode())
    print(json.dumps(dict(out=a.out, runtime_s=rt, **totals)))


if __name__ == "__main__":
    main()
