"""The `vllm` scheduling policy, rule by rule, on hand-made cases checked against the real vLLM 0.33.

Each case is a few requests on a tiny KV cache (a few blocks of 16 tokens) built to exercise one
rule of vLLM 0.33's V1 scheduler (issue 11; the rules as read in the source are in
tests/fixtures/vllm_0_33/README.md, "What the source says"). The expected numbers are literals
made by the REAL vLLM 0.33.0 (its own `Scheduler` / `AsyncScheduler`, `KVCacheManager`,
`BlockPool`), driven by scripts/vllm_reference/run_vllm.py (fake model runner, 20 ms per
non-empty step). The comment on each case derives them by hand from the rules, so a reader can
check them without running vLLM. Per request the project must give exactly vLLM's
hit_tokens_first, preemptions, first_token_step and finish_step, and first_token_at /
finished_at equal to vLLM's first_token_ms / finish_ms (/ 1000, within 1e-9 s). A second test
checks that the expectations themselves show their rule (`shows`), so no case passes vacuously.

Regenerate / check the literals (side venv with vLLM 0.33.0, see scripts/vllm_reference/README.md):

    /work/vllm-venv/bin/python scripts/vllm_reference/rule_cases.py            # compare with real vLLM
    /work/vllm-venv/bin/python scripts/vllm_reference/rule_cases.py --print    # fresh `Row(...)` lines
    /work/vllm-venv/bin/python scripts/vllm_reference/rule_cases.py --write    # rewrite them here
    /work/vllm-venv/bin/python scripts/vllm_reference/rule_cases.py --mutants  # each case depends on its rule

(`--write` rewrites only the numbers inside the `Row(...)` of each case's `expect`; the comments
that explain them must then be re-read by hand. `--mutants` reruns the cases on copies of vLLM's
scheduler with one rule changed, e.g. the first running request as the victim, and checks that
the cases written for that rule change.) The script imports this module with a stub for pytest;
keep its top level free of project imports (they are inside `project_rows`).

Conventions used in the comments: requests are A, B, C, ... in input order; "step k" is the
k-th non-empty batch (0-based) and ends at 20 ms * (k + 1) while the engine stays busy; a
request's blocks = ceil(tokens / 16); the capacity is in tokens (apc `num_pages * 16`; vLLM gets
capacity/16 + 1 blocks, one being BlockPool's null block). "free" counts free blocks, cached
blocks nobody holds (evictable) included, as vLLM's `get_num_free_blocks` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

BLOCK = 16
STEP_S = 0.02


@dataclass(frozen=True)
class Req:
    """A request: prompt as segments (first token id, length) of consecutive ids, so two
    prompts share tokens only where they share a segment; output length; arrival (s)."""

    prompt: tuple[tuple[int, int], ...]
    output_len: int
    arrival: float = 0.0

    def tokens(self) -> list[int]:
        return [t for first, n in self.prompt for t in range(first, first + n)]


@dataclass(frozen=True)
class Row:
    """One request's outcome, as vLLM records it (run_vllm.py's records)."""

    hit: int  # hit_tokens_first: prefix-cache hit tokens at first admission
    preemptions: int
    first_step: int  # first_token_step
    finish_step: int
    first_ms: float  # first_token_ms (end of the batch that sampled the first token)
    finish_ms: float


@dataclass(frozen=True)
class Case:
    name: str
    rule: str
    capacity: int  # tokens: apc num_pages * 16
    reqs: tuple[Req, ...]
    expect: tuple[Row, ...]
    shows: Callable[[list[Row]], None]  # asserts the rows exercise `rule` (given vLLM's or the project's rows)
    budget: int = 8192  # max_num_batched_tokens / token_budget
    max_seqs: int = 8  # max_num_seqs / max_running (vLLM wants budget >= max_num_seqs)
    async_sched: bool = False


def seg(first: int, n: int) -> tuple[int, int]:
    return (first, n)


# Shared prefixes (ids far from the private ones).
S48 = seg(900_000, 48)
S32 = seg(900_000, 32)
T32 = seg(800_000, 32)


# ---------------------------------------------------------------------------------------------
# What each case must show (run on the literal expectations and on the project's rows): the
# outcome that distinguishes the rule from its plausible alternatives. `rule_cases.py --mutants`
# checks on vLLM itself that changing the rule changes these cases.


def shows_budget_split(r: list[Row]) -> None:
    a, b, c = r
    assert a.first_step == 1  # A's 40 tokens > the 32-token budget: two chunks
    assert b.first_step == 2  # B admitted with the 24 tokens A's last chunk left, finished a step later
    assert c.first_step == 3  # C's 20 tokens fit the budget, yet running requests came first: 15 + 5


def shows_preempt_last(r: list[Row]) -> None:
    a, b, c, d = r
    # A needed the block; C, the LAST running request, was the victim; B (in between) untouched.
    assert (a.preemptions, b.preemptions, c.preemptions, d.preemptions) == (0, 0, 1, 0)
    # C was put in FRONT of D (waiting since 1 ms): re-admitted the step after A's finish (its
    # last 5 tokens at A.finish + 1 .. A.finish + 5); D fits only once B has finished too.
    assert c.finish_step == a.finish_step + 5
    assert d.first_step == b.finish_step + 1 > a.finish_step + 1


def shows_preempt_self(r: list[Row]) -> None:
    a, b = r
    # B needed the block and was itself the last running request: B preempted, A kept running.
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert b.finish_step == a.finish_step + 2  # back the step after A's finish, 2 tokens to go


def shows_fit_stops_pass(r: list[Row]) -> None:
    a, b, c = r
    # C (1 block) fitted in the block free from step 1 on, but B (2 blocks) ahead of it did not:
    # C waited for B, i.e. for A's finish.
    assert c.first_step == b.first_step == a.finish_step + 1 > 1


def shows_fit_whole_prompt(r: list[Row]) -> None:
    a, b = r
    # B's first 12- or 16-token chunk would have fitted in the free block; its whole prompt did not.
    assert b.first_step == a.finish_step + 2  # two chunks after A's finish


def shows_fit_evictable_hit(r: list[Row]) -> None:
    a, b, c = r
    # C hit B's 2 cached blocks and its 2 new blocks fitted in the 3 free ones, yet it waited for A:
    # its hit blocks are evictable, so they count in what it needs (2 + 2 > 3).
    assert c.hit == 32
    assert c.first_step == a.finish_step + 1 > 1


def shows_evictable_free(r: list[Row]) -> None:
    a, b, c = r
    assert b.first_step == 1  # B admitted at once on A's cached (evictable) blocks ...
    assert c.hit == 0  # ... which it evicted: A's prompt again finds nothing


def shows_same_step_hit(r: list[Row]) -> None:
    a, b = r
    # B hit A's 48 shared tokens in the very step that admitted both, before A ever ran.
    assert (a.hit, b.hit) == (0, 48)
    assert a.first_step == b.first_step == 0


def shows_hit_cap(r: list[Row]) -> None:
    a, b, c = r
    assert b.hit == 16  # A's 32 tokens again, all cached: capped at 31 -> one full block
    assert c.hit == 32  # the same 32 + 1 token: both blocks


def shows_last_token_no_kv(r: list[Row]) -> None:
    (a,) = r
    # 16 + 17 = 33 tokens on 2 blocks (32 slots): the last token never needs a slot.
    assert a.preemptions == 0
    assert a.finish_step == 16


def shows_sync_twin(r: list[Row]) -> None:
    a, b = r
    assert a.finish_step == 2 and b.first_step == 1


def shows_async_differs(r: list[Row]) -> None:
    assert _rows_tuple(r) != _rows_tuple(CASE["async_sync_twin"].expect)
    a, b = r
    assert b.first_step == 2  # admission slips a step (sync: 1)
    assert a.finish_step == 2  # A's 3 tokens in consecutive batches 0, 1, 2


def shows_async_gate(r: list[Row]) -> None:
    a, b, c = r
    # B preempted itself at step 1; C (2 blocks, 2 free then) was not admitted in that step, and
    # afterwards B (3 blocks) stood in front of it until A finished.
    assert b.preemptions == 1
    assert c.first_step == a.finish_step + 1 > 1


def shows_stale_token_delivered(r: list[Row]) -> None:
    a, b = r
    # B preempted itself with its first token in flight: that token still counts (first_step 0),
    # and B resumes after it.
    assert b.preemptions == 1 and b.first_step == 0
    assert b.finish_step == a.finish_step + 2


def shows_stale_last_token(r: list[Row]) -> None:
    a, b = r
    # B was preempted (for A's block) while its last token was in flight: it finishes with that
    # batch, never re-admitted.
    assert b.preemptions == 1
    assert b.finish_step == 1 < a.finish_step


def _rows_tuple(rows) -> list[tuple]:
    return [(x.hit, x.preemptions, x.first_step, x.finish_step) for x in rows]


# ---------------------------------------------------------------------------------------------
# The cases. Expectations: Row(hit, preemptions, first_step, finish_step, first_ms, finish_ms).

CASES: list[Case] = [
    # Rule 1, budget split. 20 blocks (memory never short), budget 32.
    # step 0: nothing running; waiting A gets min(40, 32) = 32 tokens, budget spent (B, C wait).
    #         A's chunk stops short of its 40 known tokens: no token sampled.
    # step 1: running first: A's rest, 8 tokens -> A's 1st token; 24 left -> B admitted, 24 of 40.
    # step 2: A decode 1 (2nd), B's rest 16 (B's 1st); 15 left -> C admitted, 15 of 20.
    # step 3: A 1 (3rd: finish), B 1 (2nd: finish), C's rest 5 (C's 1st).
    # step 4: C 1 (2nd: finish). Step k ends at 20 * (k + 1) ms.
    Case(
        name="budget_split_running_first",
        rule="1 budget split",
        capacity=320,
        budget=32,
        reqs=(
            Req((seg(1000, 40),), 3),  # A
            Req((seg(2000, 40),), 2),  # B
            Req((seg(3000, 20),), 2),  # C
        ),
        expect=(
            Row(0, 0, 1, 3, 40.0, 80.0),  # A
            Row(0, 0, 2, 3, 60.0, 80.0),  # B
            Row(0, 0, 3, 4, 80.0, 100.0),  # C
        ),
        shows=shows_budget_split,
    ),
    # Rule 2, victim = the LAST running request, requeued at the FRONT. 6 blocks.
    # step 0: A 30 (2 blocks), B 20 (2), C 20 (2): 0 free; each samples its 1st token. D (40
    #         tokens, 3 blocks) arrives at 1 ms and waits (3 > 0 free).
    # steps 1, 2: decodes write A's positions 30, 31 and B's, C's 20, 21: all in their 2nd blocks.
    # step 3: A writes position 32: a 3rd block, none free -> the last running request, C, is
    #         preempted (blocks freed, computed reset, put at the FRONT of waiting, ahead of D);
    #         A's retry takes one of C's 2 blocks (C's full first block stays cached). B (position
    #         22) carries on. No admission in this step.
    #         C now has 20 + 3 = 23 tokens: 2 blocks, hit 16 (its own cached block, evictable,
    #         so it counts): needs 2 > 1 free -> waits, and D behind it (rule 4).
    # step 7: A's 8th token: finish, 3 blocks back -> 4 free.
    # step 8: B decodes; C re-admitted (hit 16, computes its 7 other tokens) samples its 4th token
    #         -> 2 free; D (3 blocks) does not fit. C's 5th..8th: steps 9..12 (finish step 12).
    # step 11: B's 12th token: finish -> 4 free. step 12: D admitted (1st token); step 13: 2nd.
    Case(
        name="preempt_last_running",
        rule="2 preemption: victim and requeue",
        capacity=96,
        budget=128,
        reqs=(
            Req((seg(1000, 30),), 8),  # A
            Req((seg(2000, 20),), 12),  # B
            Req((seg(3000, 20),), 8),  # C
            Req((seg(4000, 40),), 2, 0.001),  # D
        ),
        expect=(
            Row(0, 0, 0, 7, 20.0, 160.0),  # A
            Row(0, 0, 0, 11, 20.0, 240.0),  # B
            Row(0, 1, 0, 12, 20.0, 260.0),  # C
            Row(0, 0, 12, 13, 260.0, 280.0),  # D
        ),
        shows=shows_preempt_last,
    ),
    # Rule 2, the request being served is itself the victim. 3 blocks.
    # step 0: A 20 (2 blocks), B 16 (1 block): 0 free; both sample their 1st token.
    # step 1: A writes position 20 (its 2nd block). B writes position 16: a 2nd block, none free
    #         -> victim = the last running request = B itself: preempted (its full block stays
    #         cached: 1 free), and the running pass stops (nothing after B). No admission.
    #         B has 17 tokens: 2 blocks, hit 16 (own block, evictable) -> 2 > 1 free: waits.
    # step 2: A's 3rd token: finish -> 3 free.
    # step 3: B re-admitted: hit 16, computes position 16 -> 2nd token; step 4: 3rd (finish).
    #         (hit_tokens_first is B's first admission: 0.)
    Case(
        name="preempt_self",
        rule="2 preemption: the request is its own victim",
        capacity=48,
        reqs=(
            Req((seg(1000, 20),), 3),  # A
            Req((seg(2000, 16),), 3),  # B
        ),
        expect=(
            Row(0, 0, 0, 2, 20.0, 60.0),  # A
            Row(0, 1, 0, 4, 20.0, 100.0),  # B
        ),
        shows=shows_preempt_self,
    ),
    # Rule 4, a waiting request that does not fit stops the pass. 4 blocks.
    # step 0: A 40 tokens, 3 blocks -> 1 free; 1st token. B (30 tokens, 2 blocks) arrives at 1 ms,
    #         C (10 tokens, 1 block) at 2 ms.
    # steps 1..5: B needs 2 > 1 free -> the waiting pass stops: C, which fits, is not tried. A
    #         grows to 46 tokens (3 blocks suffice); its 6th token at step 5: finish, 4 free.
    # step 6: B (2) then C (1) admitted, 1st tokens; step 7: 2nd tokens.
    Case(
        name="fit_stops_the_pass",
        rule="4 whole-prompt fit stops the waiting pass",
        capacity=64,
        reqs=(
            Req((seg(1000, 40),), 6),  # A
            Req((seg(2000, 30),), 2, 0.001),  # B
            Req((seg(3000, 10),), 2, 0.002),  # C
        ),
        expect=(
            Row(0, 0, 0, 5, 20.0, 120.0),  # A
            Row(0, 0, 6, 7, 140.0, 160.0),  # B
            Row(0, 0, 6, 7, 140.0, 160.0),  # C
        ),
        shows=shows_fit_stops_pass,
    ),
    # Rule 4, the WHOLE prompt must fit, not just the first chunk. 3 blocks, budget 16.
    # step 0: A (20 tokens: 2 blocks, fits) gets a 16-token chunk (1 block).
    # step 1: A's rest 4 (2nd block) -> 1st token; 1 free, 12 budget left. B (arrived at 1 ms, 32
    #         tokens) would take a 12-token chunk (1 block: fits) but its whole prompt needs 2 > 1.
    # steps 2..8: A decodes (positions 20..26, 2nd block); 8th token at step 8: finish.
    # step 9: B admitted, chunk 16 (no token); step 10: chunk 16 -> its only token (finish).
    Case(
        name="fit_whole_prompt_not_chunk",
        rule="4 whole-prompt fit (not the first chunk)",
        capacity=48,
        budget=16,
        reqs=(
            Req((seg(1000, 20),), 8),  # A
            Req((seg(2000, 32),), 1, 0.001),  # B
        ),
        expect=(
            Row(0, 0, 1, 8, 40.0, 180.0),  # A
            Row(0, 0, 10, 10, 220.0, 220.0),  # B
        ),
        shows=shows_fit_whole_prompt,
    ),
    # Rule 4, the fit counts the hit blocks that are evictable. 4 blocks.
    # step 0: A (4 tokens; 16 with its outputs, the last without KV: 1 block throughout), B = S32
    #         + 8 (40 tokens, 3 blocks): 0 free. B's only token -> B finishes: its 3 blocks are
    #         free again, the 2 full ones (S32) cached and evictable -> 3 free.
    # C = S32 + 32 (64 tokens, 4 blocks) arrives at 21 ms (added before step 2): hit 32 (B's
    #         blocks); it needs 2 new blocks, and its 2 hit blocks, held by nobody, count too
    #         (they are part of the 3 free): 2 + 2 = 4 > 3 -> waits.
    # step 11: A's 12th token: finish -> 4 free. step 12: C admitted, hit 32, computes 32 -> token.
    Case(
        name="fit_counts_evictable_hit_blocks",
        rule="4 fit: evictable hit blocks count in the need",
        capacity=64,
        reqs=(
            Req((seg(1000, 4),), 12),  # A
            Req((S32, seg(2000, 8)), 1),  # B
            Req((S32, seg(3000, 32)), 1, 0.021),  # C
        ),
        expect=(
            Row(0, 0, 0, 11, 20.0, 240.0),  # A
            Row(0, 0, 0, 0, 20.0, 20.0),  # B
            Row(32, 0, 12, 12, 260.0, 260.0),  # C
        ),
        shows=shows_fit_evictable_hit,
    ),
    # Rule 4, cached blocks nobody holds are free. 3 blocks.
    # step 0 (0-20 ms): A 40 tokens (3 blocks) -> its only token: finish; its 2 full blocks stay
    #         cached (evictable) -> 3 free.
    # B (48 tokens, 3 blocks, nothing shared) arrives at 21 ms: the idle engine jumps there; the 3
    #         free blocks include A's 2 cached ones -> admitted, step 1 = 21-41 ms, evicting them.
    # C = A's prompt again, at 101 ms: A's blocks are gone -> hit 0; step 2 = 101-121 ms.
    Case(
        name="evictable_blocks_count_as_free",
        rule="4 fit: evictable cached blocks are free",
        capacity=48,
        reqs=(
            Req((seg(1000, 40),), 1),  # A
            Req((seg(2000, 48),), 1, 0.021),  # B
            Req((seg(1000, 40),), 1, 0.101),  # C
        ),
        expect=(
            Row(0, 0, 0, 0, 20.0, 20.0),  # A
            Row(0, 0, 1, 1, 41.0, 41.0),  # B
            Row(0, 0, 2, 2, 121.0, 121.0),  # C
        ),
        shows=shows_evictable_free,
    ),
    # Rule 5, blocks are hittable as soon as they are allocated. 20 blocks.
    # step 0: A = S48 + 8 admitted first (hit 0); allocating its 56 tokens caches its 3 full blocks
    #         (S48) at once. B = S48 + 12, admitted next in the SAME step, hits them: 48, and
    #         computes 12. Both sample their 1st token at step 0, 2nd at step 1.
    Case(
        name="same_step_hit",
        rule="5 same-step hits",
        capacity=320,
        reqs=(
            Req((S48, seg(1000, 8)), 2),  # A
            Req((S48, seg(2000, 12)), 2),  # B
        ),
        expect=(
            Row(0, 0, 0, 1, 20.0, 40.0),  # A
            Row(48, 0, 0, 1, 20.0, 40.0),  # B
        ),
        shows=shows_same_step_hit,
    ),
    # Rule 6, the hit is capped at prompt - 1 tokens, in full blocks. 20 blocks.
    # step 0 (0-20 ms): A = T32 (exactly 2 blocks) -> token, finish; both blocks cached.
    # B = T32 again at 21 ms: all 32 are cached, but at least one token must be computed to sample:
    #         cap 31 -> 1 full block: hit 16, computes 16; step 1 = 21-41 ms (idle jump).
    # C = T32 + 1 token at 51 ms: cap 32 -> hit 32, computes 1; step 2 = 51-71 ms.
    Case(
        name="hit_capped_below_prompt",
        rule="6 hit capped at prompt - 1 in full blocks",
        capacity=320,
        reqs=(
            Req((T32,), 1),  # A
            Req((T32,), 1, 0.021),  # B
            Req((T32, seg(3000, 1)), 1, 0.051),  # C
        ),
        expect=(
            Row(0, 0, 0, 0, 20.0, 20.0),  # A
            Row(16, 0, 1, 1, 41.0, 41.0),  # B
            Row(32, 0, 2, 2, 71.0, 71.0),  # C
        ),
        shows=shows_hit_cap,
    ),
    # Rule 6, a token is sampled when a chunk reaches the end of the known tokens, and the last
    # sampled token gets no KV. 2 blocks.
    # A: 16-token prompt, 17 outputs (33 tokens). step 0: prefill (1st block) -> 1st token;
    # steps 1..16 compute positions 16..31 (2nd block), each sampling the next token: the 17th at
    # step 16 (340 ms). Position 32 (the 17th token) is never computed: 2 blocks suffice, no
    # preemption.
    Case(
        name="last_token_gets_no_kv",
        rule="6 the last sampled token gets no KV",
        capacity=32,
        reqs=(
            Req((seg(1000, 16),), 17),  # A
        ),
        expect=(
            Row(0, 0, 0, 16, 20.0, 340.0),  # A
        ),
        shows=shows_last_token_no_kv,
    ),
    # Rule 7, the synchronous run of `async_admission_slips` below.
    # step 0 (0-20 ms): A prefill -> 1st token. B (1 ms) is added at 20 ms.
    # step 1: A decode (2nd), B prefill (1st); step 2: A's 3rd and B's 2nd: both finish at 60 ms.
    Case(
        name="async_sync_twin",
        rule="7 async: the sync run of async_admission_slips",
        capacity=320,
        reqs=(
            Req((seg(1000, 20),), 3),  # A
            Req((seg(2000, 20),), 2, 0.001),  # B
        ),
        expect=(
            Row(0, 0, 0, 2, 20.0, 60.0),  # A
            Row(0, 0, 1, 2, 40.0, 60.0),  # B
        ),
        shows=shows_sync_twin,
    ),
    # Rule 7, async scheduling (two batches in flight), same requests.
    # batch 0, scheduled at 0: A's prefill (0-20 ms). The engine does not wait for it: batch 1 is
    #         scheduled at once, still at clock 0 (B not arrived), with A's decode on a placeholder
    #         for its not yet known 1st token (20-40 ms).
    # Then the engine waits for batch 0 (clock 20 ms), adds B and schedules batch 2: A's 3rd token
    #         and B's prefill -> B's 1st token at step 2 (60 ms), one step later than in sync.
    # batch 3: A is skipped (its batches in flight already reach its 3 tokens); B decodes -> 2nd
    #         token, finish at step 3 (80 ms). A's tokens came from consecutive batches 0, 1, 2.
    Case(
        name="async_admission_slips",
        rule="7 async: admission slips a step, decode in consecutive batches",
        capacity=320,
        async_sched=True,
        reqs=(
            Req((seg(1000, 20),), 3),  # A
            Req((seg(2000, 20),), 2, 0.001),  # B
        ),
        expect=(
            Row(0, 0, 0, 2, 20.0, 60.0),  # A
            Row(0, 0, 2, 3, 60.0, 80.0),  # B
        ),
        shows=shows_async_differs,
    ),
    # Rule 3, no admission in a step that preempted (async). 6 blocks, budget 64.
    # Synchronously the rule never shows on its own: a step's victim is first in the waiting queue
    # and cannot fit right after its preemption (the request it made room for took some of its
    # blocks), so rule 4 stops the pass anyway. Under async scheduling, a waiting request whose
    # output is still in flight (stale) is skipped rather than stopping the pass, and only this
    # rule keeps the requests behind it out (run synchronously, these requests give the same rows,
    # for rule 4's reason):
    # batch 0 (at 0): A 48 tokens (3 blocks); B (47 tokens: 3 blocks, 3 free: fits) admitted with
    #         the 16 budget tokens left (1 block) -> 2 free. C (17 tokens, 2 blocks): no budget.
    # batch 1 (batch 0 in flight): A decodes position 48 on a placeholder: a 4th block -> 1 free.
    #         B's rest, 31 tokens (positions 16..46), needs 2 more blocks > 1 -> B, the last running
    #         request, preempts itself, its 16-token chunk still in flight; its block (cached,
    #         evictable) -> 2 free. The step preempted: no admission, although C (2 blocks) fits.
    # After that B is at the front: 47 tokens, hit 16 (own block, evictable) -> 2 new + 1 = 3 > 2
    #         free; C behind it. A samples one token per batch, 0..14: finish at step 14 (300 ms).
    # step 15: B re-admitted (hit 16, computes 31 -> 1st token) and C (17 -> 1st token): 320 ms.
    #         C's 2nd at step 16; B's 2nd, 3rd at steps 16, 17.
    Case(
        name="async_no_admission_in_preempting_step",
        rule="3 no admission in a step that preempted (7 async, stale chunk)",
        capacity=96,
        budget=64,
        async_sched=True,
        reqs=(
            Req((seg(1000, 48),), 15),  # A
            Req((seg(2000, 47),), 3),  # B
            Req((seg(3000, 17),), 2),  # C
        ),
        expect=(
            Row(0, 0, 0, 14, 20.0, 300.0),  # A
            Row(0, 1, 15, 17, 320.0, 360.0),  # B
            Row(0, 0, 15, 16, 320.0, 340.0),  # C
        ),
        shows=shows_async_gate,
    ),
    # Rule 7, a request preempted with output in flight (stale) still receives it. 3 blocks.
    # batch 0: A 20 (2 blocks), B 16 (1 block): 0 free; both sample their 1st token.
    # batch 1 (batch 0 in flight): A decodes position 20. B decodes position 16: a 2nd block, none
    #         free -> B (last running) preempts itself while batch 0, with its 1st token, is in flight.
    # batch 0 completes: B's 1st token is delivered although B is preempted (first_step 0); B has
    #         17 tokens: 2 blocks, 1 new + its own evictable block = 2 > 1 free -> waits.
    # A: tokens at batches 0..3, finish at step 3 (80 ms). (The schedule after batch 3 is empty:
    #         A's last token is in flight, B does not fit.)
    # batch 4: B re-admitted: hit 16, computes position 16 -> 2nd token; batch 5: 3rd (120 ms).
    Case(
        name="async_stale_token_delivered",
        rule="7 async: a preempted request's in-flight token still counts",
        capacity=48,
        async_sched=True,
        reqs=(
            Req((seg(1000, 20),), 4),  # A
            Req((seg(2000, 16),), 3),  # B
        ),
        expect=(
            Row(0, 0, 0, 3, 20.0, 80.0),  # A
            Row(0, 1, 0, 5, 20.0, 120.0),  # B
        ),
        shows=shows_stale_token_delivered,
    ),
    # Rule 7, preempted while its LAST token is in flight. 3 blocks.
    # batch 0: A 31 (2 blocks), B 10 (1 block): 0 free; both sample their 1st token.
    # batch 1 (batch 0 in flight): A position 31 (still its 2nd block), B position 10 -> B's 2nd
    #         and last token.
    # batch 2 (after batch 0 completes; batch 1 in flight): A writes position 32: a 3rd block, none
    #         free -> victim: the last running request, B, although B is no longer scheduled (its
    #         batches in flight reach its 2 tokens). Its block goes to A.
    # batch 1 completes: B's 2nd token is delivered: B finishes while preempted (step 1, 40 ms),
    #         never re-admitted. A: tokens at steps 0..3, finish 80 ms.
    # (Synchronously B would finish at step 1, before A needs the block at step 2: no preemption.)
    Case(
        name="async_preempted_with_last_token_in_flight",
        rule="7 async: preempted while its last token is in flight",
        capacity=48,
        async_sched=True,
        reqs=(
            Req((seg(1000, 31),), 4),  # A
            Req((seg(2000, 10),), 2),  # B
        ),
        expect=(
            Row(0, 0, 0, 3, 20.0, 80.0),  # A
            Row(0, 1, 0, 1, 20.0, 40.0),  # B
        ),
        shows=shows_stale_last_token,
    ),
]

CASE = {c.name: c for c in CASES}


# ---------------------------------------------------------------------------------------------
# The project's side.


def project_rows(case: Case) -> list[dict]:
    import numpy as np

    from cachelib import create_cache
    from experiments.engine import FixedStepExecutor, ServingConfig, serve
    from experiments.workloads.spec import RequestSpec

    specs = [
        RequestSpec(str(i), np.asarray(q.tokens(), dtype=np.int32), q.output_len, arrival=q.arrival)
        for i, q in enumerate(case.reqs)
    ]
    cache = create_cache("apc", num_pages=case.capacity // BLOCK, page_size=BLOCK)
    config = ServingConfig(
        token_budget=case.budget, max_running=case.max_seqs, scheduler="vllm", async_scheduling=case.async_sched
    )
    res = serve(cache, specs, FixedStepExecutor(STEP_S), config)
    return sorted(res.requests, key=lambda r: r["request_index"])


def as_row(rec: dict) -> Row:
    first = rec["first_token_at"]
    fin = rec["finished_at"]
    return Row(
        rec["hit_tokens_first"],
        rec["preemptions"],
        rec["first_token_step"],
        rec["finish_step"],
        None if first is None else first * 1000.0,
        None if fin is None else fin * 1000.0,
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_case_shows_its_rule(case: Case) -> None:
    """The literal expectations (real vLLM) exercise the case's rule."""
    assert len(case.expect) == len(case.reqs)
    assert all(q.arrival >= 0 and all(n > 0 for _, n in q.prompt) for q in case.reqs)
    case.shows(list(case.expect))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_vllm_rule(case: Case) -> None:
    recs = project_rows(case)
    assert [r["request_index"] for r in recs] == list(range(len(case.reqs)))
    assert not any(r["aborted"] for r in recs)
    got = [as_row(r) for r in recs]
    table = "\n".join(
        f"  {chr(65 + i)}: project {_rows_tuple([g])[0]} vLLM {_rows_tuple([e])[0]}"
        for i, (g, e) in enumerate(zip(got, case.expect, strict=True))
    )
    # (hit, preemptions, first_step, finish_step) per request, exactly
    assert _rows_tuple(got) == _rows_tuple(case.expect), f"rule {case.rule}:\n{table}"
    for i, (g, e) in enumerate(zip(got, case.expect, strict=True)):
        assert abs(recs[i]["first_token_at"] - e.first_ms / 1000) <= 1e-9, (chr(65 + i), g.first_ms, e.first_ms)
        assert abs(recs[i]["finished_at"] - e.finish_ms / 1000) <= 1e-9, (chr(65 + i), g.finish_ms, e.finish_ms)
    case.shows(got)
