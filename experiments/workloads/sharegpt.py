"""ShareGPT-format conversations as a multi-turn workload.

Input: a JSON file holding a list of conversations (`.json`, or `.json.gz`), or one
conversation per line (`.jsonl`, `.jsonl.gz`), each

    {"id": "abc", "conversations": [{"from": "human", "value": "..."},
                                    {"from": "gpt", "value": "..."}, ...]}

(the layout of the ShareGPT dumps that `vllm bench serve --dataset-name sharegpt` and
SGLang's `bench_serving` read; other fields are ignored). Roles: `human`/`user` ask,
`gpt`/`assistant`/`chatgpt`/`bing`/`bard` answer, `system` is context; any other role is an
error, so a typo is not read as text.

Requests: every answer with something before it is one request. Its prompt is the
conversation so far (every earlier message, answers included, each tokenized on its own and
concatenated, so turn t+1's prompt starts with turn t's prompt and answer, id for id, as a
chat client re-sends its history); its output is that answer's tokens, generated exactly
(`RequestSpec.forced_output`), so the next turn can hit the answer's KV. No chat template
is applied (a real server adds role markers: a few tokens per message, the same in every
turn, so the sharing is the same). Unlike the vLLM and SGLang benchmarks, which keep the
first two messages of a conversation, every turn is kept.

Messages that make no request are counted in the workload's config (`skipped`), never
dropped silently: a conversation with no messages, an answer with nothing before it (it
stays in the history later turns re-send), and trailing questions nobody answered.

Arrivals: conversations start as a Poisson process of `rate` per second (seeded); a turn
arrives an exponential think time (mean `think_time` s) after the previous turn finishes
in the serving protocol (`RequestSpec.after`), after the previous one arrives in replay,
as in `multi_turn_chat`.

Tokenizer: a local Hugging Face `tokenizer.json` (the `tokenizers` package, `pip install
'prefix-cache-lab[tokenizers]'`) or a local `transformers` directory (see text.py); by
default the built-in deterministic tokenizer (builtin_tokenizer.py), which needs nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from experiments.workloads.builtin_tokenizer import BUILTIN_VOCAB, BuiltinTokenizer
from experiments.workloads.generators import ConcatPrompt, Workload, make_rng, poisson_arrivals, require_float
from experiments.workloads.spec import RequestSpec, TraceFormatError
from experiments.workloads.text import Encoder, encode, load_tokenizer
from experiments.workloads.tracefile import is_int, open_bytes, read_json_lines

ASKS = frozenset({"human", "user"})
ANSWERS = frozenset({"gpt", "assistant", "chatgpt", "bing", "bard"})
CONTEXT = frozenset({"system"})
ROLES = ASKS | ANSWERS | CONTEXT
#: the `tokenizer` knob's value for the built-in tokenizer
BUILTIN = "builtin"


def tokenizer_for(tokenizer: str | Encoder, vocab_size: int | None) -> tuple[Encoder, str]:
    """(encoder, its name for the config): `builtin` (with `vocab_size`, default 32,000) or a
    local tokenizer path; `vocab_size` with a real tokenizer is an error (its vocabulary is its own)."""
    if isinstance(tokenizer, str) and tokenizer == BUILTIN:
        tok = BuiltinTokenizer(BUILTIN_VOCAB if vocab_size is None else vocab_size)
        return tok, tok.describe()
    if vocab_size is not None:
        raise ValueError(f"vocab_size applies to the built-in tokenizer only; tokenizer {tokenizer} has its own")
    if isinstance(tokenizer, (str, Path)):
        return load_tokenizer(tokenizer), str(tokenizer)
    return tokenizer, type(tokenizer).__name__


def read_conversations(path: Path) -> Iterator[tuple[str, Any]]:
    """(`path: conversation i`, object) of each conversation, in file order."""
    stem = path.name[:-3] if path.name.endswith(".gz") else path.name
    if stem.endswith(".jsonl"):
        for i, (where, obj) in enumerate(read_json_lines(path)):
            yield f"{where} (conversation {i})", obj
        return
    try:
        with open_bytes(path) as fh:
            data = json.loads(fh.read().decode("utf-8"), parse_constant=_no_constant)
    except OSError as exc:  # gzip damage is an OSError (BadGzipFile) or EOFError
        raise TraceFormatError(f"{path}: cannot read ({exc})") from None
    except EOFError:
        raise TraceFormatError(f"{path}: truncated gzip file") from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{path}: not UTF-8 text (byte offset {exc.start})") from None
    except (json.JSONDecodeError, ValueError) as exc:
        raise TraceFormatError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, list):
        raise TraceFormatError(
            f"{path}: a ShareGPT file is a JSON list of conversations, got a {type(data).__name__}"
            + (" (one conversation per line? name the file .jsonl)" if isinstance(data, dict) else "")
        )
    for i, obj in enumerate(data):
        yield f"{path}: conversation {i}", obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not strict JSON")


def _messages(obj: Any, where: str) -> list[tuple[str, str]]:
    """(role kind: ask | answer | context, text) of each message of one conversation."""
    if not isinstance(obj, dict) or "conversations" not in obj:
        raise TraceFormatError(f'{where}: expected an object with a "conversations" list, got {_kind(obj)}')
    turns = obj["conversations"]
    if not isinstance(turns, list):
        raise TraceFormatError(f'{where}: "conversations" must be a list of messages, got {_kind(turns)}')
    out = []
    for j, turn in enumerate(turns):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str) and isinstance(turn.get("value"), str)):
            raise TraceFormatError(f'{where}, message {j}: expected {{"from": ROLE, "value": TEXT}}, got {_kind(turn)}')
        role = turn["from"].strip().lower()
        if role not in ROLES:
            raise TraceFormatError(
                f"{where}, message {j}: unknown role {turn['from']!r}; roles: {', '.join(sorted(ROLES))}"
            )
        out.append(("ask" if role in ASKS else "answer" if role in ANSWERS else "context", turn["value"]))
    return out


def _kind(value: Any) -> str:
    text = json.dumps(value)[:40] if isinstance(value, (dict, list, str)) else repr(value)
    return f"{type(value).__name__} {text}"


def load_sharegpt(
    path: str | Path,
    tokenizer: str | Encoder = BUILTIN,
    *,
    seed: int = 0,
    limit: int | None = None,
    rate: float = 1.0,
    think_time: float = 5.0,
    vocab_size: int | None = None,
) -> Workload:
    """The first `limit` conversations (all if None) of a ShareGPT file as requests (module
    docstring); a `TraceFormatError` naming the conversation and message on bad input."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: {path}")
    if limit is not None and (not is_int(limit) or limit <= 0):
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    require_float("rate", rate, strict=True)
    require_float("think_time", think_time, finite=True)
    tok, tok_name = tokenizer_for(tokenizer, vocab_size)
    conversations: list[list[tuple[str, np.ndarray]]] = []
    for where, obj in read_conversations(path):
        if limit is not None and len(conversations) >= limit:
            break
        conversations.append([(kind, encode(tok, text)) for kind, text in _messages(obj, where)])
    if not conversations:
        raise TraceFormatError(f"{path}: no conversations in the file")
    rng = make_rng(seed, "sharegpt")
    starts = poisson_arrivals(rng, len(conversations), rate)
    skipped = {"empty_conversations": 0, "answers_without_prompt": 0, "unanswered_messages": 0}
    requests: list[RequestSpec] = []
    for c, messages in enumerate(conversations):
        if not messages:
            skipped["empty_conversations"] += 1
        history: tuple[np.ndarray, ...] = ()
        arrival, prev = float(starts[c]), None
        pending, turn = 0, 0  # messages since the last answer; requests of this conversation
        for kind, ids in messages:
            if kind == "answer":
                if sum(int(p.size) for p in history) == 0:
                    skipped["answers_without_prompt"] += 1
                else:
                    think = float(rng.exponential(think_time)) if prev is not None and think_time > 0 else 0.0
                    arrival += think
                    rid = f"sharegpt{c}-turn{turn}"
                    turn += 1
                    requests.append(
                        RequestSpec(
                            rid,
                            ConcatPrompt(history),
                            int(ids.size),
                            arrival,
                            after=prev,
                            think_time=think,
                            forced_output=ids,
                        )  # fmt: skip
                    )
                    prev = rid
                pending = 0
            else:
                pending += 1
            history = (*history, ids)
        skipped["unanswered_messages"] += pending
    if not requests:
        raise TraceFormatError(f"{path}: no requests: no answer follows a question in any conversation ({skipped})")
    config = {"path": str(path), "tokenizer": tok_name, "limit": limit, "rate": _num(rate), "think_time": think_time,
              "seed": seed, "conversations": len(conversations), "skipped": skipped}  # fmt: skip
    return Workload("sharegpt", sorted(requests, key=lambda s: s.arrival), config=config)


def _num(value: float) -> float | str:
    return "inf" if value == float("inf") else value
