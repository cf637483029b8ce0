"""Write path: rotate + center + clip + quantize + pack K/V rows into INT2 history storage, and the one-token write
(:func:`append`) of every storage. Torch references here; supported shapes on CUDA go to ``write_triton.py`` /
``append_triton.py``.
"""
from __future__ import annotations

import torch

from oscar_hf.quant import encode_heads, quantize_rows, rows_group_size

from .append_checks import check_append_inputs, check_paged_inputs
from .kv import History, KVParams, PagedRows, Ring, Window
from .plan import plain_fits, triton_enabled


def rotate_quantize_reference(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0, quantizer="minmax",
                              bits=2):
    """``x [B, Hk, T, D]`` (model dtype) -> ``QuantizedRows`` (``codes [B, Hk, T, D/4]`` uint8, ``scale`` / ``zero``
    ``[B, Hk, T, D/G]``, at 3 ``bits`` ``hi [B, Hk, T, D/8]``) of ``(x - mu) @ r`` (``r [Hk, D, D]`` float32, ``mu``
    None or ``[Hk, D]``), or written into ``out.*[:, :, out_offset : out_offset + T]``."""
    xf = x.float()
    if mu is not None:  # [Hk, D] (calibrated) or [B, Hk, D] (per sequence)
        xf = xf - (mu[None, :, None, :] if mu.dim() == 2 else mu[:, :, None, :])
    rows = torch.matmul(xf, r.unsqueeze(0))  # [B, Hk, T, D] @ [1, Hk, D, D]
    q = quantize_rows(rows, group_size, clip, meta_dtype, quantizer, bits)
    if out is None:
        return q
    t = x.shape[-2]
    for dst, src in zip(out, q, strict=True):
        dst[:, :, out_offset : out_offset + t].copy_(src)
    return out


def rotate_quantize(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0, use_kernels="auto",
                    quantizer="minmax", bits=2):
    """Dispatch: the Triton kernel on CUDA (when importable, allowed and the shape is supported; INT2 codes only),
    else the torch reference."""
    if bits == 2 and triton_enabled(x, use_kernels):
        from .write_triton import kernel_supported, rotate_quantize_triton
        if kernel_supported(x, group_size, clip, meta_dtype):
            return rotate_quantize_triton(x, r, mu, clip, group_size, meta_dtype, out=out, out_offset=out_offset,
                                          quantizer=quantizer)
    return rotate_quantize_reference(x, r, mu, clip, group_size, meta_dtype, out=out, out_offset=out_offset,
                                     quantizer=quantizer, bits=bits)


# ---------------------------------------------------------------------------------- one-token write step (static cache)


def _kv_head_of_hist(hist_heads, hq: int):
    """``[H2]`` int64: the KV head that history head ``hh`` stores (the inverse of ``hist_heads``, computed on the
    device: every history index is assumed to be the image of exactly one KV head), or None for the identity."""
    if hist_heads is None:
        return None
    hk = hist_heads.shape[0]
    inv = torch.zeros(hq + 1, dtype=torch.long, device=hist_heads.device)
    dst = torch.where(hist_heads >= 0, hist_heads, torch.full_like(hist_heads, hq))  # unquantized heads -> slot hq
    inv.scatter_(0, dst, torch.arange(hk, device=hist_heads.device))
    return inv[:hq]


def put_entries(at: Ring, ring: int) -> torch.Tensor:
    """``[B, 2]`` (``[B, 1]`` without a sink) int64: the window entries a decode step's new token goes to, per row:
    ring entry ``S0 + T % R`` and, for rows with ``0 <= T - pad[b] < S0``, sink entry ``T - pad[b]`` (else the ring
    entry again)."""
    s0, t = at.sink, at.length
    b = at.pad.shape[0]
    entry = (s0 + torch.remainder(t, ring)).reshape(1, 1).expand(b, 1)  # [B, 1]
    if s0 == 0:
        return entry
    j = (t - at.pad).reshape(b, 1)  # row b's real tokens before this one
    return torch.cat([entry, torch.where((j >= 0) & (j < s0), j, entry)], 1)


def ring_put(win: torch.Tensor, new: torch.Tensor, entries: torch.Tensor) -> None:
    """The new token's rows ``new [..., B, Hk, 1, D]`` into ``win [..., B, Hk, S0 + R, D]`` (any leading dimensions)
    at :func:`put_entries` ``[B, E]``, in place, one scatter (a row outside its sink writes its ring entry twice, the
    same value). (Traced by a compiled step, Inductor made it a copy of the whole window: 0.8 ms a step at B=32/32K
    on 18 layers, docs/kernels.md §2.1; the compiled layer puts with the write kernel instead.)"""
    *lead, b, hk, _, d = new.shape
    e = entries.shape[1]
    win.scatter_(-2, entries[:, None, :, None].expand(*lead, b, hk, e, d), new.expand(*lead, b, hk, e, d))


def demote_reference(params: KVParams, window: Window, history: History, at: Ring) -> None:
    """Slot ``T - W`` of a contiguous storage (``S0 = sink``, ``W = recent``, ``T = length``) from its ring entry into
    history index ``T - W - S0`` (coded for the retrieval heads), in place, tensor ops only (graph-capturable); a
    no-op where that slot is no history slot. Window ``[B, Hk, S0 + R, D]``: the sink, then a ring holding slot ``s``
    at entry ``S0 + s % R``. Step ``T`` reads slot ``T - W`` from its window and the history below it: this write
    touches nothing that step's read reads, nor the entry :func:`ring_put` writes (``R > W``), so it may run beside
    them (``WriteDefaults.beside_max_batch``, docs/kernels.md §2.1)."""
    ring, n, h2 = check_append_inputs(params, None, None, window, history, at)
    p, win_k, win_v, s0 = params, window.k, window.v, at.sink
    # written to a clamped index, masked to the old contents when slot s is no history slot
    s = at.length - at.recent
    e = s - s0
    ok = (e >= 0) & (e < n)
    src_entry = (s0 + torch.remainder(s, ring)).reshape(1)
    dst = e.clamp(0, max(n - 1, 0)).reshape(1)

    def write(stores, rows):
        for store, row in zip(stores, rows, strict=True):
            store.index_copy_(2, dst, torch.where(ok, row, store.index_select(2, dst)))

    if n > 0 and h2 > 0:
        heads = _kv_head_of_hist(p.hist_of, h2)
        for win, hist, r, mu, clip in ((win_k, history.k, p.r_k, p.mu_k, p.clip_k),
                                       (win_v, history.v, p.r_v, p.mu_v, p.clip_v)):
            x = win.index_select(2, src_entry)  # [B, Hk, 1, D]
            if heads is not None:
                x = x.index_select(1, heads)  # [B, H2, 1, D]
            # the store's own width and group (3-bit keys or INT2; values at a group of their own)
            write(hist, rotate_quantize_reference(x, r, mu, clip, rows_group_size(hist), p.meta_dtype,
                                                  quantizer=p.quantizer, bits=hist.bits))
    if n > 0 and history.coded is not None:
        heads = _kv_head_of_hist(p.heads.coded_of, history.coded[0][0].shape[1])  # [P]: each coded entry's KV head
        for win, store in zip((win_k, win_v), history.coded):
            write(store, encode_heads(win.index_select(2, src_entry).index_select(1, heads), p.heads.bits))


def put_reference(params: KVParams, new_k, new_v, window: Window, history: History, at: Ring) -> None:
    """The new token alone: ``new_k/new_v [B, Hk, 1, D]`` into the ring and, while it fills, the sink
    (:func:`ring_put`)."""
    entries = put_entries(at, check_append_inputs(params, new_k, new_v, window, history, at)[0])
    for win, new in ((window.k, new_k), (window.v, new_v)):
        ring_put(win, new, entries)


def append_token_reference(params: KVParams, new_k, new_v, window: Window, history: History, at: Ring):
    """One decode step's write of a contiguous storage: :func:`demote_reference` (slot ``T - W`` into the history),
    then :func:`put_reference`. Tensor ops only."""
    demote_reference(params, window, history, at)
    put_reference(params, new_k, new_v, window, history, at)


# ------------------------------------------------------------------- the paged one-token write (the serving store)


def scatter_entries(dst, pages, offsets, src) -> None:
    """One entry per row: ``src.* [Bp, H, 1, X]`` row ``i`` at offset ``offsets[i]`` of page ``pages[i]`` of
    ``dst.* [pages, H, P, X]``."""
    for d, x in zip(dst, src, strict=True):
        d[pages, :, offsets] = x[:, :, 0]


def paged_append_reference(params: KVParams, new_k, new_v, window: Window, history: History, rows: PagedRows):
    """One decode step of the serving store, in place, static shapes (graph-capturable): ``new_k/new_v [Hk, Q, D]``
    the packed batch, the window ``[slots, Hk, S0 + R, D]``, the history the page pool's ``[pages, H2, P, *]``.
    (1) Each row's ``demote_entry`` is quantized (coded for the retrieval heads) into ``demote_page`` /
    ``demote_off``; (2) its new token goes to ``new_entry`` and ``sink_entry`` (:class:`PagedRows`)."""
    h2 = check_paged_inputs(params, new_k, new_v, window, history, rows)
    p, win_k, win_v, coded = params, window.k, window.v, history.coded
    if rows.demote:  # 1. ring -> INT2 and coded rows, into the row's page (or the trash page)
        int2 = _kv_head_of_hist(p.hist_of, h2)
        coded_heads = None if coded is None else _kv_head_of_hist(p.heads.coded_of, coded[0][0].shape[1])
        stores = coded or (None, None)
        for win, hist, r, mu, clip, store in ((win_k, history.k, p.r_k, p.mu_k, p.clip_k, stores[0]),
                                              (win_v, history.v, p.r_v, p.mu_v, p.clip_v, stores[1])):
            x = win[rows.slots, :, rows.demote_entry][:, :, None]  # [Bp, Hk, 1, D]
            if store is not None:
                scatter_entries(store, rows.demote_page, rows.demote_off,
                                encode_heads(x.index_select(1, coded_heads), p.heads.bits))
            if h2:  # (the store's own width and group: 3-bit keys or INT2; values at a group of their own)
                q = rotate_quantize_reference(x if int2 is None else x.index_select(1, int2), r, mu, clip,
                                              rows_group_size(hist), p.meta_dtype, quantizer=p.quantizer,
                                              bits=hist.bits)
                scatter_entries(hist, rows.demote_page, rows.demote_off, q)
    # 2. the new token: its ring entry, and its sink entry while T < S0
    for win, new in ((win_k, new_k), (win_v, new_v)):
        new = new.index_select(1, rows.pos).transpose(0, 1)  # [Bp, Hk, D]
        win[rows.slots, :, rows.new_entry] = new
        if rows.write_sink:
            win[rows.slots, :, rows.sink_entry] = new


def append(params: KVParams, new_k, new_v, window: Window, history: History, at: Ring | PagedRows,
           use_kernels="auto", demote: bool = True) -> None:
    """The one-token write of every storage, in place. At a :class:`Ring` (a contiguous storage,
    :func:`append_token_reference`): slot ``T - W`` demoted into the history, the new token into the ring (and the
    sink while it fills); ``new_k = new_v = None``: the demotion alone; ``demote=False``: the new token alone
    (:func:`ring_put`). At a serving step's :class:`PagedRows` (:func:`paged_append_reference`): slot ``T - 1 - W``
    demoted, then the new token. One fused Triton launch where supported."""
    contiguous, kernels = isinstance(at, Ring), triton_enabled(window.k, use_kernels)
    if (new_k is None or not demote) and not contiguous:
        raise ValueError("the paged write takes the new token's rows (new_k, new_v) and demotes; only a Ring's "
                         "write splits")
    if new_k is None and not demote:
        raise ValueError("append without the new token's rows and without the demotion writes nothing")
    k_group, v_group, d = rows_group_size(history.k), rows_group_size(history.v), window.k.shape[-1]
    # 3-bit keys, values at a group of their own: the write kernel at a power-of-two head_dim only
    plain = history.k.bits == 3 or v_group != k_group
    kernels = kernels and k_group == params.group_size and (not plain or plain_fits(d))
    if kernels:  # (a shape the write kernel takes)
        from .write_triton import kernel_supported
        kernels = (kernel_supported(window.k, k_group, params.clip_k, params.meta_dtype)
                   and kernel_supported(window.k, v_group, params.clip_v))
    if kernels:
        from .append_triton import append_token_triton, paged_append_triton
        if contiguous:
            return append_token_triton(params, new_k, new_v, window, history, at, demote=demote)
        return paged_append_triton(params, new_k, new_v, window, history, at)
    if contiguous and new_k is None:
        return demote_reference(params, window, history, at)
    if contiguous and not demote:
        return put_reference(params, new_k, new_v, window, history, at)
    write = append_token_reference if contiguous else paged_append_reference
    return write(params, new_k, new_v, window, history, at)
