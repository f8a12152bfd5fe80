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
