"""The sink + ring window of the OSCAR layer and the serving store, and the writes that move its slots into the
history, addressed by :class:`RowsHistory` or :class:`PagedHistory`: one layout and write path for both. Layout:
docs/kernels.md §1, docs/cache.md ("The compiled layer"), docs/serving.md §3 ("Windows").
"""
from __future__ import annotations

import torch

from ..config import OscarConfig
from ..quant import QuantizedRows
from .params import LayerParams


def ring_entries(slots: torch.Tensor, sink: int, ring: int) -> torch.Tensor:
    """The window entries of ``slots`` (any shape, long) in a ring of ``ring`` entries after a sink of ``sink``."""
    return sink + torch.remainder(slots, ring)


def ring_slots(length: torch.Tensor, ring: int) -> torch.Tensor:
    """``[..., R]``: the slot each entry of a ring of ``R`` holds (slot ``s`` at entry ``s % R``) once slots
    ``[0, length)`` are written (may be < 0); ``length`` 0-d or ``[B, 1]``."""
    q = torch.arange(ring, device=length.device)
    return (length - 1) - torch.remainder(length - 1 - q, ring)


def window_mask(length: torch.Tensor, pad, sink: int, ring: int, recent: int) -> torch.Tensor:
    """``[B, S0 + R]`` bool: which window entries hold a row's sink tokens or one of the last ``recent`` of its
    ``length`` slots. ``length``: 0-d or ``[B]``; ``pad``: ``[B]`` or 0."""
    length = length.reshape(-1, 1)
    pad = pad.reshape(-1, 1) if isinstance(pad, torch.Tensor) else pad
    sink_ok = torch.arange(sink, device=length.device)[None, :] < (length - pad).clamp(0, sink)
    slot = ring_slots(length, ring)
    ring_ok = (slot >= pad + sink) & (slot >= length - recent)
    return torch.cat([sink_ok, ring_ok], 1)


def sink_from(sink: torch.Tensor, src: torch.Tensor, pad, first: int) -> torch.Tensor:
    """``sink [B', Hk, S0, D]`` with the entries whose slot ``pad + j`` is one of ``src [B', Hk, n, D]``'s slots
    ``[first, first + n)`` taken from there, per row (``pad``: ``[B']`` or an int)."""
    b, hk, s0, d = sink.shape
    n = src.shape[2]
    if n == 0 or s0 == 0:
        return sink
    slot = torch.as_tensor(pad, device=src.device).reshape(-1, 1) + torch.arange(s0, device=src.device)[None, :]
    sel = ((slot >= first) & (slot < first + n))[:, None, :, None]  # [B' or 1, 1, S0, 1]
    idx = (slot - first).clamp(0, n - 1)[:, None, :, None].expand(b, hk, s0, d)
    return torch.where(sel, src.gather(2, idx), sink)


class RowsHistory:
    """History entries as rows of per-layer buffers (the OSCAR layer): entry ``j`` at index ``j`` of every row.
    ``int2_k/v``: :class:`QuantizedRows` ``[B, H2, N, *]``; ``coded_k/v``: tuples of ``[B, P, N, *]`` or None."""

    def __init__(self, int2_k: QuantizedRows, int2_v: QuantizedRows, coded_k: tuple | None, coded_v: tuple | None):
        self.parts = {"k": (coded_k, int2_k), "v": (coded_v, int2_v)}

    def write(self, kind: str, first: int, coded: tuple | None, int2: QuantizedRows | None) -> None:
        for dst, src in zip(self.parts[kind], (coded, int2)):
            if src is not None:
                for d, s in zip(dst, src, strict=True):
                    d[:, :, first : first + s.shape[2]] = s


class PagedHistory:
    """History entries in one request's pages: entry ``j`` at offset ``j % page_size`` of page
    ``table[j // page_size]`` of ``pool``; the caller allocates the pages first."""

    def __init__(self, pool, table: list[int], layer: int):
        self.pool, self.table, self.layer = pool, table, layer

    def write(self, kind: str, first: int, coded: tuple | None, int2: QuantizedRows | None) -> None:
        if coded is not None:
            self.pool.write_coded(self.table, self.layer, kind, first, coded)
        if int2 is not None:
            self.pool.write(self.table, self.layer, kind, first, int2)


def demote(win_k: torch.Tensor, win_v: torch.Tensor, history, params: LayerParams, config: OscarConfig, a: int, b: int,
           t_old: int, new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None,
           mu_k: torch.Tensor | None = None) -> None:
    """Encode slots ``[a, b)`` (``>= S0``) into history entries ``[a - S0, b - S0)``: slots ``< t_old`` from the
    ring of ``win_k/v [B', Hk, S0 + R, D]``, the others from ``new_k/v [B', Hk, L, D]``, ``prefill_chunk`` at a time.
    ``mu_k``: a per-sequence key offset ``[B', H2, D]``, else None."""
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
    """Slot ``t - 1 - W``, which the last decode step kept in its window, into the history (idempotent)."""
    s0, w = config.sink, config.recent
    demote(win_k, win_v, history, params, config, max(s0, t - w - 1), t - w, t, mu_k=mu_k)


def commit(win_k: torch.Tensor, win_v: torch.Tensor, pad, history, params: LayerParams, config: OscarConfig,
           t_old: int, new_k: torch.Tensor, new_v: torch.Tensor, mu_k: torch.Tensor | None = None,
           floor: int = 0) -> None:
    """Store a multi-token forward's rows ``new_k/v [B', Hk, L, D]`` (slots ``[t_old, t_old + L)``): the history up
    to ``t_old + L - W`` (from ``floor``: below it, a shared prefix's pages), the sink entries, the ring."""
    s0, w, dev = config.sink, config.recent, new_k.device
    ring = win_k.shape[2] - s0
    t_new = t_old + new_k.shape[2]
    # 1. history: slots [max(T - W, S0), T + L - W), from the ring (< T) or the new rows (>= T)
    demote(win_k, win_v, history, params, config, max(t_old - w, s0, floor), t_new - w, t_old, new_k, new_v, mu_k)
    # 2. sink: the entries whose slot is among the new rows, per row (none past the sink without padding: a chunk)
    if not (isinstance(pad, int) and pad + s0 <= t_old):
        for win, new in ((win_k, new_k), (win_v, new_v)):
            win[:, :, :s0] = sink_from(win[:, :, :s0], new, pad, t_old)
    # 3. ring: the last R slots
    first = max(t_old, t_new - ring)
    entries = ring_entries(torch.arange(first, t_new, device=dev), s0, ring)
    win_k.index_copy_(2, entries, new_k[:, :, first - t_old :])
    win_v.index_copy_(2, entries, new_v[:, :, first - t_old :])
