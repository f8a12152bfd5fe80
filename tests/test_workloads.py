"""Workloads: determinism, knob effects, the JSONL and text loaders, the registry's errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from cachelib.types import NO_EXTRA
from experiments.workloads.generators import Workload
from experiments.workloads.jsonl import dump_jsonl, load_jsonl
from experiments.workloads.kshot import kshot_prefix_len
from experiments.workloads.registry import (
    REQUIRED,
    WORKLOADS,
    WorkloadError,
    describe_workloads,
    knobs_of,
    make_workload,
)
from experiments.workloads.spec import TraceFormatError
from experiments.workloads.text import MissingTokenizerPackage, load_text, load_tokenizer

SMALL = {
    "shared_doc_qa": {"num_documents": 5, "doc_len": 64, "num_requests": 30},
    "multi_turn_chat": {"num_conversations": 4, "turns": 3, "user_turn_len": 20, "answer_len": 10},
    "kshot": {"num_requests": 20},
    "multi_tenant": {"num_tenants": 3, "system_len": 64, "num_requests": 30},
    "no_sharing": {"num_requests": 30, "prompt_len": 64},
    "parallel_sampling": {"num_requests": 5},
    "beam_search": {"num_requests": 5},
}
GENERATORS = [n for n in SMALL if n in WORKLOADS]


def fingerprint(w: Workload) -> list[tuple]:
    return [
        (s.request_id, s.prompt.tobytes(), s.output_len, s.arrival, s.extra, s.prefix_id, s.n, s.beam_width)
        for s in w.requests
    ]


def blocks(tokens: np.ndarray, size: int = 16) -> list[bytes]:
    return [tokens[i : i + size].tobytes() for i in range(0, tokens.size - size + 1, size)]


# -- every generator ------------------------------------------------------------------------


@pytest.mark.parametrize("name", GENERATORS)
def test_generator_is_deterministic_per_seed(name: str) -> None:
    a, b = make_workload(name, seed=3, **SMALL[name]), make_workload(name, seed=3, **SMALL[name])
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint(a) != fingerprint(make_workload(name, seed=4, **SMALL[name]))


@pytest.mark.parametrize("name", GENERATORS)
def test_generator_output_is_well_formed(name: str) -> None:
    w = make_workload(name, seed=1, **SMALL[name])
    w.check()
    assert w.name == name and len(w) > 0
    arrivals = [s.arrival for s in w]
    assert arrivals == sorted(arrivals) and arrivals[0] >= 0
    assert len({s.request_id for s in w}) == len(w)
    for s in w:
        assert s.prompt.dtype == np.int32 and s.prompt.ndim == 1 and s.prompt.size > 0
        assert 0 <= s.prompt.min() and s.prompt.max() < 32000 and s.output_len >= 1
        if hasattr(s.prompt_source, "__len__"):  # lazy prompts report their length without building
            assert len(s.prompt_source) == s.prompt.size
    json.dumps(w.config)  # a report stores it
    # the config is exactly the knobs: it rebuilds the same workload
    assert fingerprint(make_workload(name, **w.config)) == fingerprint(w)


def test_vocab_size_bounds_token_ids() -> None:
    w = make_workload("no_sharing", num_requests=10, prompt_len=50, vocab_size=7)
    assert max(int(s.prompt.max()) for s in w) < 7


def test_rate_sets_poisson_arrivals() -> None:
    w = make_workload("no_sharing", num_requests=2000, prompt_len=4, rate=50.0)
    gaps = np.diff([0.0] + [s.arrival for s in w])
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.1)
    assert all(s.arrival == 0.0 for s in make_workload("no_sharing", num_requests=5, rate=float("inf")))


def test_output_dist() -> None:
    fixed = make_workload("no_sharing", num_requests=200, prompt_len=4, output_len=40)
    assert {s.output_len for s in fixed} == {40}
    uni = [s.output_len for s in make_workload("no_sharing", num_requests=500, output_len=40, output_dist="uniform")]
    assert min(uni) >= 20 and max(uni) <= 60 and np.mean(uni) == pytest.approx(40, rel=0.1)
    exp = [
        s.output_len for s in make_workload("no_sharing", num_requests=2000, output_len=40, output_dist="exponential")
    ]
    assert min(exp) >= 1 and np.mean(exp) == pytest.approx(40, rel=0.1) and max(exp) > 120


# -- knob effects ---------------------------------------------------------------------------


def doc_counts(zipf_a: float) -> list[int]:
    w = make_workload("shared_doc_qa", num_documents=20, doc_len=16, num_requests=1000, zipf_a=zipf_a)
    return sorted(Counter(s.request_id.split("-")[0] for s in w).values(), reverse=True)


def test_zipf_skew_concentrates_requests_on_few_documents() -> None:
    flat, skewed = doc_counts(0.0), doc_counts(2.0)
    assert sum(skewed[:3]) > 0.8 * 1000 > sum(flat[:3]) * 2
    assert max(flat) < 100  # uniform: about 50 each


def test_shared_doc_requests_start_with_their_document() -> None:
    w = make_workload(
        "shared_doc_qa", num_documents=3, doc_len=32, question_len=8, num_requests=40, declare_documents=True
    )
    w.check()  # each request starts with its declared document
    by_doc: dict[int, set[bytes]] = {}
    for s in w:
        assert s.prompt.size == 40
        by_doc.setdefault(s.prefix_id, set()).add(s.prompt[:32].tobytes())
    assert all(len(v) == 1 for v in by_doc.values()) and len(by_doc) > 1
    assert make_workload("shared_doc_qa", num_requests=3).declared_prefixes == {}


def test_chat_turn_resends_previous_prompt_and_answer() -> None:
    w = make_workload(
        "multi_turn_chat",
        num_conversations=5,
        turns=4,
        system_len=10,
        user_turn_len=7,
        answer_len=9,
        answer_dist="uniform",
    )
    by_id = {s.request_id: s for s in w}
    for c in range(5):
        for t in range(1, 4):
            prev, cur = by_id[f"conv{c}-turn{t - 1}"], by_id[f"conv{c}-turn{t}"]
            answer = prev.forced_output
            assert answer.size == prev.output_len and answer.dtype == np.int32
            history = np.concatenate([prev.prompt, answer])
            assert np.array_equal(cur.prompt[: history.size], history)
            assert cur.prompt.size == history.size + 7
            assert cur.arrival >= prev.arrival
            assert w.requests.index(cur) > w.requests.index(prev)
    systems = {s.prompt[:10].tobytes() for s in w}
    assert len(systems) == 1  # the system prompt is shared by every conversation


def test_chat_think_time_spaces_turns() -> None:
    w = make_workload("multi_turn_chat", num_conversations=50, turns=5, think_time=3.0, rate=float("inf"))
    by_id = {s.request_id: s.arrival for s in w}
    gaps = [by_id[f"conv{c}-turn{t}"] - by_id[f"conv{c}-turn{t - 1}"] for c in range(50) for t in range(1, 5)]
    assert min(gaps) >= 0 and np.mean(gaps) == pytest.approx(3.0, rel=0.2)


@pytest.mark.parametrize(("shots", "length"), [(1, 80), (2, 145), (5, 341)])
def test_kshot_prefix_has_the_paper_lengths(shots: int, length: int) -> None:
    assert kshot_prefix_len(shots) == length
    w = make_workload("kshot", num_shots=shots, num_requests=30)
    w.check()
    assert list(w.declared_prefixes) == [1]
    assert w.declared_prefixes[1].size == length and w.declared_prefixes[1].dtype == np.int32
    assert all(s.prefix_id == 1 and s.prompt.size > length for s in w)


def test_kshot_tasks_and_undeclared() -> None:
    w = make_workload("kshot", num_shots=3, num_tasks=4, num_requests=100)
    w.check()
    assert sorted(w.declared_prefixes) == [1, 2, 3, 4]
    assert len({p.tobytes() for p in w.declared_prefixes.values()}) == 4
    assert {s.prefix_id for s in w} == {1, 2, 3, 4}
    plain = make_workload("kshot", num_shots=3, num_tasks=4, num_requests=100, declare=False)
    assert plain.declared_prefixes == {} and all(s.prefix_id is None for s in plain)
    assert fingerprint(plain) == [f[:5] + (None,) + f[6:] for f in fingerprint(w)]


def test_tenants_share_tokens_but_not_salts() -> None:
    w = make_workload("multi_tenant", num_tenants=3, system_len=48, user_len=16, num_requests=60)
    salts = {s.extra.cache_salt for s in w}
    assert salts == {"tenant-0", "tenant-1", "tenant-2"}
    assert len({s.prompt[:48].tobytes() for s in w}) == 1  # identical system prompts
    for s in w:
        assert s.request_id.startswith(s.extra.cache_salt.replace("-", ""))
    unsalted = make_workload("multi_tenant", num_tenants=3, num_requests=10, salted=False)
    assert all(s.extra == NO_EXTRA for s in unsalted)


def test_tenants_declared_system_prompt_carries_the_salt() -> None:
    w = make_workload("multi_tenant", num_tenants=2, num_requests=20, declare_system_prompt=True)
    w.check()
    assert sorted(w.declared_prefixes) == [1, 2]
    assert w.extra_of_prefix(2).cache_salt == "tenant-1"


def test_no_sharing_prompts_share_no_block() -> None:
    w = make_workload("no_sharing", num_requests=300, prompt_len=128)
    all_blocks = [b for s in w for b in blocks(s.prompt)]
    assert len(all_blocks) == len(set(all_blocks)) > 2000


@pytest.mark.skipif("parallel_sampling" not in WORKLOADS, reason="sampling.py not present")
def test_sampling_workloads_carry_their_schedules() -> None:
    par = make_workload("parallel_sampling", n=3, num_requests=5)
    assert all(s.n == 3 and len(s.sample_lens) == 3 for s in par)
    beam = make_workload("beam_search", beam_width=2, num_requests=5)
    assert all(s.beam_width == 2 and s.beam_parents.shape == (s.output_len, 2) for s in beam)


# -- registry -------------------------------------------------------------------------------


def test_unknown_workload_lists_the_valid_ones() -> None:
    with pytest.raises(WorkloadError, match="unknown workload 'nope'.*shared_doc_qa.*no_sharing"):
        make_workload("nope")


def test_unknown_knob_lists_the_valid_ones() -> None:
    with pytest.raises(WorkloadError, match=r"no knob\(s\) bogus; its knobs: num_conversations, turns"):
        make_workload("multi_turn_chat", bogus=1)
    with pytest.raises(WorkloadError, match=r"needs knob\(s\) path"):
        make_workload("jsonl")


def test_bad_knob_values() -> None:
    with pytest.raises(ValueError, match="knob num_shots must be an int in 1..5"):
        make_workload("kshot", num_shots=6)
    with pytest.raises(ValueError, match="knob output_dist must be one of"):
        make_workload("no_sharing", output_dist="gauss")
    with pytest.raises(ValueError, match="knob rate must be a number > 0"):
        make_workload("no_sharing", rate=0)
    with pytest.raises(WorkloadError, match="knob turns expects int"):
        make_workload("multi_turn_chat", turns="many")


def test_string_knobs_are_converted() -> None:
    w = make_workload("kshot", num_requests="5", rate="inf", declare="false", example_lens="10,20", num_shots="2")
    assert len(w) == 5 and w.declared_prefixes == {} and w.config["example_lens"] == [10, 20]
    assert all(s.arrival == 0 and s.prompt.size >= 15 + 30 for s in w)


def test_describe_workloads() -> None:
    d = describe_workloads()
    assert set(d) == set(WORKLOADS)
    assert d["shared_doc_qa"]["summary"].startswith("Shared-document QA")
    assert d["shared_doc_qa"]["knobs"]["zipf_a"] == 1.0
    assert d["jsonl"]["knobs"]["path"] == REQUIRED
    for name, entry in d.items():  # every knob is documented in its docstring
        assert set(entry["help"]) == set(knobs_of(name)), name


def test_mooncake_is_registered() -> None:
    w = make_workload("mooncake", limit=5)
    assert w.name == "mooncake" and len(w) == 5 and w.requests[0].prompt.dtype == np.int32


# -- JSONL of token ids ---------------------------------------------------------------------


def write(tmp_path: Path, lines: list[object], name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_jsonl_good_lines(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        [
            {"prompt": [1, 2, 3], "output_len": 4},
            "",
            {
                "prompt": [7, 8, 9, 10],
                "output_len": 0,
                "arrival": 1.5,
                "cache_salt": "a",
                "lora_id": 2,
                "prefix_id": 5,
                "id": "x",
            },
            {"prefix_id": 5, "prefix": [7, 8], "cache_salt": "a", "lora_id": 2},
        ],
    )
    w = load_jsonl(p)
    assert [s.request_id for s in w] == ["jsonl-0", "x"]
    a, b = w.requests
    assert a.prompt.tolist() == [1, 2, 3] and a.prompt.dtype == np.int32 and a.arrival == 0.0 and a.extra == NO_EXTRA
    assert (b.output_len, b.arrival, b.extra.cache_salt, b.extra.lora_id, b.prefix_id) == (0, 1.5, "a", 2, 5)
    assert w.declared_prefixes[5].tolist() == [7, 8] and w.extra_of_prefix(5) == b.extra
    assert len(load_jsonl(p, limit=1)) == 1


def test_jsonl_round_trip(tmp_path: Path) -> None:
    w = make_workload("multi_tenant", num_tenants=2, num_requests=6, system_len=20, declare_system_prompt=True)
    dump_jsonl(w, tmp_path / "w.jsonl")
    back = load_jsonl(tmp_path / "w.jsonl")
    assert fingerprint(back) == fingerprint(w)
    assert {k: v.tolist() for k, v in back.declared_prefixes.items()} == {
        k: v.tolist() for k, v in w.declared_prefixes.items()
    }


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"prompt": [1]}, r"missing field\(s\) output_len"),
        ({"prompt": [1], "output_len": 1, "colour": 1}, r"unknown field\(s\) colour; allowed: prompt"),
        ({"prompt": [], "output_len": 1}, "prompt must be a non-empty list"),
        ({"prompt": [1, -2], "output_len": 1}, "prompt must be a non-empty list of token ids"),
        ({"prompt": [1, 2**31], "output_len": 1}, "prompt must be .* token ids"),
        ({"prompt": [1, 2.5], "output_len": 1}, "prompt must be .* token ids"),
        ({"prompt": [1, 2_000_000_000], "output_len": 1}, "prompt must .* generated tokens"),
        ({"prompt": [1], "output_len": -1}, "output_len must be an int in 0..147,483,647"),
        ({"prompt": [1], "output_len": True}, "output_len must be an int in 0"),
        ({"prompt": [1], "output_len": 147_483_648}, "output_len must be an int in 0..147,483,647"),
        ({"prompt": [1], "output_len": 1, "arrival": -1}, "arrival must be a finite non-negative number"),
        ('{"prompt": [1], "output_len": 1, "arrival": NaN}', "NaN is not a number"),
        ('{"prompt": [1], "output_len": 1, "arrival": Infinity}', "Infinity is not a number"),
        ('{"prompt": [1], "output_len": 1, "arrival": 1e400}', "arrival must be a finite"),
        ({"prompt": [1], "output_len": 1, "arrival": 10**400}, r"arrival must be a finite .* got 1000.*\.\.\."),
        ({"prompt": [1], "output_len": 1, "cache_salt": 3}, "cache_salt must be a string"),
        ({"prompt": [1], "output_len": 1, "lora_id": "a"}, "lora_id must be an int in 0..2"),
        ({"prompt": [1], "output_len": 1, "lora_id": 2**64}, "lora_id must be an int in 0..2"),
        ({"prompt": [1], "output_len": 1, "prefix_id": 9}, "prefix_id 9 is not declared"),
        ({"prompt": [1], "output_len": 1, "id": ""}, "id must be a non-empty string"),
    ],
)
def test_jsonl_bad_line_names_path_and_line(tmp_path: Path, line: object, message: str) -> None:
    p = write(tmp_path, [{"prompt": [5], "output_len": 1}, line])
    with pytest.raises(TraceFormatError, match=rf"t\.jsonl:2: {message}"):
        load_jsonl(p)


def test_jsonl_bad_prefixes(tmp_path: Path) -> None:
    cases = [
        (
            [{"prefix_id": 1, "prefix": [1, 2]}, {"prompt": [1, 3], "output_len": 1, "prefix_id": 1}],
            "t.jsonl:2: prompt does not start with declared prefix 1",
        ),
        (
            [{"prefix_id": 1, "prefix": [1]}, {"prompt": [1, 3], "output_len": 1, "prefix_id": 1, "cache_salt": "s"}],
            "t.jsonl:2: cache_salt/lora_id differ",
        ),
        ([{"prefix_id": 1, "prefix": [1]}, {"prefix_id": 1, "prefix": [2]}], "t.jsonl:2: prefix_id 1 declared twice"),
        (
            [{"prompt": [1], "output_len": 1, "id": "a"}, {"prompt": [1], "output_len": 1, "id": "a"}],
            "t.jsonl:2: duplicate id 'a' \\(first at .*t.jsonl:1\\)",
        ),
        ([{"prefix_id": 1, "prefix": [1], "extra": 1}], r"t.jsonl:1: unknown field\(s\) extra"),
    ]
    for lines, message in cases:
        with pytest.raises(TraceFormatError, match=message):
            load_jsonl(write(tmp_path, lines))


def test_jsonl_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_jsonl(tmp_path / "none.jsonl")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_jsonl(write(tmp_path, [""]))
    with pytest.raises(ValueError, match="limit must be a positive int"):
        load_jsonl(write(tmp_path, [{"prompt": [1], "output_len": 1}]), limit=0)


# -- text through a tokenizer ---------------------------------------------------------------


class WordTokenizer:
    """A tiny injected tokenizer: one id per whitespace-separated word (stable within a run)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False  # the loader must not add BOS and the like
        return [self.vocab.setdefault(word, len(self.vocab)) for word in text.split()]


def test_text_with_injected_tokenizer(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        [
            {"text": "translate the cat", "output_len": 3, "prefix_id": 1, "cache_salt": "t"},
            {"prefix_id": 1, "prefix_text": "you are a translator", "cache_salt": "t"},
            {"text": "hello world", "output_len": 2, "arrival": 0.5, "id": "plain"},
        ],
    )
    w = load_text(p, WordTokenizer())
    w.check()
    first, second = w.requests
    prefix = w.declared_prefixes[1]
    assert prefix.size == 4 and first.prompt.size == 7 and np.array_equal(first.prompt[:4], prefix)
    assert second.request_id == "plain" and second.prompt.size == 2 and second.prompt.dtype == np.int32
    assert w.name == "text" and w.config["tokenizer"] == "WordTokenizer"


def test_text_bad_lines(tmp_path: Path) -> None:
    for lines, message in [
        ([{"text": 5, "output_len": 1}], "t.jsonl:1: text must be a string"),
        ([{"text": "", "output_len": 1}], "t.jsonl:1: text encodes to no tokens"),
        ([{"text": "a", "output_len": 1, "prefix_id": 2}], "t.jsonl:1: prefix_id 2 is not declared"),
        ([{"prompt": [1], "output_len": 1}], r"t.jsonl:1: unknown field\(s\) prompt"),
    ]:
        with pytest.raises(TraceFormatError, match=message):
            load_text(write(tmp_path, lines), WordTokenizer())


def test_tokenizer_path_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer not found: .*nothing is downloaded"):
        load_tokenizer(tmp_path / "missing.json")
    # pretend neither optional package is installed, whatever this environment has
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(MissingTokenizerPackage, match="needs the `tokenizers` package"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(MissingTokenizerPackage, match="needs the `tokenizers` package"):
        load_tokenizer(tmp_path)  # a directory with tokenizer.json falls back to tokenizers
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(MissingTokenizerPackage, match="needs the `transformers` package"):
        load_tokenizer(tmp_path)
    trace = write(tmp_path, [{"text": "a", "output_len": 1}])
    with pytest.raises(WorkloadError, match="needs knob"):
        make_workload("text", path=str(trace))
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        make_workload("text", path=str(trace), tokenizer=str(tmp_path / "nope"))


# -- what backends see ----------------------------------------------------------------------


def run_all(cache, w: Workload, pid_map: dict[int, int] | None = None) -> list[int]:
    """match -> admit -> commit -> release each request in order; the hit of each."""
    from cachelib.types import Sequence

    hits = []
    for spec in w:
        pid = None if spec.prefix_id is None else (pid_map or {}).get(spec.prefix_id)
        seq = Sequence(spec.request_id, spec.prompt, spec.extra, prefix_id=pid)
        m = cache.match(seq)
        assert cache.admit(seq, m, len(seq)) is not None
        cache.commit(seq, len(seq))
        cache.release(seq)
        cache.check_invariants()
        hits.append(m.num_tokens)
    return hits


def test_declared_kshot_prefixes_are_shared_by_paged() -> None:
    from cachelib import create_cache

    w = make_workload("kshot", num_shots=5, num_tasks=2, num_requests=12)
    cache = create_cache("paged", num_pages=400, page_size=16)
    pid_map = {}
    for wid, tokens in w.declared_prefixes.items():  # the engine's job: register, compute once
        pid = cache.register_prefix(tokens, w.extra_of_prefix(wid))
        cache.commit(cache.prefix_sequence(pid), tokens.size)
        pid_map[wid] = pid
    assert run_all(cache, w, pid_map) == [341] * 12


def test_salts_keep_tenants_apart_on_apc() -> None:
    from cachelib import create_cache

    w = make_workload("multi_tenant", num_tenants=3, system_len=64, user_len=16, num_requests=30)
    hits = run_all(create_cache("apc", num_pages=1000, page_size=16), w)
    seen: set[str] = set()
    for spec, hit in zip(w, hits, strict=True):
        salt = spec.extra.cache_salt
        assert hit == (0 if salt not in seen else 64)  # a tenant's first request misses
        seen.add(salt)
    unsalted = make_workload("multi_tenant", num_tenants=3, system_len=64, user_len=16, num_requests=30, salted=False)
    assert run_all(create_cache("apc", num_pages=1000, page_size=16), unsalted)[1:] == [64] * 29
