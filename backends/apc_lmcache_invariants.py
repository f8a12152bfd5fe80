"""apc-lmcache's own invariants, beyond apc's (checked first): each LMCache store within its
capacity and its token count its entries' sum, every chunk a whole chunk (or, with
`save_unfull_chunk`, a shorter last one), every stored key with exactly one host-page id and
every id with a key on some tier, nothing pending, and each live request's adapter state
within its sequence."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachelib.errors import InvariantViolation

if TYPE_CHECKING:
    from backends.apc_lmcache import APCLMCacheCache


def check_lmcache(cache: APCLMCacheCache) -> None:
    """Raise `InvariantViolation` on the first broken invariant of `cache`'s LMCache tiers."""

    def fail(msg: str) -> None:
        raise InvariantViolation(f"apc-lmcache: {msg}")

    lmc = cache.lmc
    spec = lmc.spec
    chunk = spec.chunk_tokens
    stores = [lmc.host] + ([lmc.disk] if lmc.disk is not None else [])
    held: set[bytes] = set()
    for store in stores:
        if store.used != sum(store.entries.values()):
            fail(f"{store.name} counts {store.used} tokens, its chunks hold {sum(store.entries.values())}")
        if store.used > store.capacity:
            fail(f"{store.name} holds {store.used} tokens above its capacity {store.capacity}")
        for key, tokens in store.entries.items():
            partial = key.startswith(b"partial:")
            if not (0 < tokens < chunk if partial else tokens == chunk):
                fail(f"{store.name}: a {'short' if partial else 'full'} chunk of {tokens} tokens (chunk {chunk})")
            if partial and not spec.save_unfull_chunk:
                fail(f"{store.name} holds a short chunk without save_unfull_chunk")
        held |= set(store.entries)
    if set(lmc.objects) != held:
        extra = set(lmc.objects) - held
        fail(f"{len(extra)} host-page ids for keys no tier holds" if extra else "a stored key without a host-page id")
    ids = list(lmc.objects.values())
    if len(set(ids)) != len(ids) or set(ids) & set(lmc._free_ids) or len(set(lmc._free_ids)) != len(lmc._free_ids):
        fail("a host-page id is used twice, or both used and free")
    if any(not 0 <= i < lmc._next_id for i in ids + lmc._free_ids) or len(ids) + len(lmc._free_ids) != lmc._next_id:
        fail("host-page ids do not partition the ids handed out")
    if not set(cache._trackers) <= set(cache._live):
        fail("adapter state kept for a request that is not live")
    for rid, tracker in cache._trackers.items():
        seq = cache._live[rid].seq
        reused = tracker.host_tokens + tracker.storage_tokens
        if min(tracker.host_tokens, tracker.storage_tokens, tracker.gpu_tokens) < 0:
            fail(f"{rid}: negative reuse {tracker.gpu_tokens}/{tracker.host_tokens}/{tracker.storage_tokens}")
        if tracker.gpu_tokens + reused > len(seq) - 1 or tracker.lmc_hit > seq.prompt_len:
            fail(f"{rid}: reuse {tracker.gpu_tokens} + {reused} or hit {tracker.lmc_hit} beyond its prompt")
        if reused and tracker.gpu_tokens + reused > tracker.lmc_hit:
            fail(f"{rid}: loaded past its LMCache hit {tracker.lmc_hit}")
        if tracker.num_saved > len(seq):
            fail(f"{rid}: {tracker.num_saved} tokens saved of a {len(seq)}-token sequence")
