"""The built-in tokenizer: text to token ids with no vocabulary file and no package, so a text
or ShareGPT workload runs anywhere. Use a real `tokenizer.json` for a model's exact ids.

The rule, fixed (changing it changes every result built with it, so it is versioned,
`BuiltinTokenizer.VERSION`):
1. Split the text (Unicode) into runs of word characters (`\\w+`) and single other
   non-space characters (punctuation, symbols); whitespace separates pieces and yields no
   token.
2. Cut each word run into chunks of at most 4 characters, left to right: English averages
   about 4 characters per BPE token, so token counts land near a real tokenizer's (a guide,
   not a promise: code, numbers and other scripts differ more).
3. A chunk's id is the first 8 bytes of BLAKE2b of its UTF-8 bytes, as an unsigned
   little-endian integer, modulo `vocab_size` (default 32,000, Llama 2's size).

Properties: deterministic across runs, machines and Python versions (no `hash()`, no
random salt); the same text always gives the same ids, so shared prefixes of text share
prefixes of ids; ids lie in [0, vocab_size). Different chunks may share an id (a hash
modulo the vocabulary), as different words would never do in a real vocabulary; a prefix
hit still needs every id of a page to agree, so such collisions almost never make one.
"""

from __future__ import annotations

import hashlib
import re
from typing import ClassVar

import numpy as np

#: the vocabulary the built-in tokenizer maps into, unless told otherwise
BUILTIN_VOCAB = 32_000
_PIECES = re.compile(r"\w+|[^\w\s]")
_CHUNK = 4


class BuiltinTokenizer:
    """Deterministic text -> ids (the module docstring states the rule); `encode` has the
    signature of a `tokenizers`/`transformers` tokenizer's, so the loaders take either."""

    VERSION: ClassVar[int] = 1
    NAME: ClassVar[str] = "builtin"

    def __init__(self, vocab_size: int = BUILTIN_VOCAB) -> None:
        if not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool) and 2 <= vocab_size <= 2**31 - 1):
            raise ValueError(f"vocab_size must be an int in 2..2**31-1, got {vocab_size!r}")
        self.vocab_size = vocab_size
        self._ids: dict[str, int] = {}  # chunk -> id: real text repeats its words

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray:
        """Token ids of `text` as int32 (no special tokens: there are none)."""
        ids = [self._id(c) for piece in _PIECES.findall(text) for c in _chunks(piece)]
        return np.asarray(ids, dtype=np.int32)

    def _id(self, chunk: str) -> int:
        known = self._ids.get(chunk)
        if known is None:
            digest = hashlib.blake2b(chunk.encode("utf-8"), digest_size=8).digest()
            known = self._ids[chunk] = int.from_bytes(digest, "little") % self.vocab_size
        return known

    def describe(self) -> str:
        return f"{self.NAME}-v{self.VERSION}(vocab_size={self.vocab_size})"


def _chunks(piece: str) -> list[str]:
    return [piece[i : i + _CHUNK] for i in range(0, len(piece), _CHUNK)]
