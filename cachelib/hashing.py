"""Chained block hashes: `H_i = hash(H_{i-1} || tokens of block i || extra keys of block i)`.

The parent hash makes equal tokens at different positions (or after different prefixes)
hash apart, so a table keyed by `H_i` identifies a whole prefix. Extra keys fold in what
else changes the KV: `cache_salt` on the first block, `lora_id` on every block, a
multimodal input's hash on every block it overlaps (docs/design.md §4 apc).

Tokens enter as their little-endian int32 bytes, a fixed width per block, and each extra
key is length-prefixed, so the byte string of a block is unambiguous.

The tables apc keeps cached blocks in, by hash, are here too: `RunIndex` (one entry per
commit, relying on the chaining above) and `DictIndex` (one entry per hash, for any hash
function). Both answer, per chain position, a hash's oldest cached block.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from functools import partial
from itertools import islice, takewhile
from typing import ClassVar

import numpy as np
import xxhash

from cachelib.errors import InvalidRequestError
from cachelib.types import ExtraKeys

BlockHash = bytes
HashFn = Callable[[bytes], bytes]

#: `H_{-1}`: the parent of every first block. Fixed, so runs are reproducible.
ROOT_HASH: BlockHash = b"\x00" * 16


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HASH_ALGORITHMS: dict[str, HashFn] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256,
}


def _key(tag: bytes, payload: bytes) -> bytes:
    return tag + len(payload).to_bytes(4, "little") + payload


class BlockHasher:
    """Computes the chained hashes of a sequence's full blocks.

    `algorithm` is `xxh3_128` (default, fast, non-cryptographic) or `sha256`; `hash_fn`
    overrides both (tests use a deliberately colliding one).
    """

    def __init__(self, page_size: int, algorithm: str = "xxh3_128", hash_fn: HashFn | None = None) -> None:
        if hash_fn is not None and not callable(hash_fn):
            raise InvalidRequestError(f"hash_fn must be a function bytes -> bytes, got {hash_fn!r}")
        if hash_fn is None:
            try:
                hash_fn = HASH_ALGORITHMS[algorithm]
            except KeyError:
                raise InvalidRequestError(
                    f"unknown hash algorithm {algorithm!r}; choose one of {sorted(HASH_ALGORITHMS)}"
                ) from None
        self.page_size = page_size
        self.algorithm = algorithm if hash_fn is HASH_ALGORITHMS.get(algorithm) else "custom"
        self._fn = hash_fn

    def extra_bytes(self, extra: ExtraKeys, block: int) -> bytes:
        """The extra-key bytes of block number `block`."""
        parts = []
        if block == 0 and extra.cache_salt is not None:
            parts.append(_key(b"s", extra.cache_salt.encode()))
        if extra.lora_id is not None:
            parts.append(_key(b"l", extra.lora_id.to_bytes(8, "little")))
        if extra.mm:
            lo, hi = block * self.page_size, (block + 1) * self.page_size
            for span in extra.mm:
                if span.offset < hi and span.offset + span.length > lo:
                    parts.append(_key(b"m", span.mm_hash.encode()))
        return b"".join(parts)

    def hash_block(self, parent: BlockHash | None, block_tokens: bytes, extra: bytes) -> BlockHash:
        """The hash of one block from its parent's hash (None: the first block), its tokens'
        int32 bytes and its extra-key bytes (`extra_bytes`): what `hash_blocks` chains."""
        return self._fn((ROOT_HASH if parent is None else parent) + block_tokens + extra)

    def hash_blocks(
        self, tokens: np.ndarray, extra: ExtraKeys, start: int, stop: int, parent: BlockHash | None
    ) -> list[BlockHash]:
        """Hashes of full blocks `start .. stop-1` of `tokens`, chained from `parent`
        (the hash of block `start - 1`, or None for the root)."""
        size = self.page_size
        if stop * size > tokens.size:
            raise InvalidRequestError(f"block {stop - 1} is not full ({tokens.size} tokens)")
        fn = self._fn
        h = ROOT_HASH if parent is None else parent
        span = np.ascontiguousarray(tokens[start * size : stop * size])
        # one C call turns the span into a list of per-block byte strings (a void view per
        # block): cheaper than slicing a bytes buffer block by block in the loop
        chunks = span.reshape(-1, size).view(np.dtype((np.void, 4 * size))).ravel().tolist()
        if extra.mm:
            # Multimodal spans vary the extra keys block by block: the slow path.
            return [h := fn(h + chunk + self.extra_bytes(extra, start + i)) for i, chunk in enumerate(chunks)]
        head: list[BlockHash] = []
        if start == 0 and stop > 0 and extra.cache_salt is not None:
            h = fn(h + chunks[0] + self.extra_bytes(extra, 0))
            head.append(h)
            chunks = chunks[1:]
        suffix = self.extra_bytes(extra, 1)  # the same for every later block
        # one comprehension, the chain carried in `h`: no method call per block
        if suffix:
            rest = [h := fn(h + chunk + suffix) for chunk in chunks]
        else:
            rest = [h := fn(h + chunk) for chunk in chunks]
        return head + rest if head else rest


_is_not_none = partial(operator.is_not, None)
_true = partial(operator.is_, True)


class DictIndex:
    """The cached blocks by hash, one dict entry per hash (hash -> its oldest block, the
    younger ones listed apart): one dict operation per block published or evicted. Exact
    for any hash function; `RunIndex` does the same with no per-block table operation for
    hashes that chain (the built-in algorithms)."""

    #: False: it does not know a block's chain position (`RunIndex.position`)
    knows_positions: ClassVar[bool] = False

    __slots__ = ("cached", "digest", "_first", "_dups")

    def __init__(self) -> None:
        self.cached = np.zeros(0, dtype=bool)
        self.digest = np.empty(0, dtype=object)
        self._first: dict[BlockHash, int] = {}
        self._dups: dict[BlockHash, list[int]] = {}

    def cover(self, num_blocks: int) -> None:
        """Make the per-block arrays hold ids `0 .. num_blocks - 1`."""
        more = num_blocks - self.cached.size
        if more > 0:
            self.cached = np.concatenate([self.cached, np.zeros(more, dtype=bool)])
            self.digest = np.concatenate([self.digest, np.full(more, None, dtype=object)])

    def __len__(self) -> int:
        return len(self._first) + sum(map(len, self._dups.values()))

    def lookup(self, hashes: list[BlockHash]) -> np.ndarray:
        get = self._first.get
        return np.fromiter((get(h, -1) for h in hashes), dtype=np.int64, count=len(hashes))

    def first_run(self, hashes: list[BlockHash]) -> list[int]:
        return list(takewhile(_is_not_none, map(self._first.get, hashes)))

    def members(self, h: BlockHash) -> list[int]:
        first = self._first.get(h)
        return [] if first is None else [first, *self._dups.get(h, ())]

    def items(self) -> list[tuple[BlockHash, list[int]]]:
        return [(h, [b, *self._dups.get(h, ())]) for h, b in self._first.items()]

    def digests(self, blocks) -> list[BlockHash | None]:
        return self.digest[np.asarray(blocks, dtype=np.int64)].tolist()

    def candidates(self, hashes: list[BlockHash]) -> list[list[int]]:
        out = []
        for h in hashes:
            members = self.members(h)
            if not members:
                break
            out.append(members)
        return out

    def add(self, blocks: np.ndarray, hashes: list[BlockHash], start: int = 0) -> None:
        self.cached[blocks] = True
        self.digest[blocks] = np.fromiter(hashes, dtype=object, count=len(hashes))  # (a list converts slower)
        ids = blocks.tolist()
        firsts = list(map(self._first.setdefault, hashes, ids))
        if firsts != ids:  # an equal block is cached already: this one is its duplicate
            for h, block, first in zip(hashes, ids, firsts, strict=True):
                if first != block:
                    self._dups.setdefault(h, []).append(block)

    def remove(self, blocks: np.ndarray) -> None:
        hashes = self.digest[blocks].tolist()
        if self._dups:
            for block, h in zip(blocks.tolist(), hashes, strict=True):
                self._remove_one(block, h)
        else:  # every hash has one block: its entry goes
            first = self._first
            for h in hashes:
                del first[h]
        self.digest[blocks] = None
        self.cached[blocks] = False

    def _remove_one(self, block: int, h: BlockHash) -> None:
        others = self._dups.get(h)
        if self._first[h] == block:
            if others:
                self._first[h] = others.pop(0)
            else:
                del self._first[h]
        elif others is not None:
            others.remove(block)
        if others is not None and not others:
            del self._dups[h]

    def reindex(self, block: int, h: BlockHash | None) -> None:
        """Cache `block` under `h` instead (None: uncache it), as the youngest of `h`'s
        blocks. For tests that corrupt a cache on purpose; not used by apc's own calls."""
        self.cover(block + 1)
        ids = np.array([block], dtype=np.int64)
        if self.cached[block]:
            self.remove(ids)
        if h is not None:
            self.add(ids, [h])

    def make_oldest(self, h: BlockHash, block: int) -> None:
        """Make `block` (cached under `h`) the oldest of `h`'s blocks (tests)."""
        members = self.members(h)
        if block not in members:
            raise KeyError(f"block {block} is not cached under that hash")
        if members[0] != block:
            others = [b for b in members if b != block]
            self._first[h] = block
            self._dups[h] = others

    def check(self, fail) -> None:
        has_digest = np.fromiter((d is not None for d in self.digest.tolist()), dtype=bool, count=self.cached.size)
        if not np.array_equal(has_digest, self.cached):
            b = int((has_digest != self.cached).nonzero()[0][0])
            fail(f"block {b} cached={bool(self.cached[b])} but its hash is {self.digest[b]!r:.20}")
        seen: set[int] = set()
        for h, dups in self._dups.items():
            if h not in self._first or not dups:
                fail("a duplicate list that is empty or whose hash has no oldest block")
        for h, members in self.items():
            for b in members:
                if b.__class__ is not int or not 0 <= b < self.cached.size or self.digest[b] != h or b in seen:
                    fail(f"block {b} is not cached under its hash once")
                seen.add(b)
        if seen != set(self.cached.nonzero()[0].tolist()):
            fail("the indexed blocks are not exactly the cached ones")


class _Run:
    """Blocks committed together: chain positions `start ..`, their hashes and block ids."""

    __slots__ = ("start", "keys", "blocks", "live")

    def __init__(self, start: int, keys: list[BlockHash], blocks: np.ndarray) -> None:
        self.start = start
        self.keys = keys
        self.blocks = blocks
        self.live = blocks.size  # of its blocks, how many are still cached


_NEVER = np.iinfo(np.int64).max


class RunIndex:
    """The cached blocks by *chained* hash, kept per commit: a run is the blocks one commit
    published, at chain positions `start, start + 1, ...`, with their hashes. Publishing a
    run is one dict operation (`_starts`: its first hash -> its id) and a few array writes;
    evicting a block clears its `cached` flag (a run goes when its last block does). No
    operation per block on a hash table.

    A lookup walks the chain: at each position the runs that start there are found by the
    position's hash (chained hashes: equal hashes mean equal prefixes, so a run holding a
    query's hash at position i starts at a position whose hash the query shares too), each
    run agrees with the query up to its first different hash, and the answer at a position
    is the oldest cached block (smallest commit order `seq`) of the runs covering it, as a
    hash table that keeps a hash's oldest block would answer. Exact for the built-in
    algorithms (a collision of xxh3-128 or sha256 aside, which misleads any hash table);
    a hash function that does not chain (tests' colliding ones) needs `DictIndex`.
    """

    #: True: `position(block)` is the chain position a cached block is indexed at
    knows_positions: ClassVar[bool] = True

    __slots__ = ("cached", "_run", "_off", "_seq", "_runs", "_starts", "_next_run", "_next_seq")

    def __init__(self) -> None:
        self.cached = np.zeros(0, dtype=bool)
        self._run = np.zeros(0, dtype=np.int64)  # per block: its run while cached
        self._off = np.zeros(0, dtype=np.int64)  # per block: its place in its run
        self._seq = np.zeros(0, dtype=np.int64)  # per block: commit order (older = smaller)
        self._runs: dict[int, _Run] = {}
        self._starts: dict[BlockHash, list[int]] = {}  # first hash of a run -> run ids
        self._next_run = 0
        self._next_seq = 0

    def cover(self, num_blocks: int) -> None:
        """Make the per-block arrays hold ids `0 .. num_blocks - 1`."""
        more = num_blocks - self.cached.size
        if more > 0:
            self.cached = np.concatenate([self.cached, np.zeros(more, dtype=bool)])
            self._run = np.concatenate([self._run, np.full(more, -1, dtype=np.int64)])
            self._off = np.concatenate([self._off, np.zeros(more, dtype=np.int64)])
            self._seq = np.concatenate([self._seq, np.zeros(more, dtype=np.int64)])

    def __len__(self) -> int:
        return int(np.count_nonzero(self.cached))

    # -- publishing and evicting ---------------------------------------------------------

    def add(self, blocks: np.ndarray, hashes: list[BlockHash], start: int = 0) -> None:
        """Cache `blocks[i]` under `hashes[i]`, at chain positions `start + i`, as one run."""
        n = blocks.size
        if not n:
            return
        r = self._next_run
        self._next_run += 1
        self._runs[r] = _Run(start, hashes, blocks.copy())
        self._starts.setdefault(hashes[0], []).append(r)
        self.cached[blocks] = True
        self._run[blocks] = r
        self._off[blocks] = np.arange(n)
        self._seq[blocks] = np.arange(self._next_seq, self._next_seq + n)
        self._next_seq += n

    def remove(self, blocks: np.ndarray) -> None:
        """Uncache `blocks` (each cached, each once)."""
        if not blocks.size:
            return
        self.cached[blocks] = False
        runs = self._run[blocks]
        self._run[blocks] = -1
        # evicted in LRU order, a run's blocks come in a few stretches: count per stretch
        cut = (runs[1:] != runs[:-1]).nonzero()[0] + 1
        if not cut.size:
            gone = {int(runs[0]): runs.size}
        else:
            ends = [*cut.tolist(), runs.size]
            gone = {}
            begin = 0
            for r, end in zip(runs[[0, *ends[:-1]]].tolist(), ends, strict=True):
                gone[r] = gone.get(r, 0) + end - begin
                begin = end
        for r, k in gone.items():
            run = self._runs[r]
            run.live -= k
            if not run.live:
                del self._runs[r]
                others = self._starts[run.keys[0]]
                others.remove(r)
                if not others:
                    del self._starts[run.keys[0]]

    # -- reading ---------------------------------------------------------------------

    def _fold(
        self, r: int, run: _Run, hashes: list[BlockHash], at: int, best: np.ndarray, best_block: np.ndarray
    ) -> None:
        """Offer run `r`'s blocks still cached in it for the positions where it agrees with
        `hashes` (a block evicted from the run and cached again elsewhere is not its own)."""
        # the agreement, compared up to the first different hash only (C-level)
        n = len(list(takewhile(_true, map(operator.eq, run.keys, islice(hashes, at, None)))))
        blocks = run.blocks[:n]
        seq = self._seq[blocks]
        mine = self._run[blocks] == r
        if not mine.all():
            seq = np.where(mine, seq, _NEVER)
        window = best[at : at + n]
        older = seq < window
        window[older] = seq[older]
        best_block[at : at + n][older] = blocks[older]

    def first_run(self, hashes: list[BlockHash]) -> list[int]:
        """The oldest cached block of each chain position of `hashes`, up to the first
        position with none."""
        m = len(hashes)
        best = np.full(m, _NEVER, dtype=np.int64)
        best_block = np.full(m, -1, dtype=np.int64)
        runs, starts = self._runs, self._starts.get
        lo, step = 0, 64
        while lo < m:
            hi = min(m, lo + step)
            for i, found in enumerate(map(starts, hashes[lo:hi]), lo):
                if found:
                    for r in found:
                        run = runs[r]
                        if run.start == i:
                            self._fold(r, run, hashes, i, best, best_block)
            miss = (best[lo:hi] == _NEVER).nonzero()[0]
            if miss.size:
                return best_block[: lo + int(miss[0])].tolist()
            lo, step = hi, step * 4
        return best_block.tolist()

    def candidates(self, hashes: list[BlockHash]) -> list[list[int]]:
        """Per chain position of `hashes`, every cached block there, oldest first, up to
        the first position with none (for verify_tokens' walk)."""
        out: list[list[int]] = []
        active: list[int] = []
        for i, h in enumerate(hashes):
            active += [r for r in self._starts.get(h, ()) if self._runs[r].start == i]
            here = []
            for r in active:
                run = self._runs[r]
                j = i - run.start
                if j < len(run.keys) and run.keys[j] == h:
                    b = int(run.blocks[j])
                    if self._run[b] == r:
                        here.append((int(self._seq[b]), b))
            if not here:
                break
            out.append([b for _, b in sorted(here)])
        return out

    def digests(self, blocks) -> list[BlockHash | None]:
        """The hash each of `blocks` is cached under (None: not cached)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        runs = self._runs
        return [
            None if r < 0 else runs[r].keys[o]
            for r, o in zip(self._run[blocks].tolist(), self._off[blocks].tolist(), strict=True)
        ]

    def items(self) -> list[tuple[BlockHash, list[int]]]:
        """(hash, its cached blocks oldest first) for every cached hash."""
        groups: dict[BlockHash, list[tuple[int, int]]] = {}
        for b in self.cached.nonzero()[0].tolist():
            (h,) = self.digests([b])
            groups.setdefault(h, []).append((int(self._seq[b]), b))
        return [(h, [b for _, b in sorted(v)]) for h, v in groups.items()]

    def members(self, h: BlockHash) -> list[int]:
        return dict(self.items()).get(h, [])

    # -- for tests that corrupt a cache on purpose ---------------------------------------

    def position(self, block: int) -> int:
        run = self._runs[int(self._run[block])]
        return run.start + int(self._off[block])

    def reindex(self, block: int, h: BlockHash | None) -> None:
        """Cache `block` under `h` instead, at its chain position, as the youngest of `h`'s
        blocks (None: uncache it)."""
        self.cover(block + 1)
        at = self.position(block) if self.cached[block] else 0
        ids = np.array([block], dtype=np.int64)
        if self.cached[block]:
            self.remove(ids)
        if h is not None:
            self.add(ids, [h], at)

    def make_oldest(self, h: BlockHash, block: int) -> None:
        members = self.members(h)
        if block not in members:
            raise KeyError(f"block {block} is not cached under that hash")
        if members[0] != block:
            self._seq[block] = self._seq[members[0]] - 1

    def check(self, fail) -> None:
        """Call `fail(message)` on the first broken invariant of the layout."""
        size = self.cached.size
        if not self._run.size == self._off.size == self._seq.size == size:
            fail("index arrays of different sizes")
        live = np.zeros(self._next_run, dtype=np.int64)
        for b in self.cached.nonzero()[0].tolist():
            r = int(self._run[b])
            run = self._runs.get(r)
            if run is None or not 0 <= self._off[b] < run.blocks.size or run.blocks[self._off[b]] != b:
                fail(f"cached block {b} is not where its run says")
            live[r] += 1
        if (self._run[~self.cached] != -1).any():
            fail("a block that is not cached belongs to a run")
        for r, run in self._runs.items():
            if run.live != live[r] or not run.live:
                fail(f"run {r} counts {run.live} cached blocks, holds {live[r]}")
            if len(run.keys) != run.blocks.size or r not in self._starts.get(run.keys[0], ()):
                fail(f"run {r} is not indexed under its first hash")
        for h, rs in self._starts.items():
            for r in rs:
                if r not in self._runs or self._runs[r].keys[0] != h:
                    fail("a run start points at a run gone or with another first hash")
