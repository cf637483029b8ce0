"""The one read of a decode step: :func:`decode`, a layer's attention over its window and history (:mod:`.kv`'s
bundles) for every storage, the retrieval heads beside the INT2 heads: the kernels where they take the shape, the
torch references elsewhere.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from oscar_hf.quant import rows_group_size

from . import settings
from .heads_attention import heads_decode_attention, merge_heads
from .int2_attention import decode_attention_reference, rotate_query, rotate_query_reference
from .kv import History, KVParams, Window
from .paged_decode import check_paged_inputs, paged_decode_batched, paged_supported
from .plan import triton_enabled

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> the retrieval heads' stream (settings.HeadsDefaults)


def _side_stream(q: torch.Tensor, kernels: bool):
    """The stream the retrieval heads' read runs on beside the INT2 heads', or None (same stream: CPU, references,
    while dynamo traces, or ``HeadsDefaults.side_stream`` off)."""
    if not (kernels and q.is_cuda and settings.HEADS_DEFAULTS.side_stream) or torch.compiler.is_compiling():
        return None
    if q.device.index not in _SIDE_STREAMS:
        _SIDE_STREAMS[q.device.index] = torch.cuda.Stream(q.device)
    return _SIDE_STREAMS[q.device.index]


def decode(params: KVParams, q: torch.Tensor, window: Window, history: History, scaling: float, out_dtype=None, *,
           rotated=None, softcap=None, sinks=None, use_kernels="auto") -> torch.Tensor:
    """``[B, Hk, M, D]`` in ``out_dtype``: attention of ``q [B, Hk, M, D]`` (unrotated) over ``window`` and
    ``history`` in the value space; rows without a valid key give 0. ``rotated``: the INT2 heads' query already
    rotated, ``(q_rot [B, H2, M, D] float32, qk_off [B, H2, M] or None)``; ``sinks [Hk, M]`` or None. With
    ``history.coded`` the retrieval heads read their coded rows; outputs merge at their KV heads."""
    out_dtype = out_dtype or q.dtype
    split = params.heads if history.coded is not None else None
    qi, win, si = q, window, sinks
    full = None  # with retrieval heads and kernels: [B, Hk, M, D], the launcher writes the INT2 heads' rows in place
    side = None
    if split is not None:  # the INT2 heads' part of the query and the sinks; their window, read in place
        qi, win = q.index_select(1, split.int2_idx), window.heads(split.int2_idx)
        si = None if sinks is None else sinks.index_select(0, split.int2_idx)
        # the retrieval heads first, on a side stream where there is one (joined below)
        side = _side_stream(q, triton_enabled(q, use_kernels))
        if side is not None:
            main = torch.cuda.current_stream(q.device)
            side.wait_stream(main)
        with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
            coded = _read_coded(params, q, window, history, scaling, out_dtype, softcap, sinks, use_kernels)
    out = None
    if history.k.codes.shape[1]:  # the INT2 heads
        from . import decode_triton as dt
        from .query_triton import query_kernel_supported
        k, v, w = history.k, history.v, 0 if win.k is None else win.k.shape[-2]
        kernels, vg = triton_enabled(qi, use_kernels), rows_group_size(v)  # (the values' group may be their own)
        if split is not None and kernels:  # (the references return the INT2 heads' rows: merged below)
            full = torch.empty(q.shape, dtype=out_dtype, device=q.device)
        if history.pages is not None:  # (the float32 query: the window's logits as the store has always read them)
            pages, qf, b = history.pages, qi.float(), qi.shape[0]
            check_paged_inputs(qf, k, v, pages, win)
            if pages.max_len is None:  # (one host sync: the bound of the grid, or of the reference's gather)
                pages = dataclasses.replace(pages, max_len=int(pages.lengths.max()) if b else 0)
                history = dataclasses.replace(history, pages=pages)
            if not (kernels and paged_supported(qf, k, v, params.group_size, win.k)):
                out = paged_decode_batched(params, qf, win, history, scaling, out_dtype)
            elif b == 0 or (pages.max_len == 0 and w == 0):  # nothing to attend to
                out = torch.zeros(qf.shape, device=qf.device, dtype=out_dtype)
            else:
                out = dt.decode_attention_triton(params, qf, win, history, scaling, out_dtype, out=full)
        elif (rotated is None and history.n_valid is None and kernels and not torch.compiler.is_compiling()
              and query_kernel_supported(qi)
              and dt.kernel_supported(qi, k, params.group_size, history.key_mask, win.mask, w, vg)):
            out = dt.decode_attention_triton(params, qi, win, history, scaling, out_dtype, sinks=si, softcap=softcap,
                                             out=full)
        else:
            if rotated is None:  # the kernels' rotation where the launcher reads a device-side length
                rotate = rotate_query if history.n_valid is not None else rotate_query_reference
                rotated = rotate(qi, params.r_k, params.mu_k, *(() if history.n_valid is None else (use_kernels,)))
            if kernels and dt.kernel_supported(qi, k, params.group_size, history.key_mask, win.mask, w, vg):
                out = dt.decode_attention_triton(params, qi, win, history, scaling, out_dtype,
                                                 rotated=(rotated[0].float().contiguous(), rotated[1]), sinks=si,
                                                 softcap=softcap, out=full)
            else:
                out = decode_attention_reference(params, qi, win.gathered(), history.cut(), scaling, out_dtype,
                                                 rotated=rotated, softcap=softcap, sinks=si)
    if split is None:  # (no INT2 head: an empty output, the caller merges the retrieval heads it reads itself)
        return out if out is not None else torch.empty(qi.shape, dtype=out_dtype, device=qi.device)
    if side is not None:  # (the join: the output's rows are read on this stream from here on)
        main.wait_stream(side)
        coded.record_stream(main)
    if full is not None and out is full:  # (the launcher wrote the INT2 heads' rows in place)
        return full.index_copy_(1, split.coded_idx, coded)
    return merge_heads(out, coded, split.int2_idx, split.coded_idx, q.shape[1])


def _read_coded(params: KVParams, q, window: Window, history: History, scaling, out_dtype, softcap, sinks,
                use_kernels) -> torch.Tensor:
    """``[B, P, M, D]`` in ``out_dtype``: the retrieval heads' coded history read in place (through the block tables
    when paged) and the exact window."""
    split, pages = params.heads, history.pages
    lo = history.start if pages is None else torch.zeros_like(pages.lengths, dtype=torch.long)
    hi = pages.lengths if pages is not None else history.n_valid
    if pages is None and hi.device.type == "cpu":  # (a CPU reference reads only the filled part)
        hi = int(hi)
    coded = heads_decode_attention(q, split.coded_idx, history.coded, split.bits, (lo, hi), window, scaling,
                                   out_dtype, pages=pages, softcap=softcap, use_kernels=use_kernels,
                                   sinks=None if sinks is None else sinks.index_select(0, split.coded_idx))
    return coded.to(out_dtype)
