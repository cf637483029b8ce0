"""The retrieval heads' decode read (:func:`heads_decode_attention`): a layer's ``P`` coded heads
(:mod:`oscar_hf.cache.heads`) and the window they share, read in place by ``heads_triton`` on CUDA and by the torch
reference below elsewhere, with the argument checks. Design: docs/kernels.md §3.9.
"""
from __future__ import annotations

import torch

from oscar_hf.quant import QuantizedRows, dequantize_minmax, unpack_int4

from .append_checks import check_coded_store
from .int2_attention import history_partial_reference, merge_history_and_window
from .paged_decode import gather_rows
from .plan import triton_enabled


def dequantize_heads(parts: tuple[torch.Tensor, ...], bits: int) -> torch.Tensor:
    """A coded store's slots (``parts`` sliced to ``n`` slots) -> ``[B, P, n, D]`` float32."""
    if bits == 16:
        return parts[0].float()
    codes, scale, zero = parts
    return dequantize_minmax(QuantizedRows(unpack_int4(codes) if bits == 4 else codes, scale, zero), torch.float32)


def check_heads_args(q, heads, k, v, bits, win_k, win_mask, block_table=None, win_slot=None) -> None:
    """Shapes and forms the read takes: a clear error at the call, never a wrong read (``win_slot [B]``: the window
    is a pool ``[slots, Hk, W, D]``, row ``b`` at ``win_slot[b]``)."""
    b, hk, _, d = q.shape
    # rows, or pages of a paged store
    check_coded_store(k, v, bits, b if block_table is None else k[0].shape[0], heads.numel(), k[0].shape[2], d)
    if block_table is not None and (block_table.dim() != 2 or block_table.shape[0] != b):
        raise ValueError(f"block table {tuple(block_table.shape)} is not [B, pages] with B = {b}")
    if (win_k.shape[0] != b and win_slot is None) or win_k.shape[1] != hk or win_k.shape[-1] != d:
        raise ValueError(f"window {tuple(win_k.shape)} does not match queries {tuple(q.shape)}")
    if win_slot is not None and (win_slot.shape != (b,) or win_slot.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"window slots must be int32/int64 [B={b}], got {win_slot.dtype} {tuple(win_slot.shape)}")
    if win_mask is not None and win_mask.shape != (b, win_k.shape[2]):
        raise ValueError(f"window mask {tuple(win_mask.shape)} is not [B, W] = {(b, win_k.shape[2])}")


def merge_heads(int2_part: torch.Tensor | None, coded_part: torch.Tensor, int2_idx: torch.Tensor,
                coded_idx: torch.Tensor, hk: int) -> torch.Tensor:
    """``[B, H2, ...]`` and ``[B, P, ...]`` -> ``[B, Hk, ...]`` (``coded_part``'s dtype), each part at its KV heads
    ``int2_idx [H2]`` / ``coded_idx [P]`` (``int2_part`` None when no head is an INT2 head)."""
    out = coded_part.new_empty(coded_part.shape[0], hk, *coded_part.shape[2:])
    if int2_part is not None:
        out.index_copy_(1, int2_idx, int2_part.to(out.dtype))
    return out.index_copy_(1, coded_idx, coded_part.to(out.dtype))


def heads_decode_reference(q, heads, coded, bits: int, bounds, window, scaling: float, out_dtype=None, *,
                           pages=None, block_n: int = 1024, softcap=None, sinks=None) -> torch.Tensor:
    """Torch reference of :func:`heads_decode_attention` (float32; ``block_n`` slots dequantized at a time)."""
    (k, v), (lo, hi) = coded, bounds
    if pages is not None:
        n_all = pages.table.shape[1] * k[0].shape[2]  # every slot the table addresses (``hi`` masks the rest)
        k, v = gather_rows(k, pages.table, n_all), gather_rows(v, pages.table, n_all)
    qh = q.index_select(1, heads).float()  # [B, P, M, D]
    # a device-side hi is masked (no host sync: the compiled CPU step runs this), a host one cuts the store
    if isinstance(hi, torch.Tensor):
        hi = hi.to(qh.device).reshape(-1, 1, 1, 1)  # one bound, or one per row
    else:
        end = max(0, min(k[0].shape[2], int(hi)))
        k, v, hi = tuple(x[:, :, :end] for x in k), tuple(x[:, :, :end] for x in v), None
    part = history_partial_reference(qh, k, v, lo.to(qh.device).reshape(-1), None, None, scaling, 0, block_n, hi,
                                     softcap, dequant=lambda parts: dequantize_heads(parts, bits))
    win = window.heads(heads).gathered()  # [B, P, W, D], copied (the kernel reads the pool's rows and heads in place)
    mask = win.mask_2d()
    return merge_history_and_window(part, qh, win.k, win.v, None if mask is None else mask[:, None, None, :], None,
                                    None, scaling, out_dtype or q.dtype, softcap, sinks)


def heads_decode_attention(q, heads, coded, bits: int, bounds, window, scaling: float, out_dtype=None, *,
                           pages=None, softcap=None, sinks=None, use_kernels="auto") -> torch.Tensor:
    """``[B, P, M, D]`` in ``out_dtype``: ``softmax(scaling * q k^T) v`` over the coded history and the window (rows
    with no valid key give 0); two Triton launches on CUDA, the reference elsewhere.

    ``q [B, Hk, M, D]`` every KV head's query rows, unrotated; ``heads [P]`` int64 the coded KV heads; ``coded``
    ``(k, v)``, each ``(codes [B, P, N, D * bits / 8] uint8, scale [B, P, N, 1], zero [B, P, N, 1])`` (INT4: channel
    ``j`` in byte ``j``'s low nibble, ``j + D/2`` in its high one) or ``(x [B, P, N, D],)`` at 16 bits; ``bounds``
    ``(lo [B], hi)``: row ``b`` reads slots ``lo[b] <= s < hi`` (``hi`` an int, or a 0-d / ``[B]`` device tensor,
    graph-safe); ``pages``: parts ``[num_pages, P, page_size, *]`` through ``pages.table``; ``window``: ``k/v [B, Hk,
    W, D]`` (or a pool with ``slot``), mask ``[B, W]`` or ``[B, 1, 1, W]``; ``sinks [P, M]``."""
    _check(q, heads, coded, bits, window, pages, sinks)
    out_dtype = out_dtype or q.dtype
    if _on_kernels(q, use_kernels):
        from .heads_triton import heads_decode_triton
        return heads_decode_triton(q, heads, coded, bits, bounds, window, scaling, out_dtype, pages=pages,
                                   sinks=sinks, softcap=softcap)
    return heads_decode_reference(q, heads, coded, bits, bounds, window, scaling, out_dtype, pages=pages,
                                  softcap=softcap, sinks=sinks)


def heads_decode_partials(q, heads, coded, bits: int, bounds, window, scaling: float, *, pages=None, softcap=None,
                          sinks=None, use_kernels="auto"):
    """The split launch of :func:`heads_decode_attention` alone (its arguments): the retrieval heads' partials for the
    INT2 heads' combine to merge (:class:`~oscar_hf.kernels.kv.CodedPartials`), or None where the kernels do not
    serve the call in one launch (the reference, or row chunks): then :func:`heads_decode_attention` reads them."""
    _check(q, heads, coded, bits, window, pages, sinks)
    if not _on_kernels(q, use_kernels):
        return None
    from .heads_triton import heads_partials
    return heads_partials(q, heads, coded, bits, bounds, window, scaling, pages=pages, sinks=sinks, softcap=softcap)


def _on_kernels(q, use_kernels) -> bool:
    """Whether the Triton launches read the call (up to 64 query rows a KV head)."""
    return triton_enabled(q, use_kernels) and q.shape[2] <= 64


def _check(q, heads, coded, bits, window, pages, sinks) -> None:
    check_heads_args(q, heads, *coded, bits, window.k, window.mask_2d(), None if pages is None else pages.table,
                     window.slot)
    if sinks is not None and sinks.shape != (heads.numel(), q.shape[2]):
        raise ValueError(f"sinks {tuple(sinks.shape)} are not [P, M] = {(heads.numel(), q.shape[2])}")
