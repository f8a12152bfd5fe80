"""Page tables -> FlashInfer's CSR batch metadata; the one place this conversion lives.

A batch holds, per sequence, `q_len` new tokens whose queries attend over a context of
`kv_len = num_cached + q_len` tokens (the queries are the context's suffix). Token t of a
sequence lives at page `page_table[t // page_size]`, slot `t % page_size` (docs/design.md §3).
All input checks that need no tensor happen here, before any kernel runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


class AttentionInputError(ValueError):
    """Bad input to the attention path: caught before any kernel runs."""


class PageTableError(AttentionInputError):
    """A page table is shorter than its sequence, or names a page outside the pool."""


class ShapeMismatchError(AttentionInputError):
    """Head counts, head dims, page sizes or dtypes that do not fit together."""


class TokenIdError(AttentionInputError):
    """A token id outside the model's vocabulary."""


@dataclass(frozen=True, slots=True)
class BatchMeta:
    """CSR description of one batch over a paged KV cache (FlashInfer's `plan` inputs).

    Device tensors (int32 unless noted):
      qo_indptr        [B + 1]  query rows of sequence b are `qo_indptr[b]:qo_indptr[b+1]`
      kv_indptr        [B + 1]  its pages are `kv_indices[kv_indptr[b]:kv_indptr[b+1]]`
      kv_indices       [nnz_pages]
      kv_last_page_len [B]      valid slots in the last page, in [1, page_size]
      positions        [total_q] int64, absolute position of each query token (RoPE)
      write_pages      [total_q] int64, page that receives each new token's K/V
      write_slots      [total_q] int64, slot within that page
    Host copies (`q_lens`, `kv_lens`, `pages`) spare the reference a device sync.
    """

    page_size: int
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    positions: torch.Tensor
    write_pages: torch.Tensor
    write_slots: torch.Tensor
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    pages: tuple[tuple[int, ...], ...]

    @property
    def batch_size(self) -> int:
        return len(self.q_lens)

    @property
    def num_q_tokens(self) -> int:
        return int(sum(self.q_lens))

    @property
    def is_decode(self) -> bool:
        """One query per sequence: the decode kernel applies."""
        return all(n == 1 for n in self.q_lens)


def _check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise AttentionInputError(f"{name} must be an int >= {lo}, got {value!r}")
    return value


def build_batch_meta(
    page_tables: Sequence[Sequence[int]],
    num_cached: Sequence[int],
    q_lens: Sequence[int],
    page_size: int,
    *,
    num_pages: int | None = None,
    device: torch.device | str = "cpu",
) -> BatchMeta:
    """CSR metadata for sequences with `num_cached[b]` cached and `q_lens[b]` new tokens.

    A table may be longer than its context needs (a backend may allocate ahead); only the
    first `ceil(kv_len / page_size)` pages are used. Raises `PageTableError` when a table
    is too short or names a page outside `[0, num_pages)`.
    """
    _check_int("page_size", page_size, 1)
    if not (len(page_tables) == len(num_cached) == len(q_lens)):
        raise AttentionInputError(
            f"batch lists differ in length: {len(page_tables)} tables, {len(num_cached)} cached counts, {len(q_lens)} query counts"
        )
    if not page_tables:
        raise AttentionInputError("empty batch")
    qo_indptr, kv_indptr, indices, last_len = [0], [0], [], []
    positions, write_pages, write_slots = [], [], []
    kv_lens, used_pages = [], []
    for b, (table, cached, q_len) in enumerate(zip(page_tables, num_cached, q_lens, strict=True)):
        _check_int(f"sequence {b}: num_cached", cached, 0)
        _check_int(f"sequence {b}: number of new tokens", q_len, 1)
        kv_len = cached + q_len
        need = -(-kv_len // page_size)
        if len(table) < need:
            raise PageTableError(
                f"sequence {b}: page table has {len(table)} pages but {kv_len} tokens need {need} pages of {page_size}"
            )
        pages = tuple(int(p) for p in table[:need])
        if num_pages is not None:
            bad = [p for p in pages if not 0 <= p < num_pages]
            if bad:
                raise PageTableError(f"sequence {b}: page id {bad[0]} outside the pool [0, {num_pages})")
        qo_indptr.append(qo_indptr[-1] + q_len)
        kv_indptr.append(kv_indptr[-1] + need)
        indices.extend(pages)
        last_len.append(kv_len - (need - 1) * page_size)
        for t in range(cached, kv_len):
            positions.append(t)
            write_pages.append(pages[t // page_size])
            write_slots.append(t % page_size)
        kv_lens.append(kv_len)
        used_pages.append(pages)
    # Two new tokens landing on the same (page, slot) means two tables share a page that
    # is being written: the cache forgot a copy-on-write. Catch it before it corrupts KV.
    targets = set(zip(write_pages, write_slots, strict=True))
    if len(targets) != len(write_pages):
        raise PageTableError("two new tokens of this batch would be written to the same (page, slot)")

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    def i64(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int64, device=device)

    return BatchMeta(
        page_size=page_size,
        qo_indptr=i32(qo_indptr),
        kv_indptr=i32(kv_indptr),
        kv_indices=i32(indices),
        kv_last_page_len=i32(last_len),
        positions=i64(positions),
        write_pages=i64(write_pages),
        write_slots=i64(write_slots),
        q_lens=tuple(int(q) for q in q_lens),
        kv_lens=tuple(kv_lens),
        pages=tuple(used_pages),
    )
