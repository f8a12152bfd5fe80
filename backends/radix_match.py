"""Is a `Match` a true description of a sequence's cached prefix in a radix cache, now?

`admit` pins the node a match names and puts the match's pages at the head of the
sequence's table, so a match made for other tokens under the same request id, by another
cache, in another namespace, or forged would hand out pages holding other KV. The proof is
O(hit): the node is still in this cache's tree (not evicted: else the match is stale),
under the root of the sequence's namespace, ends exactly at the matched depth, and the
path's pages and tokens are the match's pages and the sequence's first tokens.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from backends.radix_tree import RadixNode
from cachelib.errors import InvalidRequestError, StaleMatchError
from cachelib.types import Match, Sequence

if TYPE_CHECKING:
    from backends.radix import RadixCache


def verify_radix_match(cache: RadixCache, seq: Sequence, match: Match) -> None:
    """Raise unless `match` describes `seq`'s prefix in `cache` (a miss: its handle is the
    namespace's root)."""
    node = match.handle
    rid = seq.request_id
    if not match.num_tokens:
        if node is not cache.tree.roots.get(cache._namespace(seq)):
            raise InvalidRequestError(f"request {rid!r}: a match of 0 tokens names a node other than its root")
        return
    if not isinstance(node, RadixNode):
        raise InvalidRequestError(f"request {rid!r}: the match's handle is not a radix node (forged)")
    if node.pages is None and node.lender is None:
        raise StaleMatchError(f"request {rid!r}: the matched prefix was evicted since; match again")
    n = match.num_tokens
    path = []
    x = node
    while x.parent is not None:
        path.append(x)
        x = x.parent
    if cache.tree.roots.get(cache._namespace(seq)) is not x:
        raise InvalidRequestError(
            f"request {rid!r}: the match's node is not in this cache's tree under the request's "
            "namespace (another cache's match, another salt/LoRA, or forged)"
        )
    if node.start + len(node.key) != n:
        raise InvalidRequestError(
            f"request {rid!r}: the match's node ends at token {node.start + len(node.key)}, not {n}"
        )
    page_ids = cache.tree.page_ids
    if len(path) == 1:
        pages, key = page_ids(node), node.key
    else:
        path.reverse()
        pages = list(chain.from_iterable(page_ids(y) for y in path))
        key = np.concatenate([y.key for y in path])
    if tuple(pages) != match.pages or key.tobytes() != seq.tokens[:n].tobytes():
        raise InvalidRequestError(
            f"request {rid!r}: the match's pages or tokens are not the tree's for this sequence "
            "(a match made for other tokens under the same id, or forged)"
        )
