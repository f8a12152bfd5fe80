"""The contract cannot be misused into wrong KV: one regression test per misuse, per backend.

Each misuse was once accepted and corrupted tables or shared KV wrongly. Now each raises a
`CacheError` and leaves the cache (and the sequences passed in) exactly as they were,
compared by `deep_state` (every object, order and count, not only `stats()`).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from cachelib import (
    CacheError,
    ExtraKeys,
    InvalidRequestError,
    InvariantViolation,
    Match,
    PrefixCache,
    Sequence,
    StaleMatchError,
    available_backends,
    create_cache,
)
from cachelib.types import MultiModalSpan
from tests.snapshots import deep_state, first_difference

BACKENDS = available_backends()
PS = 4
PREFIX = list(range(100, 112))  # three full pages
TAIL = [7, 8]


@contextmanager
def unchanged(*objs):
    """The block must leave every object (a cache, sequences) exactly as it found it."""
    before = deep_state(objs)
    yield
    after = deep_state(objs)
    assert after == before, first_difference(before, after)
    for obj in objs:
        if isinstance(obj, PrefixCache):
            obj.check_invariants()


class Warm:
    """A cache holding `PREFIX` (cached for apc/radix, a declared prefix on paged), so a
    sequence made by `seq()` gets a 12-token hit (none never hits)."""

    def __init__(self, backend: str, **options) -> None:
        self.cache = create_cache(backend, num_pages=16, page_size=PS, **options)
        self.prefix_id = None
        if backend == "paged":
            pid = self.cache.register_prefix(np.asarray(PREFIX))
            self.cache.commit(self.cache.prefix_sequence(pid), len(PREFIX))
            self.prefix_id = pid
        else:
            w = Sequence("warm", PREFIX + TAIL)
            self.admit(w)
            self.cache.release(w)

    def seq(self, rid: str, tokens=None, extra: ExtraKeys | None = None) -> Sequence:
        return Sequence(
            rid, PREFIX + TAIL if tokens is None else tokens, extra or ExtraKeys(), prefix_id=self.prefix_id
        )

    def admit(self, s: Sequence) -> Match:
        m = self.cache.match(s)
        assert self.cache.admit(s, m, len(s)) is not None
        self.cache.commit(s, len(s))
        return m


def _released_leaves_nothing_pinned(w: Warm, *seqs: Sequence) -> None:
    for s in seqs:
        w.cache.release(s)
    w.cache.check_invariants()
    idle = w.cache.stats().extra.get("prefix_pages", 0)
    assert w.cache.stats().pages_pinned == idle, "pages stay pinned after every sequence is released"


# -- a second Sequence object carrying a live request id --------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("same_tokens", [True, False])
def test_impostor_sequence_is_refused(backend, same_tokens):
    w = Warm(backend)
    a = w.seq("a")
    w.admit(a)
    impostor = w.seq("a", None if same_tokens else [5] * 20)
    child = w.seq("child")
    with unchanged(w.cache, a, impostor, child):
        with pytest.raises(InvalidRequestError, match="another Sequence object"):
            w.cache.grow(impostor, len(impostor))
        with pytest.raises(InvalidRequestError, match="another Sequence object"):
            w.cache.commit(impostor, len(a))
        with pytest.raises(InvalidRequestError, match="another Sequence object"):
            w.cache.release(impostor)
        with pytest.raises(InvalidRequestError, match="another Sequence object"):
            w.cache.fork(impostor, child)
    # the real one still works, and releasing it leaks nothing (none and radix used to
    # free the impostor's table and leak the real one's)
    _released_leaves_nothing_pinned(w, a)


# -- a Match that is not this cache's description of this sequence ----------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_match_made_for_other_tokens_under_the_same_id_is_refused(backend):
    w = Warm(backend)
    m = w.cache.match(w.seq("x"))
    other = w.seq("x", PREFIX[:4] + [9] * 10)  # same id, other tokens after the first page
    if not m.num_tokens:  # none: a miss describes every sequence truthfully; nothing to misuse
        assert backend == "none"
        return
    with unchanged(w.cache, other):
        with pytest.raises(InvalidRequestError, match="other tokens|does not start|not a match"):
            w.cache.admit(other, m, len(other))


@pytest.mark.parametrize("backend", BACKENDS)
def test_match_made_for_another_namespace_is_refused(backend):
    w = Warm(backend)
    salted = w.seq("x", extra=ExtraKeys(cache_salt="tenant-b"))
    m = w.cache.match(w.seq("x"))  # made for the unsalted tokens
    if not m.num_tokens:
        return
    with unchanged(w.cache, salted):
        with pytest.raises(CacheError):
            w.cache.admit(salted, m, len(salted))


@pytest.mark.parametrize("backend", BACKENDS)
def test_match_made_by_another_cache_is_refused(backend):
    w1, w2 = Warm(backend), Warm(backend)  # identical histories: the same page ids
    s = w1.seq("x")
    m = w2.cache.match(w2.seq("x"))
    with unchanged(w1.cache, w2.cache, s):
        with pytest.raises(InvalidRequestError, match="another cache"):
            w1.cache.admit(s, m, len(s))


def _forgeries(w: Warm, m: Match) -> list[tuple[str, Match]]:
    out = [
        ("more tokens", m._replace(num_tokens=m.num_tokens + PS, pages=m.pages + (15,))),
        ("a page swapped", m._replace(num_tokens=PS, pages=(15,))),
        ("a hit with no handle", m._replace(num_tokens=PS, pages=(0,), handle=None)),
        ("a float count", m._replace(num_tokens=float(m.num_tokens))),
        ("pages as a list", m._replace(pages=list(m.pages))),
        ("another request's id", m._replace(request_id="someone-else")),
        ("no owner", m._replace(owner=None)),
    ]
    if m.num_tokens:
        out += [
            ("pages reordered", m._replace(pages=m.pages[::-1])),
            ("a shorter count, same pages", m._replace(num_tokens=m.num_tokens - PS)),
            ("a miss carrying the handle", m._replace(num_tokens=0, pages=())),
        ]
    if isinstance(m.handle, list):  # apc: the handle is the hit blocks
        out.append(("foreign block objects", m._replace(handle=Warm("apc").cache.match(w.seq("x")).handle)))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_forged_match_is_refused(backend):
    w = Warm(backend)
    s = w.seq("x")
    m = w.cache.match(s)
    for what, forged in _forgeries(w, m):
        if forged == m:
            continue
        with unchanged(w.cache, s):
            with pytest.raises(CacheError):
                w.cache.admit(s, forged, len(s))
                pytest.fail(f"a forged match ({what}) was admitted")
    assert w.cache.admit(s, m, len(s)) is not None  # the genuine one still works
    w.cache.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_match_is_refused_or_still_true(backend):
    """Matches made before an eviction either raise StaleMatchError or are still exact."""
    w = Warm(backend)
    s = w.seq("x")
    m = w.cache.match(s)
    w.cache.evict(w.cache.num_pages)
    if backend == "paged":
        w.cache.unregister_prefix(w.prefix_id)
    if not m.num_tokens:
        return
    with unchanged(w.cache, s):
        with pytest.raises(StaleMatchError):
            w.cache.admit(s, m, len(s))


# -- fork into a child under other extra keys -------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "extra",
    [ExtraKeys(lora_id=3), ExtraKeys(cache_salt="tenant-b"), ExtraKeys(mm=(MultiModalSpan(0, 2, "img"),))],
    ids=["lora", "salt", "mm"],
)
def test_fork_into_a_child_with_other_extra_keys_is_refused(backend, extra):
    if extra.mm and backend.startswith("radix"):
        pytest.skip("radix keys KV by (salt, LoRA) only: its match ignores multimodal inputs too (not modelled)")
    w = Warm(backend)
    parent = w.seq("p")
    w.admit(parent)
    child = Sequence("c", parent.tokens.copy(), extra)
    with unchanged(w.cache, parent, child):
        with pytest.raises(InvalidRequestError, match="other extra keys"):
            w.cache.fork(parent, child)
    _released_leaves_nothing_pinned(w, parent)


# -- wrong types ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Sequence(5, [1, 2]), "request_id must be a str"),
        (lambda: Sequence(b"r", [1, 2]), "request_id must be a str"),
        (lambda: Sequence("r", [1, 2], extra={"cache_salt": "a"}), "extra must be ExtraKeys"),
        (lambda: Sequence("r", [1, 2], prefix_id="p"), "prefix_id"),
        (lambda: Sequence("r", [1, 2], prefix_id=True), "prefix_id"),
        (lambda: ExtraKeys(cache_salt=5), "cache_salt must be a str"),
        (lambda: ExtraKeys(lora_id=True), "lora_id"),
        (lambda: ExtraKeys(lora_id=1.0), "lora_id"),
        (lambda: ExtraKeys(mm=[MultiModalSpan(0, 1, "x")]), "tuple"),
        (lambda: ExtraKeys(mm=((0, 1, "x"),)), "multimodal span"),
        (lambda: ExtraKeys(mm=(MultiModalSpan(0, 1, 7),)), "multimodal span"),
    ],
)
def test_wrong_types_in_the_value_types(make, message):
    with pytest.raises(InvalidRequestError, match=message):
        make()


@pytest.mark.parametrize("token", [1.5, 1.0, True, "3", None, np.float32(2.0)])
def test_append_token_refuses_what_is_not_an_int(token):
    s = Sequence("r", [1, 2])
    with pytest.raises(InvalidRequestError, match="token id must be an int"):
        s.append_token(token)
    assert s.tokens.tolist() == [1, 2]


def test_append_token_takes_numpy_ints_and_the_whole_int32_range():
    s = Sequence("r", [0])
    s.append_token(np.int32(5))
    s.append_token(np.int64(2**31 - 1))
    s.append_token(0)
    assert s.tokens.tolist() == [0, 5, 2**31 - 1, 0]
    with pytest.raises(InvalidRequestError):
        s.append_token(2**31)


def test_num_tokens_is_the_length_after_every_kind_of_append():
    """`Sequence.num_tokens` (what the caches read for `len(seq)`) follows every append
    form, a refused one included (nothing appended), and a buffer outgrown on the way."""
    s = Sequence("r", np.arange(3, dtype=np.int32), room=2)
    seen = [s.num_tokens]
    s.append_token(7)
    seen.append(s.num_tokens)
    s.extend_ids([8, 9, 10])  # past the room: the buffer doubles
    seen.append(s.num_tokens)
    s.extend_ids(range(100, 150))
    seen.append(s.num_tokens)
    s.append(np.array([1, 2], dtype=np.int32))
    seen.append(s.num_tokens)
    with pytest.raises(InvalidRequestError):
        s.extend_ids([1, -1])
    seen.append(s.num_tokens)
    assert seen == [3, 4, 7, 57, 59, 59]
    assert s.num_tokens == len(s) == s.tokens.size
    assert s.fork("c").num_tokens == 59


def _wrong_type_calls(cache: PrefixCache, live: Sequence, fresh: Sequence, m: Match):
    """(name, call) pairs that must each raise a CacheError, never a TypeError or similar."""
    renamed = Sequence("renamed", [1, 2, 3])
    renamed.request_id = 5  # mutated after validation
    return [
        ("match(None)", lambda: cache.match(None)),
        ("match(str)", lambda: cache.match("a")),
        ("admit(None, m)", lambda: cache.admit(None, m, 3)),
        ("admit(seq, None)", lambda: cache.admit(fresh, None, 3)),
        ("admit(seq, tuple)", lambda: cache.admit(fresh, tuple(m), 3)),
        ("admit(seq, m, float)", lambda: cache.admit(fresh, m, 3.0)),
        ("admit(seq, m, True)", lambda: cache.admit(fresh, m, True)),
        ("admit(int id)", lambda: cache.admit(renamed, m, 3)),
        ("grow(None)", lambda: cache.grow(None, 3)),
        ("grow(str)", lambda: cache.grow("a", 3)),
        ("grow(int id)", lambda: cache.grow(renamed, 3)),
        ("grow(seq, str)", lambda: cache.grow(live, "3")),
        ("grow(seq, None)", lambda: cache.grow(live, None)),
        ("commit(42)", lambda: cache.commit(42, 3)),
        ("commit(seq, float)", lambda: cache.commit(live, float(len(live)))),
        ("fork(None, child)", lambda: cache.fork(None, fresh)),
        ("fork(seq, str)", lambda: cache.fork(live, "child")),
        ("fork(seq, int id)", lambda: cache.fork(live, renamed)),
        ("release(None)", lambda: cache.release(None)),
        ("release(list)", lambda: cache.release([live])),
        ("release(int id)", lambda: cache.release(renamed)),
        ("evict(str)", lambda: cache.evict("1")),
        ("evict(float)", lambda: cache.evict(1.0)),
        ("evict(True)", lambda: cache.evict(True)),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_types_raise_cache_errors_and_change_nothing(backend):
    w = Warm(backend)
    live = w.seq("live")
    w.admit(live)
    fresh = w.seq("fresh")
    m = w.cache.match(fresh)
    for what, call in _wrong_type_calls(w.cache, live, fresh, m):
        with unchanged(w.cache, live, fresh):
            try:
                call()
            except CacheError:
                pass
            except Exception as exc:  # noqa: BLE001 - the point: nothing else may escape
                pytest.fail(f"{backend}: {what} raised {type(exc).__name__}: {exc}")
            else:
                pytest.fail(f"{backend}: {what} was accepted")


# -- check_invariants sees corrupted content ---------------------------------------------


def _two_cached_blocks_apc():
    cache = create_cache("apc", num_pages=8, page_size=PS, verify_tokens=True)
    for rid, toks in (("a", [1, 2, 3, 4, 5]), ("b", [9, 9, 9, 9, 5])):
        s = Sequence(rid, toks)
        cache.admit(s, cache.match(s), len(s))
        cache.commit(s, len(s))
        cache.release(s)
    cache.check_invariants()
    return cache


def test_apc_invariants_catch_a_block_cached_under_another_blocks_tokens():
    cache = _two_cached_blocks_apc()
    a, b = (blk for blk in cache.blocks if blk.block_hash is not None)
    cache._tokens[a.block_id] = cache._tokens[b.block_id]  # the content recorded is b's
    with pytest.raises(InvariantViolation, match="rehash"):
        cache.check_invariants()


def test_apc_invariants_catch_two_table_entries_swapped():
    cache = _two_cached_blocks_apc()
    a, b = (blk for blk in cache.blocks if blk.block_hash is not None)
    ha, hb = a.block_hash, b.block_hash
    a.block_hash, b.block_hash = hb, ha  # each block indexed under the other's tokens
    cache._table[ha], cache._table[hb] = b, a
    with pytest.raises(InvariantViolation, match="rehash"):
        cache.check_invariants()


def test_apc_invariants_catch_a_live_block_holding_other_content():
    cache = create_cache("apc", num_pages=8, page_size=PS, verify_tokens=True)
    s = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    cache.admit(s, cache.match(s), len(s))
    cache.commit(s, len(s))
    cache._tokens[s.page_table[1], 0] = 77  # recorded KV of block 1 is not s's
    with pytest.raises(InvariantViolation):
        cache.check_invariants()


@pytest.mark.parametrize("backend", ["radix", "radix-aged"])
def test_radix_invariants_catch_a_node_whose_pages_hold_other_tokens(backend):
    cache = create_cache(backend, num_pages=8, page_size=PS, track_contents=True)
    for rid, toks in (("a", [1, 2, 3, 4, 5]), ("b", [9, 9, 9, 9, 5])):
        s = Sequence(rid, toks)
        cache.admit(s, cache.match(s), len(s))
        cache.commit(s, len(s))
        cache.release(s)
    cache.check_invariants()
    na, nb = sorted(cache.tree.nodes(), key=lambda n: n.node_id)
    na.pages, nb.pages = nb.pages, na.pages  # each node's pages hold the other's tokens
    with pytest.raises(InvariantViolation, match="other tokens than its key"):
        cache.check_invariants()


@pytest.mark.parametrize(
    "backend, options, message",
    [
        ("none", {"verify_tokens": True}, "unexpected keyword argument 'verify_tokens'; its options are none"),
        ("radix", {"bogus": 1}, "unexpected keyword argument 'bogus'; its options are .*eviction_policy"),
        ("apc", {"verify_tokens": "yes"}, "verify_tokens must be a bool"),
        ("apc", {"hash_fn": "sha256"}, "hash_fn must be a function"),
        ("radix-aged", {"cost_context": True}, "cost_context"),
    ],
)
def test_wrong_options_are_invalid_requests(backend, options, message):
    with pytest.raises(InvalidRequestError, match=message):
        create_cache(backend, num_pages=4, page_size=PS, **options)


def test_paged_prefix_id_true_is_not_prefix_1():
    w = Warm("paged")
    assert w.prefix_id == 1
    with pytest.raises(InvalidRequestError, match="unknown prefix id True"):
        w.cache.prefix_sequence(True)


# -- the shared page-partition check (cachelib/invariants.py) sees lost and doubled pages --


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_invariants_catch_a_sequence_forgotten_without_release(backend):
    """A state dropped without `release`: its pages stay pinned (or are lost) with no holder."""
    w = Warm(backend)
    a = w.seq("a")
    w.admit(a)
    w.cache.check_invariants()
    del w.cache._live["a"]
    with pytest.raises(InvariantViolation, match="pinned pages are not exactly|neither free, cached nor pinned"):
        w.cache.check_invariants()


def _hand_back_a_pinned_page(cache: PrefixCache, page: int) -> None:
    """Put a page a live table holds into the backend's free pool (a double free)."""
    if cache.name.startswith("apc"):  # apc, apc-lmcache (apc below LMCache)
        cache.free_queue.append(cache.blocks[page])
    elif cache.name.startswith("radix"):
        cache._give([page])
    else:  # none, paged: a FIFO page pool
        cache._free.give([page])


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_invariants_catch_a_page_both_free_and_pinned(backend):
    w = Warm(backend)
    a = w.seq("a")
    w.admit(a)
    _hand_back_a_pinned_page(w.cache, a.page_table[-1])
    with pytest.raises(InvariantViolation, match=f"{backend}: page {a.page_table[-1]} is both"):
        w.cache.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_capabilities_are_declared(backend):
    cls = type(create_cache(backend, num_pages=4, page_size=PS))
    overrides_verify = cls._verify_match is not PrefixCache._verify_match
    assert cls.reuses_kv == overrides_verify == (backend != "none")
    assert cls.declares_prefixes == (backend == "paged")
