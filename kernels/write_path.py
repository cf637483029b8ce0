"""Write path: rotate + center + clip + quantize + pack K/V rows into INT2 history storage.

``rotate_quantize(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0, quantizer="minmax")``

* ``x``  ``[B, Hk, T, D]`` rows in the model dtype (post-RoPE keys or values),
* ``r``  ``[Hk, D, D]`` float32 rotation (row-vector convention: ``x_rot = (x - mu) @ r``),
* ``mu`` ``[Hk, D]`` float32 offset or None,
* ``clip`` float: the layer's clip ratio (``quantizer="minmax"``; ``"std"`` sets each group's grid from its mean and
  standard deviation and has no clip, see ``oscar_hf/quant.py``),
* result: :class:`oscar_hf.quant.QuantizedRows` with ``codes [B, Hk, T, D/4] uint8`` and
  ``scale``/``zero`` ``[B, Hk, T, D/G]``; when ``out`` is given the rows are written into
  ``out.*[:, :, out_offset : out_offset + T]`` instead (the cache's history storage).

This file holds the torch reference and the dispatcher :func:`rotate_quantize`, which sends supported shapes on CUDA
to the Triton kernel (``write_triton.py``) and everything else to the reference.

``append_token(new_k, new_v, win_k, win_v, hist_k, hist_v, length, pad, hist_heads, r_k, mu_k, clip_k, r_v, mu_v,
clip_v, group_size, meta_dtype, sink, recent, quantizer="minmax")``: the one-token write step of the static (CUDA-graph) cache, which
mutates one layer's storage in place (see :func:`append_token_reference` for the layout and the semantics) and sends
supported shapes on CUDA to one fused Triton launch (``append_triton.py``).

``paged_append(new_k, new_v, win_k, win_v, hist_k, hist_v, rows, hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v,
group_size, meta_dtype, demote=True, write_sink=True, quantizer="minmax", coded=None)``: the same write for the
serving store's decode rows (window slots of a window pool, history in a page pool, where each row reads and writes
given by the step's plan, :class:`PagedRows`); see :func:`paged_append_reference`. Also one launch on CUDA.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from oscar_hf.quant import QuantizedRows, encode_heads, quantize_rows

from .append_checks import check_append_inputs, check_coded_slots, check_paged_inputs
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


class CodedSlots(NamedTuple):
    """The retrieval heads' history entries that the one-token write fills beside the INT2 heads' (``coded=`` of
    :func:`append_token`): ``k``/``v`` the stored parts ``[B, P, N, *]`` (:func:`~oscar_hf.quant.encode_heads`:
    ``(x,)`` at 16 bits, ``(codes, scale, zero)`` at 8 / 4, metadata in the window's dtype), ``coded_of [Hk]`` int64
    each KV head's index among them or -1 (an INT2 head), ``bits`` 16, 8 or 4."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    coded_of: torch.Tensor
    bits: int


def _kv_head_of_hist(hist_heads, hq: int):
    """``[Hq]`` int64: the KV head that history head ``hh`` stores (the inverse of ``hist_heads``, computed on the
    device: every history index is assumed to be the image of exactly one KV head), or None for the identity."""
    if hist_heads is None:
        return None
    hk = hist_heads.shape[0]
    inv = torch.zeros(hq + 1, dtype=torch.long, device=hist_heads.device)
    dst = torch.where(hist_heads >= 0, hist_heads, torch.full_like(hist_heads, hq))  # unquantized heads -> slot hq
    inv.scatter_(0, dst, torch.arange(hk, device=hist_heads.device))
    return inv[:hq]


def append_token_reference(new_k, new_v, win_k, win_v, hist_k: QuantizedRows, hist_v: QuantizedRows, length, pad,
                           hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, group_size, meta_dtype, sink, recent,
                           quantizer="minmax", coded: CodedSlots | None = None):
    """One decode step of the static cache's storage, in place; returns None. Tensor ops only (no host sync), so it
    can be captured in a CUDA graph or compiled.

    Storage (``S0 = sink``, ``W = recent``, ``T = length``, a 0-d int64 device tensor, not modified):

    * ``win_k/win_v [B, Hk, S0 + R, D]`` model dtype: ``[:S0]`` row ``b``'s first real tokens (slot ``pad[b] + j``
      at entry ``j``), ``[S0:]`` a ring holding slot ``s`` at entry ``S0 + s % R`` (``R >= W + 1``);
    * ``hist_k/hist_v`` :class:`QuantizedRows` ``[B, Hq, N, ...]``: slot ``s >= S0`` at index ``s - S0``;
      ``hist_heads``: None (``Hq = Hk``) or int64 ``[Hk]``, each KV head's history index or -1 (not quantized),
      one KV head per history index (not checked: that would read the device);
    * ``r_* [Hq, D, D]`` float32 rotations, ``mu_k`` None | ``[Hq, D]`` | ``[B, Hq, D]``, ``mu_v`` None | ``[Hq, D]``.

    Steps: (1) slot ``s = T - 1 - W`` leaves the window: when ``S0 <= s < S0 + N`` its ring entry is quantized
    (rotate, center, clip, INT2) into history index ``s - S0`` of every quantized head; it is read before (2), which
    overwrites the same entry when ``R = W + 1``; ``coded`` (:class:`CodedSlots`, the retrieval heads) gets the same
    slot's entry of its heads, coded. (2) ``new [B, Hk, 1, D]`` goes to ring entry ``S0 + T % R``, and to sink entry
    ``T - pad[b]`` of each row with ``0 <= T - pad[b] < S0``."""
    ring, n, hq = check_append_inputs(new_k, new_v, win_k, win_v, hist_k, hist_v, length, pad, hist_heads, r_k, mu_k,
                                      r_v, mu_v, group_size, meta_dtype, sink, recent)
    check_coded_slots(coded, win_k, n)
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
                x = x.index_select(1, heads)  # [B, Hq, 1, D]
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


def append_token(new_k, new_v, win_k, win_v, hist_k: QuantizedRows, hist_v: QuantizedRows, length, pad, hist_heads,
                 r_k, mu_k, clip_k, r_v, mu_v, clip_v, group_size, meta_dtype, sink, recent, use_kernels="auto",
                 quantizer="minmax", coded: CodedSlots | None = None):
    """Dispatch :func:`append_token_reference`: one fused Triton launch on CUDA (when importable, allowed and the
    shape is supported, as for :func:`rotate_quantize`), else the torch reference. Returns None."""
    if _append_kernel_serves(new_k, group_size, clip_k, clip_v, meta_dtype, use_kernels):
        from .append_triton import append_token_triton

        return append_token_triton(new_k, new_v, win_k, win_v, hist_k, hist_v, length, pad, hist_heads, r_k, mu_k,
                                   clip_k, r_v, mu_v, clip_v, group_size, meta_dtype, sink, recent,
                                   quantizer=quantizer, coded=coded)
    return append_token_reference(new_k, new_v, win_k, win_v, hist_k, hist_v, length, pad, hist_heads, r_k, mu_k,
                                  clip_k, r_v, mu_v, clip_v, group_size, meta_dtype, sink, recent, quantizer=quantizer,
                                  coded=coded)


# ------------------------------------------------------------------- the paged one-token write (the serving store)


class PagedRows(NamedTuple):
    """Where each of the ``Bp`` decode rows of a step reads and writes (``[Bp]`` int64 device tensors, the serving
    store's ``DecodePlan``): ``pos`` its new token's position in the packed batch, ``slots`` its window slot,
    ``new_entry`` the new token's ring entry, ``sink_entry`` its sink entry (``new_entry`` again when it has none),
    ``demote_entry`` the ring entry that left the window at the previous step, ``demote_page`` / ``demote_off`` the page
    and offset it goes to (the pool's trash page for a row that demotes nothing: every row writes one entry)."""

    pos: torch.Tensor
    slots: torch.Tensor
    new_entry: torch.Tensor
    sink_entry: torch.Tensor
    demote_entry: torch.Tensor
    demote_page: torch.Tensor
    demote_off: torch.Tensor


def scatter_entries(dst, pages, offsets, src) -> None:
    """One entry per row: ``src.* [Bp, H, 1, X]`` row ``i`` at offset ``offsets[i]`` of page ``pages[i]`` of
    ``dst.* [pages, H, P, X]``."""
    for d, x in zip(dst, src, strict=True):
        d[pages, :, offsets] = x[:, :, 0]


def paged_append_reference(new_k, new_v, win_k, win_v, hist_k: QuantizedRows, hist_v: QuantizedRows,
                           rows: PagedRows, hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, group_size, meta_dtype,
                           demote=True, write_sink=True, quantizer="minmax", coded: CodedSlots | None = None):
    """The write of one decode step of the serving store (one token per row, ``Bp`` rows), in place; returns None.
    Tensor ops only, static shapes (a CUDA graph captures it).

    * ``new_k/new_v [Hk, Q, D]`` the packed batch's keys / values (row ``b``'s token at ``rows.pos[b]``);
    * ``win_k/win_v [slots, Hk, S0 + R, D]`` the window pool (one layer);
    * ``hist_k/hist_v`` :class:`QuantizedRows` ``[pages, Hq, P, *]`` the page pool's INT2 rows of the layer
      (``PagedInt2Pool.rows``); ``hist_heads`` None (``Hq = Hk``) or int64 ``[Hk]``, each KV head's INT2 index or -1;
      ``coded`` (:class:`CodedSlots`, its parts ``[pages, F, P, *]``: ``PagedInt2Pool.coded_rows``) the retrieval
      heads' pages;
    * ``r_* [Hq, D, D]`` float32 rotations, ``mu_*`` None or ``[Hq, D]``; ``rows``: :class:`PagedRows`.

    Steps (``demote`` / ``write_sink``: whether any row demotes / writes a sink entry this step, host bools): (1) ring
    entry ``demote_entry[b]`` of slot ``slots[b]`` is quantized (rotate, center, clip, INT2) into offset
    ``demote_off[b]`` of page ``demote_page[b]`` for every INT2 head, and coded there for every retrieval head; (2) the
    new token goes to ring entry ``new_entry[b]`` (the one just read when ``R = W + 1``) and sink entry
    ``sink_entry[b]``."""
    hq = check_paged_inputs(new_k, new_v, win_k, win_v, hist_k, hist_v, rows, hist_heads, r_k, mu_k, r_v, mu_v,
                            group_size, meta_dtype, coded)
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


def paged_append(new_k, new_v, win_k, win_v, hist_k: QuantizedRows, hist_v: QuantizedRows, rows: PagedRows,
                 hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, group_size, meta_dtype, demote=True,
                 write_sink=True, use_kernels="auto", quantizer="minmax", coded: CodedSlots | None = None):
    """Dispatch :func:`paged_append_reference`: one Triton launch on CUDA (when importable, allowed and the shape is
    supported, as for :func:`append_token`), else the torch reference. Returns None."""
    if _append_kernel_serves(new_k, group_size, clip_k, clip_v, meta_dtype, use_kernels):
        from .append_triton import paged_append_triton

        return paged_append_triton(new_k, new_v, win_k, win_v, hist_k, hist_v, rows, hist_heads, r_k, mu_k, clip_k,
                                   r_v, mu_v, clip_v, group_size, meta_dtype, demote=demote, write_sink=write_sink,
                                   quantizer=quantizer, coded=coded)
    return paged_append_reference(new_k, new_v, win_k, win_v, hist_k, hist_v, rows, hist_heads, r_k, mu_k, clip_k,
                                  r_v, mu_v, clip_v, group_size, meta_dtype, demote=demote, write_sink=write_sink,
                                  quantizer=quantizer, coded=coded)
