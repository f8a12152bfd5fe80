"""Page ids of the radix backend as int32 arrays: the free pool and the sequences' tables.

Page ids as Python ints in lists cost a reference-count update per page every time a list
is copied, joined or cut (at page size 1 that is every token of every prompt, several times
per request, each a likely cache miss). Here every move of page ids is a `memcpy` of an
int32 array, and a tree node takes its pages as a view of the table that computed them
(`RadixTree._node_pages`), not as a copy. No decision depends on which ids a table holds:
only how the ids are stored changes.
"""

from __future__ import annotations

import numpy as np

from cachelib.errors import InvariantViolation
from cachelib.page_table import PageTable

__all__ = ["PagePool", "PageTable"]

#: an array given back shorter than this is copied onto the pool's stack instead of
#: standing as a run of its own (a request's partial last page, a decode leaf, a page-16
#: prompt): up to 8 KiB of ids copy faster than the turns of `take_into`'s loop that their
#: own run would cost; longer ones (page-1 prompts) are kept as they are, never copied twice
_SHORT_RUN = 2048


class PagePool:
    """The free page ids: whole runs given back (an evicted node's page array, kept as it
    is: no copy), a stack of short ones, then the never-used ids `fresh .. num_pages - 1`,
    created only when first handed out, so an unlimited pool costs nothing up front. Taking
    copies each id once, into the table that takes it. It does not check what it is
    given: the cache hands back only pages it handed out."""

    __slots__ = ("num_pages", "_runs", "_stack", "_top", "_fresh")

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._runs: list[np.ndarray] = []  # arrays given back whole, none empty
        self._stack = np.empty(min(num_pages, 1024), dtype=np.int32)
        self._top = 0  # short ones given back: `_stack[:_top]`
        self._fresh = 0  # the next never-used id

    @property
    def num_free(self) -> int:
        return sum(r.size for r in self._runs) + self._top + self.num_pages - self._fresh

    def take(self, n: int) -> np.ndarray:
        """`n` free ids as a new array (the caller checked there are that many)."""
        out = np.empty(n, dtype=np.int32)
        self.take_into(out)
        return out

    def take_into(self, out: np.ndarray) -> None:
        """Fill `out` with free ids, as many as it holds (the caller checked there are):
        the last runs given back first, then the stack, then never-used ids."""
        n = out.size
        top = self._top
        runs = self._runs
        if n <= top and not runs:  # the common case: all from the stack's top
            out[:] = self._stack[top - n : top]
            self._top = top - n
            return
        got = 0
        while got < n and runs:
            run = runs[-1]
            k = run.size
            if k <= n - got:  # the whole run
                out[got : got + k] = run
                runs.pop()
            else:  # its tail; the rest stays, a view unless short beside its buffer
                k = n - got
                out[got:n] = run[run.size - k :]
                rest = run[: run.size - k]
                base = rest.base
                runs[-1] = rest.copy() if base is not None and 2 * rest.size < base.size else rest
            got += k
        if got < n and self._top:
            k = min(n - got, self._top)
            top = self._top
            out[got : got + k] = self._stack[top - k : top]
            self._top = top - k
            got += k
        if got < n:
            fresh = self._fresh
            if fresh + n - got > self.num_pages:
                # the caller's check failed: never hand out an id past the pool
                raise InvariantViolation(f"radix: {n} pages taken with {got + self.num_pages - fresh} free")
            out[got:] = np.arange(fresh, fresh + n - got, dtype=np.int32)
            self._fresh = fresh + n - got

    def give(self, pages: np.ndarray | list[int]) -> None:
        """Take `pages` back. A long int32 array is kept as it is (a view, unless short
        beside the buffer under it): the caller hands it over and never writes it again (an
        evicted node's pages, a finished table's tail); a list (a subclass's) or a short
        array is copied."""
        n = len(pages)
        if not n:
            return
        if n >= _SHORT_RUN:
            if pages.__class__ is not np.ndarray:
                pages = np.array(pages, dtype=np.int32)
            elif pages.base is not None and 2 * n < pages.base.size:
                pages = pages.copy()  # as a node's view: never pin more than twice its ids
            self._runs.append(pages)
            return
        top = self._top
        if top + n > self._stack.size:
            grown = np.empty(min(max(2 * self._stack.size, top + n), self.num_pages), dtype=np.int32)
            grown[:top] = self._stack[:top]
            self._stack = grown
        self._stack[top : top + n] = pages
        self._top = top + n

    def free_ids(self) -> list[int]:
        """Every free id (for invariants and tests)."""
        out = [p for r in self._runs for p in r.tolist()]
        out += self._stack[: self._top].tolist()
        out += range(self._fresh, self.num_pages)
        return out
