"""Reading a JSONL trace file strictly: every problem is a `TraceFormatError` naming `path:line`.

Shared by the Mooncake, token-id and text loaders, so they reject the same things the same
way: a file that cannot be opened, bytes that are not UTF-8 (a binary or mis-encoded file),
JSON that is not strict (`NaN`, `Infinity`, which Python's `json` accepts by default and
which would make an arrival time never come), a line that is not one JSON object, and
numbers that are not finite once converted. A file whose name ends in `.gz` is read
through gzip (`trace.jsonl.gz` wherever `trace.jsonl` is taken); a damaged or truncated
archive is a `TraceFormatError` too.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from experiments.workloads.spec import GENERATED_TOKEN_BASE, TraceFormatError

#: prompt ids stay below the engine's generated ids: one among them could match another
#: request's generated tokens, a false hit
MAX_PROMPT_TOKEN = GENERATED_TOKEN_BASE - 1
#: a request generating more tokens than this would run its generated ids past int32
MAX_OUTPUT_LEN = 2**31 - 1 - GENERATED_TOKEN_BASE


class _NonFinite(ValueError):
    pass


def _reject_constant(name: str) -> Any:
    raise _NonFinite(name)


def read_json_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(`path:line`, object) for every non-blank line of `path`, in order."""
    try:
        fh = open_bytes(path)  # bytes: a decoding error can then name its line
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot open ({exc.strerror or exc})") from None
    with fh:
        for lineno, raw in _lines(fh, path):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceFormatError(
                    f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
                    "a JSONL trace is one JSON object per line"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line, parse_constant=_reject_constant)
            except _NonFinite as exc:
                raise TraceFormatError(f"{where}: {exc} is not a number (strict JSON has no NaN or Infinity)") from None
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
            except RecursionError:  # `[[[[...` nested past Python's limit
                raise TraceFormatError(f"{where}: not valid JSON (nested too deeply)") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            yield where, obj


def open_bytes(path: Path) -> IO[bytes]:
    """`path` opened for reading bytes, through gzip when its name ends in `.gz`."""
    return gzip.open(path, "rb") if path.name.endswith(".gz") else path.open("rb")


def _lines(fh: IO[bytes], path: Path) -> Iterator[tuple[int, bytes]]:
    """(number, bytes) of each line; a damaged gzip stream is a `TraceFormatError`."""
    lineno = 0
    try:
        for lineno, raw in enumerate(fh, 1):  # noqa: B007 (read after the loop, in the error)
            yield lineno, raw
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise TraceFormatError(f"{path}: not a readable gzip file after line {lineno} ({exc})") from None


def show(value: object, width: int = 40) -> str:
    """`repr(value)` cut to `width` characters: a 400-digit number still fits an error line."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def is_int(value: object) -> bool:
    """A JSON integer (bool is not one, though Python says it is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def finite_nonneg(value: object, where: str, field: str, unit: str) -> float:
    """`value` as a finite float >= 0, or a `TraceFormatError` naming `field`.

    Catches what a plain `value >= 0` lets through: NaN (every comparison is false), a float
    literal too large for a double (`1e400` parses as inf) and an int too large to convert.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        number = float(value) if ok else math.nan  # type: ignore[arg-type]
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and number >= 0):
        raise TraceFormatError(f"{where}: {field} must be a finite non-negative number{unit}, got {show(value)}")
    return number


def output_length(value: object, where: str, field: str) -> int:
    """An output length: an int in 0..MAX_OUTPUT_LEN."""
    if not (is_int(value) and 0 <= value <= MAX_OUTPUT_LEN):  # type: ignore[operator]
        raise TraceFormatError(f"{where}: {field} must be an int in 0..{MAX_OUTPUT_LEN:,}, got {show(value)}")
    return int(value)  # type: ignore[arg-type]
