"""Shared-document QA: each request is one document followed by a fresh question about it."""

from __future__ import annotations

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
    zipf_weights,
)
from experiments.workloads.spec import RequestSpec


def shared_doc_qa(
    seed: int = 0,
    *,
    num_documents: int = 20,
    doc_len: int = 2000,
    question_len: int = 40,
    zipf_a: float = 1.0,
    num_requests: int = 200,
    output_len: int = 64,
    output_dist: str = "fixed",
    rate: float = 10.0,
    vocab_size: int = 32000,
    declare_documents: bool = False,
) -> Workload:
    """Shared-document QA: documents x questions, Zipf popularity of documents.

    Knobs:
    - num_documents (20): distinct documents.
    - doc_len (2000): tokens per document (the shared prefix).
    - question_len (40): tokens of the question; every request gets a fresh one.
    - zipf_a (1.0): document of popularity rank r is asked about with probability
      proportional to 1 / r**zipf_a; 0 = uniform, larger = a few hot documents. Document 0
      is the most popular.
    - num_requests (200): requests generated.
    - output_len (64), output_dist ("fixed"): answer length mean and its distribution
      (fixed | uniform | exponential).
    - rate (10.0): Poisson arrival rate, requests/s (inf: all at time 0).
    - vocab_size (32000): token ids are drawn from [0, vocab_size).
    - declare_documents (False): declare each document as a prefix (id = document index
      + 1) so `paged` can share it.
    """
    config = json_config(**locals())  # first, so locals() holds exactly the knobs
    require_int("num_documents", num_documents)
    require_int("doc_len", doc_len)
    require_int("question_len", question_len)
    require_float("zipf_a", zipf_a)
    require_int("num_requests", num_requests, 0)
    common_knobs(vocab_size, rate, output_len, output_dist)
    rng = make_rng(seed, "shared_doc_qa")
    docs = [random_tokens(rng, doc_len, vocab_size) for _ in range(num_documents)]
    picks = rng.choice(num_documents, size=num_requests, p=zipf_weights(num_documents, zipf_a))
    questions = random_tokens(rng, num_requests * question_len, vocab_size).reshape(num_requests, question_len)
    out_lens = sample_lengths(rng, num_requests, output_len, output_dist)
    arrivals = poisson_arrivals(rng, num_requests, rate)
    requests = [
        RequestSpec(
            f"doc{int(d)}-q{i}",
            ConcatPrompt((docs[d], questions[i])),
            int(out_lens[i]),
            float(arrivals[i]),
            prefix_id=int(d) + 1 if declare_documents else None,
        )
        for i, d in enumerate(picks)
    ]
    declared = {d + 1: docs[d] for d in sorted(set(map(int, picks)))} if declare_documents else {}
    return Workload("shared_doc_qa", requests, declared, config)
