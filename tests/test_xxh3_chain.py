"""The compiled xxh3_128 chain (cachelib/xxh3_chain.py, numba) against the `xxhash` package,
digest for digest, and apc's decisions and events with it against the package path.

The package is the reference: every page size and suffix length the kernel takes, both
XXH3-128 length classes it implements (17..128 and 129..240 bytes) and their edges, random
parents and tokens (negative ones too). Then `BlockHasher(kernel=...)` on every kind of
extra key (the kernel takes some, hands the rest to the package) and its errors, and apc
replaying and serving a slice of the conversation trace with each kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from backends.apc import APCCache
from cachelib import create_cache
from cachelib.errors import InvalidRequestError
from cachelib.hashing import HASH_KERNELS, BlockHasher
from cachelib.types import ExtraKeys, MultiModalSpan
from tests.helpers import drive_apc_alike

numba = pytest.importorskip("numba", reason="the compiled chain is the `fast` extra")
from cachelib.xxh3_chain import MAX_INPUT, MIN_INPUT, Xxh3Chain  # noqa: E402 (after the skip)


def package_chain(tokens: np.ndarray, page: int, start: int, stop: int, parent: bytes | None, suffix: bytes):
    h = b"\x00" * 16 if parent is None else parent
    out = []
    for i in range(start, stop):
        h = xxhash.xxh3_128_digest(h + tokens[i * page : (i + 1) * page].astype("<i4").tobytes() + suffix)
        out.append(h)
    return out


def fitting_cases():
    for page in range(1, 57):
        for suffix_len in range(0, 241, 4):
            if Xxh3Chain.takes(page, suffix_len):
                yield page, suffix_len


def test_every_page_size_and_suffix_it_takes_equals_the_package():
    rng = np.random.default_rng(12)
    cases = list(fitting_cases())
    lengths = {16 + 4 * p + s for p, s in cases}
    assert min(lengths) == 20 and max(lengths) == MAX_INPUT  # 17..19 are not multiples of 4
    assert {128, 132, 240} <= lengths  # both length classes and their edges
    for page, suffix_len in cases:
        chain = Xxh3Chain(page)
        blocks = int(rng.integers(1, 12))
        start = int(rng.integers(0, 3))
        tokens = rng.integers(-(2**31), 2**31, size=page * (start + blocks) + int(rng.integers(0, page + 1)))
        tokens = tokens.astype(np.int32)
        parent = None if rng.random() < 0.3 else rng.bytes(16)
        suffix = rng.bytes(suffix_len)
        got = chain.digests(tokens, start, start + blocks, parent, suffix)
        assert got.dtype == np.dtype("V16") and got.shape == (blocks,)
        assert got.tolist() == package_chain(tokens, page, start, start + blocks, parent, suffix), (page, suffix_len)


def test_a_long_chain_read_only_and_sliced_tokens():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 200_000, size=16 * 900, dtype=np.int32)
    chain = Xxh3Chain(16)
    want = package_chain(tokens, 16, 0, 900, None, b"")
    assert chain.digests(tokens, 0, 900, None, b"").tolist() == want
    ro = tokens.view()
    ro.flags.writeable = False  # Sequence.tokens is a read-only view
    assert chain.digests(ro, 100, 900, want[99], b"").tolist() == want[100:]
    strided = np.repeat(tokens, 2)[::2]  # not contiguous: copied first
    assert chain.digests(strided, 0, 900, None, b"").tolist() == want
    assert chain.digests(tokens, 5, 5, None, b"").size == 0


def test_what_it_takes():
    assert Xxh3Chain.takes(1, 0) and Xxh3Chain.takes(56, 0) and not Xxh3Chain.takes(57, 0)
    assert not Xxh3Chain.takes(16, 13)  # a lora_id key's 13 bytes: not a multiple of 4
    assert Xxh3Chain.takes(16, 12) and not Xxh3Chain.takes(56, 4)
    assert MIN_INPUT == 17 and MAX_INPUT == 240
    with pytest.raises(InvalidRequestError, match="page size 57"):
        Xxh3Chain(57)


def test_bad_input_is_refused_before_the_loop_reads():
    """The compiled loop reads without bounds checks: every input is checked first."""
    chain = Xxh3Chain(4)
    tokens = np.arange(10, dtype=np.int32)
    with pytest.raises(InvalidRequestError, match="blocks 0..2 of 4 tokens"):
        chain.digests(tokens, 0, 3, None, b"")  # block 2 is not full
    with pytest.raises(InvalidRequestError, match="int64"):
        chain.digests(tokens.astype(np.int64), 0, 1, None, b"")
    with pytest.raises(InvalidRequestError, match="2-d"):
        chain.digests(np.zeros((2, 4), dtype=np.int32), 0, 1, None, b"")
    with pytest.raises(InvalidRequestError, match="blocks -1..0"):
        chain.digests(tokens, -1, 1, None, b"")
    with pytest.raises(InvalidRequestError, match="got 8 and 0"):
        chain.digests(tokens, 0, 1, bytes(8), b"")
    with pytest.raises(InvalidRequestError, match="got None and 3"):
        chain.digests(tokens, 0, 1, None, b"abc")
    assert chain.digests(tokens, 2, 2, None, b"").size == 0


EXTRAS = [
    ExtraKeys(),
    ExtraKeys(cache_salt="tenant-a"),
    ExtraKeys(lora_id=7),  # a 13-byte suffix: the package
    ExtraKeys(cache_salt="s", lora_id=3),
    ExtraKeys(mm=(MultiModalSpan(offset=20, length=40, mm_hash="img0"),)),
]


@pytest.mark.parametrize("page", [1, 2, 3, 8, 16, 32, 56])
@pytest.mark.parametrize("extra", EXTRAS, ids=["plain", "salt", "lora", "salt+lora", "mm"])
def test_block_hasher_kernels_agree(page, extra):
    rng = np.random.default_rng(page)
    numba_hasher = BlockHasher(page, "xxh3_128", kernel="numba")
    python_hasher = BlockHasher(page, "xxh3_128", kernel="python")
    assert (numba_hasher.kernel, python_hasher.kernel) == ("numba", "python")
    tokens = rng.integers(0, 50_000, size=page * 40 + 3, dtype=np.int32)
    full = python_hasher.hash_blocks(tokens, extra, 0, 40, None)
    assert numba_hasher.hash_blocks(tokens, extra, 0, 40, None) == full
    assert numba_hasher.hash_keys(tokens, extra, 0, 40, None).tolist() == full
    # continued from a parent, as apc's prefill chunks and decode commits continue a memo
    assert numba_hasher.hash_blocks(tokens, extra, 17, 40, full[16]) == full[17:]
    assert numba_hasher.hash_keys(tokens, extra, 39, 40, full[38]).tolist() == full[39:]
    # int64 tokens: the package path hashes their 8-byte words, and so does the numba hasher
    wide = tokens.astype(np.int64)
    assert numba_hasher.hash_blocks(wide, extra, 0, 5, None) == python_hasher.hash_blocks(wide, extra, 0, 5, None)
    with pytest.raises(InvalidRequestError, match="not full"):
        numba_hasher.hash_keys(tokens, extra, 0, tokens.size // page + 1, None)


def test_kernel_choice_and_errors(monkeypatch):
    assert HASH_KERNELS == ("auto", "numba", "python")
    assert BlockHasher(16).kernel == "numba"  # auto, numba installed, page 16 fits
    assert BlockHasher(64).kernel == "python"  # auto: page 64 is past the kernel's inputs
    assert BlockHasher(16, "sha256").kernel == "python"
    assert BlockHasher(4, "poly128").kernel == "python"
    with pytest.raises(InvalidRequestError, match="unknown hash kernel 'fast'"):
        BlockHasher(16, kernel="fast")
    with pytest.raises(InvalidRequestError, match="xxh3_128 only, not 'sha256'"):
        BlockHasher(16, "sha256", kernel="numba")
    with pytest.raises(InvalidRequestError, match="xxh3_128 only, not 'custom'"):
        BlockHasher(16, hash_fn=lambda b: b[:16], kernel="numba")
    with pytest.raises(InvalidRequestError, match="page size 64"):
        BlockHasher(64, kernel="numba")
    monkeypatch.setattr("cachelib.hashing.numba_installed", lambda: False)
    assert BlockHasher(16).kernel == "python"
    with pytest.raises(InvalidRequestError, match=r"needs numba: pip install 'prefix-cache-lab\[fast\]'"):
        BlockHasher(16, kernel="numba")
    with pytest.raises(InvalidRequestError, match="unknown hash kernel"):
        create_cache("apc", num_pages=10, page_size=16, hash_kernel="gpu")


@pytest.mark.parametrize("page", [2, 5, 16, 32])
@pytest.mark.parametrize("seed", range(3))
def test_apc_decides_alike_with_each_kernel(page, seed):
    """Random calls (shared prefixes, salts, lora ids, decode, forks, evictions): equal
    matches, tables, copies, stats, LRU order and free queue after every call."""
    caches = [
        APCCache(num_pages=max(30, 160 // page), page_size=page, hash_algorithm="xxh3_128", hash_kernel=kernel)
        for kernel in ("numba", "python")
    ]
    assert [c.hasher.kernel for c in caches] == ["numba", "python"]
    drive_apc_alike(caches, seed, 200, salted=True)


def _events(cache) -> list:
    events: list = []

    class Listener:
        def on_kv_event(self, event):
            events.append(event)

    cache.subscribe(Listener())
    return events


def test_apc_replays_and_serves_alike_with_each_kernel(shipped_trace):
    """The conversation trace's first requests under memory pressure: the same hit per
    request, the same evictions, every KV event (with its hashes) equal; then a serving
    cell, request by request."""
    from experiments.engine import CacheClient, replay
    from experiments.runs.runner import CellConfig, run_cell

    replays = []
    for kernel in ("numba", "python"):
        cache = create_cache("apc", num_pages=4000, page_size=16, hash_kernel=kernel)
        events = _events(cache)
        result = replay(CacheClient(cache), shipped_trace[:150])
        cache.check_invariants()
        replays.append((result["hit_tokens"], result["evicted_pages"], result["per_request_hits"], events))
    assert replays[0] == replays[1]
    assert replays[0][0] > 0 and replays[0][1] > 0 and replays[0][3]  # hits, evictions and events happened
    cells = [
        run_cell(
            CellConfig(
                "apc",
                "mooncake",
                200_000,
                page_size=16,
                knobs={"limit": 60},
                protocol="serving",
                backend_options={"hash_kernel": kernel},
            )  # fmt: skip
        )
        for kernel in ("numba", "python")
    ]
    rows = [c["per_request"] for c in cells]
    assert rows[0] == rows[1] and len(rows[0]) == 60
    assert cells[0]["serving"]["hit_tokens"] == cells[1]["serving"]["hit_tokens"] > 0
