"""The serving policy's per-step array rules, each written once over the running rows.

A step's bookkeeping is the same few operations on every running request: split the token
budget in running order and tell which rows' steps need a cache call (`plan_rows`), which
of them a conditional promise leaves to be checked at their turn (`unproven_rows`), which
rows sample a token (`after_schedule`), deliver the tokens with first tokens, finishes and
inter-token gaps (`deliver`), price the step (`price_rows`), and for a decode window
bound it (`window_bound`, `most_steps`) and say which rows call (`window_calls`). Each is
one function over numpy arrays (`RunningRows`' fields, or the same fields gathered from
request objects), in the subset of numpy that numba compiles:
`experiments/engine/compiled.py` hands the policy these very functions compiled where
numba is installed (the `fast` extra), and as they are otherwise. There is no second copy
of a rule: compiled or not, it is this code.

Both paths give the same values to the last bit: integers, bools, elementwise float
subtractions, and float sums only as `cumsum` (sequential in numpy and in numba alike).
"""

from __future__ import annotations

import numpy as np

#: what a scheduled row's step asks of the cache under the lazy rule (`plan_rows`)
IDLE, EXCUSED, FILLS, NEW_PAGE, CALLS = -1, 0, 1, 2, 3
#: the lazy rule's condition (`PrefixCache.decode_noops_when`): none, a page free, the row private
PROMISE_ALWAYS, PROMISE_WHILE_FREE, PROMISE_IF_PRIVATE = 0, 1, 2


def plan_rows(computed, known, placeholders, total, capacity, prompt, budget, page, lazy, quiet):
    """One step's running pass over the rows (vLLM 0.33 `Scheduler.schedule`, rules 1-2):
    `n`, the tokens each row computes, and `kind`, what its step asks of the cache.

    A row needs its known tokens and in-flight placeholders not yet computed; one whose
    in-flight token will be its last (of `total`: prompt and outputs) takes no step (async). The budget goes in running
    order: all a row needs while it lasts, then what is left, then none. Under the lazy
    rule (`lazy`: the backend promises decode steps inside a held page publish nothing) a
    one-token step past the prompt is EXCUSED inside its table, FILLS when it fills a held
    page (only the publish), NEW_PAGE when it needs a page (only the grow), else CALLS;
    `quiet`: fills publish nothing either (radix, none). A one-token prefill chunk CALLS:
    the promise is for generated tokens. A row computing nothing is IDLE."""
    # (each statement one elementwise expression: numba fuses it into one loop, no temporaries)
    need = (known + placeholders - computed) * ((placeholders <= 0) | (computed + 2 - placeholders < total))
    if need.sum() <= budget:
        n = need
    else:  # what the rows ahead take comes first
        n = np.minimum(np.maximum(budget - (need.cumsum() - need), 0), need)
    end = computed + n
    if not lazy:
        return n, (n > 0) * (CALLS - IDLE) + IDLE
    decode = (n == 1) & (end > prompt)
    inside = end <= capacity
    fills = (end % page == 0) & (not quiet)
    # a decode row's kind, counted down from CALLS: inside its table EXCUSED (3 less) or,
    # filling a page, FILLS (2 less); past it NEW_PAGE (1 less) unless it fills one
    below_calls = decode * (inside * (3 - fills) + ~inside * ~fills)
    return n, (n > 0) * (CALLS - IDLE - below_calls) + IDLE


def unproven_rows(end, capacity, page, promise, free, private, excused):
    """The `excused` rows (their step, to `end`, asks nothing of the cache) for which a
    conditional lazy promise is not proven before any call: under `PROMISE_WHILE_FREE`
    the calls before a row take at most the new pages of the rows ahead of it, so while
    those are fewer than the `free` pages a page is still free at its turn; under
    `PROMISE_IF_PRIVATE`, where the cache did not approve the row (`private`) after its
    last call. Such a row is decided at its turn."""
    if promise == PROMISE_WHILE_FREE:
        take = np.maximum((end + page - 1) // page - capacity // page, 0)
        return excused & (take.cumsum() - take >= free)
    if promise == PROMISE_IF_PRIVATE:
        return excused & ~private
    return np.zeros(end.size, dtype=np.bool_)


def after_schedule(computed, known, placeholders, in_flight, n, async_loop):
    """vLLM's `_update_after_schedule`: each row's computed count moves by its `n`; returns
    the tokens each row samples this step, 1 where its chunk reaches its known tokens and
    placeholders, else 0. In the async loop the scheduled tokens are in flight until processed,
    and a sampling row holds an output placeholder until its token is delivered."""
    sampled = ((n > 0) & (computed + n == known + placeholders)) * 1  # (int64: one fused loop, no cast copy)
    computed += n
    if async_loop:
        in_flight += n
        placeholders += sampled
    return sampled


def deliver(known, generated, target, has_first, timed, last, tokens, at, last_at, prev, has_prev):
    """vLLM's `update_from_output`: each row gets its `tokens` (1 a step, k a decode window),
    the first at `at`, the last at `last_at`. Returns the rows that got their first token
    (`has_first` set), the rows that finished (generated reached target), and the
    inter-token gaps at `at` (`TokenGaps.add_step`): `at - last` for each `timed` row whose
    last token came neither at the previous step's end (`prev`, when `has_prev`: those
    share one gap, how many is the fourth value) nor never (NaN)."""
    got = tokens > 0
    known += tokens
    generated += tokens
    firsts = np.flatnonzero(got & ~has_first)
    has_first |= got
    clocked = np.flatnonzero(got & timed)
    came = last[clocked]
    regular = (came == prev) & has_prev
    gaps = at - came[~regular & (came == came)]  # (came != came: NaN, no token before it)
    last[clocked] = last_at
    done = np.flatnonzero(got & (generated >= target))
    return firsts, done, gaps, np.count_nonzero(regular)


def price_rows(new, starts, per_token, params_flops):
    """The sums a roofline prices a step by (`CostModelExecutor.batch_seconds`), over the
    rows computing something: the FLOPs (2 x parameters per token, then each row's
    attention `per_token * new * (start + (new + 1) / 2)`, added in row order), the step's
    tokens and the KV tokens it reads (each row's context and its new tokens)."""
    tokens = new.sum()
    # a row computing nothing adds +0.0 (the same float: no mask, no gathered copies)
    per_item = per_token * new * (starts + (new + 1) / 2)
    flops = np.concatenate((np.full(1, params_flops * tokens), per_item)).cumsum()[-1]
    return flops, tokens, (starts * (new > 0)).sum() + tokens


def window_bound(n, computed, known, generated, target, most):
    """How many decode steps a window may take by the rows alone: 1 unless every row decoded
    one known token this step (`computed` is after it) and has an output already, else the
    steps left to the row nearest its end, at most `most`."""
    if n.size == 0:
        return 1
    if np.count_nonzero(n != 1) or np.count_nonzero(computed != known) or np.count_nonzero(generated == 0):
        return 1
    return min(most, (target - generated).min())


def most_steps(computed, capacity, page, spare, most):
    """The most decode steps, at most `most`, whose new pages (beyond each row's table)
    fit in `spare` pages; 0 when not even one does."""
    held = capacity // page

    def fits(steps):
        return np.maximum((computed + steps + page - 1) // page - held, 0).sum() <= spare

    if fits(most):
        return most
    if not fits(1):
        return 0
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def window_calls(final, capacity, committed, page, lazy, quiet):
    """The rows a decode window ending at `final` calls the cache for: its end past the
    table, or (fills not quiet) a page filled past the published count, or every row
    without the lazy rule."""
    calls = final > capacity
    if not quiet:
        calls = calls | (final // page > committed // page) | (not lazy)
    return calls
