"""A waiting request holds no `Sequence` until its scheduler first considers it.

`VllmScheduler.sequence` builds a request's sequence (its prompt's tokens, with room for its
output) when the policy first needs it, to match or admit the request: built at arrival,
a long waiting queue held every waiting prompt's tokens (on the Mooncake conversation trace
most of a serving run's memory). What a run decides is unchanged (the engine goldens, the
real-vLLM goldens and the fidelity tests run through it); here: when sequences are built,
that each prompt is built once, and what reads a waiting request without one.
"""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import create_cache
from experiments.engine import ServingConfig
from experiments.engine.cache_client import CacheClient
from experiments.engine.clock import VirtualClock
from experiments.engine.executors import FixedStepExecutor
from experiments.engine.serving import drive, drive_async
from experiments.engine.vllm import VllmScheduler
from experiments.workloads.spec import RequestSpec

PAGE = 4
PROMPT = 40  # tokens: 10 pages
OUTPUT = 6


class CountingPrompt:
    """A lazy prompt source (as a trace's: it knows its length) that counts its builds."""

    def __init__(self, tokens: np.ndarray) -> None:
        self.tokens = tokens
        self.built = 0

    def __len__(self) -> int:
        return self.tokens.size

    def __call__(self) -> np.ndarray:
        self.built += 1
        return self.tokens.copy()


def requests(n: int) -> tuple[list[RequestSpec], list[CountingPrompt]]:
    """`n` requests arriving at once, prompts of distinct tokens (no hits)."""
    sources = [CountingPrompt(np.arange(i * PROMPT, (i + 1) * PROMPT, dtype=np.int32)) for i in range(n)]
    return [RequestSpec(f"r{i}", src, OUTPUT, 0.0) for i, src in enumerate(sources)], sources


def scheduler(specs: list[RequestSpec], num_pages: int, **config) -> VllmScheduler:
    """The policy over an apc cache of `num_pages` pages, the requests not added yet."""
    cache = create_cache("apc", num_pages=num_pages, page_size=PAGE)
    return VllmScheduler(CacheClient(cache), FixedStepExecutor(0.01), ServingConfig(**config), VirtualClock(specs))


def added(s: VllmScheduler, specs: list[RequestSpec]) -> VllmScheduler:
    for i, spec in enumerate(specs):
        s.add(spec, 0.0, i)
    return s


#: room for about two requests at a time
TWO = 2 * (PROMPT + OUTPUT) // PAGE + 2


def test_a_waiting_request_holds_no_sequence_until_it_is_considered():
    specs, sources = requests(20)
    s = added(scheduler(specs, TWO), specs)
    assert all(r.seq is None for r in s.waiting)
    assert sum(src.built for src in sources) == 0  # arrival builds no prompt
    s.step()
    admitted = list(s.running)
    assert 1 <= len(admitted) <= 3
    assert all(r.seq is not None and r.seq.prompt_len == PROMPT for r in admitted)
    # the head the pass stopped at was matched (so built); every request behind it is untouched
    behind = list(s.waiting)[1:]
    assert behind and all(r.seq is None for r in behind)
    assert all(sources[int(r.spec.request_id[1:])].built == 0 for r in behind)


@pytest.mark.parametrize(
    ("drive_loop", "config"), [(drive, {}), (drive_async, {"async_scheduling": True})], ids=["sync", "async"]
)
def test_every_prompt_is_built_once_over_a_run(drive_loop, config):
    specs, sources = requests(20)
    s = scheduler(specs, TWO, **config)
    drive_loop(s.clock, s, {spec.request_id: i for i, spec in enumerate(specs)})
    assert sorted(rec["request_id"] for rec in s.result.requests) == sorted(spec.request_id for spec in specs)
    assert all(rec["output_tokens"] == OUTPUT for rec in s.result.requests)
    assert s.result.preemptions == 0  # (a preempted request keeps its tokens: still one build)
    assert [src.built for src in sources] == [1] * 20


def test_loads_count_a_waiting_requests_whole_prompt_without_building_it():
    specs, sources = requests(5)
    s = added(scheduler(specs, 64), specs)
    assert s.loads() == (5 * (PROMPT + OUTPUT), 5 * PROMPT, 5 * (PROMPT // PAGE))  # outstanding, prefill, pages
    assert sum(src.built for src in sources) == 0
