"""Small assert helpers shared by the tests."""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from cachelib import PrefixCache, Sequence
from cachelib.types import ExtraKeys


def seq(rid: str, tokens, extra: ExtraKeys | None = None) -> Sequence:
    return Sequence(rid, np.asarray(tokens, dtype=np.int64), extra or ExtraKeys())


def run_prompt(cache: PrefixCache, s: Sequence, num_tokens: int | None = None):
    """match -> admit -> commit the whole prompt; returns the match (asserts it fit)."""
    m = cache.match(s)
    n = len(s) if num_tokens is None else num_tokens
    ops = cache.admit(s, m, n)
    assert ops is not None, f"{s.request_id} did not fit"
    cache.commit(s, n)
    cache.check_invariants()
    return m


def snapshot(cache: PrefixCache):
    """What must not change when a call fails: stats and the per-page picture."""
    st = cache.stats()
    return (st, getattr(cache, "cached_blocks_in_lru_order", lambda: None)())


@contextmanager
def unchanged(cache: PrefixCache):
    """Assert the block leaves `cache` exactly as it found it (for failed calls)."""
    before = snapshot(cache)
    yield
    cache.check_invariants()
    assert snapshot(cache) == before


def assert_refused_before_work(argv, code, message, capsys, monkeypatch):
    """`python -m experiments ARGV` fails with exit `code` (2: argparse) and `message` on
    stderr, before it builds a workload (a stub that fails the test stands in for it)."""
    import pytest

    import experiments.cli.compare as cli_compare
    from experiments.__main__ import main

    def started(*args, **kwargs):
        pytest.fail("work started before the settings were checked")

    monkeypatch.setattr(cli_compare, "build_workload", started)
    if code == 2:  # argparse refuses it
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    else:
        assert main(argv) == code
    assert message in capsys.readouterr().err


def drive_apc_alike(caches: list, seed: int, steps: int, *, salted: bool = False) -> None:
    """The same random calls on each apc cache (shared prefixes, decode, forks, releases,
    explicit evictions, memory pressure), which must decide alike: equal matches, page
    tables, copies, fork results, stats, LRU order and free queue after every call, and
    every cache passes `check_invariants` after every call. `salted`: some prompts carry a
    `cache_salt` too (extra keys on the first block)."""
    import random

    from cachelib.types import CopyOp

    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(5)]
    live: list[list[Sequence]] = []  # per cache, the same sequences by position
    for step in range(steps):
        op = rng.random()
        if op < 0.42 or not live:
            toks = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            salt = rng.choice([None, None, "t"]) if salted else None
            extra = ExtraKeys(lora_id=rng.choice([None, 1]), cache_salt=salt)
            seqs = [Sequence(f"s{step}", toks, extra) for _ in caches]
            got = []
            for c, s in zip(caches, seqs, strict=True):
                m = c.match(s)
                ops = c.admit(s, m, len(s))
                if ops is not None:
                    c.commit(s, len(s))
                got.append((m.num_tokens, m.pages, ops, s.page_table))
            assert all(g == got[0] for g in got)
            if got[0][2] is not None:
                live.append(seqs)
        elif op < 0.62:
            seqs = rng.choice(live)
            new = [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 20))]
            got = []
            for c, s in zip(caches, seqs, strict=True):
                s.append(new)
                ops = c.grow(s, len(s))
                if ops is not None:
                    c.commit(s, len(s) - 1)
                got.append((ops, s.page_table, s.num_computed))
            assert all(g == got[0] for g in got)
        elif op < 0.71:
            parents = rng.choice(live)
            kids = [p.fork(f"f{step}") for p in parents]
            got = [c.fork(p, k) for c, p, k in zip(caches, parents, kids, strict=True)]
            assert all(g == got[0] for g in got) and all(o is None or isinstance(o, list) for o in got)
            assert all(isinstance(op_, CopyOp) for op_ in got[0] or [])
            if got[0] is not None:
                assert all(k.page_table == kids[0].page_table for k in kids)
                live.append(kids)
        elif op < 0.95:
            seqs = live.pop(rng.randrange(len(live)))
            for c, s in zip(caches, seqs, strict=True):
                c.release(s)
        else:
            n = rng.randrange(0, 6)
            assert len({c.evict(n) for c in caches}) == 1
        for c in caches:
            c.check_invariants()
        states = [(c.stats(), c.cached_blocks_in_lru_order(), list(c.free_queue)) for c in caches]
        assert all(st == states[0] for st in states)
