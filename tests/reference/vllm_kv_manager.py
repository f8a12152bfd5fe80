"""A literal, deliberately naive model of vLLM V1's KVCacheManager + BlockPool decisions.

Written from vLLM's documented algorithm (docs/design/prefix_caching.md; block_pool.py,
kv_cache_manager.py, single_type_kv_cache_manager.py), for one full-attention KV group,
without sharing any code or data structure with `backends/apc.py`: block state lives in
plain lists, the free queue is an OrderedDict (head = first item), and block identity is a
sha256 chain instead of xxh3. It is slow and obvious, so the fast backend can be checked
against it decision by decision: which blocks each request gets, which tokens hit, which
blocks are evicted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from cachelib.types import CacheStats, CopyOp, Match, Sequence


class VllmModel:
    """Duck-types the `PrefixCache` calls the replay protocol makes, and no more: it shares
    not even the contract's base class (and its checks) with the backend it judges."""

    name = "vllm-model"
    decode_steps_are_noops = False
    decode_noops_when = None

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.ref_cnt = [0] * num_pages
        self.block_hash: list[bytes | None] = [None] * num_pages
        self.free = OrderedDict((b, None) for b in range(num_pages))
        self.cached: dict[bytes, dict[int, None]] = {}  # hash -> block ids, oldest first
        self.req_blocks: dict[str, list[int]] = {}
        self.req_num_cached: dict[str, int] = {}
        self.evicted: list[int] = []

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        out, parent = [], b"root"
        toks = seq.tokens
        for i in range(num_blocks):
            block = toks[i * self.page_size : (i + 1) * self.page_size]
            parent = hashlib.sha256(parent + block.tobytes()).digest()
            out.append(parent)
        return out

    # get_computed_blocks + find_longest_cache_hit
    def match(self, seq: Sequence) -> Match:
        max_blocks = (len(seq) - 1) // self.page_size
        hit = []
        for h in self._hashes(seq, max_blocks):
            ids = self.cached.get(h)
            if not ids:
                break
            hit.append(next(iter(ids)))
        return Match(seq.request_id, len(hit) * self.page_size, tuple(hit))

    def _pop_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # _maybe_evict_cached_block
            del self.cached[h][block]
            if not self.cached[h]:
                del self.cached[h]
            self.block_hash[block] = None
            self.evicted.append(block)
        self.ref_cnt[block] = 1
        return block

    # allocate_slots
    def admit(self, seq: Sequence, match: Match, num_tokens: int) -> list[CopyOp] | None:
        hit = list(match.pages)
        num_new = -(-num_tokens // self.page_size) - len(hit)
        evictable_hit = sum(1 for b in hit if self.ref_cnt[b] == 0)
        if num_new + evictable_hit > len(self.free):
            return None
        for b in hit:  # touch
            if self.ref_cnt[b] == 0:
                del self.free[b]
            self.ref_cnt[b] += 1
        blocks = hit + [self._pop_free() for _ in range(num_new)]
        self.req_blocks[seq.request_id] = blocks
        self.req_num_cached[seq.request_id] = len(hit)
        seq.page_table = list(blocks)
        seq.num_computed = match.num_tokens
        return []

    def grow(self, seq: Sequence, num_tokens: int) -> list[CopyOp] | None:
        blocks = self.req_blocks[seq.request_id]
        num_new = -(-num_tokens // self.page_size) - len(blocks)
        if num_new > len(self.free):
            return None
        new = [self._pop_free() for _ in range(max(num_new, 0))]
        blocks.extend(new)
        seq.page_table.extend(new)
        return []

    # cache_full_blocks
    def commit(self, seq: Sequence, num_computed: int) -> None:
        rid = seq.request_id
        full = num_computed // self.page_size
        hashes = self._hashes(seq, full)
        for i in range(self.req_num_cached[rid], full):
            b = self.req_blocks[rid][i]
            assert self.block_hash[b] is None
            self.block_hash[b] = hashes[i]
            self.cached.setdefault(hashes[i], {})[b] = None
        self.req_num_cached[rid] = max(full, self.req_num_cached[rid])
        seq.num_computed = num_computed

    # free: reversed order; hashed blocks to the tail, others to the head
    def release(self, seq: Sequence) -> None:
        for b in reversed(self.req_blocks.pop(seq.request_id)):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free[b] = None
                if self.block_hash[b] is None:
                    self.free.move_to_end(b, last=False)
        del self.req_num_cached[seq.request_id]

    def cached_blocks_in_lru_order(self) -> list[int]:
        return [b for b in self.free if self.block_hash[b] is not None]

    def fork(self, parent, child):  # not part of the replay protocol
        raise NotImplementedError

    def evict(self, num_pages: int) -> int:
        raise NotImplementedError

    def stats(self) -> CacheStats:
        return CacheStats(self.name, self.num_pages, self.page_size, evicted_pages=len(self.evicted))

    def check_invariants(self) -> None:
        pass  # a model, not a backend: the fast backend is what gets checked
