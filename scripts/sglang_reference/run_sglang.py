"""Ground truth from the real SGLang 0.5.23 radix cache, driven by this project's replay protocol.

This script runs SGLang's own `RadixCache`, `TokenToKVPoolAllocator` /
`PagedTokenToKVPoolAllocator`, `ReqToTokenPool`, `Req` and the scheduler's allocation and
caching helpers, unmodified, on CPU, and records per-request hit tokens and evicted tokens.
It does NOT import this project's backends: its output is the reference the `radix`
backend is tested against (tests/fixtures/sglang_0_5_23/).

Side venv (outside the repo; never a CUDA torch)
------------------------------------------------
    python3 -m venv /work/sglang-venv
    V=/work/sglang-venv/bin/pip
    $V install torch==2.13.0            # the CPU build (+cpu wheel; the local wheelhouse has it)
    $V install --no-deps sglang==0.5.23 numpy
    $V install --no-deps triton==3.9.0   # imported at module level by sglang.srt.utils; no kernel is launched
    $V install --no-deps orjson psutil pybase64 requests urllib3 idna certifi packaging pillow \
        starlette anyio msgspec pydantic pydantic_core typing_inspection annotated_types pyzmq \
        tqdm IPython traitlets pygments aiohttp multidict attrs yarl propcache aiohappyeyeballs \
        aiosignal frozenlist transformers==5.19.0 'huggingface_hub>=1.0' httpx2 httpcore2 \
        truststore h11 regex pyyaml 'safetensors>=0.8.0' tokenizers typer 'apache-tvm-ffi==0.1.11' \
        dill sentencepiece compressed_tensors loguru gguf openai==2.8.0 httpx sniffio distro \
        partial_json_parser
(`scripts/sglang_reference/setup_venv.sh` does exactly this.) Then

    /work/sglang-venv/bin/python scripts/sglang_reference/run_sglang.py \
        --trace mooncake:experiments/data/mooncake_conversation_2000.jsonl --capacity 200000 \
        --out tests/fixtures/sglang_0_5_23/mooncake_conversation_2000.json.gz

What is stubbed or patched (nothing in the cache / allocator / eviction code)
--------------------------------------------------------------------------------
- `torchvision` is replaced by an empty auto-attribute stub module (a `sys.meta_path`
  finder): the PyPI torchvision wheel is a CUDA build whose C ops do not load against a CPU
  torch, and only model/multimodal config modules that `sglang.srt.configs` imports at
  package level use it. Before the stub is installed, transformers' cached
  `is_torchvision_available()` is evaluated (False), so transformers never takes the stub for
  the real package.
- Clock: `sglang.srt.mem_cache.radix_cache.time` (that module's reference to the `time`
  module, used for `TreeNode.last_access_time`, `TreeNode.creation_time` and the access stamps
  in `_match_prefix_helper` / `_insert_helper`) is replaced by a namespace whose `monotonic()`
  returns a logical counter that increases by 1 on every call (`perf_counter` stays real; it
  only times eviction for metrics). Real SGLang reads `time.monotonic()`, which on a fast
  machine can return equal values; the counter is the same order with no ties. Ties cannot
  change a decision: every `monotonic()` call gets a distinct value, a match/insert walk
  stamps one value on nodes of a single root path (no two of which are evictable leaves at
  once), and every `TreeNode` (also one made by `_split_node`) gets its own creation time, so
  the eviction heap never compares two equal keys (it would fall back to `TreeNode.__lt__`).
- The runtime config context is published from a default `ServerArgs(model_path="dummy",
  device="cpu")` (`get_context().set_server_args`), which `release_kv_cache` reads
  (`get_spec().speculative_algorithm` None, `get_serving().strip_thinking_cache` False).
- `RadixCache.evict` is wrapped on the instance by a counter that calls the original and adds
  `EvictResult.num_tokens_evicted` (observation only).

Replay protocol -> SGLang 0.5.23 calls (sglang/srt/...)
------------------------------------------------------
Requests in trace order, at most C in flight, the oldest finishing first
(experiments/engine/replay.py `replay`). Per request:

0. `while len(inflight) >= C: finish(oldest)`.
1. Match: a real `managers/schedule_batch.py` `Req` (sampling `max_new_tokens=output_len`,
   no logprobs) and `Req.init_next_round_input(tree_cache)` -> `mem_cache/common.py`
   `match_kv_cache` -> `RadixCache.match_prefix(RadixKey(ids, limit=len-1))`: at most
   `len-1` tokens (`Req._compute_max_prefix_len`), page-aligned down
   (`RadixKey.page_aligned`); sets `req.prefix_len`, `req.last_node`,
   `req.kv.cache_protected_len = prefix_len`.
2. Admission check, like `managers/schedule_policy.py` `PrefillAdder.add_one_req`: under a
   temporary `tree_cache.lock(req.last_node)` (`_lock_node`), the prompt fits iff
   `allocator.available_size() + tree_cache.evictable_size() >= new_pages * page_size`
   (new_pages = ceil(prompt_len/ps) - prefix_len/ps). This is the protocol's rule (no
   max_new_tokens reservation, no chunked prefill); SGLang's own budget also reserves decode
   tokens. If it does not fit: unlock; with something in flight finish the oldest and go back
   to 1 (match again); with nothing in flight the request is unschedulable (hit -1).
3. Admit: `req.lock = tree_cache.lock(req.last_node)` (`PrefillAdder._commit_prefill_admission`),
   `req.extend_end = prompt_len`; `mem_cache/allocation.py` `alloc_req_slots`, then as
   `alloc_for_extend` does: `alloc_token_slots(tree_cache, extend)` at page size 1, else
   `alloc_paged_token_slots_extend(...)` (both evict through `common.evict_from_tree_cache` ->
   `BaseTokenToKVPoolAllocator.evict_to_free_tokens`); the row is written as
   `write_cache_indices` does (prefix from `tree_cache.prefix_device_indices(req)`), and
   `kv_allocated_len = kv_committed_len = prompt_len`.
4. After prefill: the first output token is appended to `req.output_ids`, then
   `common.checkpoint_kv_cache(req, tree_cache)` -> `RadixCache.checkpoint(req, up_to=prompt_len)`
   (what `cache_unfinished_req` was). This is done even when output_len is 1 (the protocol
   commits the prompt before decoding; SGLang would release such a request at once).
5. Decode output_len - 1 steps, each as the scheduler does one step for this request:
   `ScheduleBatch.check_decode_mem` -> `allocator.check_decode_capacity(num_tokens=
   new_tokens_required_next_decode)` (ps if `kv_committed_len % ps == 0` else 0), then
   `alloc_for_decode_default`: `alloc_token_slots(tree_cache, 1)` at page size 1, else
   `alloc_paged_token_slots_decode(...)` (evicts the shortfall of `1 * page_size`), row write,
   `kv_allocated_len += 1`, `kv_committed_len += 1`, the next generated id appended to
   `output_ids`. Before the first step the whole decode is checked as the engine's single
   `grow` is: if `available + evictable` cannot cover its new pages, the oldest in flight
   finishes and the check repeats; alone, the request decodes nothing ("truncated").
   Generated ids are `2_000_000_000 + a global counter`, `output_len` ids per request taken
   when its decode starts (the engine's rule), so no prompt ever matches them.
6. The request joins the in-flight queue. Finishing it: `req.finished_reason =
   FINISH_LENGTH(output_len)` and `common.release_kv_cache(req, tree_cache, checkpoint=True)`
   -> `RadixCache.checkpoint(req, up_to=owned_kv_len)` (inserts prompt + output - 1 tokens,
   page-aligned, with `inserted_len = cache_inserted_len`; frees the duplicates; the
   `split_prompt` re-insert; re-match; re-lock), `free_kv_row` of the unaligned tail,
   `unlock`, `req_to_token_pool.free`. At the end of the trace all in-flight requests finish,
   oldest first.

HiCache (--hicache --host-capacity TOKENS [--write-policies ...])
-------------------------------------------------------------------
The hierarchical cache a 0.5.23 server builds for `--enable-hierarchical-cache`:
`UnifiedRadixCache` (FULL component, `tree_core_backend="python"`: the Python TreeCore, whose
decisions the `radix-hicache` backend follows) with a host tier attached as
`UnifiedRadixCache.init_hicache` -> `attach_hybrid_pool_to_unified_cache` leaves it. What is
stubbed, and why (nothing in the tree core, the cache's backup / eviction / load-back code
or the allocators is touched):
- The host pool: `HostPoolStub`, the slot accounting of `pool_host/base.py`
  (`alloc(need)`: page multiples, None when more than is free; `free`; `available_size`),
  sized `--host-capacity` tokens, with no tensors behind it (no bytes are moved on CPU).
  It also stands in for the pool group (`free(indices, pool=KV)`) and its anchor entry
  (`shared_allocation_domain=None`, so the cache takes its own `evict_host` path, as a
  plain MHA host pool does).
- The controller: `ControllerStub`, `HybridCacheController.write` / `load` as the cache calls
  them: `write` allocates host slots (None when short) and queues an ack; `load` allocates
  device slots from the real allocator (None when short) and queues an ack. Every ack's
  CUDA events report completion at once (the GPU-optimistic timing of the replay protocol).
- The attributes `init_hicache` sets: `cache_controller`, `host_pool_group`, the FULL
  component's `_full_kv_pool_host`, `tree_core.set_hicache_enabled()`,
  `write_through_threshold` (1 for write_through, else 2, as `init_hicache`),
  `is_write_back`, `load_back_threshold = 10`.
- `evict_host` is wrapped on the instance to count host tokens freed (observation only);
  the `sglang` logger is set to ERROR (write_back logs every dropped subtree).
The protocol gains, per request: after the fit check (2), if the match has a host hit
(`req.host_hit_length > 0`), `PrefillAdder.add_one_req`'s load-back: under
`tree.lock(req.last_node)` and `_lock_node(req.best_match_node, lock_host=True)`
(`inc_host_lock_ref` + `lock`), `tree.init_load_back(InitLoadBackParams(best_match_node,
host_hit_length, req))`; then `req.host_loaded_length, req.last_node = loaded`,
`req.prefix_len += loaded`, `req.kv.cache_protected_len = req.prefix_len`, and admission (3)
goes on from there. Transfers complete where the scheduler would poll them
(`check_hicache_events` -> `writing_check` / `loading_check` with every queued ack ready):
after the prefill's checkpoint, after every finish, and after each request. Recorded per
config: `per_request_hits` (the GPU prefix at match), `per_request_host_loaded` (tokens
loaded back; -1 if unschedulable), `backup_tokens`, `load_back_tokens`,
`host_evicted_tokens`, `host_tokens_end`, besides the usual fields.

HiCache storage (--hicache ... --storage [--storage-capacity TOKENS] [--prefetch-threshold N])
-------------------------------------------------------------------------------------------
The L3 under the host tier with `--hicache-storage-backend file`: a real `HiCacheFile`
(and its `LRUFileEvictor`, `max_size` = the storage capacity, pages of one byte per token so
bytes are tokens) in a temporary directory, attached as `StorageAttachment.
apply_runtime_config` attaches one (node hashing on, the prefetch threshold and policy).
The controller is `storage_controller`: the stub above mixed into the real
`HybridCacheController` class (built without its constructor), whose storage threads run
inline (`StorageControllerStub`: the hit query at submission, the page reads when the cache
has allocated the hit, the page writes at `write_storage`), acks passed on as one rank's
sync thread does. Per request, before the match: the scheduler's `_prefetch_kvcache`
(`init_next_round_input`, then `prefetch_from_storage` when the match ends at the root or a
backed-up node), the storage queues drained until every transfer completed
(`_drain_storage_control_queues_impl`), `check_prefetch_progress` and
`pop_prefetch_loaded_span`; after the load-back, `split_cached_prefix_by_tier` gives the
request's storage tokens. Recorded per config besides the HiCache fields:
`per_request_storage_loaded`, `total_storage_loaded_tokens`, `storage_written_pages`
(pages offered to the backend's set, stored or already there), `storage_fetched_tokens`.

Output: one gzip'd JSON per trace, see tests/fixtures/sglang_0_5_23/README.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.abc
import importlib.machinery
import itertools
import json
import sys
import time
import types
import warnings
from array import array
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED_TOKEN_BASE = 2_000_000_000
POLICIES = ("lru", "lfu", "fifo", "mru", "filo")


# --------------------------------------------------------------------------------------
# Importing SGLang on CPU
# --------------------------------------------------------------------------------------


class _StubModule(types.ModuleType):
    """Any attribute is another stub (and a stub can be called or subclassed)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        mod = sys.modules.get(full)
        if mod is None:
            mod = _StubModule(full)
            sys.modules[full] = mod
        return mod

    def __call__(self, *args, **kwargs):
        return _StubModule(self.__name__ + "()")

    def __mro_entries__(self, bases):
        return (object,)


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        pass


STUBBED_MODULES = ("torchvision",)
SG = types.SimpleNamespace()  # the imported SGLang names


def bootstrap_sglang() -> None:
    """Import the SGLang pieces (see the module docstring for what is stubbed)."""
    if getattr(SG, "ready", False):
        return
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("sglang").setLevel(logging.ERROR)  # write_back logs every dropped subtree
    from transformers.utils import import_utils as _tf_import_utils

    assert _tf_import_utils.is_torchvision_available() is False  # cached before the stub
    sys.meta_path.insert(0, _StubFinder(set(STUBBED_MODULES)))

    import sglang
    import torch
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, split_cached_prefix_by_tier
    from sglang.srt.mem_cache import radix_cache
    from sglang.srt.mem_cache.allocation import (
        alloc_paged_token_slots_decode,
        alloc_paged_token_slots_extend,
        alloc_req_slots,
        alloc_token_slots,
    )
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.common import checkpoint_kv_cache, release_kv_cache
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.srt.runtime_context import get_context
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    get_context().set_server_args(ServerArgs(model_path="dummy", device="cpu"))
    SG.__dict__.update(
        torch=torch,
        version=sglang.__version__,
        Req=Req,
        FINISH_LENGTH=FINISH_LENGTH,
        split_cached_prefix_by_tier=split_cached_prefix_by_tier,
        radix_cache=radix_cache,
        RadixCache=radix_cache.RadixCache,
        UnifiedRadixCache=UnifiedRadixCache,
        InitLoadBackParams=InitLoadBackParams,
        PoolName=PoolName,
        ComponentType=ComponentType,
        alloc_token_slots=alloc_token_slots,
        alloc_paged_token_slots_extend=alloc_paged_token_slots_extend,
        alloc_paged_token_slots_decode=alloc_paged_token_slots_decode,
        alloc_req_slots=alloc_req_slots,
        TokenToKVPoolAllocator=TokenToKVPoolAllocator,
        PagedTokenToKVPoolAllocator=PagedTokenToKVPoolAllocator,
        CacheInitParams=CacheInitParams,
        checkpoint_kv_cache=checkpoint_kv_cache,
        release_kv_cache=release_kv_cache,
        ReqToTokenPool=ReqToTokenPool,
        SamplingParams=SamplingParams,
        ready=True,
    )


class LogicalClock:
    """Replaces `time` inside radix_cache: `monotonic()` is a counter, +1 per call."""

    def __init__(self) -> None:
        self._count = itertools.count(1)
        self.perf_counter = time.perf_counter
        self.time = time.time

    def monotonic(self) -> int:
        return next(self._count)


# --------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_trace(spec: str) -> tuple[str, Path, list[tuple[array, int]]]:
    """`mooncake:PATH` (expanded by the project's loader) or `jsonl:PATH` (the project's
    token-id JSONL, optionally .gz; only `prompt`, `output_len`, `id`, `arrival` are used and
    salts, LoRA ids and declared prefixes are refused). Returns (kind, path, [(prompt ids,
    output_len)])."""
    kind, _, path = spec.partition(":")
    path = Path(path)
    if kind == "mooncake":
        sys.path.insert(0, str(REPO))
        from experiments.workloads.mooncake import load_mooncake

        reqs = []
        for r in load_mooncake(path):
            assert r.n == 1 and r.beam_width == 1
            reqs.append((array("q", r.prompt.astype("int64").tobytes()), int(r.output_len)))
        return kind, path, reqs
    if kind == "jsonl":
        opener = gzip.open if path.suffix == ".gz" else open
        reqs = []
        with opener(path, "rt") as fh:
            for line in fh:
                if not line.strip():
                    continue
                obj = json.loads(line)
                bad = set(obj) - {"prompt", "output_len", "id", "arrival"}
                if bad:
                    raise ValueError(f"{path}: unsupported fields {sorted(bad)}")
                reqs.append((array("q", obj["prompt"]), int(obj["output_len"])))
        return kind, path, reqs
    raise ValueError(f"trace must be mooncake:PATH or jsonl:PATH, got {spec!r}")


# --------------------------------------------------------------------------------------
# The replay
# --------------------------------------------------------------------------------------


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Replay:
    """One configuration: real SGLang objects and the protocol of the module docstring."""

    def __init__(
        self, policy: str, page_size: int, capacity_tokens: int, concurrency: int, max_len: int, cache: str = "radix"
    ) -> None:
        torch = SG.torch
        self.ps = page_size
        self.concurrency = concurrency
        self.clock = LogicalClock()
        SG.radix_cache.time = self.clock  # the only patch (see docstring)
        if page_size == 1:
            self.allocator = SG.TokenToKVPoolAllocator(
                size=capacity_tokens, dtype=torch.int8, device="cpu", kvcache=None, need_sort=False
            )
        else:
            assert capacity_tokens % page_size == 0
            self.allocator = SG.PagedTokenToKVPoolAllocator(
                size=capacity_tokens, page_size=page_size, dtype=torch.int8, device="cpu", kvcache=None, need_sort=False
            )
            assert not self.allocator.use_triton_kernels  # CPU: alloc_extend_naive / alloc_decode_naive
        self.req_to_token_pool = SG.ReqToTokenPool(
            size=concurrency + 1, max_context_len=max_len + 2 * page_size, device="cpu", enable_memory_saver=False
        )
        common = dict(
            disable=False,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=page_size,
            eviction_policy=policy,
        )
        self.evicted = 0
        if cache == "radix":
            self.tree = SG.RadixCache(SG.CacheInitParams(**common))
            assert type(self.tree.eviction_strategy).__name__.lower().startswith(policy)
            wrap = ("evict",)  # evict_for_alloc (base class) calls self.evict
        else:  # cross-check only: the tree the 0.5.23 server builds by default (registry.py)
            backend = cache.split(":")[1]  # unified:python | unified:rust
            self.tree = SG.UnifiedRadixCache(
                SG.CacheInitParams(**common, tree_components=(SG.ComponentType.FULL,), tree_core_backend=backend)
            )
            wrap = ("evict", "evict_for_alloc")  # both call _evict
        for name in wrap:
            real = getattr(self.tree, name)

            def counting(params, _real=real, **kwargs):
                result = _real(params, **kwargs)
                self.evicted += result.num_tokens_evicted
                return result

            setattr(self.tree, name, counting)
        self.inflight: deque = deque()
        self.next_token = GENERATED_TOKEN_BASE
        self.counts = dict(admission_finishes=0, decode_finishes=0, unschedulable=0, truncated=0)

    # -- helpers --------------------------------------------------------------------

    def fits(self, tokens: int) -> bool:
        return self.allocator.available_size() + self.tree.evictable_size() >= tokens

    def finish_oldest(self) -> None:
        self.finish(self.inflight.popleft())

    def finish(self, req) -> None:
        req.finished_reason = SG.FINISH_LENGTH(length=len(req.output_ids))
        SG.release_kv_cache(req, self.tree, checkpoint=True)

    # -- one request ----------------------------------------------------------------

    def request(self, idx: int, prompt: list[int], output_len: int) -> int:
        torch = SG.torch
        ps = self.ps
        tree = self.tree
        while len(self.inflight) >= self.concurrency:
            self.finish_oldest()
        prompt_len = len(prompt)
        req = SG.Req(
            rid=f"r{idx}",
            origin_input_text="",
            origin_input_ids=array("q", prompt),  # a copy: the Req appends to its own arrays
            sampling_params=SG.SamplingParams(max_new_tokens=max(output_len, 1), ignore_eos=True),
        )
        if not self.admit_match(req, prompt_len):
            self.counts["unschedulable"] += 1
            return -1
        hit = req.prefix_len
        # PrefillAdder._commit_prefill_admission
        req.extend_end = prompt_len
        req.lock = tree.lock(req.last_node)
        # ScheduleBatch.prepare_for_extend -> alloc_for_extend
        SG.alloc_req_slots(self.req_to_token_pool, [req], tree)
        row = req.kv.req_pool_idx
        prefix = tree.prefix_device_indices(req) if hit else torch.empty((0,), dtype=torch.int64)
        extend = prompt_len - hit
        if ps == 1:
            out = SG.alloc_token_slots(tree, extend)
        else:
            last_loc = prefix[-1:] if hit else torch.full((1,), -1, dtype=torch.int64)
            prefix_lens = torch.tensor([hit], dtype=torch.int64)
            seq_lens = torch.tensor([prompt_len], dtype=torch.int64)
            out = SG.alloc_paged_token_slots_extend(
                tree_cache=tree,
                prefix_lens=prefix_lens,
                prefix_lens_cpu=prefix_lens,
                seq_lens=seq_lens,
                seq_lens_cpu=seq_lens,
                last_loc=last_loc.to(torch.int64),
                extend_num_tokens=extend,
            )
        self.req_to_token_pool.write((row, slice(0, hit)), prefix)
        self.req_to_token_pool.write((row, slice(hit, prompt_len)), out)
        req.kv.kv_allocated_len = prompt_len
        req.kv.kv_committed_len = prompt_len
        # the prefill forward samples the first output token; the request goes on decoding
        first = self.next_token
        self.next_token += output_len
        if output_len > 0:
            req.output_ids.append(first)
        SG.checkpoint_kv_cache(req, tree)  # cache_unfinished_req: insert the prompt
        self.after_prefill()
        # decode: output_len - 1 steps, each giving KV to the token fed back
        steps = max(output_len - 1, 0)
        if steps:
            need = (ceil_div(prompt_len + steps, ps) - ceil_div(prompt_len, ps)) * ps
            while not self.fits(need) and self.inflight:
                self.counts["decode_finishes"] += 1
                self.finish_oldest()
            if not self.fits(need):
                self.counts["truncated"] += 1
                steps = 0
        for k in range(1, steps + 1):
            self.decode_step(req, row)
            req.output_ids.append(first + k)
        self.inflight.append(req)
        return hit

    def admit_match(self, req, prompt_len: int) -> bool:
        """Steps 1-2: match, and the fit check (finishing the oldest for room); False when
        the prompt does not fit even with nothing in flight."""
        tree = self.tree
        while True:
            req.init_next_round_input(tree)  # match_kv_cache: len-1 cap, page-aligned
            new_tokens = ceil_div(prompt_len, self.ps) * self.ps - req.prefix_len
            lock = tree.lock(req.last_node)  # PrefillAdder._lock_node: the pin during the check
            ok = self.fits(new_tokens)
            tree.unlock(lock)
            if ok or not self.inflight:
                return ok
            self.counts["admission_finishes"] += 1
            self.finish_oldest()

    def after_prefill(self) -> None:
        """After the prefill's checkpoint (HiCache: its transfers complete)."""

    def decode_step(self, req, row: int) -> None:
        torch = SG.torch
        ps = self.ps
        tree = self.tree
        seq_len = req.kv.kv_committed_len  # the token fed back is written at this position
        # ScheduleBatch.check_decode_mem (update_running_batch) -> check_decode_capacity
        new_tokens = ps if seq_len % ps == 0 else 0
        ok = self.allocator.check_decode_capacity(num_tokens=new_tokens, tree_cache=tree)
        assert ok, "the whole-decode check above guarantees every step"
        # ScheduleBatch.prepare_for_decode -> alloc_for_decode_default
        if ps == 1:
            out = SG.alloc_token_slots(tree, 1)
        else:
            last_loc = self.req_to_token_pool.req_to_token[row, seq_len - 1 : seq_len].to(torch.int64)
            nxt = torch.tensor([seq_len + 1], dtype=torch.int64)
            out = SG.alloc_paged_token_slots_decode(
                tree_cache=tree, seq_lens=nxt, seq_lens_cpu=nxt, last_loc=last_loc, token_per_req=1
            )
        self.req_to_token_pool.write((row, slice(seq_len, seq_len + 1)), out.to(torch.int32))
        req.kv.kv_allocated_len += 1
        req.kv.kv_committed_len += 1

    def run(self, requests: list[tuple[list[int], int]]) -> dict:
        hits, evicted_after = [], []
        for i, (prompt, out_len) in enumerate(requests):
            hits.append(self.request(i, prompt, out_len))
            evicted_after.append(self.evicted)
        while self.inflight:
            self.finish_oldest()
        assert self.tree.protected_size() == 0
        assert self.allocator.available_size() + self.tree.evictable_size() == self.allocator.size
        scheduled = [h for h in hits if h >= 0]
        return {
            "per_request_hits": hits,
            "total_hit_tokens": sum(scheduled),
            "evicted_tokens": self.evicted,
            "evicted_tokens_after_request": evicted_after,
            "prompt_tokens_scheduled": sum(len(p) for (p, _), h in zip(requests, hits, strict=True) if h >= 0),
            **self.counts,
            "tree_tokens_end": self.tree.evictable_size(),
            "free_tokens_end": self.allocator.available_size(),
        }


# --------------------------------------------------------------------------------------
# HiCache (--hicache): UnifiedRadixCache with a host tier, transfers completing at once
# --------------------------------------------------------------------------------------

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


class HostPoolStub:
    """The host KV pool's slot accounting (`mem_cache/pool_host/base.py` `alloc` / `free` /
    `available_size`: page-multiple requests, None when more than is free), with no
    tensors behind it. Also stands in for the pool group and its anchor entry, which the
    cache reads only for these calls."""

    def __init__(self, size: int, page_size: int) -> None:
        assert size % page_size == 0, "host capacity must be whole pages"
        self.size = size
        self.page_size = page_size
        self.logical_page_size = page_size
        self.shared_allocation_domain = None  # -> the cache's own evict_host path
        self.host_pool = self
        self.host_evict_fn = None
        self.anchor_entry = self
        self.clear()

    def clear(self) -> None:
        self.free_slots: list[int] = list(range(self.size))
        self.used = 0

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int):
        assert need_size % self.page_size == 0, "host alloc must be whole pages"
        if need_size > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        self.used += need_size
        return SG.torch.tensor(out, dtype=SG.torch.int64)

    def free(self, indices, pool=None) -> int:
        n = int(indices.numel())
        self.free_slots.extend(indices.tolist())
        self.used -= n
        return n

    def get_pool(self, name):
        return self if name == SG.PoolName.KV else None

    def destroy(self) -> None:
        pass


class _DoneEvent:
    """A CUDA event that has always completed (GPU-optimistic transfer)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _Ack:
    def __init__(self, node_id: int) -> None:
        self.node_ids = [node_id]
        self.finish_event = _DoneEvent()
        self.start_event = _DoneEvent()
        self.num_tokens_by_pool = None
        self.num_bytes = 0
        self.timing_enabled = False


class ControllerStub:
    """`HybridCacheController`'s `write` / `load` as the cache calls them
    (`hybrid_cache/hybrid_cache_controller.py`): `write` allocates host slots (None when
    the host has too few) and queues an ack; `load` allocates device slots from the real
    allocator (None when short) and queues an ack. No bytes move; every ack is complete at
    once, so the next `writing_check` / `loading_check` consumes it."""

    def __init__(self, host: HostPoolStub, allocator, write_policy: str) -> None:
        self.mem_pool_host = host
        self.mem_pool_device_allocator = allocator
        self.write_policy = write_policy
        self.enable_storage = False
        self.pp_prefetch_command_group = None  # no pipeline parallelism
        self.ack_write_queue: list = []
        self.ack_load_queue: list = []
        self.written_tokens = 0
        self.loaded_tokens = 0

    def write(self, device_indices, priority=None, node_id=-1, extra_pools=None, flush=True, start_owner=None):
        assert not extra_pools and start_owner is None
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.written_tokens += len(device_indices)
        self.ack_write_queue.append(_Ack(node_id))
        return host_indices

    def load(
        self, host_indices, priority=None, node_id=-1, extra_pools=None, *, device_indices=None, anchor_indices=None
    ):
        assert not extra_pools and device_indices is None
        if host_indices.numel() == 0:
            return SG.torch.empty((0,), dtype=SG.torch.int64)
        out = self.mem_pool_device_allocator.alloc(len(host_indices))
        if out is None:
            return None
        self.loaded_tokens += len(host_indices)
        self.ack_load_queue.append(_Ack(node_id))
        return out

    def start_writing(self) -> None:
        pass

    def start_loading(self) -> int:
        return 0

    def reset(self) -> None:
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()


class HiCacheReplay(Replay):
    """The replay protocol on SGLang 0.5.23's hierarchical cache: `UnifiedRadixCache`
    (FULL component, Python TreeCore) with a host tier attached as `init_hicache` attaches
    one (see the module docstring, "HiCache"), transfers completing at once."""

    def __init__(
        self,
        policy: str,
        page_size: int,
        capacity_tokens: int,
        concurrency: int,
        max_len: int,
        write_policy: str,
        host_tokens: int,
    ) -> None:
        super().__init__(policy, page_size, capacity_tokens, concurrency, max_len, cache="unified:python")
        tree = self.tree
        self.host = HostPoolStub(host_tokens, page_size)
        self.cc = ControllerStub(self.host, self.allocator, write_policy)
        # what init_hicache + attach_hybrid_pool_to_unified_cache leave behind, FULL only
        tree.cache_controller = self.cc
        tree.host_pool_group = self.host
        tree.components[SG.ComponentType.FULL]._full_kv_pool_host = self.host
        tree.tree_core.set_hicache_enabled()
        tree.write_through_threshold = 1 if write_policy == "write_through" else 2
        tree.is_write_back = write_policy == "write_back"
        tree.load_back_threshold = 10
        self.host_evicted = 0
        real_evict_host = tree.evict_host

        def counting_evict_host(num_tokens, *args, **kwargs):
            before = self.host.used
            out = real_evict_host(num_tokens, *args, **kwargs)
            self.host_evicted += before - self.host.used
            return out

        tree.evict_host = counting_evict_host

    def drain(self) -> None:
        """check_hicache_events: every transfer issued so far has completed."""
        self.tree.writing_check(finish_count=len(self.cc.ack_write_queue))
        self.tree.loading_check(finish_count=len(self.cc.ack_load_queue))

    def finish(self, req) -> None:
        super().finish(req)
        self.drain()

    def admit_match(self, req, prompt_len: int) -> bool:
        """Steps 1-2 (match, fit check), then 2b: the host load-back."""
        ok = super().admit_match(req, prompt_len)
        self.loaded = 0
        if ok and req.host_hit_length > 0:
            tree = self.tree
            # PrefillAdder.add_one_req: under _lock_node(last_node) and
            # _lock_node(best_match_node, lock_host=True), init_load_back
            dev_lock = tree.lock(req.last_node)
            host_params = tree.inc_host_lock_ref(req.best_match_node).to_dec_params()
            best_lock = tree.lock(req.best_match_node)
            loaded, node = tree.init_load_back(
                SG.InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req)
            )
            tree.unlock(best_lock)
            tree.dec_host_lock_ref(req.best_match_node, host_params)
            tree.unlock(dev_lock)
            req.host_loaded_length, req.last_node = loaded, node
            req.prefix_len += loaded
            req.kv.cache_protected_len = req.prefix_len
            self.loaded = loaded
        return ok

    def after_prefill(self) -> None:
        self.drain()

    def request(self, idx: int, prompt: list[int], output_len: int) -> int:
        """The GPU hit (the host tokens loaded back are recorded beside it)."""
        self.loaded = 0
        total = super().request(idx, prompt, output_len)
        self.drain()
        self.loaded_per_request.append(self.loaded if total >= 0 else -1)
        return total - self.loaded if total >= 0 else -1

    def run(self, requests):
        self.loaded_per_request: list[int] = []
        out = super().run(requests)
        self.drain()
        out["per_request_host_loaded"] = self.loaded_per_request
        out["total_host_loaded_tokens"] = sum(self.loaded_per_request)
        out["host_capacity_tokens"] = self.host.size
        out["write_policy"] = self.cc.write_policy
        out["backup_tokens"] = self.cc.written_tokens
        out["load_back_tokens"] = self.cc.loaded_tokens
        out["host_evicted_tokens"] = self.host_evicted
        out["host_tokens_end"] = self.host.used
        return out


# --------------------------------------------------------------------------------------
# HiCache storage (--storage-backend file): the L3 layer under the host tier
# --------------------------------------------------------------------------------------


class StorageHostPoolStub(HostPoolStub):
    """`HostPoolStub` with the data-page calls the controller's generic storage get / set
    make (`_generic_page_get` / `_generic_page_set`): a page of `page_size` bytes (one
    byte per token, so the file backend's `max_size` in bytes is a capacity in tokens)."""

    def get_data_page(self, index, flat: bool = True):
        return SG.torch.zeros(self.page_size, dtype=SG.torch.uint8)

    def get_dummy_flat_data_page(self):
        return SG.torch.empty(self.page_size, dtype=SG.torch.uint8)

    def set_from_flat_data_page(self, index, data) -> None:
        pass

    @property
    def logical_size(self) -> int:
        return self.size


def storage_controller(host, allocator, write_policy: str, directory: str, capacity_tokens: int):
    """A `StorageControllerStub` that is also a `HybridCacheController` (its methods call
    `super()`), built without the real constructor (no threads, no device)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    cls = type("StorageController", (StorageControllerStub, HybridCacheController), {})
    obj = object.__new__(cls)
    StorageControllerStub.__init__(obj, host, allocator, write_policy, directory, capacity_tokens)
    return obj


class StorageControllerStub(ControllerStub):
    """`ControllerStub` plus the storage half of `HybridCacheController` as the cache
    calls it (mixed into the real class by `storage_controller`, so the real methods run
    unchanged), with a real `HiCacheFile` (and its `LRUFileEvictor`) in a temporary
    directory. The controller's storage threads are run inline, in the order their queues
    give: `prefetch` runs `prefetch_thread_func`'s body (the real `_storage_hit_query` and
    `_sync_prefetch_hit_query`, a no-op reduce at one rank) and queues the hit;
    `run_prefetch_io` runs `prefetch_io_aux_func` (the real `_page_transfer`) for every
    allocated hit and passes its acks on as `prefetch_sync_thread_func` does at one rank;
    `write_storage` runs `backup_thread_func` (the real `_page_backup`). Every transfer is
    complete when the cache next drains its queues (the replay protocol's timing)."""

    def __init__(self, host, allocator, write_policy: str, directory: str, capacity_tokens: int) -> None:
        from queue import Queue

        from sglang.srt.managers import cache_controller as base
        from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
        from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as hybrid

        super().__init__(host, allocator, write_policy)
        self._base, self._hybrid = base.HiCacheController, hybrid.HybridCacheController
        self._ack_class = base.PrefetchAck
        self.page_size = host.page_size
        self.enable_storage = True
        self.host_memory_mode = "cache"
        self.storage_host_pool = host
        extra = {"max_size": capacity_tokens} if capacity_tokens else None
        self.storage_config = HiCacheStorageConfig(
            tp_rank=0,
            tp_size=1,
            pp_rank=0,
            pp_size=1,
            attn_cp_rank=0,
            attn_cp_size=1,
            is_mla_model=False,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name=None,
            extra_config=extra,
        )
        self.storage_backend = HiCacheFile(self.storage_config, file_path=directory)
        self.storage_backend_type = "file"
        self.prefetch_capacity_limit = int(0.5 * host.size)  # attach_storage_backend, cache mode
        self.prefetch_tokens_occupied = 0
        self.prefetch_hits_sync_groups: list = []
        self.prefetch_completion_sync_groups: list = []
        self.pp_prefetch_decisions: dict = {}
        self.extra_host_mem_release_queues: dict = {}
        for name in (
            "prefetch_queue",
            "prefetch_hit_queue",
            "prefetch_buffer",
            "prefetch_sync_queue",
            "ack_prefetch_queue",
            "backup_queue",
            "ack_backup_queue",
            "host_mem_release_queue",
        ):
            setattr(self, name, Queue())
        self.stored_pages = 0
        self.fetched_tokens = 0

    backup_skip = False  # one rank: the storage writer

    def _page_transfer(self, operation):
        return self._base._page_transfer(self, operation)  # KV only: no sidecar pools

    def page_get_func(self, operation, hash_values, host_indices, extra_info=None):
        return self._base._generic_page_get(self, operation, hash_values, host_indices, extra_info)

    def page_set_func(self, hash_values, host_indices, extra_info=None):
        self.stored_pages += len(hash_values)
        return self._base._generic_page_set(self, hash_values, host_indices, extra_info)

    def prefetch(
        self, handle, new_input_tokens, last_hash=None, prefix_keys=None, extra_pools=None, assume_stored=False
    ):
        operation = self._hybrid.prefetch(
            self, handle, new_input_tokens, last_hash, prefix_keys, extra_pools, assume_stored
        )
        # prefetch_thread_func
        op = self.prefetch_queue.get()
        assert op is operation
        if op.is_terminated():
            hash_value, hit = [], 0
        else:
            hash_value, hit = self._storage_hit_query(op)
        hit = self._sync_prefetch_hit_query(op, hit)
        op.hash_value = hash_value[: hit // self.page_size]
        op.storage_hit_count = hit
        self.prefetch_hit_queue.put(op)
        return operation

    def run_prefetch_io(self) -> None:
        """prefetch_io_aux_func for every allocated hit, then the sync thread's pass-on."""
        while not self.prefetch_buffer.empty():
            op = self.prefetch_buffer.get()
            try:
                self.fetched_tokens += self._page_transfer(op) * self.page_size
            finally:
                self.prefetch_sync_queue.put(self._ack_class(rid=op.request_id, completed_req=True, operation=op))
        while not self.prefetch_sync_queue.empty():
            self.ack_prefetch_queue.put(self.prefetch_sync_queue.get())  # one rank: nothing to reduce

    def write_storage(self, host_indices, token_ids, hash_value=None, prefix_keys=None, extra_pools=None):
        op_id = self._hybrid.write_storage(self, host_indices, token_ids, hash_value, prefix_keys, extra_pools)
        op = self.backup_queue.get()  # backup_thread_func
        if not self.backup_skip:
            self._page_backup_or_log(op)
        self.ack_backup_queue.put(op)
        return op_id

    def _page_backup_or_log(self, operation):
        self._base._page_backup(self, operation)  # KV only: no sidecar pools


class HiCacheStorageReplay(HiCacheReplay):
    """`HiCacheReplay` with an L3 under the host: the file backend (`HiCacheFile`, with
    `max_size` = the storage capacity when given), attached as `init_hicache` ->
    `StorageAttachment.apply_runtime_config` attaches one (hashing turned on, the prefetch
    threshold and policy set). Per request, before the match of (1): the scheduler's
    `_prefetch_kvcache` (a match, then `prefetch_from_storage` when the match ends at the
    root or at a backed-up node), the storage queues drained (`_drain_storage_control_
    queues_impl`: the hit is allocated and read, the result inserted into the tree), then
    `check_prefetch_progress` and `pop_prefetch_loaded_span` as the scheduler does at
    admission; after the load-back the request's storage tokens are
    `split_cached_prefix_by_tier`'s (SGLang's `cached_tokens_storage`)."""

    def __init__(self, *args, storage_capacity: int, prefetch_threshold: int, prefetch_policy: str) -> None:
        import tempfile

        from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment

        super().__init__(*args)
        tree = self.tree
        self.host = StorageHostPoolStub(self.host.size, self.host.page_size)
        self._dir = tempfile.TemporaryDirectory(prefix="hicache-file-")
        cc = storage_controller(self.host, self.allocator, self.cc.write_policy, self._dir.name, storage_capacity)
        self.cc = cc
        tree.cache_controller = cc
        tree.host_pool_group = self.host
        tree.components[SG.ComponentType.FULL]._full_kv_pool_host = self.host
        tree.prefetch_stop_policy = prefetch_policy
        StorageAttachment(tree).apply_runtime_config(
            storage_backend="file",
            prefetch_threshold=max(prefetch_threshold, self.ps),  # attach_storage_backend
            prefetch_timeout_base=1.0,
            prefetch_timeout_per_ki_token=0.25,
            hicache_storage_pass_prefix_keys=False,
            enable_storage=True,
            enable_storage_metrics=False,
            extra_metric_labels=None,
        )
        self.storage_per_request: list[int] = []

    def drain(self) -> None:
        super().drain()
        self.drain_storage()

    def drain_storage(self) -> None:
        """check_hicache_events' storage part: every queued storage transfer completes."""
        tree, cc = self.tree, self.cc
        while True:
            tree._drain_storage_control_queues_impl(
                n_storage_hit=None,
                n_ack_prefetch=None,
                n_backup=None,
                n_release=None,
                extra_release_counts={},
                log_metrics=False,
            )
            if cc.prefetch_buffer.empty() and cc.ack_prefetch_queue.empty() and cc.prefetch_hit_queue.empty():
                return
            cc.run_prefetch_io()

    def admit_match(self, req, prompt_len: int) -> bool:
        tree = self.tree
        # Scheduler._prefetch_kvcache, at the request's arrival
        req.init_next_round_input(tree, cow_mamba=False)
        last_host_node = req.last_host_node
        matched_len = req.prefix_len + req.host_hit_length
        if tree.is_backuped(last_host_node) or tree.is_root(last_host_node):
            match_end = req._compute_max_prefix_len(len(req.full_untruncated_fill_ids))
            tree.prefetch_from_storage(
                req.cache_request_handle,
                last_host_node,
                req.full_untruncated_fill_ids[matched_len:match_end],
                tree.get_last_hash_value(last_host_node),
                None,
                matched_prefix_tokens=req.full_untruncated_fill_ids[:matched_len],
                extra_key=req.extra_key,
                cache_salt=req.cache_salt,
            )
        self.drain_storage()
        # get_new_batch_prefill: the prefetch is done; pop the L3-loaded span
        assert tree.check_prefetch_progress(req.cache_request_handle)
        loaded, start = tree.pop_prefetch_loaded_span(req.cache_request_handle)
        req.storage_hit_length, req.storage_hit_start = (loaded, start) if loaded > 0 else (0, None)
        ok = super().admit_match(req, prompt_len)
        self.storage = 0
        if ok:
            _, _, self.storage = SG.split_cached_prefix_by_tier(
                prefix_len=req.prefix_len,
                host_hit_len=self.loaded,
                storage_hit_len=req.storage_hit_length,
                storage_hit_start=req.storage_hit_start,
            )
        return ok

    def request(self, idx: int, prompt: list[int], output_len: int) -> int:
        self.storage = 0
        total = super().request(idx, prompt, output_len)
        self.storage_per_request.append(self.storage if total >= 0 else -1)
        return total

    def run(self, requests):
        out = super().run(requests)
        out["per_request_storage_loaded"] = self.storage_per_request
        out["total_storage_loaded_tokens"] = sum(x for x in self.storage_per_request if x > 0)
        out["storage_written_pages"] = self.cc.stored_pages
        out["storage_fetched_tokens"] = self.cc.fetched_tokens
        self._dir.cleanup()
        return out


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="mooncake:PATH or jsonl:PATH[.gz]")
    ap.add_argument("--name", help="trace name in the output (default: the file's stem)")
    ap.add_argument("--capacity", type=int, required=True, help="KV pool size in tokens")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--limit", type=int, help="only the first N requests")
    ap.add_argument(
        "--cache",
        default="radix",
        help="radix (RadixCache, the goldens) or unified:python / unified:rust (UnifiedRadixCache, cross-check)",
    )
    ap.add_argument("--out", required=True, help="output .json.gz")
    ap.add_argument("--trace-meta", help="JSON object merged into the output's trace metadata")
    ap.add_argument(
        "--hicache", action="store_true", help="the hierarchical cache (UnifiedRadixCache + a host tier, see HiCache)"
    )
    ap.add_argument("--write-policies", default=",".join(WRITE_POLICIES), help="with --hicache")
    ap.add_argument("--host-capacity", type=int, help="with --hicache: host tier size in tokens")
    ap.add_argument(
        "--storage",
        action="store_true",
        help="with --hicache: an L3 under the host, the file backend (see HiCacheStorageReplay)",
    )
    ap.add_argument(
        "--storage-capacity",
        type=int,
        default=0,
        help="with --storage: the file backend's max_size in tokens (0: none)",
    )
    ap.add_argument("--prefetch-threshold", type=int, default=256, help="with --storage: SGLang's prefetch_threshold")
    ap.add_argument("--prefetch-policy", default="best_effort", help="with --storage")
    args = ap.parse_args(argv)
    if args.storage and not args.hicache:
        ap.error("--storage needs --hicache")
    if args.hicache:
        if not args.host_capacity or args.host_capacity <= 0:
            ap.error("--hicache needs --host-capacity TOKENS > 0")
        bad = set(args.write_policies.split(",")) - set(WRITE_POLICIES)
        if bad:
            ap.error(f"unknown write policies {sorted(bad)}; choose from {', '.join(WRITE_POLICIES)}")

    bootstrap_sglang()
    kind, path, requests = load_trace(args.trace)
    if args.limit:
        requests = requests[: args.limit]
    max_len = max(len(p) + o for p, o in requests)
    name = args.name or path.name.split(".")[0]
    configs = []
    write_policies = args.write_policies.split(",") if args.hicache else [None]
    for policy, wp in itertools.product(args.policies.split(","), write_policies):
        for ps in (int(x) for x in args.page_sizes.split(",")):
            for c in (int(x) for x in args.concurrency.split(",")):
                t0 = time.perf_counter()
                if wp is None:
                    result = Replay(policy, ps, args.capacity, c, max_len, args.cache).run(requests)
                elif args.storage:
                    result = HiCacheStorageReplay(
                        policy,
                        ps,
                        args.capacity,
                        c,
                        max_len,
                        wp,
                        args.host_capacity,
                        storage_capacity=args.storage_capacity,
                        prefetch_threshold=args.prefetch_threshold,
                        prefetch_policy=args.prefetch_policy,
                    ).run(requests)
                else:
                    result = HiCacheReplay(policy, ps, args.capacity, c, max_len, wp, args.host_capacity).run(requests)
                dt = time.perf_counter() - t0
                cfg = {"policy": policy, "page_size": ps, "concurrency": c, "capacity_tokens": args.capacity}
                if wp is not None:
                    cfg["cache"] = "unified:python+hicache"
                    cfg["write_policy"] = wp
                    cfg["host_capacity_tokens"] = args.host_capacity
                    if args.storage:
                        cfg["cache"] = "unified:python+hicache+file"
                        cfg["storage_capacity_tokens"] = args.storage_capacity
                        cfg["prefetch_threshold"] = args.prefetch_threshold
                        cfg["prefetch_policy"] = args.prefetch_policy
                        print(f"  storage loaded={result['total_storage_loaded_tokens']:,}", flush=True)
                    print(
                        f"  {wp}: host loaded={result['total_host_loaded_tokens']:,} "
                        f"backup={result['backup_tokens']:,} host_evicted={result['host_evicted_tokens']:,}",
                        flush=True,
                    )
                elif args.cache != "radix":
                    cfg["cache"] = args.cache
                print(
                    f"{name} {policy:4s} ps={ps:2d} C={c}: hits={result['total_hit_tokens']:,} "
                    f"evicted={result['evicted_tokens']:,} unsched={result['unschedulable']} "
                    f"adm_fin={result['admission_finishes']} dec_fin={result['decode_finishes']} "
                    f"trunc={result['truncated']} ({dt:.1f}s)",
                    flush=True,
                )
                configs.append({**cfg, **result})
    try:
        rel = str(path.resolve().relative_to(REPO))
    except ValueError:
        rel = str(path)
    trace_meta = {
        "name": name,
        "kind": kind,
        "path": rel,
        "sha256": sha256_of(path),
        **(
            {"sha256_uncompressed": hashlib.sha256(gzip.decompress(path.read_bytes())).hexdigest()}
            if path.suffix == ".gz"
            else {}
        ),
        "requests": len(requests),
        "prompt_tokens": sum(len(p) for p, _ in requests),
        "output_tokens": sum(o for _, o in requests),
    }
    if args.trace_meta:
        trace_meta.update(json.loads(args.trace_meta))
    doc = {
        "sglang_version": SG.version,
        "generator": "scripts/sglang_reference/run_sglang.py",
        "command": "run_sglang.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "trace": trace_meta,
        "protocol": {
            "generated_token_base": GENERATED_TOKEN_BASE,
            "generated_ids": "fresh: 2_000_000_000 + a global counter, output_len ids per request "
            "taken when its decode starts; the last generated token gets no KV",
            "admission_fit": "available + evictable (after pinning the match) >= new pages * page_size",
            "decode_fit": "available + evictable >= the whole decode's new pages * page_size, "
            "checked once before the first step (the engine's single grow)",
            "clock": "logical counter for time.monotonic in radix_cache",
            "chunked_prefill": False,
        },
        "configs": configs,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(out, "wt", compresslevel=9) as fh:
        # mtime-free gzip is not needed for correctness; json is compact
        json.dump(doc, fh, separators=(",", ":"))
    print(f"wrote {out} ({out.stat().st_size:,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
