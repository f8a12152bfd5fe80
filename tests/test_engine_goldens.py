"""Every serving, cluster and replay configuration of `tests/engine_goldens.py` gives the
outcome the engine gave before it was rewritten as one policy (issue 31): the digest of every
request record, ITL pair, page timeline entry, step count, cache counter, KV event order and
replay result. A change of numbers must be intended, regenerated and said in its commit."""

from __future__ import annotations

import json

import pytest

from tests.engine_goldens import GOLDENS, cases, digest, run_case, summary

EXPECTED = json.loads(GOLDENS.read_text())
CASES = list(cases())
#: the suite's default run takes every other serving case (both loops, every backend and
#: workload still among them); `make test-all` runs them all
SERVING = [c for c in CASES if c.kind == "serve"]
SLOW = {c.name for c in SERVING[1::2]}
PARAMS = [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.name in SLOW else []) for c in CASES]


def test_every_case_has_a_golden():
    assert sorted(c.name for c in CASES) == sorted(EXPECTED)


@pytest.mark.parametrize("case", PARAMS)
def test_the_engine_gives_the_golden_outcome(case):
    outcome = run_case(case)
    want = EXPECTED[case.name]
    if digest(outcome) != want["digest"]:
        got = json.loads(json.dumps(summary(case, outcome), default=repr))
        pytest.fail(f"{case.name}: the outcome moved; now {got}, the golden's {want['summary']}")
