"""The row scheduler's per-step array work in compiled loops (numba, the `fast` extra).

`VllmRowScheduler` (experiments/engine/vllm_rows.py) runs every step as a few numpy
operations over its running rows: split the token budget, pick the rows whose step needs a
cache call, deliver the sampled tokens. Each numpy call costs about a microsecond whatever
its size, and a step makes some forty of them: on the Mooncake trace's serving cells that
is a quarter of the engine's time (a few hundred rows per step at large capacities, a dozen
at small ones, where the fixed cost is nearly all of it). The functions here compute the
same values in one pass each: `plan_rows` (the budget split and the rows to call),
`deliver_rows` (the tokens sampled, first tokens, finishes and inter-token gaps),
`price_rows` (the cost model's sums for a step's price), and for a decode window
`window_bound` and `most_steps` (how many steps it may take), `window_calls` and
`window_deliver`.

The numpy code in vllm_rows.py and executors.py stays the reference, rule for rule:
`VllmRowScheduler` and `CostModelExecutor` take either (`kernel`: `numba`, `numpy`, or
`auto`, numba where it is installed; experiments/engine/compiled.py), and
tests/test_vllm_rows.py runs both against the object loop, comparing every record, and
each function against the numpy formulas. Values are integers, bools, float64
subtractions and one sum added in the numpy path's order (no reassociation), so the two
paths agree to the last bit. Importing this module imports numba; the engine imports it
only when the compiled path is chosen. Each function has one explicit signature: compiled,
or loaded from numba's cache, at import, never inside a run.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

#: what a scheduled row's step asks of the cache (vllm_rows.EXCUSED ... CALLS, the same numbers)
_EXCUSED, _FILLS, _NEW_PAGE, _CALLS = 0, 1, 2, 3

_I64 = types.Array(types.int64, 1, "C")
_F64 = types.Array(types.float64, 1, "C")
_BOOL = types.Array(types.boolean, 1, "C")


#: `plan_rows`' `promise`: the lazy rule is unconditional (or off), holds while a page is
#: free (`DECODE_NOOPS_WHILE_FREE`), or for the rows the cache approved (`..._IF_PRIVATE`)
PROMISE_ALWAYS, PROMISE_WHILE_FREE, PROMISE_IF_PRIVATE = 0, 1, 2


@njit(_I64(_I64, _I64, types.int64), cache=True)
def _split_budget(computed, known, budget):
    """Tokens each row computes this step, in running order: all it needs (`known -
    computed`) while the budget lasts, then what is left of it, then none (`vllm_rows`'
    `min(max(budget - before, 0), need)`, before: the need of the rows ahead)."""
    m = computed.size
    n = np.empty(m, dtype=np.int64)
    total = 0
    for i in range(m):
        total += known[i] - computed[i]
    before = 0
    for i in range(m):
        need = known[i] - computed[i]
        if total <= budget:
            n[i] = need
        else:
            n[i] = min(max(budget - before, 0), need)
        before += need
    return n


@njit(
    types.Tuple((_I64, types.Array(types.int64, 2, "C"), _I64, types.boolean))(
        _I64, _I64, _I64, _I64, types.int64, types.int64, types.boolean, types.boolean, types.int64, types.int64, _BOOL
    ),
    cache=True,
)
def plan_rows(computed, known, capacity, prompt, budget, page, lazy, quiet, promise, free, private):
    """One step's plan over the running rows, in running order: `n` (tokens each row
    computes: all it needs, unless the budget runs out, then what is left of it), the
    rows whose step needs a cache call as a table of (row, tokens, end, kind) with their
    known counts beside it, and whether a scheduled row's lazy promise is unproven.

    The split is `vllm_rows`' `min(max(budget - before, 0), need)` (before: the need of the
    rows ahead); a row needs a call unless it computes nothing or the lazy rule excuses
    it (`lazy`, `quiet`: `row_kind`, whose kinds the table carries; without the lazy rule
    every scheduled row CALLS). Under a conditional promise (`promise`) a row is unproven
    as `unproven_rows` says: while a page is free, once the new pages of the rows ahead of
    it reach the `free` ones; if private, where `private` is False. A scheduled unproven
    row is decided at its turn, one call at a time: the caller then takes the numpy path
    (the table is for the unconditional case)."""
    m = computed.size
    n = _split_budget(computed, known, budget)
    table = np.empty((m, 4), dtype=np.int64)
    known_out = np.empty(m, dtype=np.int64)
    k = 0
    taken = 0  # new pages of the rows ahead
    unproven = False
    for i in range(m):
        ni = n[i]
        end = computed[i] + ni
        cap = capacity[i]
        if lazy and ni > 0:
            if promise == PROMISE_WHILE_FREE and taken >= free:
                unproven = True
            elif promise == PROMISE_IF_PRIVATE and not private[i]:
                unproven = True
        take = (end + page - 1) // page - cap // page
        if take > 0:
            taken += take
        if ni <= 0:
            continue
        kind = _CALLS
        if lazy and ni == 1 and end > prompt[i]:
            fills = end % page == 0 and not quiet
            if end <= cap:
                if not fills:
                    continue  # excused: inside a held page, publishing nothing
                kind = _FILLS
            elif not fills:
                kind = _NEW_PAGE
        table[k, 0] = i
        table[k, 1] = ni
        table[k, 2] = end
        table[k, 3] = kind
        known_out[k] = known[i]
        k += 1
    return n, table[:k], known_out[:k], unproven


@njit(cache=True, inline="always")
def _gap(came, at, prev, has_prev, gaps, ng):
    """`TokenGaps.step_rows`' rule for one timed row that got a token at `at`, its last one
    having come at `came`: (1, ng) when that was the previous step's end (`prev`, when
    `has_prev`: the step's shared gap); else its own gap `at - came` is written to
    `gaps[ng]`, (0, ng + 1), unless it had none before (NaN: its first token), (0, ng)."""
    if has_prev and came == prev:
        return 1, ng
    if not np.isnan(came):
        gaps[ng] = at - came
        return 0, ng + 1
    return 0, ng


@njit(
    types.Tuple((_I64, _I64, _F64, types.int64))(
        _I64, _I64, _I64, _I64, _BOOL, _BOOL, _F64, _I64, types.float64, types.float64, types.boolean
    ),
    cache=True,
)
def deliver_rows(computed, known, generated, target, has_first, timed, last, n, at, prev, has_prev):
    """The tokens a step ending at `at` delivered, rows updated in place: a scheduled row
    whose chunk reached its known end sampled one (`known`, `generated` + 1); returns the
    rows that got their first token (`has_first` set), the rows that finished (generated
    reached target), and the inter-token gaps of `TokenGaps.step_rows`: `at - last` for
    each timed row whose last token came neither at the previous step's end (`prev`, when
    `has_prev`) nor never (NaN), in row order, and how many came at `prev`; `last` is
    `at` for every timed row that sampled."""
    m = computed.size
    firsts = np.empty(m, dtype=np.int64)
    done = np.empty(m, dtype=np.int64)
    gaps = np.empty(m, dtype=np.float64)
    nf = nd = ng = 0
    regular = 0
    for i in range(m):
        if n[i] <= 0 or computed[i] != known[i]:
            continue
        known[i] += 1
        generated[i] += 1
        if not has_first[i]:
            has_first[i] = True
            firsts[nf] = i
            nf += 1
        if timed[i]:
            came_at_prev, ng = _gap(last[i], at, prev, has_prev, gaps, ng)
            regular += came_at_prev
            last[i] = at
        if generated[i] >= target[i]:
            done[nd] = i
            nd += 1
    return firsts[:nf], done[:nd], gaps[:ng], regular


@njit(types.Tuple((types.float64, types.int64, types.int64))(_I64, _I64, types.float64, types.float64), cache=True)
def price_rows(new, starts, per_token, params_flops):
    """The sums `CostModelExecutor.batch_seconds` prices a step by, over the items with
    `new[i] > 0` (the others are not in the step): the FLOPs, the step's tokens and the
    KV tokens read (each item's context and its new tokens). FLOPs add in batch order
    after `params_flops * tokens` (2 x the parameters per token), each item's term
    `per_token * new * (start + (new + 1) / 2)` (`per_token`: 4 x layers x heads x head
    dim), as the numpy path's cumulative sum adds them: the same float to the last bit."""
    tokens = 0
    kv_read = 0
    for i in range(new.size):
        if new[i] > 0:
            tokens += new[i]
            kv_read += starts[i] + new[i]
    flops = params_flops * tokens
    for i in range(new.size):
        k = new[i]
        if k > 0:
            flops += per_token * k * (starts[i] + (k + 1) / 2)
    return flops, tokens, kv_read


@njit(types.int64(_I64, _I64, _I64, _I64, _I64, types.int64), cache=True)
def window_bound(n, computed, known, generated, target, most):
    """`VllmRowScheduler.window_steps`' first bound: 1 unless every row decoded one token
    this step (`n` 1, `computed` equal to `known`) and has generated one before, else the
    decode steps left to the row nearest its end, at most `most`."""
    k = most
    for i in range(n.size):
        if n[i] != 1 or computed[i] != known[i] or generated[i] == 0:
            return 1
        k = min(k, target[i] - generated[i])
    return k


@njit(types.int64(_I64, _I64, types.int64, types.int64), cache=True)
def _new_pages(computed, capacity, page, steps):
    """`scheduler._new_pages` over the table capacities (in tokens)."""
    total = 0
    for i in range(computed.size):
        need = (computed[i] + steps + page - 1) // page - capacity[i] // page
        if need > 0:
            total += need
    return total


@njit(types.int64(_I64, _I64, types.int64, types.int64, types.int64), cache=True)
def most_steps(computed, capacity, page, spare, most):
    """The most decode steps, at most `most`, whose new pages fit in `spare` (0: not even
    one): `scheduler._pages_limit`'s answer (a monotone count, so any search finds it)."""
    if _new_pages(computed, capacity, page, most) <= spare:
        return most
    if _new_pages(computed, capacity, page, 1) > spare:
        return 0
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _new_pages(computed, capacity, page, mid) <= spare:
            lo = mid
        else:
            hi = mid - 1
    return lo


@njit(
    types.Tuple((types.Array(types.int64, 2, "C"), _I64, types.boolean))(
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        types.int64,
        types.int64,
        types.boolean,
        types.boolean,
        types.int64,
        types.int64,
        _BOOL,
    ),
    cache=True,
)
def window_calls(start, computed, capacity, committed, known, k, page, lazy, quiet, promise, free, private):
    """The calls of a decode window of `k` steps of every row from `start` (`computed`:
    after its first step; `run_decode_window`): the rows that need one, as (row, tokens
    from `computed`, end) with their known counts after the window (`known + k`), and
    whether a conditional promise leaves a row it excuses unproven (then the numpy path
    decides that row at its turn). A row calls when its window ends past its table, or
    (fills not quiet) fills a page past its published count, or always without the lazy
    rule."""
    m = computed.size
    table = np.empty((m, 3), dtype=np.int64)
    known_out = np.empty(m, dtype=np.int64)
    rows = 0
    taken = 0
    doubtful = False
    for i in range(m):
        final = start[i] + k
        calls = final > capacity[i]
        if not quiet:
            calls = calls or final // page > committed[i] // page or not lazy
        if lazy and not calls:
            if promise == PROMISE_WHILE_FREE and taken >= free:
                doubtful = True
            elif promise == PROMISE_IF_PRIVATE and not private[i]:
                doubtful = True
        take = (final + page - 1) // page - capacity[i] // page
        if take > 0:
            taken += take
        if calls:
            table[rows, 0] = i
            table[rows, 1] = final - computed[i]
            table[rows, 2] = final
            known_out[rows] = known[i] + k
            rows += 1
    return table[:rows], known_out[:rows], doubtful


@njit(
    types.Tuple((_I64, _F64, types.int64, types.int64))(
        _I64,
        _I64,
        _I64,
        _I64,
        _I64,
        _BOOL,
        _F64,
        types.int64,
        types.float64,
        types.float64,
        types.float64,
        types.boolean,
    ),
    cache=True,
)
def window_deliver(computed, generated, work, target, start, timed, last, k, first_end, final_end, prev, has_prev):
    """After a decode window of `k` steps ending at `first_end` ... `final_end`, every row
    updated in place (computed `start + k`, `generated` and `work` + k, the timed rows'
    last token at `final_end`); returns the rows that finished, the gaps of the window's
    first step (`TokenGaps.step_rows` over the timed rows at `first_end`, the other steps
    being one shared gap each), how many of its rows came at `prev`, and how many rows are
    timed."""
    m = computed.size
    done = np.empty(m, dtype=np.int64)
    gaps = np.empty(m, dtype=np.float64)
    nd = ng = regular = many = 0
    for i in range(m):
        computed[i] = start[i] + k
        generated[i] += k
        work[i] += k
        if timed[i]:
            many += 1
            came_at_prev, ng = _gap(last[i], first_end, prev, has_prev, gaps, ng)
            regular += came_at_prev
            last[i] = final_end
        if generated[i] >= target[i]:
            done[nd] = i
            nd += 1
    return done[:nd], gaps[:ng], regular, many
