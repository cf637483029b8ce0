"""Write path: rotate + center + clip + quantize + pack K/V rows into INT2 history storage.

``rotate_quantize(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0, quantizer="minmax")``: ``x [B, Hk,
T, D]`` rows in the model dtype (post-RoPE keys or values); ``r [Hk, D, D]`` float32 rotation (row-vector convention:
``x_rot = (x - mu) @ r``); ``mu [Hk, D]`` float32 or None; ``clip`` the layer's clip ratio (``"minmax"``; ``"std"``
has none, ``oscar_hf/quant.py``). Result: :class:`oscar_hf.quant.QuantizedRows` (``codes [B, Hk, T, D/4] uint8``,
``scale``/``zero`` ``[B, Hk, T, D/G]``), or written into ``out.*[:, :, out_offset : out_offset + T]`` (the cache's
history storage). The torch reference is here; :func:`rotate_quantize` sends supported shapes on CUDA to
``write_triton.py``.

``append(params, new_k, new_v, window, history, at)``: the one-token write of every storage (:mod:`.kv`'s bundles), in
place: the compiled layer's (``at`` a ``Ring``: :func:`append_token_reference`) and the serving store's decode rows
(``at`` the step's ``PagedRows``: :func:`paged_append_reference`); supported shapes on CUDA go to one fused Triton
launch (``append_triton.py``).
"""
from __future__ import annotations

import torch

from oscar_hf.quant import QuantizedRows, encode_heads, quantize_rows

from .append_checks import CodedSlots, check_append_inputs, check_paged_inputs, write_operands  # noqa: F401
from .kv import History, KVParams, PagedRows, Ring, Window
from .plan import triton_enabled


def rotate_quantize_reference(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0, quantizer="minmax"):
    xf = x.float()
    if mu is not None:  # [Hk, D] (calibrated) or [B, Hk, D] (per sequence)
        xf = xf - (mu[None, :, None, :] if mu.dim() == 2 else mu[:, :, None, :])
    rows = torch.matmul(xf, r.unsqueeze(0))  # [B, Hk, T, D] @ [1, Hk, D, D]
    q = quantize_rows(rows, group_size, clip, meta_dtype, quantizer)
    if out is None:
        return q
    t = x.shape[-2]
    for dst, src in zip(out, q):
        dst[:, :, out_offset : out_offset + t].copy_(src)
    return out


def rotate_quantize(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0, use_kernels="auto",
                    quantizer="minmax"):
    """Dispatch: the Triton kernel on CUDA (when importable, allowed and the shape is supported), else the torch
    reference."""
    if triton_enabled(x, use_kernels):
        from .write_triton import kernel_supported, rotate_quantize_triton
        if kernel_supported(x, group_size, clip, meta_dtype):
            return rotate_quantize_triton(x, r, mu, clip, group_size, meta_dtype, out=out, out_offset=out_offset,
                                          quantizer=quantizer)
    return rotate_quantize_reference(x, r, mu, clip, group_size, meta_dtype, out=out, out_offset=out_offset,
                                     quantizer=quantizer)


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


def append_token_reference(params: KVParams, new_k, new_v, window: Window, history: History, at: Ring):
    """One decode step of the static cache's storage (the window, history and parameters of :mod:`.kv`'s bundles:
    the names below are their fields), in place; returns None. Tensor ops only (no host sync), so it
    can be captured in a CUDA graph or compiled.

    Storage (``S0 = sink``, ``W = recent``, ``T = length``, a 0-d int64 device tensor, not modified):

    * ``win_k/win_v [B, Hk, S0 + R, D]`` model dtype: ``[:S0]`` row ``b``'s first real tokens (slot ``pad[b] + j``
      at entry ``j``), ``[S0:]`` a ring holding slot ``s`` at entry ``S0 + s % R`` (``R >= W + 1``);
    * ``hist_k/hist_v`` :class:`QuantizedRows` ``[B, H2, N, ...]``: slot ``s >= S0`` at index ``s - S0``;
      ``hist_heads``: None (``H2 = Hk``) or int64 ``[Hk]``, each KV head's history index or -1 (not quantized),
      one KV head per history index (not checked: that would read the device);
    * ``r_* [H2, D, D]`` float32 rotations, ``mu_k`` None | ``[H2, D]`` | ``[B, H2, D]``, ``mu_v`` None | ``[H2, D]``.

    Steps: (1) slot ``s = T - 1 - W`` leaves the window: when ``S0 <= s < S0 + N`` its ring entry is quantized
    (rotate, center, clip, INT2) into history index ``s - S0`` of every quantized head; it is read before (2), which
    overwrites the same entry when ``R = W + 1``; ``coded`` (:class:`CodedSlots`, the retrieval heads) gets the same
    slot's entry of its heads, coded. (2) ``new [B, Hk, 1, D]`` goes to ring entry ``S0 + T % R``, and to sink entry
    ``T - pad[b]`` of each row with ``0 <= T - pad[b] < S0``."""
    ring, n, hq = check_append_inputs(params, new_k, new_v, window, history, at)
    win_k, win_v, hist_k, hist_v, hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, coded = write_operands(
        params, window, history)
    length, pad, sink, recent = at.length, at.pad, at.sink, at.recent
    group_size, meta_dtype, quantizer = params.group_size, params.meta_dtype, params.quantizer
    s0, t = sink, length
    # 1. demotion: written to a clamped index, masked to the old contents when slot s is no history slot
    s = t - 1 - recent
    e = s - s0
    ok = (e >= 0) & (e < n)
    src_entry = (s0 + torch.remainder(s, ring)).reshape(1)
    dst = e.clamp(0, max(n - 1, 0)).reshape(1)

    def write(stores, rows):
        for store, row in zip(stores, rows, strict=True):
            store.index_copy_(2, dst, torch.where(ok, row, store.index_select(2, dst)))

    if n > 0 and hq > 0:
        heads = _kv_head_of_hist(hist_heads, hq)
        for win, hist, r, mu, clip in ((win_k, hist_k, r_k, mu_k, clip_k), (win_v, hist_v, r_v, mu_v, clip_v)):
            x = win.index_select(2, src_entry)  # [B, Hk, 1, D]
            if heads is not None:
                x = x.index_select(1, heads)  # [B, H2, 1, D]
            write(hist, rotate_quantize_reference(x, r, mu, clip, group_size, meta_dtype, quantizer=quantizer))
    if n > 0 and coded is not None:
        heads = _kv_head_of_hist(coded.coded_of, coded.k[0].shape[1])  # [P]: the KV head of each coded entry
        for win, store in ((win_k, coded.k), (win_v, coded.v)):
            write(store, encode_heads(win.index_select(2, src_entry).index_select(1, heads), coded.bits))
    # 2. the new token: ring entry, then the sink of rows with fewer than S0 real tokens
    entry = (s0 + torch.remainder(t, ring)).reshape(1)
    win_k.index_copy_(2, entry, new_k)
    win_v.index_copy_(2, entry, new_v)
    if s0 > 0:
        j = t - pad  # [B] row b's real tokens before this one
        in_sink = ((j >= 0) & (j < s0))[:, None, None, None]
        b, hk, _, d = new_k.shape
        idx = j.clamp(0, s0 - 1)[:, None, None, None].expand(b, hk, 1, d)
        for win, new in ((win_k, new_k), (win_v, new_v)):
            win.scatter_(2, idx, torch.where(in_sink, new, win.gather(2, idx)))


def _append_kernel_serves(new_k, group_size, clip_k, clip_v, meta_dtype, use_kernels) -> bool:
    """Whether the one-token write (contiguous or paged) runs its Triton kernel: CUDA (when importable and allowed,
    as for :func:`rotate_quantize`) and a shape ``write_triton.kernel_supported`` takes for keys and values."""
    if not triton_enabled(new_k, use_kernels):
        return False
    from .write_triton import kernel_supported
    return kernel_supported(new_k, group_size, clip_k, meta_dtype) and kernel_supported(new_k, group_size, clip_v)


# ------------------------------------------------------------------- the paged one-token write (the serving store)


def scatter_entries(dst, pages, offsets, src) -> None:
    """One entry per row: ``src.* [Bp, H, 1, X]`` row ``i`` at offset ``offsets[i]`` of page ``pages[i]`` of
    ``dst.* [pages, H, P, X]``."""
    for d, x in zip(dst, src, strict=True):
        d[pages, :, offsets] = x[:, :, 0]


def paged_append_reference(params: KVParams, new_k, new_v, window: Window, history: History, rows: PagedRows):
    """The write of one decode step of the serving store (one token per row, ``Bp`` rows; :mod:`.kv`'s bundles, the
    names below their fields), in place; returns None. Tensor ops only, static shapes (a CUDA graph captures it).

    * ``new_k/new_v [Hk, Q, D]`` the packed batch's keys / values (row ``b``'s token at ``rows.pos[b]``);
    * ``win_k/win_v [slots, Hk, S0 + R, D]`` the window pool (one layer);
    * ``hist_k/hist_v`` :class:`QuantizedRows` ``[pages, H2, P, *]`` the page pool's INT2 rows of the layer
      (``PagedInt2Pool.rows``); ``hist_heads`` None (``H2 = Hk``) or int64 ``[Hk]``, each KV head's INT2 index or -1;
      ``coded`` (:class:`CodedSlots`, its parts ``[pages, F, P, *]``: ``PagedInt2Pool.coded_rows``) the retrieval
      heads' pages;
    * ``r_* [H2, D, D]`` float32 rotations, ``mu_*`` None or ``[H2, D]``; ``rows``: :class:`PagedRows`.

    Steps (``demote`` / ``write_sink``: whether any row demotes / writes a sink entry this step, host bools): (1) ring
    entry ``demote_entry[b]`` of slot ``slots[b]`` is quantized (rotate, center, clip, INT2) into offset
    ``demote_off[b]`` of page ``demote_page[b]`` for every INT2 head, and coded there for every retrieval head; (2) the
    new token goes to ring entry ``new_entry[b]`` (the one just read when ``R = W + 1``) and sink entry
    ``sink_entry[b]``."""
    hq = check_paged_inputs(params, new_k, new_v, window, history, rows)
    win_k, win_v, hist_k, hist_v, hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, coded = write_operands(
        params, window, history)
    demote, write_sink = rows.demote, rows.write_sink
    group_size, meta_dtype, quantizer = params.group_size, params.meta_dtype, params.quantizer
    k_new = new_k.index_select(1, rows.pos).transpose(0, 1)  # [Bp, Hk, D]
    v_new = new_v.index_select(1, rows.pos).transpose(0, 1)
    if demote:  # 1. ring -> INT2 and coded rows, into the row's page (or the trash page)
        int2 = _kv_head_of_hist(hist_heads, hq)
        coded_heads = _kv_head_of_hist(coded.coded_of, coded.k[0].shape[1]) if coded is not None else None
        stores = (None, None) if coded is None else (coded.k, coded.v)
        for win, hist, r, mu, clip, store in ((win_k, hist_k, r_k, mu_k, clip_k, stores[0]),
                                              (win_v, hist_v, r_v, mu_v, clip_v, stores[1])):
            x = win[rows.slots, :, rows.demote_entry][:, :, None]  # [Bp, Hk, 1, D]
            if store is not None:
                scatter_entries(store, rows.demote_page, rows.demote_off,
                                 encode_heads(x.index_select(1, coded_heads), coded.bits))
            if hq:
                q = rotate_quantize_reference(x if int2 is None else x.index_select(1, int2), r, mu, clip, group_size,
                                              meta_dtype, quantizer=quantizer)
                scatter_entries(hist, rows.demote_page, rows.demote_off, q)
    # 2. the new token: its ring entry, and its sink entry while T < S0
    win_k[rows.slots, :, rows.new_entry] = k_new
    win_v[rows.slots, :, rows.new_entry] = v_new
    if write_sink:
        win_k[rows.slots, :, rows.sink_entry] = k_new
        win_v[rows.slots, :, rows.sink_entry] = v_new


def append(params: KVParams, new_k, new_v, window: Window, history: History, at: Ring | PagedRows,
           use_kernels="auto") -> None:
    """The one-token write of every storage, in place (returns None): slot ``T - 1 - W``, which left the window at the
    previous step, demoted into the history (INT2 heads quantized, retrieval heads coded: ``history.coded`` with
    ``params.heads``), then the new token into the ring and, while the row fills it, the sink. ``at``: a
    :class:`~oscar_hf.kernels.kv.Ring` (a contiguous storage, ``new_k/new_v [B, Hk, 1, D]``: the compiled layer;
    :func:`append_token_reference`) or the serving step's :class:`~oscar_hf.kernels.kv.PagedRows` (``new_k/new_v [Hk,
    Q, D]`` the packed batch, the window a pool of slots, the history pages; :func:`paged_append_reference`). One
    fused Triton launch on CUDA (when importable, allowed and the shape is supported, as for :func:`rotate_quantize`),
    else the torch reference."""
    contiguous = isinstance(at, Ring)
    if _append_kernel_serves(new_k, params.group_size, params.clip_k, params.clip_v, params.meta_dtype, use_kernels):
        from .append_triton import append_token_triton, paged_append_triton
        write = append_token_triton if contiguous else paged_append_triton
    else:
        write = append_token_reference if contiguous else paged_append_reference
    return write(params, new_k, new_v, window, history, at)
