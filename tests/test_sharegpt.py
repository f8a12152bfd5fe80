"""Inputs users already have: ShareGPT conversations (built-in tokenizer or a local
tokenizer.json), gzip-compressed traces, and the Mooncake block size."""

from __future__ import annotations

import gzip
import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments.cli.main import main
from experiments.workloads.builtin_tokenizer import BuiltinTokenizer
from experiments.workloads.mooncake import block_tokens, load_mooncake
from experiments.workloads.registry import make_workload
from experiments.workloads.sharegpt import load_sharegpt
from experiments.workloads.spec import TraceFormatError

ROOT = Path(__file__).resolve().parent
FIXTURE = ROOT / "fixtures" / "sharegpt" / "conversations.json"
TOKENIZER = ROOT / "fixtures" / "tokenizer" / "tokenizer.json"
TRACE = ROOT.parent / "experiments" / "data" / "mooncake_conversation_2000.jsonl"


def _convs() -> list[dict]:
    return json.loads(FIXTURE.read_text())


def test_builtin_tokenizer_follows_its_documented_rule():
    tok = BuiltinTokenizer(1000)
    ids = tok.encode("Prefixes, shared!")
    # pieces: "Pref" "ixes" "," "shar" "ed" "!" (words cut into chunks of 4, punctuation alone)
    want = [int.from_bytes(hashlib.blake2b(c.encode(), digest_size=8).digest(), "little") % 1000
            for c in ("Pref", "ixes", ",", "shar", "ed", "!")]  # fmt: skip
    assert ids.dtype == np.int32 and ids.tolist() == want
    assert BuiltinTokenizer(1000).encode("Prefixes, shared!").tolist() == want  # no state leaks between instances
    assert tok.encode("   ").size == 0


def test_sharegpt_fixture_turns_share_their_history():
    wl = make_workload("sharegpt", path=str(FIXTURE))
    tok = BuiltinTokenizer()
    by_id = {r.request_id: r for r in wl.requests}
    assert sorted(by_id) == ["sharegpt0-turn0", "sharegpt0-turn1", "sharegpt1-turn0", "sharegpt3-turn0"]
    c0 = _convs()[0]["conversations"]
    t0, t1 = by_id["sharegpt0-turn0"], by_id["sharegpt0-turn1"]
    assert t0.prompt.tolist() == np.concatenate([tok.encode(m["value"]) for m in c0[:2]]).tolist()
    assert t0.forced_output.tolist() == tok.encode(c0[2]["value"]).tolist() and t0.output_len == t0.forced_output.size
    # turn 1 re-sends turn 0's prompt and answer, id for id, then the new question
    assert t1.prompt.tolist() == np.concatenate([t0.prompt, t0.forced_output, tok.encode(c0[3]["value"])]).tolist()
    assert t1.after == "sharegpt0-turn0" and t1.arrival > t0.arrival
    # the leading greeting of conversation 3 makes no request but stays in the history
    c3 = _convs()[3]["conversations"]
    assert (
        by_id["sharegpt3-turn0"].prompt.tolist()[: len(tok.encode(c3[0]["value"]))]
        == tok.encode(c3[0]["value"]).tolist()
    )
    # nothing dropped silently: the config counts what made no request
    assert wl.config["skipped"] == {"empty_conversations": 1, "answers_without_prompt": 1, "unanswered_messages": 1}
    assert wl.config["tokenizer"].startswith("builtin")
    assert [r.request_id for r in make_workload("sharegpt", path=str(FIXTURE), limit=1).requests] == [
        "sharegpt0-turn0", "sharegpt0-turn1"]  # fmt: skip


def test_sharegpt_with_a_tokenizer_json():
    pytest.importorskip("tokenizers")
    wl = load_sharegpt(FIXTURE, str(TOKENIZER))
    vocab = json.loads(TOKENIZER.read_text())["model"]["vocab"]
    first = wl.requests[0] if wl.requests[0].request_id == "sharegpt0-turn0" else None
    assert first is not None
    words = ["You", "are", "a", "helpful", "assistant", "who", "answers", "briefly", "."]
    assert first.prompt.tolist()[: len(words)] == [vocab[w] for w in words]
    with pytest.raises(ValueError, match="vocab_size applies to the built-in tokenizer only"):
        load_sharegpt(FIXTURE, str(TOKENIZER), vocab_size=100)


def test_a_tokenizer_json_without_the_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"needs the `tokenizers` package"):
        load_sharegpt(FIXTURE, str(TOKENIZER))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "not valid JSON"),
        ("[]", "no conversations in the file"),
        ('{"conversations": []}', "a JSON list of conversations, got a dict"),
        ('[{"id": 1}]', 'conversation 0: expected an object with a "conversations" list'),
        ('[{"conversations": "hi"}]', '"conversations" must be a list of messages'),
        (
            '[{"conversations": [{"from": "human"}]}]',
            'conversation 0, message 0: expected {"from": ROLE, "value": TEXT}',
        ),
        ('[{"conversations": [{"from": "robot", "value": "x"}]}]', "unknown role 'robot'"),
        ('[{"conversations": [{"from": "human", "value": "only a question"}]}]', "no requests"),
        ('[{"conversations": [{"from": "human", "value": NaN}]}]', "not valid JSON"),
    ],
)
def test_malformed_sharegpt_is_a_clear_error(tmp_path, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(TraceFormatError, match=message.replace("(", r"\(").replace("{", r"\{")):
        load_sharegpt(bad)


def test_compare_runs_a_sharegpt_file_and_refuses_a_bad_one(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["compare", "--workload", "sharegpt", "--knob", f"path={FIXTURE}", "--backend", "apc,none",
            "--capacity-tokens", "2000", "--no-bounds", "--no-progress", "--output-dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    apc = next(c for c in results["cells"] if c["config"]["backend"] == "apc")
    assert apc["replay"]["requests"] == 4 and apc["replay"]["hit_tokens"] > 0  # turn 1 reuses turn 0
    bad = tmp_path / "bad.json"
    bad.write_text('[{"conversations": [{"from": "robot", "value": "x"}]}]')
    capsys.readouterr()
    assert main([*argv[:3], f"--knob=path={bad}", *argv[5:]]) == 3
    assert "unknown role 'robot'" in capsys.readouterr().err


def test_gzip_traces_read_like_plain_ones(tmp_path):
    lines = TRACE.read_text().splitlines()[:30]
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    plain.write_text("\n".join(lines) + "\n")
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    a, b = load_mooncake(plain), load_mooncake(packed)
    assert [(s.arrival, s.prompt.tolist(), s.output_len) for s in a] == [
        (s.arrival, s.prompt.tolist(), s.output_len) for s in b
    ]
    (tmp_path / "c.json.gz").write_bytes(gzip.compress(FIXTURE.read_bytes()))
    assert len(load_sharegpt(tmp_path / "c.json.gz").requests) == 4
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(packed.read_bytes()[:60])
    with pytest.raises(TraceFormatError, match="not a readable gzip file"):
        load_mooncake(broken)


def test_mooncake_block_size_is_an_option(tmp_path, capsys):
    trace = tmp_path / "b16.jsonl"
    rows = [{"timestamp": 0, "input_length": 40, "output_length": 2, "hash_ids": [1, 2, 3]},
            {"timestamp": 5, "input_length": 20, "output_length": 2, "hash_ids": [1, 9]}]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceFormatError, match="needs 1 blocks of 512 tokens.*give its block_size"):
        load_mooncake(trace)
    specs = load_mooncake(trace, block_size=16)
    assert specs[0].prompt.tolist() == [h * 16 + j for h in (1, 2, 3) for j in range(16)][:40]
    assert specs[1].prompt.tolist()[:16] == specs[0].prompt.tolist()[:16]
    wl = make_workload("mooncake", path=str(trace), block_size="16")
    assert wl.config["block_size"] == 16 and len(wl.requests) == 2
    with pytest.raises(ValueError, match="block_size must be an int in 3"):
        load_mooncake(trace, block_size=2)
    assert (
        main(["replay", "--backend", "apc", "--trace", str(trace), "--mooncake-block-size", "16", "--no-progress"]) == 0
    )
    assert "hit rate" in capsys.readouterr().out
    assert main(["replay", "--backend", "apc", "--trace", str(trace), "--no-progress"]) == 3


def test_high_ids_stay_distinct_at_another_block_size():
    rng = np.random.default_rng(1)
    ids = np.unique(np.concatenate([rng.integers(0, 2**63 - 1, 2000, dtype=np.int64),
                                    np.arange(2_000_000_000 // 48 - 5, 2_000_000_000 // 48 + 5)]))  # fmt: skip
    blocks = block_tokens(ids, 48)
    assert blocks.shape == (ids.size, 48) and blocks.min() >= 0 and blocks.max() < 2_000_000_000
    assert len({tuple(row[:3]) for row in blocks.tolist()}) == ids.size  # the first 3 tokens name the id
    assert np.array_equal(block_tokens(ids[:5]), block_tokens(ids[:5], 512))


def test_the_text_workload_takes_the_builtin_tokenizer(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"text": "Hello there, world", "output_len": 2}\n{"text": "Hello there, again", "output_len": 2}\n'
    )
    wl = make_workload("text", path=str(trace), tokenizer="builtin")
    tok = BuiltinTokenizer()
    assert [r.prompt.tolist() for r in wl.requests] == [tok.encode("Hello there, world").tolist(),
                                                        tok.encode("Hello there, again").tolist()]  # fmt: skip
    assert wl.requests[0].prompt.tolist()[:3] == wl.requests[1].prompt.tolist()[:3]
