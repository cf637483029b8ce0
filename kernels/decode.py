"""The one read of a decode step: :func:`decode`, a layer's attention over its window and history (:mod:`.kv`'s
bundles) for every storage, the retrieval heads beside the INT2 heads: the kernels where they take the shape, the
torch references elsewhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch

from oscar_hf.quant import rows_group_size

from . import settings
from .heads_attention import heads_decode_attention, heads_decode_partials, merge_heads
from .int2_attention import decode_attention_reference, rotate_query, rotate_query_reference
from .kv import History, KVParams, Window
from .paged_decode import check_paged_inputs, paged_decode_batched, paged_supported
from .plan import triton_enabled

_SIDE_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}  # (device index, what runs on it) -> its stream


def side_stream(device: torch.device, purpose: str) -> torch.cuda.Stream:
    """The one side stream of ``device`` for ``purpose`` (``"heads"``: the retrieval heads' read; ``"write"``: the
    decode step's demotion, ``static_op``), made at its first use: a launch forked onto it and joined back inside an
    op is a parallel branch of the CUDA graph that captures the op."""
    key = (device.index, purpose)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[key]


def _side_stream(q: torch.Tensor, kernels: bool):
    """The stream the retrieval heads' read runs on beside the INT2 heads', or None (same stream: CPU, references,
    while dynamo traces, or ``HeadsDefaults.side_stream`` off)."""
    if not (kernels and q.is_cuda and settings.HEADS_DEFAULTS.side_stream) or torch.compiler.is_compiling():
        return None
    return side_stream(q.device, "heads")


def decode(params: KVParams, q: torch.Tensor, window: Window, history: History, scaling: float, out_dtype=None, *,
           rotated=None, softcap=None, sinks=None, use_kernels="auto") -> torch.Tensor:
    """``[B, Hk, M, D]`` in ``out_dtype``: attention of ``q [B, Hk, M, D]`` (unrotated) over ``window`` and
    ``history`` in the value space; rows without a valid key give 0. ``rotated``: the INT2 heads' query already
    rotated, ``(q_rot [B, H2, M, D] float32, qk_off [B, H2, M] or None)``; ``sinks [Hk, M]`` or None. With
    ``history.coded`` the retrieval heads read their coded rows; outputs merge at their KV heads (on the kernels, in
    the INT2 heads' combine)."""
    out_dtype = out_dtype or q.dtype
    split = params.heads if history.coded is not None else None
    qi, win, si = q, window, sinks
    if split is not None:  # the INT2 heads' part of the query and the sinks; their window, read in place
        # (with their query rotated, ``qi`` stands for their rows' shapes until the route is known: the kernels read
        # the window's query rows in place too, the references take a copy)
        qi = rotated[0] if rotated is not None else q.index_select(1, split.int2_idx)
        win = window.heads(split.int2_idx)
        si = None if sinks is None else sinks.index_select(0, split.int2_idx)
    k, v, w = history.k, history.v, 0 if win.k is None else win.k.shape[-2]
    kernels, vg = triton_enabled(qi, use_kernels), rows_group_size(v)  # (the values' group may be their own)
    if history.pages is not None and k.codes.shape[1]:  # (one host sync where the grid has no bound yet)
        pages = history.pages
        check_paged_inputs(qi.float(), k, v, pages, win)
        if pages.max_len is None:
            pages = dataclasses.replace(pages, max_len=int(pages.lengths.max()) if qi.shape[0] else 0)
            history = dataclasses.replace(history, pages=pages)
    route = _int2_route(params, qi, win, history, kernels, vg, w)
    in_place = split is not None and rotated is not None and route == "kernels"
    if split is not None and rotated is not None:
        qi = q if in_place else q.index_select(1, split.int2_idx)
    full = coded = parts = ready = side = None
    if split is not None:
        # the retrieval heads first, on a side stream where there is one (joined below); where the INT2 heads' read
        # is a combine of the kernels, only their split launch: that combine merges their partials too
        side = _side_stream(q, triton_enabled(q, use_kernels))
        if side is not None:
            main = torch.cuda.current_stream(q.device)
            side.wait_stream(main)
        with contextlib.nullcontext() if side is None else torch.cuda.stream(side):
            if route in ("kernels", "paged") and settings.HEADS_DEFAULTS.merged:
                parts = _read_coded(params, q, window, history, scaling, out_dtype, softcap, sinks, use_kernels,
                                    partials=True)
                if parts is not None and side is not None:
                    ready = torch.cuda.Event()
                    ready.record(side)
            if parts is None:
                coded = _read_coded(params, q, window, history, scaling, out_dtype, softcap, sinks, use_kernels)
        if route in ("kernels", "paged"):  # (the references return the INT2 heads' rows: merged below)
            full = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    out = _read_int2(route, params, qi, win, history, scaling, out_dtype, rotated, softcap, si, use_kernels, full,
                     parts, ready, in_place)
    if split is None:  # (no INT2 head: an empty output, the caller merges the retrieval heads it reads itself)
        return out if out is not None else torch.empty(qi.shape, dtype=out_dtype, device=qi.device)
    if side is not None:  # (the join: the output's rows and the partials are read on this stream from here on)
        main.wait_stream(side)
        for t in (coded,) if parts is None else parts[:3]:
            t.record_stream(main)
    if parts is not None:  # (the combine wrote every row)
        return full
    if full is not None and out is full:  # (the launcher wrote the INT2 heads' rows in place)
        return full.index_copy_(1, split.coded_idx, coded)
    return merge_heads(out, coded, split.int2_idx, split.coded_idx, q.shape[1])


def _int2_route(params: KVParams, qi, win: Window, history: History, kernels: bool, vg: int, w: int) -> str:
    """Which read serves the INT2 heads: ``none`` (no INT2 head), ``paged`` / ``kernels`` (the launcher),
    ``paged-reference`` / ``reference``, or ``empty`` (a paged batch with nothing to attend to)."""
    from . import decode_triton as dt
    k = history.k
    if not k.codes.shape[1]:
        return "none"
    if history.pages is not None:
        if not (kernels and paged_supported(qi, k, history.v, params.group_size, win.k)):
            return "paged-reference"
        empty = qi.shape[0] == 0 or (history.pages.max_len == 0 and w == 0)
        return "empty" if empty else "paged"
    ok = kernels and dt.kernel_supported(qi, k, params.group_size, history.key_mask, win.mask, w, vg)
    return "kernels" if ok else "reference"


def _read_int2(route: str, params: KVParams, qi, win: Window, history: History, scaling, out_dtype, rotated, softcap,
               si, use_kernels, full, parts, ready, in_place=False):
    """The INT2 heads' read (:func:`decode`'s arguments for them) on ``route``; ``full``: the layer's output buffer,
    ``parts``: the retrieval heads' partials for the launcher's combine (``ready``: their stream's event);
    ``in_place``: ``qi`` is the layer's query, read at the INT2 heads' KV heads."""
    from . import decode_triton as dt
    from .query_triton import query_kernel_supported
    if route == "none":
        return None
    extra = dict(out=full, coded=parts, coded_ready=ready)
    if route == "paged":  # (the float32 query: the window's logits as the store has always read them)
        return dt.decode_attention_triton(params, qi.float(), win, history, scaling, out_dtype, **extra)
    if route == "paged-reference":
        return paged_decode_batched(params, qi.float(), win, history, scaling, out_dtype)
    if route == "empty":  # nothing to attend to
        return torch.zeros(qi.shape, device=qi.device, dtype=out_dtype)
    if (route == "kernels" and rotated is None and history.n_valid is None and not torch.compiler.is_compiling()
            and query_kernel_supported(qi)):
        return dt.decode_attention_triton(params, qi, win, history, scaling, out_dtype, sinks=si, softcap=softcap,
                                          **extra)
    if rotated is None:  # the kernels' rotation where the launcher reads a device-side length
        rotate = rotate_query if history.n_valid is not None else rotate_query_reference
        rotated = rotate(qi, params.r_k, params.mu_k, *(() if history.n_valid is None else (use_kernels,)))
    if route == "kernels":
        return dt.decode_attention_triton(params, qi, win, history, scaling, out_dtype,
                                          rotated=(rotated[0].float().contiguous(), rotated[1]), sinks=si,
                                          softcap=softcap, q_at_kv_heads=in_place, **extra)
    return decode_attention_reference(params, qi, win.gathered(), history.cut(), scaling, out_dtype,
                                      rotated=rotated, softcap=softcap, sinks=si)


def _read_coded(params: KVParams, q, window: Window, history: History, scaling, out_dtype, softcap, sinks,
                use_kernels, partials: bool = False):
    """``[B, P, M, D]`` in ``out_dtype``: the retrieval heads' coded history read in place (through the block tables
    when paged) and the exact window; ``partials``: their split launch's partials instead, or None
    (:func:`~oscar_hf.kernels.heads_attention.heads_decode_partials`)."""
    split, pages = params.heads, history.pages
    lo = history.start if pages is None else torch.zeros_like(pages.lengths, dtype=torch.long)
    hi = pages.lengths if pages is not None else history.n_valid
    if pages is None and hi.device.type == "cpu":  # (a CPU reference reads only the filled part)
        hi = int(hi)
    read = heads_decode_partials if partials else functools.partial(heads_decode_attention, out_dtype=out_dtype)
    coded = read(q, split.coded_idx, history.coded, split.bits, (lo, hi), window, scaling, pages=pages,
                 softcap=softcap, use_kernels=use_kernels,
                 sinks=None if sinks is None else sinks.index_select(0, split.coded_idx))
    return coded if partials else coded.to(out_dtype)
