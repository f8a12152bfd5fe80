"""Multi-turn chat: every turn re-sends the conversation so far (previous user turns and answers)."""

from __future__ import annotations

import numpy as np

from experiments.workloads.generators import (
    ConcatPrompt,
    Workload,
    common_knobs,
    json_config,
    make_rng,
    poisson_arrivals,
    random_tokens,
    require_float,
    require_int,
    sample_lengths,
    sort_by_arrival,
)
from experiments.workloads.spec import RequestSpec


def multi_turn_chat(
    seed: int = 0,
    *,
    num_conversations: int = 20,
    turns: int = 5,
    system_len: int = 0,
    user_turn_len: int = 100,
    answer_len: int = 128,
    answer_dist: str = "fixed",
    think_time: float = 5.0,
    rate: float = 1.0,
    vocab_size: int = 32000,
) -> Workload:
    """Multi-turn chat: conversations whose history is re-sent each turn.

    Turn t's prompt is `system + user_0 + answer_0 + ... + answer_{t-1} + user_t`; its
    output is `answer_t`. The answers are generated here, deterministically, and stored on
    each request (`RequestSpec.forced_output`); the engine (replay and serving) makes each
    request generate exactly its answer, so the next turn can reuse the answer's KV as a real
    conversation does. In the serving protocol a turn arrives its think time after the
    previous turn finishes (`RequestSpec.after`); `arrival` (think times after the
    conversation's start) orders the replay protocol.

    Knobs:
    - num_conversations (20): conversations.
    - turns (5): requests per conversation.
    - system_len (0): tokens of a system prompt shared by every conversation.
    - user_turn_len (100): tokens of each user message.
    - answer_len (128), answer_dist ("fixed"): answer length mean and its distribution
      (fixed | uniform | exponential); a request's output_len is its answer's length.
    - think_time (5.0): mean seconds (exponential) between a turn's arrival and the next
      turn's, so the turns of a conversation arrive in order.
    - rate (1.0): Poisson rate of conversation starts, conversations/s (inf: all at 0).
    - vocab_size (32000): token ids are drawn from [0, vocab_size).
    """
    config = json_config(**locals())  # first, so locals() holds exactly the knobs
    require_int("num_conversations", num_conversations, 0)
    require_int("turns", turns)
    require_int("system_len", system_len, 0)
    require_int("user_turn_len", user_turn_len)
    require_float("think_time", think_time, finite=True)  # inf: a next turn that never arrives
    common_knobs(vocab_size, rate, answer_len, answer_dist)
    rng = make_rng(seed, "multi_turn_chat")
    system = random_tokens(rng, system_len, vocab_size)
    starts = poisson_arrivals(rng, num_conversations, rate)
    requests: list[RequestSpec] = []
    for c in range(num_conversations):
        answer_lens = sample_lengths(rng, turns, answer_len, answer_dist)
        gaps = rng.exponential(think_time, turns - 1) if think_time > 0 else np.zeros(turns - 1)
        arrivals = starts[c] + np.concatenate([[0.0], np.cumsum(gaps)])
        history: tuple[np.ndarray, ...] = (system,)  # parts, shared by every later turn's prompt
        for t in range(turns):
            prompt = ConcatPrompt((*history, random_tokens(rng, user_turn_len, vocab_size)))
            answer = random_tokens(rng, int(answer_lens[t]), vocab_size)
            rid = f"conv{c}-turn{t}"
            prev = f"conv{c}-turn{t - 1}" if t else None
            think = float(gaps[t - 1]) if t else 0.0
            requests.append(
                RequestSpec(
                    rid,
                    prompt,
                    int(answer.size),
                    float(arrivals[t]),
                    after=prev,
                    think_time=think,
                    forced_output=answer,
                )
            )
            history = (*prompt.parts, answer)
    return Workload("multi_turn_chat", sort_by_arrival(requests), config=config)
