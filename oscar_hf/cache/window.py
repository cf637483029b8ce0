"""The sink + ring window of the device-side storages and the writes that move its slots into the history: one
layout and one write path for the compiled layer (:class:`~oscar_hf.cache.compiled.CompiledOscarLayer`) and the
serving store (:class:`~oscar_hf.serving.store.OscarPagedStore`), which differ only in what they pass in.

A window (``S0 = sink``, ``W = recent``, ``R`` ring entries, ``R >= W + 1``) is ``[B', Hk, S0 + R, D]`` in the model
dtype, one per row (a batch row of the compiled layer; one request of the store, ``B' = 1``, a view of its slot):

* entries ``[0, S0)``: the sink, the row's first ``S0`` real tokens, slot ``pad + j`` at entry ``j``; ``pad`` is
  a ``[B']`` tensor (the compiled layer's left-padded rows) or 0 (the store: one unpadded request a window);
* entries ``[S0, S0 + R)``: a ring, slot ``s`` at entry ``S0 + s % R`` (:func:`ring_entries`). A read takes the
  last ``W`` (+ the new token) of them; the compiled layer keeps more (``crop`` undoes tokens exactly).

The history holds slot ``s >= S0`` at entry ``s - S0``, every head of it in one of two forms
(:meth:`~oscar_hf.cache.params.LayerParams.encode_history`): the INT2 heads rotated and quantized, the retrieval heads
coded. Where an entry lives is the storage's, told by a *history addressing* with one method,
``write(kind, first, coded, int2)`` (both forms of entries ``[first, first + n)``, either None when the layer has
no such head): :class:`RowsHistory` (the compiled layer's buffers, entry ``j`` at index ``j`` of every batch row)
or :class:`PagedHistory` (a request's pages through its block table).

Writes: :func:`demote` (slots ``[a, b)`` into the history, from the ring or the new rows; :func:`demote_pending`
the slot the last decode step left in the window) and :func:`commit` (a multi-token forward's new rows: demotion,
sink, ring). A decode step's one-token write is each storage's own (the compiled layer's a fused kernel under CUDA
graphs, the store's batched over requests).
"""
from __future__ import annotations

import torch

from ..config import OscarConfig
from ..quant import QuantizedRows
from .params import LayerParams


# ------------------------------------------------------------------ layout
def ring_entries(slots: torch.Tensor, sink: int, ring: int) -> torch.Tensor:
    """The window entries of ``slots`` (any shape, long) in a ring of ``ring`` entries after a sink of ``sink``."""
    return sink + torch.remainder(slots, ring)


def ring_slots(length: torch.Tensor, ring: int) -> torch.Tensor:
    """``[..., R]``: the slot each entry of a ring of ``R`` holds (slot ``s`` at entry ``s % R``) once slots
    ``[0, length)`` are written (may be < 0); ``length`` 0-d or ``[B, 1]``."""
    q = torch.arange(ring, device=length.device)
    return (length - 1) - torch.remainder(length - 1 - q, ring)


def window_mask(length: torch.Tensor, pad, sink: int, ring: int, recent: int) -> torch.Tensor:
    """``[B, S0 + R]`` bool: which entries of a sink + ring window (``[:S0]`` a row's first real tokens, ``[S0:]`` a
    ring of ``R``) hold a row's sink tokens or one of the last ``recent`` of its ``length`` slots; ring entries of a
    row's sink or padding are masked. ``length``: 0-d (every row) or ``[B]``; ``pad``: ``[B]`` (each row's first real
    slot) or 0. The compiled storage's rows share a length and differ in padding; the paged store's the reverse."""
    length = length.reshape(-1, 1)
    pad = pad.reshape(-1, 1) if isinstance(pad, torch.Tensor) else pad
    sink_ok = torch.arange(sink, device=length.device)[None, :] < (length - pad).clamp(0, sink)
    slot = ring_slots(length, ring)
    ring_ok = (slot >= pad + sink) & (slot >= length - recent)
    return torch.cat([sink_ok, ring_ok], 1)


# ------------------------------------------------------------------ history addressings
class RowsHistory:
    """History entries as rows of per-layer buffers (the compiled layer): entry ``j`` at index ``j`` of every batch
    row. ``int2_k/v``: :class:`QuantizedRows` ``[B, H2, N, *]``; ``coded_k/v``: tuples of ``[B, P, N, *]``
    (:mod:`oscar_hf.cache.heads`), None without retrieval heads."""

    def __init__(self, int2_k: QuantizedRows, int2_v: QuantizedRows, coded_k: tuple | None, coded_v: tuple | None):
        self.parts = {"k": (coded_k, int2_k), "v": (coded_v, int2_v)}

    def write(self, kind: str, first: int, coded: tuple | None, int2: QuantizedRows | None) -> None:
        for dst, src in zip(self.parts[kind], (coded, int2)):
            if src is not None:
                for d, s in zip(dst, src, strict=True):
                    d[:, :, first : first + s.shape[2]] = s


class PagedHistory:
    """History entries in one request's pages (the serving store): entry ``j`` of layer ``layer`` at offset
    ``j % page_size`` of page ``table[j // page_size]`` of ``pool`` (a
    :class:`~oscar_hf.serving.pool.PagedInt2Pool`); the caller allocates the pages first."""

    def __init__(self, pool, table: list[int], layer: int):
        self.pool, self.table, self.layer = pool, table, layer

    def write(self, kind: str, first: int, coded: tuple | None, int2: QuantizedRows | None) -> None:
        if coded is not None:
            self.pool.write_coded(self.table, self.layer, kind, first, coded)
        if int2 is not None:
            self.pool.write(self.table, self.layer, kind, first, int2)


# ------------------------------------------------------------------ writes
def demote(win_k: torch.Tensor, win_v: torch.Tensor, history, params: LayerParams, config: OscarConfig, a: int, b: int,
           t_old: int, new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None,
           mu_k: torch.Tensor | None = None) -> None:
    """Quantize slots ``[a, b)`` (``>= S0``) into history entries ``[a - S0, b - S0)`` of ``history``, both forms:
    slots ``< t_old`` from the ring of ``win_k/v [B', Hk, S0 + R, D]``, the others from the new rows ``new_k/v
    [B', Hk, L, D]`` (slot ``t_old + i`` at row ``i``), ``prefill_chunk`` slots at a time (a long prompt is never
    encoded whole). ``mu_k``: a per-sequence key offset ``[B', H2, D]`` (``key_offset="prefill"``), else None."""
    s0 = config.sink
    ring = win_k.shape[2] - s0
    for c0 in range(a, b, config.prefill_chunk):
        c1 = min(b, c0 + config.prefill_chunk)
        old = ring_entries(torch.arange(c0, max(c0, min(c1, t_old)), device=win_k.device), s0, ring)
        for kind, win, new in (("k", win_k, new_k), ("v", win_v, new_v)):
            x = win.index_select(2, old)  # [B', Hk, n, D]
            if c1 > t_old:
                x = torch.cat([x, new[:, :, max(c0, t_old) - t_old : c1 - t_old]], 2)
            history.write(kind, c0 - s0, *params.encode_history(x, kind, config, mu_k))


def demote_pending(win_k: torch.Tensor, win_v: torch.Tensor, history, params: LayerParams, config: OscarConfig,
                   t: int, mu_k: torch.Tensor | None = None) -> None:
    """After decode steps (``t`` tokens stored), slot ``t - 1 - W`` into the history: a step at ``T`` demotes slot
    ``T - 1 - W`` and keeps slot ``T - W`` in its window, so a multi-token read (or a save) of the history up to
    ``t - W`` demotes it first (rewriting the same entry when a multi-token write already did)."""
    s0, w = config.sink, config.recent
    demote(win_k, win_v, history, params, config, max(s0, t - w - 1), t - w, t, mu_k=mu_k)


def commit(win_k: torch.Tensor, win_v: torch.Tensor, pad, history, params: LayerParams, config: OscarConfig,
           t_old: int, new_k: torch.Tensor, new_v: torch.Tensor, mu_k: torch.Tensor | None = None,
           floor: int = 0) -> None:
    """Store a multi-token forward's rows ``new_k/v [B', Hk, L, D]`` (slots ``[T, T + L)``, ``T = t_old``): the
    history up to ``T + L - W`` (:func:`demote`; from ``floor`` up: slots below it are in the history already, a
    shared prefix's pages), the sink entries among them (row ``b``'s real token ``j`` at slot ``pad[b] + j``; ``pad``
    ``[B']`` or 0) and the last ``R`` slots in the ring. ``win_k/v [B', Hk, S0 + R, D]``."""
    s0, w, dev = config.sink, config.recent, new_k.device
    ring = win_k.shape[2] - s0
    b, hk, n_new, d = new_k.shape
    t_new = t_old + n_new
    # 1. history: slots [max(T - W, S0), T + L - W), from the ring (< T) or the new rows (>= T)
    demote(win_k, win_v, history, params, config, max(t_old - w, s0, floor), t_new - w, t_old, new_k, new_v, mu_k)
    # 2. sink: the entries whose slot is among the new rows, per row (none past the sink without padding: a chunk)
    if not (isinstance(pad, int) and pad + s0 <= t_old):
        slot = torch.as_tensor(pad, device=dev).reshape(-1, 1) + torch.arange(s0, device=dev)[None, :]  # [B' or 1, S0]
        sel = ((slot >= t_old) & (slot < t_new))[:, None, :, None]
        idx = (slot - t_old).clamp(0, n_new - 1)[:, None, :, None].expand(b, hk, s0, d)
        for win, new in ((win_k, new_k), (win_v, new_v)):
            win[:, :, :s0] = torch.where(sel, new.gather(2, idx), win[:, :, :s0])
    # 3. ring: the last R slots
    first = max(t_old, t_new - ring)
    entries = ring_entries(torch.arange(first, t_new, device=dev), s0, ring)
    win_k.index_copy_(2, entries, new_k[:, :, first - t_old :])
    win_v.index_copy_(2, entries, new_v[:, :, first - t_old :])
