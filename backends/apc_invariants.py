"""apc's own invariants (the page partition is checked for every backend by
`cachelib.invariants`): ref counts equal to the tables holding each block, the free queue exactly the unreferenced blocks, the hash table
exactly the hashed blocks, and every live table's hashed blocks holding its own content."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachelib.errors import InvariantViolation
from cachelib.free_queue import KVBlock

if TYPE_CHECKING:
    from backends.apc import APCCache


def check_apc(cache: APCCache) -> None:
    """Raise `InvariantViolation` on the first broken invariant of `cache`."""

    def fail(msg: str) -> None:
        raise InvariantViolation(f"apc: {msg}")

    cache.free_queue.check()
    in_queue = {b.block_id for b in cache.free_queue}
    refs = [0] * cache.num_pages
    for rid, held in cache._live.items():
        if not 0 <= held.num_cached <= len(held.blocks):
            fail(f"{rid}: num_cached {held.num_cached} outside its table")
        for i, block in enumerate(held.blocks):
            refs[block.block_id] += 1
            if (i < held.num_cached) != (block.block_hash is not None):
                fail(f"{rid}: block {i} hashed={block.block_hash is not None} but num_cached={held.num_cached}")
    cached_free = 0
    for block in cache.blocks:
        if block.ref_cnt != refs[block.block_id]:
            fail(f"block {block.block_id} ref {block.ref_cnt} but held by {refs[block.block_id]} tables")
        if (block.ref_cnt == 0) != (block.block_id in in_queue):
            fail(f"block {block.block_id} ref {block.ref_cnt} but in_queue={block.block_id in in_queue}")
        if block.block_hash is not None:
            entry = cache._table.get(block.block_hash)
            members = {} if entry is None else ({entry.block_id: entry} if entry.__class__ is KVBlock else entry)
            if members.get(block.block_id) is not block:
                fail(f"hashed block {block.block_id} missing from the table")
            cached_free += block.ref_cnt == 0
    for h, entry in cache._table.items():
        members = [entry] if entry.__class__ is KVBlock else list(entry.values())
        if not members or (entry.__class__ is not KVBlock and len(members) < 2):
            fail("table entry with a wrong number of blocks")
        for block in members:
            if block.block_hash != h:
                fail(f"table entry points at block {block.block_id} whose hash differs")
    hashed = sum(b.block_hash is not None for b in cache.blocks)
    entries = sum(1 if e.__class__ is KVBlock else len(e) for e in cache._table.values())
    if not hashed == entries == cache._num_hashed:
        fail(f"hashed blocks {hashed}, table entries {entries}, count {cache._num_hashed}")
    if cached_free != cache._num_cached_free:
        fail(f"cached-free count {cache._num_cached_free}, actual {cached_free}")
    if cache.verify_tokens:
        _check_recorded_contents(cache, fail)
    # index entries point only at pages whose content matches: rehash every live table
    for rid, held in cache._live.items():
        seq = held.seq
        if seq.page_table != [b.block_id for b in held.blocks]:
            fail(f"{rid}: page table differs from the blocks held")
        fresh = cache.hasher.hash_blocks(seq.tokens, seq.extra, 0, held.num_cached, None)
        for i, (block, h) in enumerate(zip(held.blocks, fresh, strict=False)):
            if block.block_hash != h:
                fail(f"{rid}: block {i} (page {block.block_id}) is cached under another content's hash")


def _check_recorded_contents(cache: APCCache, fail) -> None:
    """With `verify_tokens`: every cached block's recorded tokens and extra keys, chained
    from its recorded parent hash, rehash to the hash it is indexed under, and a parent
    still cached (same generation) still has that hash. So no block is indexed under
    another block's tokens, nor under another prefix."""
    hasher = cache.hasher
    for block in cache.blocks:
        h = block.block_hash
        if h is None:
            continue
        bid = block.block_id
        parent, parent_hash = cache._parent[bid], cache._parent_hash[bid]
        if (parent is None) != (parent_hash is None):
            fail(f"block {bid}: recorded parent {parent} but parent hash {parent_hash!r:.20}")
        if parent is not None:
            pid, generation = parent
            if cache._generation[pid] == generation and cache.blocks[pid].block_hash != parent_hash:
                fail(f"block {bid}: its parent block {pid} is cached under another hash than recorded")
        if hasher.hash_block(parent_hash, cache._tokens[bid].tobytes(), cache._extra[bid]) != h:
            fail(f"block {bid}: its recorded tokens do not rehash to the hash it is indexed under")
