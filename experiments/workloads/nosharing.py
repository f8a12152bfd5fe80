"""No sharing: random prompts with nothing in common (the control)."""

from __future__ import annotations

from experiments.workloads.generators import (
    OUTPUT_DISTS,
    Workload,
    common_knobs,
    json_config,
    make_rng,
    poisson_arrivals,
    random_tokens,
    require_choice,
    require_int,
    sample_lengths,
)
from experiments.workloads.spec import RequestSpec


def no_sharing(
    seed: int = 0,
    *,
    num_requests: int = 200,
    prompt_len: int = 512,
    prompt_dist: str = "uniform",
    output_len: int = 64,
    output_dist: str = "fixed",
    rate: float = 10.0,
    vocab_size: int = 32000,
) -> Workload:
    """No sharing: independent random prompts, the control where no cache can help.

    With the default vocabulary two prompts share a 16-token block with probability about
    32000**-16 per pair; a tiny vocab_size makes accidental sharing likely.

    Knobs:
    - num_requests (200): requests generated.
    - prompt_len (512), prompt_dist ("uniform"): prompt length mean and its distribution
      (fixed | uniform | exponential).
    - output_len (64), output_dist ("fixed"): output length mean and distribution.
    - rate (10.0): Poisson arrival rate, requests/s (inf: all at time 0).
    - vocab_size (32000): token ids are drawn from [0, vocab_size).
    """
    config = json_config(**locals())  # first, so locals() holds exactly the knobs
    require_int("num_requests", num_requests, 0)
    require_int("prompt_len", prompt_len)
    require_choice("prompt_dist", prompt_dist, OUTPUT_DISTS)
    common_knobs(vocab_size, rate, output_len, output_dist)
    rng = make_rng(seed, "no_sharing")
    in_lens = sample_lengths(rng, num_requests, prompt_len, prompt_dist)
    out_lens = sample_lengths(rng, num_requests, output_len, output_dist)
    arrivals = poisson_arrivals(rng, num_requests, rate)
    requests = [
        RequestSpec(f"rand-{i}", random_tokens(rng, int(in_lens[i]), vocab_size), int(out_lens[i]), float(arrivals[i]))
        for i in range(num_requests)
    ]
    return Workload("no_sharing", requests, config=config)
