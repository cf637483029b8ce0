"""The KV as the kernels take it: frozen bundles that the one read (:func:`~oscar_hf.kernels.decode.decode`) and the
one write (:func:`~oscar_hf.kernels.write_path.append`) take from every storage (docs/kernels.md §2.1, §3). ``B`` rows,
``Hk`` KV heads (``H2`` INT2, ``P`` retrieval), ``M`` query rows a KV head, ``D`` head_dim, ``W`` window, ``N`` history.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from oscar_hf.quant import QuantizedRows


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """A layer's split of its KV heads into INT2 heads and retrieval heads: ``int2_idx [H2]`` / ``coded_idx [P]``
    (long, ascending KV heads), ``coded_of [Hk]`` each KV head's index among the retrieval heads or -1, ``bits`` their
    storage (16, 8 or 4)."""

    int2_idx: torch.Tensor
    coded_idx: torch.Tensor
    coded_of: torch.Tensor
    bits: int


@dataclasses.dataclass(frozen=True)
class KVParams:
    """A layer's parameters: the INT2 heads' rotations ``r_k/r_v [H2, D, D]`` (float32), offsets ``mu_k`` (None,
    ``[H2, D]`` or ``[B, H2, D]``) / ``mu_v`` (None or ``[H2, D]``), the quantizer's settings, the references' block of
    history entries; ``hist_of [Hk]`` each KV head's INT2 index or -1 (None: all INT2), ``heads`` (None: no
    retrieval heads)."""

    r_k: torch.Tensor
    mu_k: torch.Tensor | None
    r_v: torch.Tensor
    mu_v: torch.Tensor | None
    group_size: int
    clip_k: float = 1.0
    clip_v: float = 1.0
    meta_dtype: torch.dtype = torch.bfloat16
    quantizer: str = "minmax"
    block_n: int = 1024
    hist_of: torch.Tensor | None = None
    heads: HeadSplit | None = None


@dataclasses.dataclass(frozen=True)
class Window:
    """The full-precision window (sink + ring, unrotated, model dtype): ``k/v [B, Hk, W, D]``, or a pool ``[slots, Hk,
    W, D]`` with ``slot [B]``; ``mask`` None, bool broadcastable to ``[B, Hk, M, W]`` (False: not a token), or ``[B,
    W]``; ``kv_heads`` None or ``[H2]`` long: the read's head ``h`` is KV head ``kv_heads[h]`` (read in place)."""

    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None
    slot: torch.Tensor | None = None
    kv_heads: torch.Tensor | None = None

    def rows(self) -> "Window":
        """The window of each row, ``[B, Hk, W, D]`` (gathered from the pool when ``slot`` is given)."""
        if self.slot is None:
            return self
        return Window(self.k.index_select(0, self.slot), self.v.index_select(0, self.slot), self.mask,
                      kv_heads=self.kv_heads)

    def heads(self, idx: torch.Tensor) -> "Window":
        """The window of the KV heads ``idx``, read in place (the kernels); :meth:`gathered` copies it out."""
        return dataclasses.replace(self, kv_heads=idx)

    def gathered(self) -> "Window":
        """The same window as plain ``[B, H2, W, D]`` tensors (the torch references' form): rows and heads copied."""
        w = self.rows()
        if w.kv_heads is None:
            return w
        return Window(w.k.index_select(1, w.kv_heads), w.v.index_select(1, w.kv_heads), w.mask)

    def mask_2d(self) -> torch.Tensor | None:
        """``[B, W]``: the mask of each row (the retrieval heads' read; a ``[B, W]`` mask as it is)."""
        return self.mask if self.mask is None or self.mask.dim() == 2 else self.mask[:, 0, 0]


@dataclasses.dataclass(frozen=True)
class Pages:
    """A paged history: row ``b``'s entry ``j`` is row ``j % P`` of page ``table[b, j // P]`` (``[B, max_pages]``
    int32, -1 past its pages), ``lengths [B]`` int32; ``max_len`` a host bound that sizes the grid (None: one sync)."""

    table: torch.Tensor
    lengths: torch.Tensor
    max_len: int | None = None


@dataclasses.dataclass(frozen=True)
class History:
    """The INT2 heads' history, ``k/v`` ``QuantizedRows [B, H2, N, *]`` (rotated and centered; with ``pages`` the
    pool's ``[num_pages, H2, P, *]``). Row ``b`` reads entries ``start[b] <= j`` that ``key_mask`` (bool
    ``[B, H2, M, N]``) allows, below ``n_valid`` (0-d device tensor; ``splits`` then fixes the grid). ``coded``: the
    retrieval heads' ``(k, v)`` parts ``[B, P, N, *]`` (:mod:`oscar_hf.cache.heads`), None without. 3-bit keys: ``k`` a
    :class:`~oscar_hf.quant.QuantizedRows3` (its ``hi`` plane; the write takes the key width from it)."""

    k: QuantizedRows
    v: QuantizedRows
    start: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    n_valid: torch.Tensor | None = None
    splits: int | None = None
    pages: Pages | None = None
    coded: tuple | None = None

    def cut(self) -> "History":
        """The same history with a CPU ``n_valid`` applied on the host (the torch references read only the filled
        part)."""
        if self.n_valid is None or self.n_valid.device.type != "cpu" or torch.compiler.is_compiling():
            return self
        n = int(self.n_valid)
        k, v = (rows.map(lambda x: x[:, :, :n]) for rows in (self.k, self.v))
        return dataclasses.replace(self, k=k, v=v, n_valid=None)


class CodedPartials(NamedTuple):
    """The retrieval heads' split partials for a combine to merge (:func:`~oscar_hf.kernels.heads_triton.
    heads_partials`): ``m`` / ``l`` ``[B * P, S, M_PAD]`` (log2 units) and ``acc [B * P, S, M_PAD, D]`` float32 over
    their ``S`` history splits, window and sink; ``heads [P]`` the KV heads whose output rows they make."""

    pm: torch.Tensor
    pl: torch.Tensor
    acc: torch.Tensor
    heads: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Ring:
    """Where a one-token write of a contiguous storage goes (:func:`~oscar_hf.kernels.write_path.append`): ``length``
    (0-d int64 device tensor, ``T``), each row's left padding ``pad [B]``, ``sink`` (``S0``) and ``recent`` (``W``)."""

    length: torch.Tensor
    pad: torch.Tensor
    sink: int
    recent: int


@dataclasses.dataclass(frozen=True)
class PagedRows:
    """Where each of the ``Bp`` decode rows of a serving step reads and writes (``[Bp]`` int64 device tensors): the
    new token's position in the packed batch, window slot, ring and sink entries (``new_entry`` again without one),
    the ring entry leaving the window and its page / offset (the trash page for rows that demote nothing);
    ``demote`` / ``write_sink``: whether any row does (host bools)."""

    pos: torch.Tensor
    slots: torch.Tensor
    new_entry: torch.Tensor
    sink_entry: torch.Tensor
    demote_entry: torch.Tensor
    demote_page: torch.Tensor
    demote_off: torch.Tensor
    demote: bool = True
    write_sink: bool = True

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The seven ``[Bp]`` tensors in field order (the kernel's arguments)."""
        return (self.pos, self.slots, self.new_entry, self.sink_entry, self.demote_entry, self.demote_page,
                self.demote_off)
