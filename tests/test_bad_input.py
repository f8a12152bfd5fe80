"""Bad input gets a clear error naming the problem, and a failed call changes nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cachelib import (
    InvalidRequestError,
    Sequence,
    UnknownBackendError,
    UnknownSequenceError,
    available_backends,
    create_cache,
)
from experiments.__main__ import main
from experiments.workloads.mooncake import load_mooncake
from experiments.workloads.spec import TraceFormatError
from tests.helpers import run_prompt, seq, unchanged

BACKENDS = available_backends()


@pytest.mark.parametrize(
    "tokens, message",
    [
        ([], "empty"),
        ([1, -2, 3], "negative token id -2"),
        ([1, 2**31], "does not fit int32"),
        ([[1, 2], [3, 4]], "flat sequence"),
        ([1.5, 2.0], "integers"),
        (["a"], "integers"),
    ],
)
def test_bad_prompts(tokens, message):
    with pytest.raises(InvalidRequestError, match=message):
        Sequence("r", tokens)


def test_bad_appended_tokens_leave_the_sequence_alone():
    s = Sequence("r", [1, 2, 3])
    with pytest.raises(InvalidRequestError, match="negative"):
        s.append([4, -1])
    assert s.tokens.tolist() == [1, 2, 3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "num_pages, page_size, message",
    [(8, 0, "page_size"), (0, 4, "num_pages"), (8, -1, "page_size"), (2.5, 4, "num_pages")],
)
def test_bad_geometry(backend, num_pages, page_size, message):
    with pytest.raises(InvalidRequestError, match=message):
        create_cache(backend, num_pages=num_pages, page_size=page_size)


def test_unknown_backend_lists_the_choices():
    with pytest.raises(UnknownBackendError, match="unknown backend 'lru2'.*apc"):
        create_cache("lru2", num_pages=4, page_size=4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_calls_leave_the_cache_unchanged(backend):
    cache = create_cache(backend, num_pages=6, page_size=4)
    r0 = seq("r0", range(10))
    run_prompt(cache, r0)
    other = seq("other", range(50, 60))
    m_other = cache.match(other)
    ghost = seq("ghost", range(5))
    m_r0 = cache.match(r0)
    huge = seq("huge", range(100, 140))
    m_huge = cache.match(huge)
    with unchanged(cache):
        with pytest.raises(InvalidRequestError, match="already admitted"):
            cache.admit(r0, m_r0, 10)
        with pytest.raises(InvalidRequestError, match="does not belong"):
            cache.admit(seq("x", range(10)), m_other, 10)
        with pytest.raises(InvalidRequestError, match="num_tokens"):
            cache.admit(other, m_other, 11)
        with pytest.raises(InvalidRequestError, match="num_tokens"):
            cache.admit(other, m_other, 0)
        assert cache.admit(huge, m_huge, 40) is None
        with pytest.raises(UnknownSequenceError):
            cache.release(ghost)
        with pytest.raises(UnknownSequenceError):
            cache.grow(ghost, 3)
        with pytest.raises(UnknownSequenceError):
            cache.commit(ghost, 3)
        with pytest.raises(UnknownSequenceError):
            cache.fork(ghost, seq("child", range(5)))
        with pytest.raises(InvalidRequestError):
            cache.grow(r0, 11)  # beyond its tokens
        with pytest.raises(InvalidRequestError):
            cache.commit(r0, 9)  # computed count cannot go backwards
        with pytest.raises(InvalidRequestError):
            cache.evict(-1)
        with pytest.raises(InvalidRequestError):
            cache.fork(r0, seq("bad-child", range(1, 11)))  # does not hold the parent's tokens
    cache.release(r0)
    with unchanged(cache):
        with pytest.raises(UnknownSequenceError):
            cache.release(r0)  # twice
        with pytest.raises(UnknownSequenceError):
            cache.fork(r0, r0.fork("late"))  # forking a released sequence


def _write(tmp_path, lines, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


GOOD = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]})


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "t.jsonl:2: not valid JSON"),
        (json.dumps({"timestamp": 0, "input_length": 5, "hash_ids": [1]}), "t.jsonl:2: missing field.*output_length"),
        (
            json.dumps({"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}),
            "t.jsonl:2: input_length",
        ),
        (json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}), "t.jsonl:2: hash_ids"),
        (json.dumps([1, 2]), "t.jsonl:2: expected a JSON object"),
    ],
)
def test_malformed_trace_lines_name_the_line(tmp_path, bad, message):
    path = _write(tmp_path, [GOOD, bad])
    with pytest.raises(TraceFormatError, match=message):
        load_mooncake(path)


def test_trace_expansion_rule(tmp_path):
    path = _write(
        tmp_path,
        [GOOD, json.dumps({"timestamp": 5, "input_length": 2000, "output_length": 1, "hash_ids": [7, 8, 9, 3]})],
    )
    a, b = load_mooncake(path)
    assert a.prompt.dtype == np.int32 and len(a.prompt) == 600
    assert a.prompt[:3].tolist() == [512, 513, 514] and a.prompt[512] == 1024
    assert len(b.prompt) == 2000 and b.arrival == 0.005  # last block: 2000 - 3 * 512 = 464 tokens
    assert b.prompt[1536:].tolist() == list(range(3 * 512, 3 * 512 + 464))


def test_cli_errors_exit_3_with_a_message(tmp_path, capsys):
    good = _write(tmp_path, [GOOD], "good.jsonl")
    assert main(["replay", "--backend", "nope", "--trace", str(good)]) == 3
    assert "unknown backend 'nope'" in capsys.readouterr().err
    assert main(["replay", "--backend", "apc", "--trace", str(tmp_path / "missing.jsonl")]) == 3
    assert "trace file not found" in capsys.readouterr().err
    bad = _write(tmp_path, [GOOD, "oops"])
    assert main(["replay", "--backend", "apc", "--trace", str(bad)]) == 3
    assert "t.jsonl:2" in capsys.readouterr().err
    assert main(["replay", "--backend", "apc", "--trace", str(good), "--capacity-tokens", "3"]) == 3
    assert "less than one page" in capsys.readouterr().err
    assert main(["replay", "--backend", "none", "--trace", str(good), "--hash-algorithm", "sha256"]) == 3
    assert "does not take --hash-algorithm" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["replay", "--backend", "apc", "--trace", str(good), "--page-size", "0"])
    assert exc.value.code == 2
