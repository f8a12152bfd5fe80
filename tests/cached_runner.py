"""Test helper: runs requests through any `PrefixCache` backend and the model, the executor's
side of the contract, small enough to check that caching never changes the output.

Per request: `match` -> `admit(seq, m, prompt_len)` -> apply the `CopyOp`s -> forward the
tokens not yet computed (`seq.num_computed ..`) into `seq.page_table` -> `commit`; then
greedy decode with `seq.append` -> `grow` -> apply copies -> forward -> `commit`; `release`
at the end. Cache calls go through `CacheClient`, so the call order is checked too.
`run_alone` is the no-cache baseline the cached runs are compared with.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np
import torch

from attention.kv_cache import PagedKVCache
from attention.model import ForwardInput, LlamaModel
from cachelib import PrefixCache, Sequence
from experiments.engine.cache_client import CacheClient


class OutOfPagesError(RuntimeError):
    """The cache could not fit a request; the tests size the pool so this never happens."""


@dataclass
class RequestResult:
    """What one request produced: logits before each generated token and the tokens."""

    request_id: str
    logits: list[torch.Tensor] = field(default_factory=list)  # each (vocab,), fp32
    tokens: list[int] = field(default_factory=list)
    hit_tokens: int = 0

    @property
    def stacked_logits(self) -> torch.Tensor:
        return torch.stack(self.logits)  # (steps, vocab)


def run_alone(
    model: LlamaModel,
    prompt: Seq[int] | np.ndarray,
    max_new_tokens: int,
    *,
    forced: Seq[int] | Mapping[int, int] = (),
    page_size: int = 16,
) -> RequestResult:
    """The request by itself: private contiguous pages, whole prompt in one forward, no cache.

    `forced` overrides greedy choices: a sequence for the first steps, or `{step: token}`
    (a sampled branch of a fork).
    """
    force = dict(forced) if isinstance(forced, Mapping) else dict(enumerate(forced))
    prompt = np.asarray(prompt, dtype=np.int32)
    total = prompt.size + max_new_tokens
    kv = model.make_kv_cache(-(-total // page_size), page_size)
    table = list(range(kv.num_pages))
    res = RequestResult("alone")
    logits = model.forward([ForwardInput(prompt, 0, table)], kv)[0]
    n = prompt.size
    for step in range(max_new_tokens):
        nxt = int(force[step]) if step in force else int(torch.argmax(logits))
        res.logits.append(logits)
        res.tokens.append(nxt)
        if step + 1 < max_new_tokens:
            logits = model.forward([ForwardInput(np.array([nxt], np.int32), n, table)], kv)[0]
            n += 1
    return res


class CachedRunner:
    """Drives sequences through `cache` and `model`, moving KV in `kv` as the cache asks."""

    def __init__(
        self, model: LlamaModel, cache: PrefixCache, *, prefill_chunk: int | None = None, check: bool = True
    ) -> None:
        self.model = model
        self.cache = cache
        self.client = CacheClient(cache)
        self.kv: PagedKVCache = model.make_kv_cache(cache.num_pages, cache.page_size)
        self.prefill_chunk = prefill_chunk
        self.check = check
        self.copied_pages = 0
        self.hits: dict[str, int] = {}  # request id -> prompt tokens the cache supplied

    def _apply(self, ops) -> None:
        if ops is None:
            raise OutOfPagesError("the cache has no room; give it more pages")
        self.copied_pages += self.kv.apply(ops)

    def _checked(self) -> None:
        if self.check:
            self.cache.check_invariants()

    def prefill(self, seq: Sequence) -> torch.Tensor:
        """Admit `seq` and compute the prompt tokens the cache did not supply; returns the
        logits `(vocab,)` at the last prompt token."""
        m = self.client.match(seq)
        self._apply(self.client.admit(seq, m, seq.prompt_len))
        self._checked()
        self.hits[seq.request_id] = seq.num_computed
        logits = None
        chunk = self.prefill_chunk or seq.prompt_len
        while seq.num_computed < seq.prompt_len:
            start = seq.num_computed
            end = min(start + chunk, seq.prompt_len)
            logits = self.model.forward([ForwardInput(seq.tokens[start:end], start, seq.page_table)], self.kv)[0]
            self.client.commit(seq, end)
            self._checked()
        if logits is None:  # contract says a match leaves >= 1 token; guard anyway
            raise RuntimeError(f"{seq.request_id}: the cache supplied the whole prompt; nothing to compute")
        return logits

    def fork(self, parent: Sequence, request_id: str) -> Sequence:
        """A child continuing from `parent`'s tokens and KV (parallel sampling)."""
        child = parent.fork(request_id)
        self._apply(self.client.fork(parent, child))
        self._checked()
        return child

    def decode(self, seqs: list[Sequence], next_tokens: list[int]) -> torch.Tensor:
        """Append one token to each sequence and run them as one batch; logits `(B, vocab)`."""
        batch = []
        for seq, tok in zip(seqs, next_tokens, strict=True):
            seq.append(np.array([tok], dtype=np.int32))
            self._apply(self.client.grow(seq, len(seq)))  # CoW copies before anything is written
        for seq in seqs:
            if seq.num_computed != len(seq) - 1:
                raise RuntimeError(f"{seq.request_id}: {seq.num_computed} computed, expected {len(seq) - 1}")
            batch.append(ForwardInput(seq.tokens[-1:], len(seq) - 1, seq.page_table))
        logits = self.model.forward(batch, self.kv)
        for seq in seqs:
            self.client.commit(seq, len(seq))
        self._checked()
        return logits

    def generate(
        self,
        seqs: list[Sequence],
        first_logits: list[torch.Tensor],
        max_new_tokens: int,
        forced: dict[str, Seq[int]] | None = None,
    ) -> dict[str, RequestResult]:
        """Greedy decode of admitted, prefilled sequences, batched; `forced` overrides the first choices."""
        forced = forced or {}
        results = {s.request_id: RequestResult(s.request_id) for s in seqs}
        logits = list(first_logits)
        for step in range(max_new_tokens):
            toks = []
            for s, lg in zip(seqs, logits, strict=True):
                f = forced.get(s.request_id, ())
                tok = int(f[step]) if step < len(f) else int(torch.argmax(lg))
                results[s.request_id].logits.append(lg)
                results[s.request_id].tokens.append(tok)
                toks.append(tok)
            if step + 1 < max_new_tokens:
                logits = list(self.decode(seqs, toks))
        return results

    def release(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.client.release(seq)
        self._checked()

    def run(
        self, prompts: dict[str, Seq[int] | np.ndarray], max_new_tokens: int, *, concurrency: int = 4
    ) -> dict[str, RequestResult]:
        """Requests in order, `concurrency` at a time: prefill each (later ones can hit what
        earlier ones committed, pinned or not), decode the group together, release it."""
        out: dict[str, RequestResult] = {}
        items = list(prompts.items())
        for g in range(0, len(items), concurrency):
            group = [Sequence(rid, np.asarray(p, dtype=np.int32)) for rid, p in items[g : g + concurrency]]
            first = [self.prefill(seq) for seq in group]
            res = self.generate(group, first, max_new_tokens)
            self.release(group)
            for rid, r in res.items():
                r.hit_tokens = self.hits[rid]
            out.update(res)
        return out
