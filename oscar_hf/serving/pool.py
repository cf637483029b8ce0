"""`PagedInt2Pool`: the history pages every request of a server shares, each form (INT2 codes, scale, zero, the
3-bit keys' high bits, the values' metadata at a group of their own, the retrieval heads' coded parts) on one flat
head axis, and the trash page where the decode rows that demote nothing write. Shapes and page addressing:
docs/serving.md §3, "Pool" and "Per request".
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from oscar_hf.kernels.paged_decode import gather_rows
from oscar_hf.kernels.write_path import scatter_entries

from ..cache import heads
from ..quant import SUPPORTED_META_DTYPES, QuantizedRows, QuantizedRows3, check_code_bits, check_group_size

KINDS = {"k": 0, "v": 1}
IDS_KEPT = 256  # PagedInt2Pool.kept's recent answers kept (a step's layers ask for the same block table)


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """A pool's heads per layer in each form (default: all in INT2, none coded), the coded rows' form, and the INT2
    rows' (``OscarConfig.key_bits``; ``value_group``: the values' group, None: the keys')."""

    int2_heads: Sequence[int] | None = None
    coded_heads: Sequence[int] | None = None
    coded_bits: int = 8
    coded_dtype: torch.dtype = torch.bfloat16
    key_bits: int = 2
    value_group: int | None = None

    def values_group(self, group_size: int) -> int:
        """The values' group size: their own, else the keys' ``group_size``."""
        return self.value_group or group_size


def page_bytes(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, group_size: int,
               meta_dtype: torch.dtype, layout: HeadLayout = HeadLayout()) -> int:
    """Bytes of one page, keys and values: INT2 rows (D/4 code bytes, D/G scales and zeros; 3-bit keys D/8 more) and
    coded rows."""
    int2 = num_layers * num_kv_heads if layout.int2_heads is None else sum(layout.int2_heads)
    meta = 2 * meta_dtype.itemsize
    rows = (2 * (head_dim // 4) + meta * (head_dim // group_size + head_dim // layout.values_group(group_size))
            + (head_dim // 8 if layout.key_bits == 3 else 0))  # a key's and a value's bytes
    coded = sum(layout.coded_heads or ()) * heads.row_bytes(layout.coded_bits, head_dim, layout.coded_dtype)
    return page_size * (int2 * rows + 2 * coded)


def _views(storage: torch.Tensor, specs: list[tuple[tuple, torch.dtype]]) -> list[torch.Tensor]:
    """One tensor per ``(shape, dtype)``, consecutive views of flat ``uint8`` ``storage``, widest dtype first."""
    if storage.dtype != torch.uint8 or storage.dim() != 1:
        raise ValueError(f"pool storage must be a flat uint8 tensor, got {storage.dtype} {tuple(storage.shape)}")
    need = sum(torch.Size(shape).numel() * dt.itemsize for shape, dt in specs)
    if storage.numel() < need:
        raise ValueError(f"pool storage holds {storage.numel()} bytes, the pages need {need}")
    if storage.data_ptr() % max(dt.itemsize for _, dt in specs):
        raise ValueError("pool storage is not aligned for the metadata dtype")
    out: list[torch.Tensor | None] = [None] * len(specs)
    pos = 0
    for i in sorted(range(len(specs)), key=lambda i: -specs[i][1].itemsize):  # stable: widest first
        shape, dt = specs[i]
        n = torch.Size(shape).numel() * dt.itemsize
        out[i] = storage[pos : pos + n].view(dt).view(shape)
        pos += n
    return out


class PoolExhausted(RuntimeError):
    """No free page is left: the scheduler admitted more history than the pool holds."""


class PagedInt2Pool:
    """Fixed-size pool of history pages (layout: the module docstring)."""

    def __init__(self, num_pages: int, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                 group_size: int, meta_dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 storage: torch.Tensor | None = None, *, layout: HeadLayout = HeadLayout(), trash_page: bool = False):
        if num_pages < 1 or num_layers < 1 or num_kv_heads < 1 or page_size < 1:
            raise ValueError(f"PagedInt2Pool needs positive sizes, got num_pages={num_pages}, num_layers={num_layers}, "
                             f"num_kv_heads={num_kv_heads}, page_size={page_size}")
        check_group_size(head_dim, group_size)
        check_code_bits(layout.key_bits, head_dim, name="key_bits")
        value_group = layout.values_group(group_size)
        check_group_size(head_dim, value_group)
        if meta_dtype not in SUPPORTED_META_DTYPES:
            raise ValueError(f"meta_dtype must be one of {SUPPORTED_META_DTYPES}, got {meta_dtype}")
        int2_heads = tuple(map(int, [num_kv_heads] * num_layers if layout.int2_heads is None else layout.int2_heads))
        coded_heads = tuple(map(int, [0] * num_layers if layout.coded_heads is None else layout.coded_heads))
        if (len(int2_heads) != num_layers or len(coded_heads) != num_layers
                or any(a < 0 or b < 0 or a + b > num_kv_heads for a, b in zip(int2_heads, coded_heads))):
            raise ValueError(f"int2_heads {int2_heads} / coded_heads {coded_heads}: one count per layer "
                             f"({num_layers}), at most {num_kv_heads} heads a layer")
        self.num_pages, self.num_layers, self.page_size = num_pages, num_layers, page_size
        self.num_kv_heads, self.head_dim, self.group_size = num_kv_heads, head_dim, group_size
        self.int2_heads, self.coded_heads = int2_heads, coded_heads
        self.layout = dataclasses.replace(layout, int2_heads=int2_heads, coded_heads=coded_heads)
        # first row of layer l's keys on each flat head axis (its values follow); on a one-kind axis, its first row
        self._int2_at = [2 * sum(int2_heads[:l]) for l in range(num_layers)]
        self._half_at = [sum(int2_heads[:l]) for l in range(num_layers)]
        self._coded_at = [2 * sum(coded_heads[:l]) for l in range(num_layers)]
        # the trash page: index num_pages, never allocated
        self.trash_page = num_pages if trash_page else None
        rows = num_pages + int(trash_page)
        h_int2, own = sum(int2_heads), value_group != group_size
        lead, half = (rows, 2 * h_int2, page_size), (rows, h_int2, page_size)  # both kinds' heads / one kind's
        # codes of both kinds; scale and zero of both, or the keys' then (own) the values' at their group
        specs = [((*lead, head_dim // 4), torch.uint8)] + [((*(half if own else lead), head_dim // group_size),
                                                             meta_dtype)] * 2
        specs += [((*half, head_dim // value_group), meta_dtype)] * 2 if own else []
        specs += [((*half, head_dim // 8), torch.uint8)] if layout.key_bits == 3 else []  # the keys' high bits
        if sum(coded_heads):
            specs += [((rows, 2 * sum(coded_heads), page_size, last), dt)
                      for last, dt in heads.part_specs(layout.coded_bits, head_dim, layout.coded_dtype)]
        self._set_tensors([torch.zeros(shape, dtype=dt, device=device) for shape, dt in specs] if storage is None
                          else _views(storage, specs))
        # LIFO free list: a page freed by a leaving request is the next one handed out (warm in cache)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._refs = [0] * num_pages
        # pages no request holds, kept for a prefix index (page -> its link), least recently released first; free to
        # allocate(), which evicts the first (calling evicted(link)) when no other page is
        self.retained: dict[int, int] = {}
        self.evicted = lambda link: None
        self.peak_used = 0  # most pages held at once since construction
        self.released = False  # release_storage() gave the tensors back
        self._kept: dict[tuple, torch.Tensor] = {}  # kept(): its last IDS_KEPT answers

    def _set_tensors(self, tensors) -> None:
        """The page tensors, in the order of the layout's specs: codes, scale, zero (own value groups: the keys'),
        the values' scale and zero, the keys' high bits, then the coded parts."""
        own, hi = self.layout.values_group(self.group_size) != self.group_size, self.layout.key_bits == 3
        n_int2 = 3 + 2 * own + hi
        self.tensors = tuple(tensors)  # every page tensor (copies, bytes)
        self.int2 = QuantizedRows(*self.tensors[:3])  # the flat INT2 tensors (own value groups: the keys' metadata)
        self.value_meta = self.tensors[3:5] if own else ()  # the values' scale and zero at their own group
        self.key_hi = self.tensors[n_int2 - 1] if hi else None  # [rows, H, P, D/8]
        self.coded = self.tensors[n_int2:]  # the flat coded parts (empty without retrieval heads)
        if all(h == self.num_kv_heads for h in self.int2_heads) and not own:  # [rows, layers, 2, Hk, P, X] views
            self.codes, self.scale, self.zero = (t.view(t.shape[0], self.num_layers, 2, self.num_kv_heads,
                                                        *t.shape[2:]) for t in self.int2)
        else:
            self.codes, self.scale, self.zero = self.int2

    def map_tensors(self, fn) -> None:
        """Every page tensor replaced by ``fn(t)`` (a copy, another device), the layout kept."""
        self._set_tensors([fn(t) for t in self.tensors])

    def kept(self, key: tuple, make) -> torch.Tensor:
        """``make()`` on the pool's device, the last ``IDS_KEPT`` answers kept by ``key`` (callers only read them): the
        tensors every layer of a forward asks for alike (block tables, window entries, masks) are made once, not one
        launch or copy a layer."""
        t = self._kept.get(key)
        if t is None:
            t = make(self.int2.codes.device)
            if len(self._kept) >= IDS_KEPT:
                del self._kept[next(iter(self._kept))]
            self._kept[key] = t
        return t

    def ids(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """``values`` as a ``dtype`` tensor on the pool's device (:meth:`kept`); through an asynchronous pinned copy
        (``torch.tensor(list, device=cuda)`` synchronizes the stream)."""
        def make(dev):
            t = torch.tensor(values, dtype=dtype)
            return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)

        return self.kept(("ids", tuple(values), dtype), make)

    def release_storage(self) -> None:
        """Give the page tensors back (only while no page is held); the accounting stays readable."""
        if self.num_used:
            raise RuntimeError(f"{self.num_used} pages are still held")
        self.map_tensors(lambda t: t.new_empty((0, *t.shape[1:])))
        self._kept.clear()
        self.released = True

    # ------------------------------------------------------------------ accounting
    @property
    def num_free(self) -> int:
        """Pages :meth:`allocate` can hand out: free and retained."""
        return len(self._free) + len(self.retained)

    @property
    def num_used(self) -> int:
        """Pages live requests hold."""
        return self.num_pages - self.num_free

    @property
    def num_shared(self) -> int:
        """Pages held by more than one request (prefix sharing, forks): each stored once."""
        return sum(r > 1 for r in self._refs)

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page: INT2 rows and coded rows."""
        return page_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size, self.group_size,
                          self.int2.scale.dtype, self.layout)

    @property
    def coded_bytes_per_page(self) -> int:
        """The retrieval heads' share of :attr:`bytes_per_page`."""
        return self.bytes_per_page - page_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size,
                                                self.group_size, self.int2.scale.dtype, dataclasses.replace(
                                                    self.layout, coded_heads=None))

    @property
    def nbytes(self) -> int:
        """Bytes of the page tensors (the trash page included)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    # ------------------------------------------------------------------ allocation
    def allocate(self) -> int:
        """A free page id, now held once."""
        if self.released:
            raise RuntimeError("this page pool gave its memory back (its continuous-batching manager stopped)")
        if not self._free:
            self.evict()
        page = self._free.pop()
        self._refs[page] = 1
        self.peak_used = max(self.peak_used, self.num_used)
        return page

    def evict(self) -> None:
        """Free the least recently released retained page (of a chain of pages, the last: :meth:`release` order)."""
        if not self.retained:
            raise PoolExhausted(f"OSCAR INT2 page pool exhausted ({self.num_pages} pages of {self.page_size} tokens): "
                                "size it for the scheduler's capacity (num_pages / memory budget)")
        page = next(iter(self.retained))
        self._free.append(page)
        self.evicted(self.retained.pop(page))

    def acquire(self, page: int) -> None:
        """One more holder of an allocated or retained page (prefix sharing)."""
        if self._refs[page] < 1 and self.retained.pop(page, None) is None:
            raise ValueError(f"page {page} is free; only an allocated page can be shared")
        self._refs[page] += 1

    def release(self, page: int, link: int | None = None) -> bool:
        """Drop one holder; with its last holder the page returns to the free list, or is retained under ``link`` (a
        prefix index's): whether it was."""
        if self._refs[page] < 1:
            raise ValueError(f"page {page} released more often than it was held")
        self._refs[page] -= 1
        kept = not self._refs[page] and link is not None
        if kept:
            self.retained[page] = link
        elif not self._refs[page]:
            self._free.append(page)
        return kept

    # ------------------------------------------------------------------ data
    def copy_page(self, source: int, dest: int) -> None:
        """Page ``dest`` becomes a copy of page ``source`` (every layer, every form: a fork's pages still written)."""
        for t in self.tensors:
            t[dest] = t[source]

    def rows(self, layer: int, kind: str) -> QuantizedRows | QuantizedRows3:
        """One layer's INT2 keys or values of every page, ``[num_pages, Hq_l, P, X]`` strided views (3-bit keys:
        :class:`QuantizedRows3`)."""
        n = self.int2_heads[layer]
        a, h = self._int2_at[layer] + KINDS[kind] * n, self._half_at[layer]
        codes = self.int2.codes[:, a : a + n]
        if not self.value_meta:  # (one metadata axis for both kinds)
            meta = (self.int2.scale[:, a : a + n], self.int2.zero[:, a : a + n])
        else:
            meta = tuple(t[:, h : h + n] for t in (self.int2[1:] if kind == "k" else self.value_meta))
        if kind == "k" and self.key_hi is not None:
            return QuantizedRows3(codes, *meta, self.key_hi[:, h : h + n])
        return QuantizedRows(codes, *meta)

    def coded_rows(self, layer: int, kind: str) -> tuple[torch.Tensor, ...]:
        """One layer's coded keys or values of every page, ``[num_pages, F_l, P, *]`` views per ``heads.part_specs``."""
        a = self._coded_at[layer] + KINDS[kind] * self.coded_heads[layer]
        return tuple(t[:, a : a + self.coded_heads[layer]] for t in self.coded)

    def write(self, table: list[int], layer: int, kind: str, first: int, rows: QuantizedRows | QuantizedRows3
              ) -> None:
        """Write packed rows ``rows.* [1, Hq_l, n, X]`` (the form :meth:`rows` holds) as history entries
        ``[first, first + n)`` of the (allocated) pages of ``table``: one indexed write per tensor, however many
        pages."""
        dst = self.rows(layer, kind)
        if type(rows) is not type(dst):  # (3-bit keys: the high bits' plane too)
            raise ValueError(f"the pool holds {kind} rows as {type(dst).__name__} ({dst.bits}-bit codes), got "
                             f"{type(rows).__name__}")
        self._write(dst, table, first, rows)

    def write_coded(self, table: list[int], layer: int, kind: str, first: int, parts: tuple) -> None:
        """:meth:`write` for the retrieval heads' coded rows ``parts [1, F_l, n, *]`` (``quant.encode_heads``)."""
        self._write(self.coded_rows(layer, kind), table, first, parts)

    def _write(self, dst: tuple, table: list[int], first: int, src: tuple) -> None:
        n, p = src[0].shape[2], self.page_size
        if n == 0:
            return
        span = table[first // p : (first + n - 1) // p + 1]  # the pages entries [first, first + n) fall in

        def make(dev):  # [2, n]: each entry's page and offset (made once a forward: K and V, every layer alike)
            j = torch.arange(first % p, first % p + n, device=dev)
            return torch.stack([self.ids(span, torch.long)[j // p], j % p])

        where = self.kept(("write", tuple(span), first % p, n), make)
        scatter_entries(dst, where[0], where[1], tuple(t[0].transpose(0, 1)[:, :, None] for t in src))

    def gather(self, pages: torch.Tensor, layer: int, kind: str, n: int) -> QuantizedRows | QuantizedRows3:
        """The first ``n`` INT2 entries of ``pages [np]`` (block-table order) as packed rows ``[1, Hq_l, n, X]``."""
        return gather_rows(self.rows(layer, kind), pages[None], n)

    def gather_coded(self, page_ids: torch.Tensor, layer: int, kind: str, n: int) -> tuple[torch.Tensor, ...]:
        """The first ``n`` coded entries of each row of ``page_ids [B, np]``, ``[B, F_l, n, *]`` per part (entries
        past a row's history are garbage the reader masks)."""
        return gather_rows(self.coded_rows(layer, kind), page_ids, n)
