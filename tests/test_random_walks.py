"""Random walks over the contract, many and fast: every backend, and every tiered
configuration (write policies x host smaller, equal and larger than the GPU x no, file and
shared storage; apc's host tier with LRU and ARC; LMCache with and without a disk) at every
page shape, with transfers completing at once and with tickets finished later in any order.
Each walk checks the invariants and the shadow KV after every step (`tests/contract_walk.py`).

The CI budget (`WALKS` x `STEPS` per configuration) makes over 300,000 contract operations;
the session's total is printed and held to `MIN_OPERATIONS` by `tests/conftest.py`. The
`slow` case runs ten times as many, on other seeds (`make test-all`).
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.contract_walk import operation_count, plain_configs, run_walks, tier_configs

WALKS, STEPS = 4, 80
#: what one CI run must make in all (checked at the session's end when every case ran)
MIN_OPERATIONS = 300_000
CONFIGS = plain_configs() + tier_configs()


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_random_walks(config, record_property):
    tally: Counter = Counter()
    run_walks(config, seed=0, walks=WALKS, steps=STEPS, tally=tally)
    ops = operation_count(tally)
    assert ops >= WALKS * STEPS, f"{config.name}: only {ops} operations in {WALKS * STEPS} steps"
    assert tally["refused misuse"] > 0, f"{config.name}: no misuse was tried"
    record_property("contract_operations", ops)


@pytest.mark.slow
@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_random_walks_long(config, record_property):
    tally: Counter = Counter()
    run_walks(config, seed=1, walks=10 * WALKS, steps=2 * STEPS, tally=tally)
    record_property("contract_operations", operation_count(tally))
