"""K-shot prefixes (PagedAttention §6.4): an instruction and k translation examples, then the input."""

from __future__ import annotations

from experiments.workloads.generators import (
    OUTPUT_DISTS,
    ConcatPrompt,
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

# §6.4 shares a one-shot prefix of 80 tokens and a five-shot prefix of 341 tokens (WMT16
# En-De); a 15-token instruction and these example lengths give exactly those sizes.
WMT16_EXAMPLE_LENS = (65, 65, 65, 65, 66)
WMT16_INSTRUCTION_LEN = 15


def kshot_prefix_len(
    num_shots: int, instruction_len: int = WMT16_INSTRUCTION_LEN, example_lens: tuple[int, ...] = WMT16_EXAMPLE_LENS
) -> int:
    """Tokens of the shared prefix with `num_shots` examples (1 -> 80, 5 -> 341 by default)."""
    return instruction_len + sum(example_lens[:num_shots])


def kshot(
    seed: int = 0,
    *,
    num_shots: int = 1,
    num_tasks: int = 1,
    instruction_len: int = WMT16_INSTRUCTION_LEN,
    example_lens: tuple[int, ...] = WMT16_EXAMPLE_LENS,
    input_len: int = 30,
    input_dist: str = "uniform",
    num_requests: int = 200,
    output_len: int = 30,
    output_dist: str = "uniform",
    rate: float = 10.0,
    vocab_size: int = 32000,
    declare: bool = True,
) -> Workload:
    """K-shot prefixes: a declared instruction + k examples shared by every request of a task.

    The shape of PagedAttention §6.4 (WMT16 translation with few-shot examples): with the
    defaults the shared prefix is 80 tokens for 1 shot and 341 for 5 shots. Each request is
    `prefix(task) + input`; the prefix has id `task + 1` in `declared_prefixes`.

    Knobs:
    - num_shots (1): examples in the prefix, 1..len(example_lens).
    - num_tasks (1): distinct prefixes (different instructions and examples); each request
      picks one uniformly.
    - instruction_len (15): tokens of the instruction that opens the prefix.
    - example_lens ((65, 65, 65, 65, 66)): tokens of example 1, 2, ...; the first num_shots
      are used.
    - input_len (30), input_dist ("uniform"): the sentence to translate, mean length and
      distribution (fixed | uniform | exponential).
    - num_requests (200): requests generated.
    - output_len (30), output_dist ("uniform"): the translation's length.
    - rate (10.0): Poisson arrival rate, requests/s (inf: all at time 0).
    - vocab_size (32000): token ids are drawn from [0, vocab_size).
    - declare (True): set each request's prefix_id; False leaves sharing to automatic caches.
    """
    config = json_config(**locals())  # first, so locals() holds exactly the knobs
    example_lens = tuple(example_lens)
    if not example_lens:
        raise ValueError("knob example_lens must name at least one example length")
    for i, n in enumerate(example_lens):
        require_int(f"example_lens[{i}]", n)
    require_int("num_shots", num_shots, 1, len(example_lens))
    require_int("num_tasks", num_tasks)
    require_int("instruction_len", instruction_len, 0)
    require_int("input_len", input_len)
    require_choice("input_dist", input_dist, OUTPUT_DISTS)
    require_int("num_requests", num_requests, 0)
    common_knobs(vocab_size, rate, output_len, output_dist)
    rng = make_rng(seed, "kshot")
    prefix_len = kshot_prefix_len(num_shots, instruction_len, example_lens)
    prefixes = {k + 1: random_tokens(rng, prefix_len, vocab_size) for k in range(num_tasks)}
    tasks = rng.integers(0, num_tasks, num_requests)
    in_lens = sample_lengths(rng, num_requests, input_len, input_dist)
    out_lens = sample_lengths(rng, num_requests, output_len, output_dist)
    arrivals = poisson_arrivals(rng, num_requests, rate)
    requests = []
    for i in range(num_requests):
        pid = int(tasks[i]) + 1
        prompt = ConcatPrompt((prefixes[pid], random_tokens(rng, int(in_lens[i]), vocab_size)))
        requests.append(
            RequestSpec(
                f"{num_shots}shot-t{pid - 1}-{i}",
                prompt,
                int(out_lens[i]),
                float(arrivals[i]),
                prefix_id=pid if declare else None,
            )
        )
    return Workload("kshot", requests, prefixes if declare else {}, config)
