"""The parallel-sampling / beam-search generator and the sharing-memory benchmark driver."""

from __future__ import annotations

import numpy as np
import pytest

from cachelib import available_backends
from experiments.bench.sharing_memory import run
from experiments.workloads.sampling import SHAPES, beam_schedule, describe, generate


def test_generation_is_seeded_and_deterministic() -> None:
    a = generate("alpaca", "parallel", 4, 30, seed=3)
    b = generate("alpaca", "parallel", 4, 30, seed=3)
    c = generate("alpaca", "parallel", 4, 30, seed=4)
    assert [r.sample_output_lens for r in a] == [r.sample_output_lens for r in b]
    assert all(np.array_equal(x.spec.prompt, y.spec.prompt) for x, y in zip(a, b, strict=True))
    assert [r.spec.prompt.size for r in a] != [r.spec.prompt.size for r in c]


def test_smaller_n_is_a_prefix_of_larger_n_and_prompts_are_shared_across_modes() -> None:
    four = generate("sharegpt", "parallel", 4, 20)
    six = generate("sharegpt", "parallel", 6, 20)
    beams = generate("sharegpt", "beam", 2, 20)
    for r4, r6, rb in zip(four, six, beams, strict=True):
        assert r6.sample_output_lens[:4] == r4.sample_output_lens
        assert np.array_equal(r4.spec.prompt, rb.spec.prompt)
        assert r4.spec.n == 4 and r6.spec.n == 6 and rb.spec.beam_width == 2
        assert r4.spec.output_len == max(r4.sample_output_lens)
        assert rb.spec.output_len == r4.sample_output_lens[0] == len(rb.beam_parents)


@pytest.mark.parametrize("dataset", sorted(SHAPES))
def test_lengths_follow_the_stated_shape(dataset: str) -> None:
    shape = SHAPES[dataset]
    reqs = generate(dataset, "parallel", 2, 4000)
    prompts = np.array([r.spec.prompt.size for r in reqs])
    outputs = np.array([x for r in reqs for x in r.sample_output_lens])
    assert prompts.min() >= shape.min_prompt and outputs.min() >= shape.min_output
    assert all(r.spec.prompt.size + max(r.sample_output_lens) <= shape.max_total for r in reqs)
    # clipping trims the upper tail a little: the means land within 10% of the targets
    assert abs(prompts.mean() / shape.prompt_mean - 1) < 0.1
    assert abs(outputs.mean() / shape.output_mean - 1) < 0.1
    assert np.std(np.log(prompts)) == pytest.approx(shape.prompt_sigma, rel=0.2)
    d = describe(dataset, reqs)
    assert d["realised_means"]["prompt"] == pytest.approx(prompts.mean())
    assert reqs[0].spec.prompt.dtype == np.int32


def test_beam_schedule_rows_are_sorted_valid_parents() -> None:
    rng = np.random.default_rng(0)
    sched = beam_schedule(rng, 4, 50, 0.5)
    assert sched.shape == (50, 4) and (sched[0] == 0).all()
    assert (np.diff(sched, axis=1) >= 0).all() and sched.min() >= 0 and sched.max() < 4
    assert (beam_schedule(rng, 3, 20, 0.5, stay=1.0)[1:] == np.arange(3)).all()  # no forks after step 0
    with pytest.raises(ValueError):
        beam_schedule(rng, 0, 5, 0.5)
    with pytest.raises(ValueError):
        generate("c4", "beam", 2, 3)
    with pytest.raises(ValueError):
        generate("alpaca", "greedy", 2, 3)


@pytest.mark.parametrize("mode", ["parallel", "beam"])
def test_benchmark_driver_on_every_backend(mode: str) -> None:
    reqs = generate("alpaca", mode, 4, 12, seed=1)
    results = {b: run(b, reqs, page_size=16, concurrency=4) for b in available_backends()}
    assert results["none"]["saving_pct"] == 0.0  # none copies everything on fork
    logical = {r["block_steps_logical"] for r in results.values()}
    assert len(logical) == 1  # the same schedule on every backend
    if "paged" in results and "apc" in results:
        # paged shares everything apc shares, plus the partial block until it is written
        assert results["paged"]["saving_pct"] >= results["apc"]["saving_pct"] > 0
        assert results["paged"]["peak_pages"] <= results["none"]["peak_pages"]
