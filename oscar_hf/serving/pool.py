"""`PagedInt2Pool`: one preallocated pool of INT2 history pages shared by every request of a server.

A **page** holds the packed history of ``P = page_size`` consecutive history entries of one request, for every
quantized layer, keys and values (the unit Transformers' continuous batching calls a *block*: one page per layer):

    codes [num_pages, L, 2, Hk, P, D/4] uint8      (2 = keys, values; four 2-bit codes per byte, plane layout)
    scale [num_pages, L, 2, Hk, P, D/G] meta dtype
    zero  [num_pages, L, 2, Hk, P, D/G] meta dtype

A request owns a *block table*: the list of its page ids, history entry ``j`` at page ``table[j // P]``, offset
``j % P``. Pages are taken from a free list and given back when the request leaves; a reference count per page lets
two requests hold the same page (prefix sharing, :meth:`acquire`), a page returning to the free list only when its
last holder releases it. Nothing else is allocated while serving: memory is flat however requests come and go.

With ``storage`` (a flat ``uint8`` tensor, e.g. the non-trash part of Transformers' paged cache tensor) the three
tensors are views into it, one after the other (codes, then scale, then zero), instead of allocations of their own.
"""
from __future__ import annotations

import torch

from oscar_hf.kernels.paged_decode import gather_pages

from ..quant import SUPPORTED_META_DTYPES, QuantizedRows, check_group_size

KINDS = {"k": 0, "v": 1}


def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, group_size: int,
               meta_dtype: torch.dtype) -> int:
    """Bytes of one page: codes (D/4 bytes per row) + scale and zero (D/G each) for keys and values of every layer."""
    meta = torch.empty((), dtype=meta_dtype).element_size()
    row = head_dim // 4 + 2 * (head_dim // group_size) * meta
    return 2 * num_layers * num_kv_heads * page_size * row


def _views(storage: torch.Tensor, shape: tuple, code_cols: int, meta_cols: int, meta_dtype: torch.dtype):
    """``codes [*shape, code_cols] uint8`` and ``scale/zero [*shape, meta_cols] meta_dtype`` as consecutive views of
    the flat ``uint8`` tensor ``storage`` (no copy, no allocation)."""
    if storage.dtype != torch.uint8 or storage.dim() != 1:
        raise ValueError(f"pool storage must be a flat uint8 tensor, got {storage.dtype} {tuple(storage.shape)}")
    rows = torch.Size(shape).numel()
    meta_size = torch.empty((), dtype=meta_dtype).element_size()
    n_codes, n_meta = rows * code_cols, rows * meta_cols * meta_size
    if storage.numel() < n_codes + 2 * n_meta:
        raise ValueError(f"pool storage holds {storage.numel()} bytes, the pages need {n_codes + 2 * n_meta}")
    if n_codes % meta_size or storage.data_ptr() % meta_size:
        raise ValueError("pool storage is not aligned for the metadata dtype")
    codes = storage[:n_codes].view(*shape, code_cols)
    scale = storage[n_codes : n_codes + n_meta].view(meta_dtype).view(*shape, meta_cols)
    zero = storage[n_codes + n_meta : n_codes + 2 * n_meta].view(meta_dtype).view(*shape, meta_cols)
    return codes, scale, zero


class PoolExhausted(RuntimeError):
    """No free page is left: the scheduler admitted more history than the pool holds."""


class PagedInt2Pool:
    """Fixed-size pool of INT2 history pages (see the module docstring for the layout)."""

    def __init__(self, num_pages: int, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 group_size: int, meta_dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 storage: torch.Tensor | None = None):
        if num_pages < 1 or num_layers < 1 or num_kv_heads < 1 or page_size < 1:
            raise ValueError(f"PagedInt2Pool needs positive sizes, got num_pages={num_pages}, num_layers={num_layers}, "
                             f"num_kv_heads={num_kv_heads}, page_size={page_size}")
        check_group_size(head_dim, group_size)
        if meta_dtype not in SUPPORTED_META_DTYPES:
            raise ValueError(f"meta_dtype must be one of {SUPPORTED_META_DTYPES}, got {meta_dtype}")
        self.num_pages, self.num_layers, self.page_size = num_pages, num_layers, page_size
        self.num_kv_heads, self.head_dim, self.group_size = num_kv_heads, head_dim, group_size
        shape = (num_pages, num_layers, 2, num_kv_heads, page_size)
        if storage is None:
            self.codes = torch.zeros(*shape, head_dim // 4, dtype=torch.uint8, device=device)
            self.scale = torch.zeros(*shape, head_dim // group_size, dtype=meta_dtype, device=device)
            self.zero = torch.zeros(*shape, head_dim // group_size, dtype=meta_dtype, device=device)
        else:
            self.codes, self.scale, self.zero = _views(storage, shape, head_dim // 4, head_dim // group_size,
                                                       meta_dtype)
        # LIFO free list: a page freed by a leaving request is the next one handed out (warm in cache)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        self.peak_used = 0  # most pages held at once since construction

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def bytes_per_page(self) -> int:
        return page_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size, self.group_size,
                          self.scale.dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def refcount(self, page: int) -> int:
        return self._refs[page]

    # ------------------------------------------------------------------ allocation
    def allocate(self) -> int:
        """A free page id, now held once."""
        if not self._free:
            raise PoolExhausted(f"OSCAR INT2 page pool exhausted ({self.num_pages} pages of {self.page_size} tokens): "
                                "size it for the scheduler's capacity (num_pages / memory budget)")
        page = self._free.pop()
        self._refs[page] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return page

    def acquire(self, page: int) -> None:
        """One more holder of an allocated page (prefix sharing)."""
        if self._refs[page] < 1:
            raise ValueError(f"page {page} is free; only an allocated page can be shared")
        self._refs[page] += 1

    def release(self, page: int) -> None:
        """Drop one holder; the page returns to the free list with its last holder."""
        if self._refs[page] < 1:
            raise ValueError(f"page {page} released more often than it was held")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)

    # ------------------------------------------------------------------ data
    def write(self, table: list[int], layer: int, kind: str, first: int, rows: QuantizedRows) -> None:
        """Write packed rows ``rows.* [1, Hk, n, X]`` as history entries ``[first, first + n)`` of the request whose
        block table is ``table`` (the pages must be allocated already): one indexed write per tensor, whatever
        the number of pages (a 32K-token prompt spans 128 pages of 256)."""
        n, p = rows.codes.shape[2], self.page_size
        if n == 0:
            return
        j = torch.arange(first, first + n, device=self.codes.device)
        pages = torch.tensor(table[first // p : (first + n - 1) // p + 1], dtype=torch.long, device=j.device)
        self.write_entries(pages[j // p - first // p], j % p, layer, kind,
                           QuantizedRows(*(t[0].transpose(0, 1)[:, :, None] for t in rows)))

    def write_entries(self, pages: torch.Tensor, offsets: torch.Tensor, layer: int, kind: str,
                      rows: QuantizedRows) -> None:
        """One entry per row of ``rows.* [n, Hk, 1, X]``: row ``i`` at offset ``offsets[i]`` of page ``pages[i]``
        (long ``[n]`` device tensors: one write for many requests, no host synchronization)."""
        for dst, src in zip(self.rows(layer, kind), rows):
            dst[pages, :, offsets] = src[:, :, 0]

    def rows(self, layer: int, kind: str) -> QuantizedRows:
        """One layer's keys or values of every page, ``[num_pages, Hk, P, X]`` strided views (what the paged kernel
        and :func:`~oscar_hf.kernels.paged_decode.gather_pages` read)."""
        kv = KINDS[kind]
        return QuantizedRows(self.codes[:, layer, kv], self.scale[:, layer, kv], self.zero[:, layer, kv])

    def gather(self, pages: torch.Tensor, layer: int, kind: str, n: int) -> QuantizedRows:
        """The first ``n`` entries of the pages ``pages [np]`` (long, in block-table order) as packed rows
        ``[1, Hk, n, X]``: a copy of INT2 codes and metadata only, never a full-precision history."""
        return gather_pages(self.rows(layer, kind), pages, n)
