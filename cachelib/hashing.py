"""Chained block hashes: `H_i = hash(H_{i-1} || tokens of block i || extra keys of block i)`.

The parent hash makes equal tokens at different positions (or after different prefixes)
hash apart, so a table keyed by `H_i` identifies a whole prefix. Extra keys fold in what
else changes the KV: `cache_salt` on the first block, `lora_id` on every block, a
multimodal input's hash on every block it overlaps (DESIGN §4 apc).

Tokens enter as their little-endian int32 bytes, a fixed width per block, and each extra
key is length-prefixed, so the byte string of a block is unambiguous.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from functools import partial
from itertools import takewhile

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


DIGEST_SIZES = {"xxh3_128": 16, "sha256": 32}


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
        #: bytes per hash when every hash has that size (the built-in algorithms), else None
        self.digest_size: int | None = DIGEST_SIZES.get(self.algorithm)
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
_EMPTY = -1  # a slot of `BlockIndex._blk` that holds no block
#: a table slot: fingerprint and block side by side (one 16-byte gather reads both)
_SLOT = np.dtype([("fp", "<u8"), ("blk", "<i8")])


class BlockIndex:
    """The cached blocks by chained hash: for every hash, its blocks, oldest first.

    What apc looks up (`first_run`, `lookup`), publishes (`add`) and evicts (`remove`), a
    whole request's blocks per call, each call a fixed number of numpy steps. A Python dict
    costs one operation per block, ~0.1 µs in a small table but ~0.2-0.5 µs once it
    outgrows the CPU caches (page size 1, a million blocks); `DictIndex` is that dict, for
    small pools, with the same interface.

    Layout. Per block id (grown with `cover`, so unused ids cost nothing): `cached`, and
    `digest`, the hash it is cached under (None when not cached). The *oldest* block of
    each hash is in one of two slots of a numpy table (`_tab[slot]` = the hash's
    fingerprint, its first 8 bytes as an integer, and the block, side by side so a lookup
    reads one cache line): slot 1 = fingerprint & mask, slot 2 = (fingerprint >> 32) &
    mask, the first free when it was added; when both were taken, it
    is in the overflow dict `_ovf` (hash -> block). `_away[slot 1]` counts the hashes of
    that slot 1 kept elsewhere, so a lookup looks further only when one may be there. The
    younger blocks of a hash (duplicates: an equal block cached again) are listed in
    `_dups` (hash -> block ids, oldest first). `_where[b]` is b's slot, or `-2 - slot 1`
    when b is in the overflow dict, or -1 (a duplicate, or not cached). A fingerprint match
    is always confirmed on the whole hash, so the index is exact for any hash function. At
    most a quarter of the slots are taken (`_regrow` doubles the table), so about one hash
    in fifty overflows.
    """

    __slots__ = (
        "cached",
        "digest",
        "_where",
        "_tab",
        "_fp",
        "_blk",
        "_away",
        "_mask",
        "_ovf",
        "_dups",
        "_primaries",
        "_stride",
    )

    def __init__(self, digest_size: int | None = 16) -> None:
        # hashes of a fixed size that is a multiple of 8 bytes give their fingerprints in
        # one numpy view; other hash functions (tests' colliding ones) take the general path
        self._stride = digest_size // 8 if digest_size and digest_size % 8 == 0 else 0
        self.cached = np.zeros(0, dtype=bool)
        self.digest = np.empty(0, dtype=object)
        self._where = np.zeros(0, dtype=np.int64)
        self._ovf: dict[BlockHash, int] = {}
        self._dups: dict[BlockHash, list[int]] = {}
        self._primaries = 0  # hashes with a cached block (= slot entries + overflow entries)
        self._new_table(1024)

    def _new_table(self, slots: int) -> None:
        self._mask = np.uint64(slots - 1)
        self._tab = np.zeros(slots, dtype=_SLOT)
        self._fp = self._tab["fp"]  # views of the two fields
        self._blk = self._tab["blk"]
        self._blk[:] = _EMPTY
        self._away = np.zeros(slots, dtype=np.int32)

    def cover(self, num_blocks: int) -> None:
        """Make the per-block arrays hold ids `0 .. num_blocks - 1` (the caller grows it
        geometrically)."""
        have = self.cached.size
        if num_blocks <= have:
            return
        more = num_blocks - have
        self.cached = np.concatenate([self.cached, np.zeros(more, dtype=bool)])
        self.digest = np.concatenate([self.digest, np.full(more, None, dtype=object)])
        self._where = np.concatenate([self._where, np.full(more, -1, dtype=np.int64)])

    def __len__(self) -> int:
        """Cached blocks (duplicates included)."""
        return self._primaries + sum(map(len, self._dups.values()))

    def fingerprints(self, hashes: list[BlockHash]) -> np.ndarray:
        """The first 8 bytes of each hash as a little-endian uint64 (zero-padded if shorter)."""
        if self._stride:
            return np.frombuffer(b"".join(hashes), dtype=np.uint64)[:: self._stride]
        pad = b"\0" * 8
        return np.fromiter(
            (int.from_bytes((h[:8] + pad)[:8], "little") for h in hashes), dtype=np.uint64, count=len(hashes)
        )

    def _slots(self, fps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mask = self._mask
        return (fps & mask).astype(np.int64), ((fps >> np.uint64(32)) & mask).astype(np.int64)

    # -- reading ---------------------------------------------------------------------

    def lookup(self, hashes: list[BlockHash]) -> np.ndarray:
        """For each hash, its oldest cached block, or -1."""
        fps = self.fingerprints(hashes)
        keys = np.fromiter(hashes, dtype=object, count=len(hashes))
        return self._find(hashes, keys, fps, *self._slots(fps))

    def _find(
        self, hashes: list[BlockHash], keys: np.ndarray, fps: np.ndarray, s1: np.ndarray, s2: np.ndarray
    ) -> np.ndarray:
        """The oldest block of each hash or -1 (`keys`: the hashes as an object array)."""
        out = self._at(self._tab[s1], keys, fps)
        far = ((out < 0) & (self._away[s1] > 0)).nonzero()[0]
        if far.size:
            got = self._at(self._tab[s2[far]], keys[far], fps[far])
            out[far] = got
            far = far[got < 0].tolist()
            if far:
                get = self._ovf.get
                out[far] = [get(hashes[i], -1) for i in far]
        return out

    def _at(self, rows: np.ndarray, keys: np.ndarray, fps: np.ndarray) -> np.ndarray:
        """The blocks of table `rows` where they hold `keys`, else -1."""
        blocks = rows["blk"]
        here = (blocks >= 0) & (rows["fp"] == fps)
        j = here.nonzero()[0]
        if j.size:  # the fingerprint matches: confirm on the whole hash
            here[j] = self.digest[blocks[j]] == keys[j]
        return np.where(here, blocks, -1)

    def first_run(self, hashes: list[BlockHash]) -> list[int]:
        """The oldest block of each of `hashes` up to the first one not cached."""
        out: list[int] = []
        start, step = 0, 64
        while start < len(hashes):
            got = self.lookup(hashes[start : start + step])
            miss = (got < 0).nonzero()[0]
            if miss.size:
                return out + got[: miss[0]].tolist()
            out += got.tolist()
            start += step
            step *= 4
        return out

    def members(self, h: BlockHash) -> list[int]:
        """Every cached block of hash `h`, oldest first."""
        (first,) = self.lookup([h]).tolist()
        return [] if first < 0 else [first, *self._dups.get(h, ())]

    def items(self) -> list[tuple[BlockHash, list[int]]]:
        """(hash, its blocks oldest first) for every cached hash (for invariants and tests)."""
        firsts = self._blk[self._blk >= 0].tolist() + list(self._ovf.values())
        return [(h, [b, *self._dups.get(h, ())]) for h, b in zip(self.digest[firsts].tolist(), firsts, strict=True)]

    # -- publishing and evicting ---------------------------------------------------------

    def add(self, blocks: np.ndarray, hashes: list[BlockHash]) -> None:
        """Cache `blocks[i]` under `hashes[i]`, in order: a hash cached already keeps its
        oldest block and gets the new one as its youngest duplicate."""
        n = blocks.size
        if not n:
            return
        if (self._primaries + n) * 4 > self._blk.size:
            self._regrow(self._primaries + n)
        keys = np.fromiter(hashes, dtype=object, count=n)
        fps = self.fingerprints(hashes)
        s1, s2 = self._slots(fps)
        old = self._find(hashes, keys, fps, s1, s2)
        self.cached[blocks] = True
        self.digest[blocks] = keys
        if (old >= 0).any():
            for i in (old >= 0).nonzero()[0].tolist():
                self._dups.setdefault(hashes[i], []).append(int(blocks[i]))
            new = (old < 0).nonzero()[0]
            blocks, keys, fps, s1, s2 = blocks[new], keys[new], fps[new], s1[new], s2[new]
            hashes = keys.tolist()
        self._place(blocks, hashes, keys, fps, s1, s2)

    def _place(
        self,
        blocks: np.ndarray,
        hashes: list[BlockHash],
        keys: np.ndarray,
        fps: np.ndarray,
        s1: np.ndarray,
        s2: np.ndarray,
    ) -> None:
        """Index `blocks` as the oldest of their hashes, none of which is cached (two equal
        hashes among them: the first is the oldest, the second its duplicate)."""
        rest = self._claim(np.arange(blocks.size), s1, blocks, fps)[1]
        if rest.size:  # slot 1 taken: an equal hash just put there, else try slot 2
            rest = rest[~self._placed_equal(rest, s1, blocks, hashes, keys, fps)]
        if rest.size:
            won, rest = self._claim(rest, s2, blocks, fps)
            np.add.at(self._away, s1[won], np.int32(1))  # (slot 2 is never slot 1: it was taken)
        if rest.size:
            rest = rest[~self._placed_equal(rest, s1, blocks, hashes, keys, fps)]
            rest = rest[~self._placed_equal(rest, s2, blocks, hashes, keys, fps)]
        if rest.size:  # both slots taken: the overflow dict
            ids = blocks[rest].tolist()
            firsts = list(map(self._ovf.setdefault, [hashes[i] for i in rest.tolist()], ids))
            if firsts != ids:  # equal hashes among these: the first is in the dict
                keep = np.array([f == b for f, b in zip(firsts, ids, strict=True)], dtype=bool)
                for i in rest[~keep].tolist():
                    self._dups.setdefault(hashes[i], []).append(int(blocks[i]))
                rest = rest[keep]
            self._where[blocks[rest]] = -2 - s1[rest]
            np.add.at(self._away, s1[rest], np.int32(1))
            self._primaries += rest.size

    def _claim(
        self, idx: np.ndarray, slots: np.ndarray, blocks: np.ndarray, fps: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Put `blocks[idx]` in their `slots[idx]` where free, the first (in order) of those
        wanting one slot getting it: (those placed, the others)."""
        want = slots[idx]
        free = self._blk[want] < 0
        if not free.any():
            return idx[:0], idx
        cand, at = idx[free], want[free]
        self._blk[at[::-1]] = -2 - cand[::-1]  # the last write wins: the first candidate
        won = self._blk[at] == -2 - cand
        cand, at = cand[won], at[won]
        self._blk[at] = blocks[cand]
        self._fp[at] = fps[cand]
        self._where[blocks[cand]] = at
        self._primaries += cand.size
        if cand.size == idx.size:
            return cand, idx[:0]
        taken = np.ones(idx.size, dtype=bool)
        taken[free.nonzero()[0][won]] = False
        return cand, idx[taken]

    def _placed_equal(
        self,
        idx: np.ndarray,
        slots: np.ndarray,
        blocks: np.ndarray,
        hashes: list[BlockHash],
        keys: np.ndarray,
        fps: np.ndarray,
    ) -> np.ndarray:
        """Which of `idx` find an equal hash (placed earlier in this batch) in their slot:
        they become its duplicates."""
        equal = self._at(self._tab[slots[idx]], keys[idx], fps[idx]) >= 0
        for i in idx[equal].tolist():
            self._dups.setdefault(hashes[i], []).append(int(blocks[i]))
        return equal

    def remove(self, blocks: np.ndarray) -> None:
        """Uncache `blocks` (each cached, each once): the oldest remaining block of a hash
        takes the place of an oldest one that goes."""
        if not blocks.size:
            return
        if self._dups:
            hashes = self.digest[blocks].tolist()
            dups = self._dups
            shared = [i for i, h in enumerate(hashes) if h in dups]
            if shared:
                for i in shared:
                    self._remove_shared(int(blocks[i]), hashes[i])
                keep = np.ones(blocks.size, dtype=bool)
                keep[shared] = False
                blocks = blocks[keep]
        where = self._where[blocks]
        in_slot = where >= 0
        if not in_slot.all():
            out = ~in_slot
            ovf = self._ovf
            for h in self.digest[blocks[out]].tolist():
                del ovf[h]
            np.subtract.at(self._away, -2 - where[out], np.int32(1))
            where = where[in_slot]
        home = (self._fp[where] & self._mask).astype(np.int64)
        away = home != where
        if away.any():
            np.subtract.at(self._away, home[away], np.int32(1))
        self._blk[where] = _EMPTY
        self._primaries -= blocks.size
        self._where[blocks] = -1
        self.cached[blocks] = False
        self.digest[blocks] = None

    def _remove_shared(self, block: int, h: BlockHash) -> None:
        """Uncache `block` of hash `h` (which had duplicates when the call began): if it is
        the oldest, the next oldest takes its place (slot or overflow entry)."""
        others = self._dups.get(h)
        where = int(self._where[block])
        if not others:  # the others went first: it is the only one left
            if where >= 0:
                home = int(self._fp[where] & self._mask)
                if home != where:
                    self._away[home] -= 1
                self._blk[where] = _EMPTY
            else:
                del self._ovf[h]
                self._away[-2 - where] -= 1
            self._primaries -= 1
        elif where == -1:
            others.remove(block)
        else:
            nxt = others.pop(0)
            if where >= 0:
                self._blk[where] = nxt
            else:
                self._ovf[h] = nxt
            self._where[nxt] = where
        if others is not None and not others:
            del self._dups[h]
        self._where[block] = -1
        self.cached[block] = False
        self.digest[block] = None

    def _regrow(self, need: int) -> None:
        """A table of at least 8 slots per hash, every oldest block placed anew."""
        slots = self._blk.size
        while need * 8 > slots:
            slots *= 2
        firsts = np.concatenate([self._blk[self._blk >= 0], np.fromiter(self._ovf.values(), dtype=np.int64)])
        self._new_table(slots)
        self._ovf = {}
        self._primaries = 0
        self._where[firsts] = -1
        keys = self.digest[firsts]
        hashes = keys.tolist()
        fps = self.fingerprints(hashes)
        self._place(firsts, hashes, keys, fps, *self._slots(fps))

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
        """Make `block` (cached under `h`) the oldest of `h`'s blocks. For tests, like
        `reindex`."""
        members = self.members(h)
        if block not in members:
            raise KeyError(f"block {block} is not cached under that hash")
        if members[0] == block:
            return
        self.remove(np.array(members, dtype=np.int64))
        order = [block] + [b for b in members if b != block]
        self.add(np.array(order, dtype=np.int64), [h] * len(order))

    # -- checking ----------------------------------------------------------------------

    def check(self, fail) -> None:
        """Call `fail(message)` on the first broken invariant of the layout."""
        size = self.cached.size
        if not self.digest.size == self._where.size == size:
            fail(f"index arrays of sizes {size}/{self.digest.size}/{self._where.size}")
        has_digest = np.fromiter((d is not None for d in self.digest.tolist()), dtype=bool, count=size)
        if not np.array_equal(has_digest, self.cached):
            b = int((has_digest != self.cached).nonzero()[0][0])
            fail(f"block {b} cached={bool(self.cached[b])} but its hash is {self.digest[b]!r:.20}")
        slots = (self._blk >= 0).nonzero()[0]
        in_slots = self._blk[slots]
        if (self._blk[self._blk < 0] != _EMPTY).any():
            fail("a table slot holds neither a block nor the empty mark")
        if in_slots.size and in_slots.max() >= size:
            fail("a table slot holds a block beyond the per-block arrays")
        slot_hashes = self.digest[in_slots].tolist()
        if None in slot_hashes:
            fail("a table slot holds a block that is not cached")
        fps = self.fingerprints(slot_hashes) if slot_hashes else np.zeros(0, dtype=np.uint64)
        s1, s2 = self._slots(fps)
        if not np.array_equal(self._fp[slots], fps) or not ((s1 == slots) | (s2 == slots)).all():
            fail("a table slot's fingerprint or place is not its block's hash")
        if not np.array_equal(self._where[in_slots], slots):
            fail("a block in a table slot does not know its slot")
        away = np.zeros(self._blk.size, dtype=np.int32)
        np.add.at(away, s1[s1 != slots], np.int32(1))
        for h, b in self._ovf.items():
            if not 0 <= b < size or self.digest[b] != h:
                fail(f"overflow entry points at block {b}, not cached under that hash")
            home = int(self._slots(self.fingerprints([h]))[0][0])
            if self._where[b] != -2 - home:
                fail(f"overflow block {b} does not know its slot 1")
            away[home] += 1
        if not np.array_equal(away, self._away):
            fail("the counts of hashes kept away from their slot 1 are wrong")
        firsts = slot_hashes + list(self._ovf)
        if len(set(firsts)) != len(firsts):
            fail("a hash has two oldest blocks")
        if self._primaries != len(firsts):
            fail(f"{len(firsts)} hashes indexed, count says {self._primaries}")
        if (self.lookup(firsts) < 0).any() if firsts else False:
            fail("an indexed hash is not found by a lookup")
        seen = set(in_slots.tolist()) | set(self._ovf.values())
        first_set = set(firsts)
        for h, dups in self._dups.items():
            if not dups or h not in first_set:
                fail("a duplicate list that is empty or whose hash has no oldest block")
            for b in dups:
                if not 0 <= b < size or self.digest[b] != h or self._where[b] != -1 or b in seen:
                    fail(f"duplicate block {b} is not cached under its hash once")
                seen.add(b)
        if seen != set(self.cached.nonzero()[0].tolist()):
            fail("the indexed blocks are not exactly the cached ones")


class DictIndex:
    """`BlockIndex`'s interface on a Python dict (hash -> oldest block) and a list of
    duplicates per hash: one dict operation per block, which beats a handful of numpy
    steps per block while the dict fits the CPU caches (small pools)."""

    __slots__ = ("cached", "digest", "_first", "_dups")

    def __init__(self, digest_size: int | None = 16) -> None:
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

    def add(self, blocks: np.ndarray, hashes: list[BlockHash]) -> None:
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
        """As `BlockIndex.reindex` (tests)."""
        self.cover(block + 1)
        ids = np.array([block], dtype=np.int64)
        if self.cached[block]:
            self.remove(ids)
        if h is not None:
            self.add(ids, [h])

    make_oldest = BlockIndex.make_oldest

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
