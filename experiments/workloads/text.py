"""Text workload: a JSONL of text prompts, tokenized by a local tokenizer the user points to.

Nothing is ever downloaded. `tokenizer` is a path to a `tokenizers` `tokenizer.json` file
(needs the `tokenizers` package) or to a local `transformers` tokenizer directory (needs
`transformers`, loaded with `local_files_only=True`; a directory holding a tokenizer.json
falls back to `tokenizers` when `transformers` is missing), or any object with
`encode(text, add_special_tokens=False)` returning ids or an object with `.ids`. Both
packages are optional and imported only here, only when used.

Format: like `jsonl.py` with text in place of token ids. A request line

    {"text": "Translate: ...", "output_len": 32, "arrival": 0.1, "cache_salt": "a",
     "lora_id": 1, "prefix_id": 1, "id": "r1"}

(`text` and `output_len` required) and a prefix line `{"prefix_id": 1, "prefix_text":
"You are ...", "cache_salt": "a", "lora_id": 1}`. A request naming a prefix gets
`encode(prefix_text) + encode(text)`: the two are tokenized apart so every request shares
exactly the prefix's ids (tokenizing the joined string could merge across the seam). No
special tokens are added. The file must be UTF-8; strict JSON (no NaN or Infinity); errors name
`path:line`. A tokenizer that cannot be loaded or returns ids of 2_000_000_000 or more (the
engine's generated tokens) is a ValueError naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import numpy as np

from experiments.workloads.generators import Workload
from experiments.workloads.jsonl import (
    TraceBuilder,
    check_fields,
    extra_keys,
    open_trace,
    prefix_id_of,
    read_objects,
    request_meta,
)
from experiments.workloads.spec import TraceFormatError
from experiments.workloads.tracefile import MAX_PROMPT_TOKEN

TEXT_FIELDS = ("text", "output_len", "arrival", "cache_salt", "lora_id", "prefix_id", "id")
PREFIX_TEXT_FIELDS = ("prefix_id", "prefix_text", "cache_salt", "lora_id")


class Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> Any: ...


class MissingTokenizerPackage(ImportError, ValueError):
    """The optional package a tokenizer path needs is not installed (a ValueError too, so the
    command line reports it in one line, as bad input, instead of a traceback)."""


def load_tokenizer(path: str | Path) -> Encoder:
    """A local tokenizer: a tokenizer.json file or a transformers tokenizer directory."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"tokenizer not found: {path} (give a local tokenizer.json or tokenizer directory; nothing is downloaded)"
        )
    if path.is_file():
        return _from_tokenizer_json(path)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        if (path / "tokenizer.json").is_file():
            return _from_tokenizer_json(path / "tokenizer.json")
        raise MissingTokenizerPackage(
            f"tokenizer directory {path} needs the `transformers` package (pip install transformers), "
            "or a tokenizer.json in it and the `tokenizers` package"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer directory {path} cannot be loaded: {exc}") from None


def _from_tokenizer_json(path: Path) -> Encoder:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise MissingTokenizerPackage(
            f"tokenizer file {path} needs the `tokenizers` package (pip install tokenizers)"
        ) from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on a file it cannot parse
        raise ValueError(f"tokenizer file {path} cannot be read as a tokenizer.json: {exc}") from None


def encode(tokenizer: Encoder, text: str) -> np.ndarray:
    """Token ids of `text` (no special tokens) as int32, each in 0..MAX_PROMPT_TOKEN."""
    out = tokenizer.encode(text, add_special_tokens=False)
    ids = np.asarray(getattr(out, "ids", out), dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() > MAX_PROMPT_TOKEN):
        raise ValueError(f"tokenizer returned ids outside 0..{MAX_PROMPT_TOKEN:_} (larger ids are generated tokens)")
    return ids.astype(np.int32)


def _text(value: object, where: str, field: str) -> str:
    if not isinstance(value, str):
        raise TraceFormatError(f"{where}: {field} must be a string, got {type(value).__name__}")
    return value


def load_text(path: str | Path, tokenizer: str | Path | Encoder, limit: int | None = None) -> Workload:
    """The first `limit` requests (all if None) of a text JSONL trace, tokenized, in file order."""
    path = open_trace(path, limit)
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, (str, Path)) else tokenizer
    objects = list(read_objects(path))  # two passes: prefixes may follow the requests using them
    trace = TraceBuilder(path)
    for where, obj in objects:
        if "prefix_text" in obj:
            check_fields(obj, where, PREFIX_TEXT_FIELDS, ("prefix_id", "prefix_text"))
            ids = encode(tok, _text(obj["prefix_text"], where, "prefix_text"))
            if ids.size == 0:
                raise TraceFormatError(f"{where}: prefix_text encodes to no tokens")
            trace.add_prefix(prefix_id_of(obj, where), ids, extra_keys(obj, where), where)
    for where, obj in objects:
        if "prefix_text" in obj or (limit is not None and len(trace.requests) >= limit):
            continue
        check_fields(obj, where, TEXT_FIELDS, ("text", "output_len"))
        meta = request_meta(obj, where, len(trace.requests))
        ids = encode(tok, _text(obj["text"], where, "text"))
        pid = meta["prefix_id"]
        if pid is not None:
            if pid not in trace.prefixes:
                raise TraceFormatError(f"{where}: prefix_id {pid} is not declared in the file")
            ids = np.concatenate([trace.prefixes[pid], ids])
        if ids.size == 0:
            raise TraceFormatError(f"{where}: text encodes to no tokens")
        trace.add_request(ids, meta, where)
    name = str(tokenizer) if isinstance(tokenizer, (str, Path)) else type(tokenizer).__name__
    return trace.build("text", {"path": str(path), "tokenizer": name, "limit": limit})
