"""The small value types of the cache contract (docs/design.md §3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from cachelib.errors import InvalidRequestError

INT32_MAX = int(np.iinfo(np.int32).max)


def as_token_ids(tokens: Any, *, what: str = "prompt", allow_empty: bool = False) -> np.ndarray:
    """Validate `tokens` and return them as a 1-D `numpy.int32` array.

    Raises `InvalidRequestError` naming the problem: an empty array (unless allowed), a
    non-integer dtype, a negative id, or an id that does not fit int32.
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.int32 and tokens.ndim == 1:
        arr = tokens
    else:
        try:
            raw = np.asarray(tokens)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(f"{what}: token ids must be integers ({exc})") from exc
        if raw.ndim != 1:
            raise InvalidRequestError(f"{what}: token ids must be a flat sequence, got shape {raw.shape}")
        if raw.size and not np.issubdtype(raw.dtype, np.integer):
            raise InvalidRequestError(f"{what}: token ids must be integers, got dtype {raw.dtype}")
        if raw.size:
            lo, hi = int(raw.min()), int(raw.max())
            if lo < 0:
                raise InvalidRequestError(f"{what}: negative token id {lo}")
            if hi > INT32_MAX:
                raise InvalidRequestError(f"{what}: token id {hi} does not fit int32")
        arr = raw.astype(np.int32, copy=True)
        return _check_nonempty(arr, what, allow_empty)
    if arr.size and int(arr.min()) < 0:
        raise InvalidRequestError(f"{what}: negative token id {int(arr.min())}")
    return _check_nonempty(arr, what, allow_empty)


def _is_int(x: Any) -> bool:
    """A Python int that is not a bool (`True` would silently mean 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _check_nonempty(arr: np.ndarray, what: str, allow_empty: bool) -> np.ndarray:
    if arr.size == 0 and not allow_empty:
        raise InvalidRequestError(f"{what}: empty token sequence")
    return arr


class MultiModalSpan(NamedTuple):
    """A multimodal input occupying tokens `[offset, offset + length)`, identified by its hash."""

    offset: int
    length: int
    mm_hash: str


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """Everything besides token ids that changes a token's KV.

    `cache_salt` isolates tenants (it enters the first block's key), `lora_id` the adapter
    (every block's key), `mm` the multimodal inputs (the blocks they overlap).
    """

    cache_salt: str | None = None
    lora_id: int | None = None
    mm: tuple[MultiModalSpan, ...] = ()

    def __post_init__(self) -> None:
        # Each key enters a hash or a namespace: a wrong type would either crash deep inside
        # a backend or, worse, compare equal to a different key (True == 1, 5 != "5").
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str or None, got {self.cache_salt!r}")
        if self.lora_id is not None and (not _is_int(self.lora_id) or self.lora_id < 0):
            raise InvalidRequestError(f"lora_id must be a non-negative int, got {self.lora_id!r}")
        if not isinstance(self.mm, tuple):
            raise InvalidRequestError(f"mm must be a tuple of MultiModalSpan, got {type(self.mm).__name__}")
        for span in self.mm:
            if (
                not isinstance(span, MultiModalSpan)
                or not _is_int(span.offset)
                or not _is_int(span.length)
                or not isinstance(span.mm_hash, str)
            ):
                raise InvalidRequestError(f"bad multimodal span {span!r}: want MultiModalSpan(int, int, str)")
            if span.offset < 0 or span.length <= 0:
                raise InvalidRequestError(f"bad multimodal span {span}")

    @property
    def namespace(self) -> tuple[str | None, int | None]:
        """The key under which tree-shaped indexes keep this request apart from others."""
        return (self.cache_salt, self.lora_id)


NO_EXTRA = ExtraKeys()


class Sequence:
    """One request as the cache sees it: token ids, extra keys, page table, computed count.

    Tokens live in a growable int32 buffer (`tokens` is a view, never a copy). The page
    table is written by the cache that holds the sequence and reads as a list of ints (a
    `list`, or a `PageTable` (cachelib/page_table.py), an integer buffer that reads like one); token t lives at
    page `page_table[t // page_size]`, slot `t % page_size`. `cache_memo` is scratch space for
    the cache that matched the sequence (vLLM keeps block hashes on its Request likewise).

    `num_tokens` is `len(seq)` as a plain attribute, for the caches' hot paths (a Python
    `__len__` costs a call each time); only the sequence's own methods change it.

    `room`: token slots to keep free past the prompt for the tokens it will generate (an
    engine passes the request's output length), so appending them never regrows the
    buffer; more may be appended (it then doubles). The prompt is copied once either way.
    """

    __slots__ = (
        "request_id",
        "extra",
        "prompt_len",
        "page_table",
        "num_computed",
        "prefix_id",
        "cache_memo",
        "num_tokens",
        "_buf",
        "_view",
        "_ro",
    )

    def __init__(
        self,
        request_id: str,
        prompt: Any,
        extra: ExtraKeys = NO_EXTRA,
        *,
        prefix_id: int | None = None,
        room: int = 0,
    ) -> None:
        # Caches key their live sequences by request id: it must hash and compare as text,
        # so 1 and "1" (or a list) can never name the same request by accident.
        if not isinstance(request_id, str):
            raise InvalidRequestError(f"request_id must be a str, got {request_id!r}")
        if not isinstance(extra, ExtraKeys):
            raise InvalidRequestError(f"request {request_id!r}: extra must be ExtraKeys, got {type(extra).__name__}")
        if prefix_id is not None and not _is_int(prefix_id):
            raise InvalidRequestError(f"request {request_id!r}: prefix_id must be an int or None, got {prefix_id!r}")
        tokens = as_token_ids(prompt, what=f"request {request_id!r} prompt")
        self.request_id = request_id
        self.extra = extra
        self.prompt_len = int(tokens.size)
        self.page_table: list[int] = []  # or a `PageTable` (cachelib/page_table.py)
        self.num_computed = 0
        self.prefix_id = prefix_id
        self.cache_memo: Any = None
        if room.__class__ is not int or room < 0:
            raise InvalidRequestError(
                f"request {request_id!r}: room (token slots reserved for its output) must be a non-negative int, got {room!r}"
            )
        if room:
            # the tokens it will generate fit without regrowing: one allocation and one copy
            # of the prompt, not a second copy (and fresh pages written) at the first append
            self._buf = np.empty(tokens.size + room, dtype=np.int32)
            self._buf[: tokens.size] = tokens
        else:
            self._buf = tokens.copy() if tokens is prompt else tokens
        self.num_tokens = int(tokens.size)
        self._view: np.ndarray | None = None  # `tokens`, made once per length
        self._ro: np.ndarray | None = None  # a read-only view of all of `_buf`, made once per buffer

    @property
    def tokens(self) -> np.ndarray:
        """All token ids so far (prompt, then generated), a read-only view.

        Made once per length and kept until the next append: a cache reads it several
        times per call, and making a read-only view costs more than the rest of a lookup's
        bookkeeping."""
        view = self._view
        if view is None:
            # a slice of a read-only view is read-only: one flag write per buffer (it grows
            # by doubling), not per length (a decode step's append makes a new length)
            ro = self._ro
            if ro is None:
                ro = self._ro = self._buf.view()
                ro.flags.writeable = False
            view = self._view = ro[: self.num_tokens]
        return view

    def __len__(self) -> int:
        return self.num_tokens

    def token_bytes(self, start: int, stop: int) -> bytes:
        """The int32 bytes of tokens `start .. stop - 1` (a block's, to hash it): read from
        the buffer, without making the `tokens` view (a decode step appends, so each
        step's view would be a new one)."""
        if not 0 <= start <= stop <= self.num_tokens:
            raise IndexError(f"tokens {start}..{stop} outside [0, {self.num_tokens}]")
        return self._buf[start:stop].tobytes()

    def append(self, new_tokens: Any) -> None:
        """Append generated token ids (validated like the prompt)."""
        new = as_token_ids(new_tokens, what=f"request {self.request_id!r} appended tokens", allow_empty=True)
        need = self.num_tokens + new.size
        if need > self._buf.size:
            grown = np.empty(max(need, 2 * self._buf.size), dtype=np.int32)
            grown[: self.num_tokens] = self._buf[: self.num_tokens]
            self._buf = grown
            self._ro = None
        self._buf[self.num_tokens : need] = new
        self.num_tokens = need
        self._view = None

    def extend_ids(self, ids: list[int] | range) -> None:
        """Append generated token ids given as a short list of Python ints (an engine bringing
        a request's decode tokens up to date): validated on the list itself, which for a few
        ids is cheaper than `append`'s array round trip. A `range` (an engine's fresh ids are
        consecutive) is validated at its ends and written as one `np.arange`."""
        if ids.__class__ is range:
            self._extend_run(ids)  # type: ignore[arg-type]
            return
        if not ids:
            return
        if not all(t.__class__ is int for t in ids):
            bad = next(t for t in ids if t.__class__ is not int)
            raise InvalidRequestError(f"request {self.request_id!r}: token id must be an int, got {bad!r}")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi > INT32_MAX:
            raise InvalidRequestError(
                f"request {self.request_id!r}: token id {lo if lo < 0 else hi} outside [0, {INT32_MAX}]"
            )
        need = self.num_tokens + len(ids)
        if need > self._buf.size:
            grown = np.empty(max(need, 2 * self._buf.size), dtype=np.int32)
            grown[: self.num_tokens] = self._buf[: self.num_tokens]
            self._buf = grown
            self._ro = None
        self._buf[self.num_tokens : need] = ids
        self.num_tokens = need
        self._view = None

    def _extend_run(self, ids: range) -> None:
        """`extend_ids` for a range: consecutive ids, so its first and last bound them all."""
        k = len(ids)
        if not k:
            return
        if ids.step != 1:
            raise InvalidRequestError(f"request {self.request_id!r}: a run of token ids must step by 1, got {ids!r}")
        lo, hi = ids.start, ids.stop - 1
        if lo < 0 or hi > INT32_MAX:
            raise InvalidRequestError(
                f"request {self.request_id!r}: token id {lo if lo < 0 else hi} outside [0, {INT32_MAX}]"
            )
        need = self.num_tokens + k
        if need > self._buf.size:
            grown = np.empty(max(need, 2 * self._buf.size), dtype=np.int32)
            grown[: self.num_tokens] = self._buf[: self.num_tokens]
            self._buf = grown
            self._ro = None
        self._buf[self.num_tokens : need] = np.arange(lo, hi + 1, dtype=np.int32)
        self.num_tokens = need
        self._view = None

    def append_token(self, token: int) -> None:
        """Append one generated token id (the decode hot path: no array round trip)."""
        if token.__class__ is not int:
            # numpy integers are fine (engines index int32 arrays); a float or a bool would
            # be stored truncated (1.5 -> 1, True -> 1) and change the KV silently
            if isinstance(token, bool) or not isinstance(token, (int, np.integer)):
                raise InvalidRequestError(f"request {self.request_id!r}: token id must be an int, got {token!r}")
            token = int(token)
        if not 0 <= token <= INT32_MAX:
            raise InvalidRequestError(f"request {self.request_id!r}: token id {token} outside [0, {INT32_MAX}]")
        if self.num_tokens == self._buf.size:
            grown = np.empty(2 * self._buf.size, dtype=np.int32)
            grown[: self.num_tokens] = self._buf
            self._buf = grown
            self._ro = None
        self._buf[self.num_tokens] = token
        self.num_tokens += 1
        self._view = None

    def fork(self, request_id: str) -> Sequence:
        """A new sequence with the same tokens and extra keys and an empty page table."""
        child = Sequence(request_id, self._buf[: self.num_tokens].copy(), self.extra, prefix_id=self.prefix_id)
        child.prompt_len = self.prompt_len
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, len={self.num_tokens}, prompt_len={self.prompt_len}, "
            f"computed={self.num_computed}, pages={len(self.page_table)})"
        )


class Match(NamedTuple):
    """The longest reusable cached prefix of a sequence (result of `PrefixCache.match`).

    `num_tokens` tokens have KV in `pages` (their first pages); 0 means no hit. `handle` and
    `epoch` are the backend's: `admit` uses them, and refuses a match made stale by an
    eviction in between (`StaleMatchError`). `owner` is the identity token of the cache that
    made it (`PrefixCache.match_token`): `admit` on any other cache refuses it. Nothing in a
    match is trusted: `admit` proves the hit against its own index before pinning a page.
    """

    request_id: str
    num_tokens: int
    pages: tuple[int, ...]
    handle: Any = None
    epoch: int = 0
    owner: object = None


class CopyOp(NamedTuple):
    """Copy the KV of page `src_page` into page `dst_page` before the next write (CoW)."""

    src_page: int
    dst_page: int


class TierCopy(NamedTuple):
    """Move pages of KV between GPU pages and host pages of a tiered cache
    (cachelib/tiers.py): `to_host` a backup (GPU -> host), else a load-back (host -> GPU);
    `device_pages[i]` pairs with `host_pages[i]` (one op per tree node moved).

    A tiered cache hands these out with the copies of its next `admit`, `grow` or `fork`,
    in the order it decided them; an executor applies a call's ops *in order* before it
    writes any KV (a GPU page saved to the host may be reused by a load in the same list).
    Until they are applied the GPU pages they read are not written: a page freed by an
    eviction is only handed out by the call that returns the ops."""

    to_host: bool
    device_pages: tuple[int, ...]
    host_pages: tuple[int, ...]


class StorageCopy(NamedTuple):
    """Move pages of KV between host pages and a storage tier (L3) of a tiered cache:
    `to_storage` writes `host_pages[i]` under page key `keys[i]`, else the stored page of
    `keys[i]` is read into `host_pages[i]` (a prefetch). Page keys name the KV of a whole
    prefix (cachelib/kv_events.py), so any page stored under a key holds that KV. Handed
    out, in decision order, among a call's other ops as `TierCopy` is. `tokens`: the
    tokens moved (what a serving clock charges at the storage bandwidth); with four fields
    it is told from a `TierCopy` (three) and a `CopyOp` (two) by its length alone, so an
    executor needs nothing of this module."""

    to_storage: bool
    host_pages: tuple[int, ...]
    keys: tuple[bytes, ...]
    tokens: int


@dataclass(slots=True)
class CacheStats:
    """Counters and occupancy of one cache. Pages are free, cached-unpinned or pinned."""

    backend: str
    num_pages: int
    page_size: int
    lookups: int = 0
    lookup_tokens: int = 0
    admitted: int = 0
    admitted_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0
    copied_pages: int = 0
    pages_free: int = 0
    pages_cached: int = 0
    pages_pinned: int = 0
    metadata_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.admitted_tokens if self.admitted_tokens else 0.0
