"""apc's own invariants (the page partition is checked for every backend by
`cachelib.invariants`): ref counts equal to the tables holding each block, the free queue
exactly the unreferenced blocks, the hash table exactly the hashed blocks, never-used
blocks without state, and every live table's hashed blocks holding its own content."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from cachelib.errors import InvariantViolation

if TYPE_CHECKING:
    from backends.apc import APCCache


def check_apc(cache: APCCache) -> None:
    """Raise `InvariantViolation` on the first broken invariant of `cache`."""

    def fail(msg: str) -> None:
        raise InvariantViolation(f"apc: {msg}")

    queue = cache.free_queue
    queue.check()
    index = cache.index
    index.check(fail)
    used = queue.num_used  # ids 0 .. used-1 were handed out; the others never were
    ref, hashed = cache._ref, index.cached
    hashes = index.digests(np.arange(hashed.size))
    if ref.size != hashed.size or not used <= ref.size <= cache.num_pages:
        fail(f"per-block arrays of sizes {ref.size}/{hashed.size} for {used} blocks handed out")
    if ref[used:].any() or hashed[used:].any():
        fail("a block never handed out is referenced or hashed")

    # ref counts are the tables holding each block; each table's first num_cached are hashed
    refs = np.zeros(ref.size, dtype=np.int64)
    for rid, held in cache._live.items():
        blocks = held.blocks
        if blocks.__class__ is not np.ndarray or blocks.dtype != np.int64 or blocks.ndim != 1:
            fail(f"{rid}: its blocks are not an int64 array")
        if not 0 <= held.num_cached <= blocks.size:
            fail(f"{rid}: num_cached {held.num_cached} outside its table")
        if blocks.size and (blocks.min() < 0 or blocks.max() >= used):
            fail(f"{rid}: holds a block that was never handed out")
        np.add.at(refs, blocks, 1)
        want = np.arange(blocks.size) < held.num_cached
        wrong = np.flatnonzero(hashed[blocks] != want)
        if wrong.size:
            i = int(wrong[0])
            fail(f"{rid}: block {i} hashed={bool(hashed[blocks[i]])} but num_cached={held.num_cached}")
    if not np.array_equal(ref, refs):
        b = int(np.flatnonzero(ref != refs)[0])
        fail(f"block {b} ref {ref[b]} but held by {refs[b]} tables")
    in_queue = queue.contains(np.arange(used))
    if not np.array_equal(ref[:used] == 0, in_queue):
        b = int(np.flatnonzero((ref[:used] == 0) != in_queue)[0])
        fail(f"block {b} ref {ref[b]} but in_queue={bool(in_queue[b])}")

    # the table holds exactly the hashed blocks, each under its own hash (the index's own
    # check proved its layout; this is the table as apc sees it)
    seen = np.zeros(ref.size, dtype=bool)
    entries = 0
    for h, members in index.items():
        for block in members:
            if seen[block]:
                fail(f"block {block} is in the table twice")
            seen[block] = True
            if hashes[block] != h:
                fail(f"table entry points at block {block} whose hash differs")
        entries += len(members)
    if not np.array_equal(seen, hashed):
        b = int(np.flatnonzero(seen != hashed)[0])
        fail(f"hashed block {b} missing from the table" if hashed[b] else f"unhashed block {b} in the table")
    if not int(np.count_nonzero(hashed)) == entries == cache._num_hashed:
        fail(f"hashed blocks {np.count_nonzero(hashed)}, table entries {entries}, count {cache._num_hashed}")
    cached_free = int(np.count_nonzero(hashed & (ref == 0)))
    if cached_free != cache._num_cached_free:
        fail(f"cached-free count {cache._num_cached_free}, actual {cached_free}")
    if cache.verify_tokens:
        _check_recorded_contents(cache, fail)
    if cache.host is not None:
        _check_host(cache, fail)
    # index entries point only at pages whose content matches: rehash every live table
    for rid, held in cache._live.items():
        seq = held.seq
        if seq.page_table is not held.table:
            fail(f"{rid}: the sequence's page table is not the table the cache holds for it")
        fresh = cache.hasher.hash_blocks(seq.tokens, seq.extra, 0, held.num_cached, None)
        for i, (block, h) in enumerate(zip(held.blocks.tolist(), fresh, strict=False)):
            if hashes[block] != h:
                fail(f"{rid}: block {i} (page {block}) is cached under another content's hash")
            if index.knows_positions and index.position(block) != i:
                fail(f"{rid}: block {i} (page {block}) is indexed at chain position {index.position(block)}")


def _check_recorded_contents(cache: APCCache, fail) -> None:
    """With `verify_tokens`: every cached block's recorded tokens and extra keys, chained
    from its recorded parent hash, rehash to the hash it is indexed under, and a parent
    still cached (same generation) still has that hash. So no block is indexed under
    another block's tokens, nor under another prefix."""
    hasher = cache.hasher
    size = cache._ref.size
    digest = cache.index.digests(np.arange(size))
    if not len(cache._tokens) == len(cache._extra) == len(cache._parent) == len(cache._generation) == size:
        fail("recorded contents do not cover every block handed out")
    for bid in np.flatnonzero(cache.index.cached).tolist():
        h = digest[bid]
        parent, parent_hash = cache._parent[bid], cache._parent_hash[bid]
        if (parent is None) != (parent_hash is None):
            fail(f"block {bid}: recorded parent {parent} but parent hash {parent_hash!r:.20}")
        if parent is not None:
            pid, generation = parent
            if cache._generation[pid] == generation and digest[pid] != parent_hash:
                fail(f"block {bid}: its parent block {pid} is cached under another hash than recorded")
        if hasher.hash_block(parent_hash, cache._tokens[bid].tobytes(), cache._extra[bid]) != h:
            fail(f"block {bid}: its recorded tokens do not rehash to the hash it is indexed under")


def _check_host(cache: APCCache, fail) -> None:
    """The host tier's own invariants (capacity, pool, index, policy), then each live
    request's offload state: its chunk keys are its own blocks' hashes, its store progress
    within them, its GPU and loaded tokens within its prompt."""
    host = cache.host
    host.check()
    bpc = host.spec.blocks_per_chunk
    for rid, held in cache._live.items():
        req = held.offload
        if req is None:
            continue
        seq = held.seq
        fresh = cache.hasher.hash_blocks(seq.tokens, seq.extra, 0, len(req.keys) * bpc, None)
        if req.keys != fresh[bpc - 1 :: bpc]:
            fail(f"{rid}: its host chunk keys are not its blocks' hashes")
        if not 0 <= req.next_stored <= len(req.keys):
            fail(f"{rid}: next chunk to store {req.next_stored} outside its {len(req.keys)} chunks")
        if req.gpu_tokens + req.loaded_tokens > len(seq) or req.gpu_tokens > held.num_cached * cache.page_size:
            fail(f"{rid}: {req.gpu_tokens} GPU + {req.loaded_tokens} loaded tokens do not fit its admission")
