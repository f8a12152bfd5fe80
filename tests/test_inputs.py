"""Inputs that cannot poison the numbers: every bad trace line, file, knob, model or seed is a
one-line error naming it before any work, and Mooncake hash ids never alias."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from experiments.__main__ import main
from experiments.engine import GENERATED_TOKEN_BASE
from experiments.workloads.jsonl import load_jsonl
from experiments.workloads.mooncake import (
    ALIAS_LIMIT,
    HIGH_FIRSTS,
    MAX_HASH_ID,
    MOONCAKE_BLOCK,
    TOKEN_MODULUS,
    block_tokens,
    load_mooncake,
)
from experiments.workloads.registry import WorkloadError, make_workload
from experiments.workloads.spec import TraceFormatError
from experiments.workloads.text import load_text

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "experiments/data/mooncake_conversation_2000.jsonl"
GOOD = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}


def _line(**fields: object) -> str:
    return json.dumps({**GOOD, **fields})


def _write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


# -- Mooncake lines ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ('{"timestamp": NaN, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}', "NaN is not a number"),
        ('{"timestamp": Infinity, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}', "Infinity is not"),
        ('{"timestamp": -Infinity, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}', "-Infinity is not"),
        (
            '{"timestamp": 1e400, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}',
            "timestamp must be a finite",
        ),
        (_line(timestamp=10**400), "timestamp must be a finite"),
        (_line(timestamp=-1), "timestamp must be a finite non-negative"),
        (_line(hash_ids=[1, 2**63]), r"hash_ids must be ints in 0\.\.2\*\*63-1 \(int64\), got 9223372036854775808"),
        (_line(hash_ids=[1, 10**30]), "hash_ids must be ints in 0..2"),
        (_line(hash_ids=[-1, 2]), "hash_ids must be ints in 0..2.*got -1"),
        (_line(hash_ids=[True, 2]), "hash_ids must be ints.*got True"),
        (_line(hash_ids=[1, None]), "hash_ids must be ints.*got None"),
        (_line(input_length=-600), "input_length must be a positive int, got -600"),
        (_line(output_length=-3), "output_length must be an int in 0..147,483,647, got -3"),
        (_line(output_length=147_483_648), "output_length must be an int in 0..147,483,647"),
        (
            _line(input_length=600, hash_ids=[1, 2, 3]),
            "input_length 600 needs 2 blocks of 512 tokens, but hash_ids has 3",
        ),
        (_line(input_length=2000, hash_ids=[7]), "input_length 2000 needs 4 blocks of 512 tokens, but hash_ids has 1"),
        (_line(input_length=512, hash_ids=[1, 2]), "input_length 512 needs 1 blocks"),
    ],
)
def test_bad_mooncake_lines_name_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    path = _write(tmp_path, [_line(), bad])
    with pytest.raises(TraceFormatError, match=rf"t\.jsonl:2: {message}"):
        load_mooncake(path)


def test_block_boundaries_are_consistent(tmp_path: Path) -> None:
    """ceil(input_length / 512) ids: 512 tokens take one block, 513 two."""
    path = _write(tmp_path, [_line(input_length=512, hash_ids=[1]), _line(input_length=513, hash_ids=[1, 2])])
    a, b = load_mooncake(path)
    assert len(a.prompt) == 512 and len(b.prompt) == 513 and b.prompt[-1] == 2 * 512


@pytest.mark.parametrize(
    "trace",
    [SHIPPED, ROOT.parent / "shared/traces/mooncake/conversation_trace.jsonl"],
    ids=["shipped", "full"],
)
def test_real_traces_have_one_hash_id_per_block(trace: Path) -> None:
    """The consistency rule is an error, not a repair, because the real traces never break it."""
    if not trace.is_file():
        pytest.skip(f"{trace} not present")
    lines = [json.loads(x) for x in trace.read_text().splitlines() if x.strip()]
    assert all(-(-o["input_length"] // 512) == len(o["hash_ids"]) for o in lines)
    assert len(load_mooncake(trace)) == len(lines)


def test_nan_timestamp_fails_compare_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A NaN arrival used to hang the serving clock forever."""
    path = _write(tmp_path, ['{"timestamp": NaN, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}'])
    argv = ["--trace", str(path), "--backend", "apc", "--capacity-tokens", "100000"]
    assert main(["compare", *argv, "--no-progress", "--output-dir", str(tmp_path / "out")]) == 3
    assert "t.jsonl:1: NaN is not a number" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# -- hash-id expansion -----------------------------------------------------------------------


def _block_id(block: np.ndarray) -> int:
    """The id a block was expanded from, read back from its first 3 tokens (the inverse that
    proves `block_tokens` injective)."""
    f, t1, t2 = (int(x) for x in block[:3])
    if f % MOONCAKE_BLOCK == 0:
        return f // MOONCAKE_BLOCK
    r = (f // MOONCAKE_BLOCK) * (MOONCAKE_BLOCK - 1) + f % MOONCAKE_BLOCK - 1
    q = (t1 - f - 1) % TOKEN_MODULUS + TOKEN_MODULUS * ((t2 - f - 2) % TOKEN_MODULUS)
    return ALIAS_LIMIT + q * HIGH_FIRSTS + r


EDGES = [
    0,
    1,
    ALIAS_LIMIT - 1,
    ALIAS_LIMIT,
    ALIAS_LIMIT + 1,
    ALIAS_LIMIT + 510,
    ALIAS_LIMIT + 511,
    ALIAS_LIMIT + HIGH_FIRSTS - 1,
    ALIAS_LIMIT + HIGH_FIRSTS,  # 2e9: the first id that shares a first token with another
    2 * ALIAS_LIMIT,
    ALIAS_LIMIT + HIGH_FIRSTS * TOKEN_MODULUS,
    MAX_HASH_ID - 1,
    MAX_HASH_ID,
]


def test_low_ids_keep_the_published_rule_bit_for_bit(shipped_trace) -> None:
    """Every number measured on the shipped slice stands: its token ids are unchanged."""
    for spec in shipped_trace:
        ids, n = spec.prompt_source.hash_ids, len(spec.prompt)
        old = (np.asarray(ids, dtype=np.int64)[:, None] * 512 + np.arange(512)) % 2_000_000_000
        assert np.array_equal(spec.prompt, old.reshape(-1)[:n].astype(np.int32))
    low = np.array([0, 1, 12345, ALIAS_LIMIT - 1])
    assert np.array_equal(block_tokens(low), (low[:, None] * 512 + np.arange(512)) % 2_000_000_000)


def test_expansion_is_injective_at_the_edges() -> None:
    blocks = block_tokens(np.array(EDGES, dtype=np.int64))
    assert blocks.min() >= 0 and blocks.max() < GENERATED_TOKEN_BASE
    assert [_block_id(b) for b in blocks] == EDGES
    assert len({b[:3].tobytes() for b in blocks}) == len(EDGES)  # distinct within 3 tokens


def test_formerly_aliased_ids_differ_from_their_first_token() -> None:
    """`(h * 512 + j) % 2e9` made h and h + 3,906,250 the same block: a false hit."""
    low = np.arange(0, ALIAS_LIMIT, 9973, dtype=np.int64)
    aliased = np.concatenate([low + ALIAS_LIMIT, low + 2 * ALIAS_LIMIT, low + 511 * ALIAS_LIMIT])
    first_low, first_high = block_tokens(low)[:, 0], block_tokens(aliased)[:, 0]
    assert np.all(first_high % 512 != 0) and np.all(first_low % 512 == 0)
    assert len(np.unique(first_high)) == aliased.size


def test_ids_below_2e9_have_distinct_first_tokens() -> None:
    """Within whole windows where the enumeration wraps (every 511 ids) and at both ends of
    the high range below 2e9, no two ids share a first token: even a 1-token block is safe."""
    windows = [np.arange(s, s + 5000, dtype=np.int64) for s in (0, ALIAS_LIMIT - 2500, 10**9, 2 * 10**9 - 5000)]
    ids = np.concatenate(windows)
    first = block_tokens(ids)[:, 0]
    assert len(np.unique(first)) == ids.size


def test_ids_sharing_a_first_token_differ_at_token_1_or_2() -> None:
    h = ALIAS_LIMIT + 12345
    same_first = np.array([h, h + HIGH_FIRSTS, h + 2 * HIGH_FIRSTS, h + HIGH_FIRSTS * TOKEN_MODULUS], dtype=np.int64)
    blocks = block_tokens(same_first)
    assert len(set(blocks[:, 0].tolist())) == 1
    assert len({b[:3].tobytes() for b in blocks}) == same_first.size


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, MAX_HASH_ID), min_size=1, max_size=20))
def test_every_int64_id_reads_back_from_its_block(ids: list[int]) -> None:
    blocks = block_tokens(np.array(ids, dtype=np.int64))
    assert blocks.min() >= 0 and blocks.max() < GENERATED_TOKEN_BASE
    assert [_block_id(b) for b in blocks] == ids


def test_large_ids_give_no_false_hit_in_a_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two requests whose ids used to alias share nothing; a third with the same ids shares all."""
    lines = [
        _line(hash_ids=[5, 6]),
        _line(hash_ids=[5 + ALIAS_LIMIT, 6 + ALIAS_LIMIT]),
        _line(hash_ids=[5 + ALIAS_LIMIT, 2**62]),
    ]
    path = _write(tmp_path, lines)
    a, b, c = load_mooncake(path)
    assert a.prompt[0] != b.prompt[0] and np.array_equal(b.prompt[:512], c.prompt[:512])
    assert b.prompt[512] != c.prompt[512]
    out = tmp_path / "r.json"
    assert main(["replay", "--backend", "apc", "--trace", str(path), "--no-progress", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hit_tokens"] == 512  # c reuses b's first block, nothing else is shared


# -- undecodable files -----------------------------------------------------------------------

BINARY = bytes(range(128, 256)) * 4 + bytes(range(128))  # starts with a byte UTF-8 never starts with
UTF16 = json.dumps(GOOD).encode("utf-16")


@pytest.mark.parametrize("content", [BINARY, UTF16], ids=["binary", "utf16"])
def test_undecodable_files_name_the_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + content)
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: not UTF-8 text \(byte 0x"):
        load_mooncake(path)
    path.write_bytes(json.dumps({"prompt": [1], "output_len": 1}).encode() + b"\n" + content)
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: not UTF-8 text"):
        load_jsonl(path)
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:2: not UTF-8 text"):
        load_text(path, tokenizer=_Words())


def test_nul_bytes_are_not_json(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\x00\x00\x00\n")
    with pytest.raises(TraceFormatError, match=r"t\.jsonl:1: not valid JSON"):
        load_mooncake(path)


def test_binary_trace_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    path.write_bytes(BINARY)
    assert main(["replay", "--backend", "apc", "--trace", str(path), "--no-progress"]) == 3
    assert "t.jsonl:1: not UTF-8 text" in capsys.readouterr().err
    out = str(tmp_path / "out")
    assert main(["compare", "--trace", str(path), "--no-progress", "--output-dir", out]) == 3
    assert "t.jsonl:1: not UTF-8 text" in capsys.readouterr().err
    assert main(["compare", "--workload", "jsonl", "--knob", f"path={path}", "--output-dir", out]) == 3
    assert "t.jsonl:1: not UTF-8 text" in capsys.readouterr().err


class _Words:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(w) for w in text.split()]


def test_unreadable_tokenizer_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Missing `tokenizers` package or a garbage tokenizer.json: exit 3 naming the file, no traceback."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"text": "a b", "output_len": 1}) + "\n")
    tok = tmp_path / "tok.json"
    tok.write_bytes(BINARY)
    argv = ["compare", "--workload", "text", "--knob", f"path={trace}", "--knob", f"tokenizer={tok}"]
    assert main([*argv, "--output-dir", str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: tokenizer file") and str(tok) in err and err.count("\n") == 1


# -- empty workloads, models, seeds, knobs ---------------------------------------------------

EMPTY = [
    ("shared_doc_qa", "num_requests"),
    ("multi_turn_chat", "num_conversations"),
    ("kshot", "num_requests"),
    ("multi_tenant", "num_requests"),
    ("no_sharing", "num_requests"),
    ("parallel_sampling", "num_requests"),
    ("beam_search", "num_requests"),
]


@pytest.mark.parametrize(("name", "knob"), EMPTY)
def test_empty_workloads_are_refused(name: str, knob: str) -> None:
    with pytest.raises(WorkloadError, match=rf"workload '{name}' has no requests \({knob}=0\): nothing to measure"):
        make_workload(name, **{knob: 0})


def test_infinite_think_time_is_refused() -> None:
    """An infinite think time would be a next turn that never arrives."""
    with pytest.raises(ValueError, match="knob think_time must be a finite number >= 0.0, got inf"):
        make_workload("multi_turn_chat", think_time="inf")


BASE = ["--backend", "apc", "--knob", "num_documents=2", "--knob", "num_requests=4", "--capacity-tokens", "100000"]


@pytest.mark.parametrize("command", ["compare", "run", "sweep"])
@pytest.mark.parametrize(
    ("extra", "code", "message"),
    [
        (
            ["--knob", "num_requests=0"],
            3,
            # the commands' default rate stays beside the given knobs
            "error: workload 'shared_doc_qa' has no requests (num_documents=2, num_requests=0, rate=20.0)",
        ),
        (["--model", "foo"], 3, "error: unknown model 'foo'; choose one of: "),
        (["--executor", "model", "--model", "foo"], 3, "error: unknown model 'foo'"),
        (["--seed", "-1"], 3, "error: seed must be an int in 0..2**63-1, got -1"),
        (["--seed", str(2**64)], 3, "error: seed must be an int in 0..2**63-1, got 18446744073709551616"),
        (["--seed", "x"], 2, "argument --seed: invalid int value: 'x'"),
        (["--seed", "2.5"], 2, "argument --seed: invalid int value: '2.5'"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, extra: list[str], code: int, message: str
) -> None:
    out = tmp_path / "out"
    argv = [command, *BASE, *extra, "--no-progress", "--no-bounds", "--output-dir", str(out)]
    if code == 2:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
    else:
        assert main(argv) == 3
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not list(out.rglob("*.*"))  # refused before any work (sweep makes its empty cells/ first)


def test_largest_seed_is_accepted() -> None:
    w = make_workload("no_sharing", seed=2**63 - 1, num_requests=2)
    assert len(w) == 2


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, MAX_HASH_ID), min_size=1, max_size=12),
    st.sampled_from([3, 16, 512, 4096]),
    st.booleans(),
    st.integers(1, 10_000),
)
def test_a_prompt_is_its_blocks_whatever_path_builds_it(ids: list[int], block_size: int, low: bool, cut: int) -> None:
    """`MooncakePrompt` builds low-id prompts in int32 directly; every prompt, low ids or
    not, is the int32 of `block_tokens`' blocks cut at its length."""
    from experiments.workloads.mooncake import MooncakePrompt

    if low:
        ids = [h % (TOKEN_MODULUS // block_size) for h in ids]
    length = min(cut, len(ids) * block_size)
    got = MooncakePrompt(tuple(ids), length, block_size)()
    want = block_tokens(np.array(ids, dtype=np.int64), block_size).reshape(-1)[:length]
    assert got.dtype == np.int32 and got.flags.c_contiguous
    assert got.tolist() == want.tolist()
