"""Ground truth from the real vLLM 0.33 V1 scheduler, driven on CPU with a fake model runner.

Runs vLLM 0.33.0's own `Scheduler` / `AsyncScheduler` (vllm/v1/core/sched/scheduler.py,
async_scheduler.py) with its real `KVCacheManager` -> `KVCacheCoordinator` ->
`FullAttentionManager` -> `BlockPool` (prefix caching, LRU free-block queue) and real
`vllm.v1.request.Request` objects, unmodified, and records each request's scheduling
decisions. It does NOT import this project's backends or engine: its output is the
reference the project's `vllm` scheduler policy (issue 11) is tested against
(tests/fixtures/vllm_0_33/).

Side venv (outside the repo; CPU torch only)
--------------------------------------------
`scripts/vllm_reference/setup_venv.sh /work/vllm-venv`: torch==2.13.0 (+cpu) first, then
`pip install --no-deps vllm==0.33.0` and its pure-python import chain one package at a time
(`venv-freeze.txt` is the venv the goldens were made with).

What is stubbed (nothing in the scheduler / KV cache manager / block pool / request code)
------------------------------------------------------------------------------------------
- `VllmConfig`: its `__post_init__` cannot run on CPU (config/device.py: "Failed to infer
  device type") and needs a real HF model. The harness makes it with
  `object.__new__(VllmConfig)` and sets every dataclass field to its default, then real
  `SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, enable_chunked_prefill=True,
  async_scheduling=...)`, real `CacheConfig(block_size=16, enable_prefix_caching=True)`,
  real `ParallelConfig()` / `ObservabilityConfig()`. Its properties (`max_concurrent_batches`,
  `num_lookahead_tokens`, ...) are vLLM's own code.
- `model_config`: a `SimpleNamespace` with the attributes the scheduler reads
  (`max_model_len` 10**7, `uses_mrope` False, `is_encoder_decoder` False, `runner_type`
  "generate", `is_diffusion` False, `supports_multimodal_inputs` False,
  `return_sampling_mask` False, `multimodal_config` None, ...).
- The model executor: a fake runner (below). No worker, no engine process, no ZMQ; the engine
  loop of vllm/v1/engine/core.py (`EngineCore.step`, `EngineCore.step_with_batch_queue`) is
  re-enacted call for call around a simulated clock.
- `StructuredOutputManager`: a `SimpleNamespace` stub whose `accept_tokens` returns True and
  `validate_tokens` returns its tokens, which is what the real manager
  (vllm/v1/structured_output/__init__.py) does for a request without structured output
  ("if not request.use_structured_output ...: return True"). No request uses one.
- KV cache: `KVCacheConfig(num_blocks=N, kv_cache_tensors=[], kv_cache_groups=[one group,
  FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1, dtype=float32)])`.
  N = capacity/16 + 1: `BlockPool.__init__` takes block 0 out of the free queue as the
  `null_block` ("self.null_block = self.free_block_queue.popleft()"), so N-1 = capacity/16
  blocks are usable, which is the project's apc capacity (no reserved block).

Requests
--------
`Request(str(i), prompt, SamplingParams(max_tokens=output_len, ignore_eos=True),
None, arrival_time=arrival_s, block_hasher=get_request_block_hasher(16, sha256))`
(`init_none_hash(sha256)` first), `Scheduler.add_request`. Output ids are fresh:
2_000_000_000 + a global counter, so they never match a prompt token.

Fake model runner (`execute_model`)
-----------------------------------
Called right after `schedule()`: for every scheduled request, one sampled token iff
`not request.is_prefill_chunk` (set by `Scheduler._update_after_schedule`:
`num_computed_tokens < num_tokens + num_output_placeholders`), i.e. the chunk reaches the end
of the request's known tokens; else an empty list (like the GPU runner discarding partial-
prefill samples). Returned as `ModelRunnerOutput(req_ids, req_id_to_index, sampled_token_ids)`.

Engine loop -> vLLM calls (STEP = 20 ms; clock arithmetic: see `Clock`, --clock float|exact)
---------------------------------------------------------
Synchronous (`EngineCore.step`, core.py):
  1. add every request with arrival <= clock (arrival order, ties in trace order) via
     `Scheduler.add_request` (= `_process_input_queue` before each step in the busy loop);
  2. if not `scheduler.has_requests()`: clock = next arrival, go to 1 (idle engine);
  3. `so = scheduler.schedule(False)`; the batch runs from start = max(clock, gpu_free) for
     STEP if `so.total_num_scheduled_tokens > 0` else 0; clock = gpu_free = end;
  4. `scheduler.update_from_output(so, fake_output)`.
Async (`EngineCore.step_with_batch_queue`, batch_queue_size = `max_concurrent_batches` = 2):
  1. add arrivals <= clock; if nothing to schedule and the queue is empty, jump to the next
     arrival;
  2. if `has_requests()`: `so = schedule(False)`, execute (batch end = max(clock, gpu_free) +
     STEP, or max(clock, gpu_free) for an empty batch; gpu_free = end for a non-empty one),
     `batch_queue.appendleft(...)`; if len(queue) < 2 and (executed or has_requests()):
     return (no blocking);
  3. else if the queue is empty: return;
  4. pop the oldest batch, clock = max(clock, its end) (blocking on its future),
     `update_from_output(so, output)`.

Records (per request, trace order)
----------------------------------
hit_tokens_first: `NewRequestData.num_computed_tokens` the first time the request appears in
`so.scheduled_new_reqs` (prefix-cache hit at first admission); preemptions:
`request.num_preemptions`; first_token_step / finish_step: 0-based index, among non-empty
batches (model executions), of the batch whose sampled token was the request's first / last;
arrival_ms, first_token_ms (end of that batch), ttft_ms, finish_ms. Totals: steps = number of
non-empty batches; also schedule_calls, empty_batches.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
from collections import deque
from dataclasses import MISSING, fields
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
STEP_MS = 20


class Clock:
    """Time arithmetic. "float" (default, the goldens): seconds as Python floats, arrival =
    trace seconds (Mooncake: timestamp_ms / 1000.0), a batch ends at max(clock, gpu_free) + 0.02,
    exactly the expression a float-seconds engine computes; ties arrival == clock are then decided
    by float rounding, as in that engine. "exact": integer microseconds (arrivals rounded to
    the microsecond), so every tie is a tie."""

    def __init__(self, mode: str):
        self.mode = mode
        self.step = STEP_MS * 1000 if mode == "exact" else STEP_MS / 1000
        self.zero = 0 if mode == "exact" else 0.0

    def arrival(self, seconds):
        return int(round(float(seconds) * 1_000_000)) if self.mode == "exact" else float(seconds)

    def seconds(self, t) -> float:
        return t / 1e6 if self.mode == "exact" else t

    def ms(self, t) -> float:
        return t / 1000 if self.mode == "exact" else t * 1000.0


OUT_BASE = 2_000_000_000


def load_trace(spec: str, limit: int | None, clk: Clock):
    """mooncake:PATH (project's load_mooncake) or jsonl:PATH[.gz] (id, prompt, output_len, arrival)."""
    kind, path = spec.split(":", 1)
    p = Path(path)
    if not p.is_absolute():
        p = REPO / p
    if kind == "mooncake":
        sys.path.insert(0, str(REPO))
        from experiments.workloads.mooncake import load_mooncake

        specs = load_mooncake(str(p))
        reqs = [(list(s.prompt), int(s.output_len), clk.arrival(s.arrival)) for s in specs]
    elif kind == "jsonl":
        op = gzip.open if p.suffix == ".gz" else open
        reqs = []
        with op(p, "rt") as f:
            for line in f:
                if line.strip():
                    o = json.loads(line)
                    reqs.append((list(o["prompt"]), int(o["output_len"]), clk.arrival(o.get("arrival", 0.0))))
    else:
        raise SystemExit(f"unknown trace kind {kind}")
    if limit is not None:
        reqs = reqs[:limit]
    return kind, p, reqs


def make_scheduler(capacity_tokens: int, block_size: int, budget: int, max_seqs: int, async_sched: bool):
    import torch
    from vllm.config import CacheConfig, ObservabilityConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    max_model_len = 10**7
    vc = object.__new__(VllmConfig)
    for f in fields(VllmConfig):
        if f.default is not MISSING:
            v = f.default
        elif f.default_factory is not MISSING:
            v = f.default_factory()
        else:
            v = None
        if type(v).__name__ == "FieldInfo":
            try:  # pydantic Field(default_factory=...); DeviceConfig() cannot infer a device: None
                v = v.default_factory() if v.default_factory is not None else v.default
            except Exception:
                v = None
        object.__setattr__(vc, f.name, v)
    sc = SchedulerConfig(
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=True,
        async_scheduling=async_sched,
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
    )
    for name, v in (
        ("scheduler_config", sc),
        ("cache_config", cc),
        ("parallel_config", ParallelConfig()),
        ("observability_config", ObservabilityConfig()),
        ("model_config", mc),
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
        # StructuredOutputManager's own answers for a request without structured output:
        accept_tokens=lambda request, new_token_ids: True,
        validate_tokens=lambda request, spec_tokens: spec_tokens,
        grammar_bitmask=lambda *a, **k: None,
    )
    cls = AsyncScheduler if async_sched else Scheduler
    sched = cls(
        vllm_config=vc, kv_cache_config=kv, structured_output_manager=som, block_size=block_size, log_stats=False
    )
    return sched, vc, num_blocks


def run(reqs, capacity, block_size=16, budget=8192, max_seqs=256, async_sched=False, progress=False, clk=None):
    clk = clk or Clock("float")
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    sched, vc, num_blocks = make_scheduler(capacity, block_size, budget, max_seqs, async_sched)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)
    n = len(reqs)
    order = sorted(range(n), key=lambda i: (reqs[i][2], i))
    objs: list = [None] * n
    rec = [
        dict(
            request_index=i,
            arrival_ms=clk.ms(reqs[i][2]),
            prompt_tokens=len(reqs[i][0]),
            output_tokens=reqs[i][1],
            hit_tokens_first=None,
            preemptions=0,
            first_token_step=None,
            finish_step=None,
            first_token_ms=None,
            ttft_ms=None,
            finish_ms=None,
            outputs_seen=0,
        )
        for i in range(n)
    ]
    counter = [0]
    state = dict(clock=clk.zero, gpu_free=clk.zero, steps=0, calls=0, empty=0, nxt=0)

    def add_arrivals():
        while state["nxt"] < n and reqs[order[state["nxt"]]][2] <= state["clock"]:
            i = order[state["nxt"]]
            p, out_len, arr = reqs[i]
            r = Request(
                str(i),
                p,
                SamplingParams(max_tokens=out_len, ignore_eos=True),
                None,
                arrival_time=clk.seconds(arr),
                block_hasher=hasher,
            )
            objs[i] = r
            sched.add_request(r)
            state["nxt"] += 1

    def execute(so):
        """schedule() has run; fake model runner + the batch's timing."""
        state["calls"] += 1
        for nr in so.scheduled_new_reqs:
            i = int(nr.req_id)
            if rec[i]["hit_tokens_first"] is None:
                rec[i]["hit_tokens_first"] = nr.num_computed_tokens
        start = max(state["clock"], state["gpu_free"])
        if so.total_num_scheduled_tokens > 0:
            step_idx = state["steps"]
            state["steps"] += 1
            end = start + clk.step
            state["gpu_free"] = end
        else:
            step_idx = None
            state["empty"] += 1
            end = start
        req_ids, sampled = [], []
        for rid in so.num_scheduled_tokens:
            r = sched.requests[rid]
            req_ids.append(rid)
            if not r.is_prefill_chunk:
                sampled.append([OUT_BASE + counter[0]])
                counter[0] += 1
            else:
                sampled.append([])
        out = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: k for k, r in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        return out, end, step_idx

    def update(so, out, end, step_idx):
        sched.update_from_output(so, out)
        for rid, toks in zip(out.req_ids, out.sampled_token_ids, strict=True):
            if not toks:
                continue
            i = int(rid)
            R = rec[i]
            R["outputs_seen"] += len(toks)
            if R["first_token_step"] is None:
                R["first_token_step"] = step_idx
                R["first_token_ms"] = clk.ms(end)
                R["ttft_ms"] = clk.ms(end - reqs[i][2])
            r = objs[i]
            if r.is_finished():
                R["finish_step"] = step_idx
                R["finish_ms"] = clk.ms(end)

    def done() -> bool:
        return state["nxt"] >= n and not sched.has_requests()

    t0 = time.time()
    last = t0
    if not async_sched:
        while not done():
            add_arrivals()
            if not sched.has_requests():
                state["clock"] = max(state["clock"], reqs[order[state["nxt"]]][2])
                continue
            so = sched.schedule(False)
            out, end, si = execute(so)
            state["clock"] = max(state["clock"], end)
            update(so, out, end, si)
            if progress and time.time() - last > 10:
                last = time.time()
                print(
                    f"  step {state['steps']} clock {clk.seconds(state['clock']):.1f}s added {state['nxt']}",
                    file=sys.stderr,
                )
    else:
        qsize = vc.max_concurrent_batches
        assert qsize == 2, qsize
        bq: deque = deque(maxlen=qsize)
        while not (done() and not bq):
            add_arrivals()
            if not sched.has_requests() and not bq:
                state["clock"] = max(state["clock"], reqs[order[state["nxt"]]][2])
                continue
            # --- EngineCore.step_with_batch_queue ---
            assert len(bq) < qsize
            if sched.has_requests():
                so = sched.schedule(False)
                out, end, si = execute(so)
                executed = so.total_num_scheduled_tokens > 0
                bq.appendleft((so, out, end, si))
                if len(bq) < qsize and (executed or sched.has_requests()):
                    continue
            elif not bq:
                continue
            so, out, end, si = bq.pop()
            state["clock"] = max(state["clock"], end)
            update(so, out, end, si)
            if progress and time.time() - last > 10:
                last = time.time()
                print(
                    f"  step {state['steps']} clock {clk.seconds(state['clock']):.1f}s added {state['nxt']}",
                    file=sys.stderr,
                )

    for i in range(n):
        R = rec[i]
        R["preemptions"] = objs[i].num_preemptions
        assert R["outputs_seen"] == reqs[i][1], (i, R["outputs_seen"], reqs[i][1])
        assert R["finish_step"] is not None
        del R["outputs_seen"]
        for k in ("arrival_ms", "first_token_ms", "ttft_ms", "finish_ms"):
            R[k] = round(R[k], 3)  # output only (float clock noise); decisions used the raw clock
    totals = dict(
        requests=n,
        hit_tokens_first=sum(r["hit_tokens_first"] for r in rec),
        preemptions=sum(r["preemptions"] for r in rec),
        preempted_requests=sum(1 for r in rec if r["preemptions"]),
        steps=state["steps"],
        schedule_calls=state["calls"],
        empty_batches=state["empty"],
        makespan_ms=max(r["finish_ms"] for r in rec),
        mean_ttft_ms=round(sum(r["ttft_ms"] for r in rec) / n, 3),
        runtime_s=round(time.time() - t0, 1),
    )
    return rec, totals, num_blocks


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", required=True, help="mooncake:PATH or jsonl:PATH[.gz]")
    ap.add_argument("--name", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--capacity", type=int, required=True, help="KV capacity in tokens (usable blocks * 16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--budget", type=int, default=8192)
    ap.add_argument("--max-seqs", type=int, default=256)
    ap.add_argument("--async-scheduling", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--clock", choices=("float", "exact"), default="float", help="see Clock")
    a = ap.parse_args()
    import vllm

    clk = Clock(a.clock)
    kind, path, reqs = load_trace(a.trace, a.limit, clk)
    rec, totals, num_blocks = run(
        reqs, a.capacity, a.block_size, a.budget, a.max_seqs, a.async_scheduling, a.progress, clk
    )
    rt = totals.pop("runtime_s")
    try:
        rel = str(path.relative_to(REPO))
    except ValueError:
        rel = str(path)
    golden = dict(
        vllm_version=vllm.__version__,
        generator="scripts/vllm_reference/run_vllm.py",
        command="run_vllm.py " + " ".join(sys.argv[1:]),
        trace=dict(
            name=a.name or path.name.split(".")[0],
            kind=kind,
            path=rel,
            sha256=sha256_file(path),
            requests=len(reqs),
            limit=a.limit,
            prompt_tokens=sum(len(r[0]) for r in reqs),
            output_tokens=sum(r[1] for r in reqs),
        ),
        config=dict(
            capacity_tokens=a.capacity,
            block_size=a.block_size,
            num_gpu_blocks=num_blocks,
            usable_blocks=num_blocks - 1,
            max_num_batched_tokens=a.budget,
            max_num_seqs=a.max_seqs,
            async_scheduling=a.async_scheduling,
            batch_queue_size=2 if a.async_scheduling else 1,
            enable_prefix_caching=True,
            enable_chunked_prefill=True,
            policy="fcfs",
            step_ms=STEP_MS,
            clock=a.clock,
            speculative_decoding=None,
            ignore_eos=True,
        ),
        totals=totals,
        requests=rec,
    )
    with gzip.GzipFile(a.out, "wb", compresslevel=9, mtime=0) as f:  # byte-reproducible
        f.write(json.dumps(golden, separators=(",", ":")).encode())
    print(json.dumps(dict(out=a.out, runtime_s=rt, **totals)))


if __name__ == "__main__":
    main()
