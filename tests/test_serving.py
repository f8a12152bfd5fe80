"""The serving protocol: continuous batching, chunked prefill, preemption by recompute."""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import available_backends, create_cache
from experiments.engine import CostModelExecutor, ModelExecutor, ServingConfig, serve
from experiments.workloads.registry import make_workload
from experiments.workloads.spec import RequestSpec

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny_model (conftest) is faster on one


@pytest.fixture(scope="module")
def docs_workload():
    # every request arrives at once: admission fills memory, then decoding runs out of pages
    return make_workload(
        "shared_doc_qa",
        seed=1,
        num_documents=3,
        doc_len=60,
        question_len=8,
        num_requests=8,
        output_len=6,
        vocab_size=512,
        rate=1000.0,
    )


@pytest.fixture(scope="module")
def alone_outputs(tiny_model, docs_workload):
    from tests.cached_runner import run_alone

    return {
        s.request_id: run_alone(tiny_model, s.prompt, s.output_len, page_size=4).tokens for s in docs_workload.requests
    }


#: every scheduling policy and engine loop: (scheduler, async_scheduling)
POLICIES = [("vllm", False), ("vllm", True)]


@pytest.mark.parametrize("scheduler,async_scheduling", POLICIES)
@pytest.mark.parametrize("backend", available_backends())
def test_memory_pressure_preempts_and_outputs_equal_no_cache(
    backend, scheduler, async_scheduling, tiny_model, docs_workload, alone_outputs
):
    """Same-step hits, pages published before their KV is computed, preemption and (async)
    tokens decoded before they are known: the greedy outputs stay those of each request run
    alone without a cache."""
    cache = create_cache(backend, num_pages=35, page_size=4)
    res = serve(
        cache,
        docs_workload.requests,
        ModelExecutor(tiny_model, 35, 4),
        ServingConfig(token_budget=1024, max_running=8, scheduler=scheduler, async_scheduling=async_scheduling),
        keep_outputs=True,
    )
    assert res.preemptions > 0, "the test must exercise preemption"
    assert res.aborted == 0 and len(res.requests) == len(docs_workload.requests)
    assert all(r["generated"] == 6 for r in res.requests)
    assert res.outputs == alone_outputs  # greedy tokens identical to each request run alone, uncached
    cache.check_invariants()
    assert cache.stats().pages_pinned == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_prefill_gives_the_same_outputs(tiny_model, docs_workload, alone_outputs, async_scheduling):
    cache = create_cache("radix", num_pages=200, page_size=4)
    res = serve(
        cache,
        docs_workload.requests,
        ModelExecutor(tiny_model, 200, 4),
        ServingConfig(token_budget=24, async_scheduling=async_scheduling),
        keep_outputs=True,
    )
    assert res.outputs == alone_outputs
    assert max(r["ttft"] for r in res.requests) > 0


def _specs(n: int, prompt: int, out: int, gap: float = 0.0) -> list[RequestSpec]:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 1000, prompt // 2, dtype=np.int32)
    return [
        RequestSpec(
            f"r{i}", np.concatenate([shared, rng.integers(0, 1000, prompt - prompt // 2, dtype=np.int32)]), out, i * gap
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("backend", available_backends())
def test_cost_model_run_accounts_for_every_token(backend):
    specs = _specs(40, 300, 20, gap=0.01)
    cache = create_cache(backend, num_pages=120, page_size=16)
    res = serve(cache, specs, CostModelExecutor(), ServingConfig(token_budget=512, max_running=16))
    assert len(res.requests) == 40 and res.aborted == 0
    for r in res.requests:
        assert r["generated"] == 20
        # computed = prompt - first hit + recomputation + decoded tokens (the last gets no KV)
        assert r["computed_tokens"] >= r["prompt_tokens"] - r["hit_tokens_first"] + 19
    assert all(t1 >= t0 for (t0, _), (t1, _) in zip(res.timeline, res.timeline[1:], strict=False))
    assert res.peak_pages <= 120
    assert cache.stats().pages_pinned == 0
    cache.check_invariants()


@pytest.mark.parametrize("backend", ["apc", "radix", "none"])
@pytest.mark.parametrize("num_pages", [60, 200])
def test_decode_windows_and_batched_commits_change_nothing_but_speed(backend, num_pages):
    """Simulating decode-only stretches in one go, and committing decode tokens a page at a
    time, must equal taking every step with a grow and a commit."""
    specs = _specs(30, 200, 50, gap=0.0 if num_pages == 60 else 0.05)  # all at once: memory pressure

    class StepByStep(CostModelExecutor):
        supports_decode_windows = False  # one step at a time

    def run(executor, eager=False):
        cache = create_cache(backend, num_pages=num_pages, page_size=16)
        if eager:
            cache.decode_steps_are_noops = False  # a grow and a commit every decode step
        res = serve(cache, specs, executor, ServingConfig(512, 16))
        return res, cache.stats()

    (a, sa), (b, sb), (c, sc) = run(CostModelExecutor()), run(StepByStep()), run(CostModelExecutor(), eager=True)
    assert len(a.timeline) < len(b.timeline), "the windows were never used"
    if num_pages == 60:
        assert b.preemptions > 0, "the tight case must preempt"
    key = lambda r: r["request_id"]  # noqa: E731
    for other, st in ((b, sb), (c, sc)):
        assert a.steps == other.steps and a.preemptions == other.preemptions
        assert sa.evicted_pages == st.evicted_pages
        assert a.makespan == pytest.approx(other.makespan, rel=1e-9)
        for x, y in zip(sorted(a.requests, key=key), sorted(other.requests, key=key), strict=True):
            assert x["hit_tokens_first"] == y["hit_tokens_first"] and x["computed_tokens"] == y["computed_tokens"]
            assert x["ttft"] == pytest.approx(y["ttft"], rel=1e-9)
            assert x["finished_at"] == pytest.approx(y["finished_at"], rel=1e-9)


def test_bad_serving_config():
    with pytest.raises(ValueError, match="unknown scheduler 'legacy'"):
        ServingConfig(scheduler="legacy")
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="token_budget must be a positive int"):
            ServingConfig(token_budget=bad)
    with pytest.raises(ValueError, match="max_running must be a positive int"):
        ServingConfig(max_running=0)


@pytest.mark.parametrize("scheduler,async_scheduling", POLICIES)
@pytest.mark.parametrize("backend", available_backends())
def test_parallel_sampling_every_sample_equals_its_uncached_run(backend, scheduler, async_scheduling, tiny_model):
    """The samples are fanned out into requests that share the prompt through the cache, as
    vLLM's front end does."""
    from tests.cached_runner import run_alone

    rng = np.random.default_rng(3)
    lens = (7, 4, 6)
    specs = [
        RequestSpec(f"q{i}", rng.integers(0, 512, 21, dtype=np.int32), 7, 0.0, n=3, sample_lens=lens) for i in range(3)
    ]
    cache = create_cache(backend, num_pages=120, page_size=4)
    config = ServingConfig(256, 16, scheduler=scheduler, async_scheduling=async_scheduling)
    res = serve(cache, specs, ModelExecutor(tiny_model, 120, 4), config, keep_outputs=True)
    assert len(res.requests) == 9 and res.aborted == 0
    for s in specs:
        greedy = run_alone(tiny_model, s.prompt, 7, page_size=4).tokens
        # greedy samples all follow the same path: each equals the uncached run, cut to its length
        for j, n in enumerate(lens):
            rid = s.request_id if j == 0 else f"{s.request_id}/{j}"
            assert res.outputs[rid] == greedy[:n], rid
    assert cache.stats().pages_pinned == 0
    cache.check_invariants()
    if backend != "none":
        assert cache.stats().copied_pages <= 2 * 3  # at most the partial prompt page per sample


def test_beam_search_is_refused_with_a_pointer():
    spec = RequestSpec("b", np.arange(10, dtype=np.int32), 4, beam_width=2)
    with pytest.raises(ValueError, match="sharing_memory"):
        serve(create_cache("apc", num_pages=10, page_size=4), [spec], CostModelExecutor())


def test_device_profile_calibrates_from_the_gpu_benchmark_json(tmp_path):
    import json

    from experiments.engine.executors import DEVICE_PROFILES, llama3_8b_shape

    bench = {
        "decode": [{"page_size": 1, "achieved_GBps": 2400.0}, {"page_size": 16, "achieved_GBps": 3840.0}],
        "prefill": [{"cached_tokens": 0, "model_forward": {"tokens_per_s": 20000.0}}, {"cached_tokens": 4096}],
    }
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(bench))
    h200 = DEVICE_PROFILES["h200"]
    cal = h200.calibrated(path)
    assert cal.bandwidth_efficiency == pytest.approx(3840e9 / 4.8e12)
    assert cal.flops_efficiency == pytest.approx(2 * llama3_8b_shape().num_params * 20000 / 989e12)
    assert "calibrated" in cal.name
    slower = CostModelExecutor(device=cal).step_seconds([(None, 1, 4000)] * 64)
    assert slower > CostModelExecutor(device=h200).step_seconds([(None, 1, 4000)] * 64) * 0.99
    with pytest.raises(FileNotFoundError):
        h200.calibrated(tmp_path / "missing.json")


def test_recorded_outputs_are_generated_and_reused_by_the_next_turn():
    from experiments.workloads.registry import make_workload

    # a think time far below a turn's service time: turns must still wait for their answers
    wl = make_workload("multi_turn_chat", seed=2, num_conversations=4, turns=3, rate=5.0, think_time=0.01)
    cache = create_cache("apc", num_pages=400, page_size=16)
    res = serve(cache, wl.requests, CostModelExecutor(), ServingConfig(1024, 16), keep_outputs=True)
    for spec in wl.requests:
        assert res.outputs[spec.request_id] == spec.forced_output.tolist()
    rows = {r["request_id"]: r for r in res.requests}
    for spec in wl.requests:
        if spec.after is None:
            continue
        prev = rows[spec.after]
        # it arrives its think time after the previous turn finished, and reuses that history
        assert rows[spec.request_id]["arrival"] == pytest.approx(prev["finished_at"] + spec.think_time)
        assert rows[spec.request_id]["hit_tokens_first"] >= prev["prompt_tokens"] // 16 * 16


@pytest.mark.parametrize("scheduler,async_scheduling", POLICIES)
def test_samples_carry_their_requests_trace_line(scheduler, async_scheduling):
    specs = [RequestSpec(f"q{i}", np.arange(40, dtype=np.int32) + 100 * i, 5, 0.01 * i, n=3) for i in range(4)]
    cache = create_cache("apc", num_pages=100, page_size=16)
    res = serve(
        cache,
        specs,
        CostModelExecutor(),
        ServingConfig(256, 16, scheduler=scheduler, async_scheduling=async_scheduling),
    )
    by_id = {r["request_id"]: r for r in res.requests}
    for i, s in enumerate(specs):
        for rid in (s.request_id, f"{s.request_id}/1", f"{s.request_id}/2"):
            assert by_id[rid]["request_index"] == i, rid
