"""Host side of the split-K decode attention over the packed INT2 history: bring the tensors into the kernels'
layouts, take every decision from one :func:`~oscar_hf.kernels.plan.decode_plan`, launch what it says. Callers send
only the shapes :func:`kernel_supported` accepts. Paths, launches and PDL: docs/kernels.md §3.1-3.8.
"""
from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import torch

from oscar_hf.quant import QuantizedRows, rows_group_size

from .decode_combine import _combine_kernel
from .decode_split import _prologue_kernel, _split_kernel
from .kv import History, KVParams
from .plan import (DEFAULTS, KERNEL_HEAD_DIMS, DecodeShape, decode_plan, gluon_pays, group_fits, last_contiguous,
                   next_pow2, num_splits, plain_fits, pow2_at_least)
from .query_triton import C_BLOCK as ROT_C_BLOCK
from .query_triton import Q8_FIELDS, Q8_TILE_BYTES, launch_rotation, rotation_args, rotation_strides

LOG2E = 1.4426950408889634


def _mask_ok(mask, b, hk, n) -> bool:
    """Whether the kernels take ``mask``: None, or bool broadcastable to [B, Hk, 1, N] (shapes only: runs in traces)."""
    return mask is None or (mask.dim() == 4 and mask.shape[2] == 1 and mask.shape[3] == n and mask.shape[0] in (1, b)
                            and mask.shape[1] in (1, hk) and mask.dtype == torch.bool)


def _mask_4d(mask, b, hk, n):
    """``mask`` (None or bool broadcastable to [B, Hk, 1, N], :func:`_mask_ok`) -> a uint8 view ``[B, Hk, 1, N]``."""
    if mask is None:
        return None
    m = mask.expand(b, hk, 1, n)
    # compiled: a copy, since the functionalized graph must not see a kernel argument aliasing a bool tensor
    return m.to(torch.uint8) if torch.compiler.is_compiling() else m.view(torch.uint8)


def kernel_supported(q_rot, k: QuantizedRows, group_size: int, key_mask, win_mask=None, w: int = 0,
                     value_group: int | None = None) -> bool:
    """Shapes the kernels serve (else: the reference): ``KERNEL_HEAD_DIMS``, group sizes ``group_fits`` takes (the
    values' ``value_group``, None: ``group_size``), 1 to 64 query rows per KV head, a key mask (and a mask over ``w``
    window tokens) of one row per KV head, or none. 3-bit keys or a values' group of their own: power-of-two head
    dims (the dequant loop, docs/kernels.md §3.11)."""
    b, hk, m, d = q_rot.shape
    vg = group_size if value_group is None else value_group
    plain = k.hi is not None or vg != group_size
    return (d in KERNEL_HEAD_DIMS and group_fits(d, group_size) and group_fits(d, vg) and 1 <= m <= 64
            and (not plain or plain_fits(d))
            and _mask_ok(key_mask, b, hk, k.codes.shape[-2]) and _mask_ok(win_mask, b, hk, w))


def _rows_layout(x: QuantizedRows) -> QuantizedRows:
    """Rows in the kernels' layout (contiguous code bytes, ``[token, group]`` metadata shared by scale and zero);
    anything else is copied once."""
    codes, scale, zero = last_contiguous(x.codes), x.scale, x.zero
    if scale.stride(-1) != 1 or scale.stride(-2) != scale.shape[-1] or zero.stride() != scale.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    return QuantizedRows(codes, scale, zero)


def _meta_words(k: QuantizedRows, v: QuantizedRows) -> bool:
    """Whether bf16 metadata can be read as aligned 4-byte words: two groups of a token (even group count), or with
    one group a token, a token pair ``2j, 2j + 1`` (the Gluon kernel at D = 64)."""
    if k.scale.shape[-1] == 1:
        return all(t.dtype == torch.bfloat16 and t.data_ptr() % 4 == 0 and t.stride(-2) == 1
                   and all(st % 2 == 0 for st in t.stride()[:-2]) for t in (k.scale, k.zero, v.scale, v.zero))
    return k.scale.shape[-1] % 2 == 0 and all(
        t.dtype == torch.bfloat16 and t.data_ptr() % 4 == 0 and all(st % 2 == 0 for st in t.stride()[:-1])
        for t in (k.scale, k.zero, v.scale, v.zero))


_READY = {}  # device -> [int32 counters of QFLAG (prologue -> history), zero between calls; the last stream]


def _ready_counters(dev: torch.device, n: int):
    """``n`` zeroed int32 counters for the prologue -> history handoff (``QFLAG``), one buffer per device reset by each
    call's combine. A call on another stream first waits for the last one's. None while capturing a graph before a
    buffer that large exists (the PDL wait serves; allocating would capture a memset into every replay)."""
    dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    entry = _READY.get(dev)
    if torch.cuda.is_current_stream_capturing():
        return entry[0] if entry is not None and entry[0].numel() >= n else None
    stream = torch.cuda.current_stream(dev)
    if entry is not None and entry[1] != stream:
        stream.wait_stream(entry[1])  # (the buffer may still be in use there)
    if entry is None or entry[0].numel() < n:
        entry = [torch.zeros(max(n, 256), device=dev, dtype=torch.int32), stream]
        _READY[dev] = entry
    entry[1] = stream
    return entry[0]


@contextlib.contextmanager
def _counters_reset_on_error(ready):
    """Zero ``ready``'s counters if a launch after the prologue fails (the combine that would have never runs), so the
    next call cannot take them for its own prologue's."""
    try:
        yield
    except BaseException:
        if ready is not None:
            ready.zero_()
        raise


class _PagedRead(NamedTuple):
    """A paged history as the kernels read it: ``block_table [B, max_pages]``, ``hist_len [B]``, ``win_slot [B]``,
    ``page`` entries per page, ``max_len`` the grid's history bound."""

    block_table: torch.Tensor
    hist_len: torch.Tensor
    win_slot: torch.Tensor
    page: int
    max_len: int


@functools.lru_cache(maxsize=None)
def _gluon_module():
    """kernels/decode_gluon.py, or None where this Triton has no Gluon (it needs ``triton.experimental.gluon``)."""
    try:
        from . import decode_gluon
    except Exception:  # noqa: BLE001 -- an older Triton: the split kernel serves every shape
        return None
    return decode_gluon


def decode_attention_triton(params, q, window, history, scaling, out_dtype=None, *, rotated=None, softcap=None,
                            sinks=None, defaults=DEFAULTS, out=None, coded=None, coded_ready=None, q_at_kv_heads=False):
    """:func:`~oscar_hf.kernels.int2_attention.decode_attention_reference` on the kernels, launched as one
    :func:`~oscar_hf.kernels.plan.decode_plan` says: ``[B, Hk, M, D]`` in the value space (rows without a valid key
    are 0). ``rotated``: ``(q_rot [B, Hk, M, D], qk_offset [B, Hk, M] or None)``, or None: the op rotates the
    unrotated ``q [B, Hk, M, D]`` (the window's query) itself. ``params.r_v`` None: no window, the history's float32
    partials ``(m [B, Hk, M], l [B, Hk, M], acc [B, Hk, M, D])`` instead (:func:`history_partial_triton`). ``sinks``
    ``[Hk, M]``; ``softcap``: the split kernel's only. ``out``: None, or ``[B, Hk_layer, M, D]`` with
    ``window.kv_heads``: head ``h``'s rows go to KV head ``kv_heads[h]``. ``coded``: with ``out``, the layer's
    retrieval heads' :class:`~oscar_hf.kernels.kv.CodedPartials`, merged into ``out`` at their KV heads by this
    call's combine (once this stream has waited for ``coded_ready``, the event of the stream that made them).
    ``q_at_kv_heads``: with ``rotated`` and ``window.kv_heads``, ``q`` is the layer's ``[B, Hk_layer, M, D]`` query,
    whose rows the window programs read at head ``h``'s KV head in place (no copy of the INT2 heads' rows).
    """
    # the bundles' fields under the names the launches below use
    k, v, start, key_mask = history.k, history.v, history.start, history.key_mask
    n_valid, splits, paged = history.n_valid, history.splits, history.pages
    group_size, r_k, mu_k, r_v, mu_v = params.group_size, params.r_k, params.mu_k, params.r_v, params.mu_v
    (q_rot, qk_offset), q_win = (None, None) if rotated is None else rotated, q
    k_win, v_win, win_mask, win_slot, win_heads = ((None,) * 5 if window is None else
                                                   (window.k, window.v, window.mask, window.slot, window.kv_heads))
    if out is not None and (win_heads is None or out.shape[0] != q.shape[0] or out.shape[2:] != q.shape[2:]):
        raise ValueError(f"an output buffer {tuple(out.shape)} needs the window's kv_heads and [B, Hk, M, D] = "
                         f"{tuple(q.shape)} but for its heads")
    if coded is not None and (out is None or coded.acc.shape[0] != q.shape[0] * coded.heads.numel()
                              or coded.acc.shape[-1] != q.shape[-1] or coded.pm.shape[2] < q.shape[2]):
        raise ValueError("the retrieval heads' partials need an output buffer and [B * P, S, >= M, D] partials of this "
                         f"call's rows, got {tuple(coded.acc.shape)} for queries {tuple(q.shape)}")
    # the INT2 heads of a layer with retrieval heads read the layer's window (and write its output) in place
    wh = {} if win_heads is None else dict(WHEAD=win_heads, HAS_WHEAD=1)
    if q_at_kv_heads and (rotated is None or win_heads is None):
        raise ValueError("q_at_kv_heads reads the window's query at the window's kv_heads: it needs both rotated "
                         "queries and window.kv_heads")
    if paged is not None:  # (the pool's window: each row's mask [B, 1, 1, W] and slot [B]; none for partials)
        rows = q if q is not None else rotated[0]  # [B, Hk, M, D]
        if window is not None:
            win_mask = window.mask_2d().view(rows.shape[0], 1, 1, k_win.shape[-2])
        win_slot = win_slot if win_slot is not None else torch.arange(rows.shape[0], device=rows.device)
        paged = _PagedRead(last_contiguous(paged.table), paged.lengths, win_slot, k.codes.shape[-2], paged.max_len)
    rotate = q_rot is None
    if rotate:  # the kernels' layouts of the rotation's inputs, and its outputs (filled by the first launch below)
        q_win, r_k, mu_k, q_rot, qk_offset = rotation_args(q_win, r_k, mu_k)
    b, hk, m, d = q_rot.shape
    n = k.codes.shape[-2] if paged is None else paged.max_len
    bh = b * hk
    dev = q_rot.device
    q_rot = last_contiguous(q_rot.float())
    # 3-bit keys' high bits [B, Hk, N, D/8] and a values' group of their own: the dequant loop's (plan's ``plain``)
    k_hi, v_group = (None if k.hi is None else last_contiguous(k.hi)), rows_group_size(v)
    plain = k_hi is not None or v_group != group_size
    k, v = _rows_layout(k), _rows_layout(v)
    start = torch.zeros(b, dtype=torch.int32, device=dev) if start is None else start.to(device=dev).reshape(b)
    kmask = _mask_4d(key_mask, b, hk, n)
    if qk_offset is not None:
        qk_offset = qk_offset.float().expand(b, hk, m)
    # the Gluon kernel's layout checks only where the plan may take it (it does not cap logits)
    glu = _gluon_module() if (q_rot.is_cuda and not softcap and not plain and gluon_pays(defaults, bh, n)) else None
    gluon_ok = glu is not None and glu.gluon_supported(q_rot, k, v, group_size, kmask, _meta_words(k, v))
    if gluon_ok and paged is not None:  # (a step never straddles pages)
        gluon_ok = paged.page % glu.tokens_per_step(m, d) == 0
    window = r_v is not None
    w = 0 if (not window or k_win is None) else k_win.shape[-2]
    p = decode_plan(DecodeShape(b, hk, m, d, n, group_size, w), dev, window=window, static=n_valid is not None,
                    splits=splits, rotate=rotate, gluon_step=glu.tokens_per_step(m, d) if gluon_ok else 0,
                    sinks=sinks is not None, softcap=bool(softcap), page=paged.page if paged is not None else 0,
                    plain=plain, defaults=defaults)
    # the paged kernels' extra arguments: the block table, per-row lengths and window slots
    pk = {} if paged is None else dict(BT=paged.block_table, HLEN=paged.hist_len, WSLOT=paged.win_slot,
                                       sbt=paged.block_table.stride(0), PAGED=1, PAGE=paged.page)
    if k_hi is not None:
        pk.update(KH=k_hi, skhb=k_hi.stride(0), skhh=k_hi.stride(1), skhn=k_hi.stride(2), KBITS=3)
    if v_group != group_size:
        pk.update(GV=v_group)
    if sinks is not None and not window:
        raise ValueError("sinks are for the whole decode op (r_v given), not the history's partials")
    if w:
        q_win, k_win, v_win = (last_contiguous(x) for x in (q_win, k_win, v_win))
    wmask = None
    if window:
        wmask = _mask_4d(win_mask, b, hk, w)
        r_v = r_v.to(device=dev, dtype=torch.float32).contiguous()
        mu_v = None if mu_v is None else mu_v.to(device=dev, dtype=torch.float32).contiguous()
    qk_scale = float(scaling) * LOG2E
    cap = float(softcap) * LOG2E if softcap else 0.0  # the cap in the kernels' log2 units (SOFTCAP; 0: none)
    dp = next_pow2(d)  # D padded to a power of two (D = 96: 128) for the kernels' channel tiles
    z3 = (0, 0, 0)
    pm = torch.empty(bh, p.s_tot, m, device=dev, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(bh, p.s_tot, m, d, device=dev, dtype=torch.float32)
    ready = _ready_counters(dev, bh) if p.ready else None
    qp8 = qpf = None
    if p.qpre:  # the int8 key path's query operands, per (row, KV head): tiles and fields (query_triton.Q8_*)
        qp8 = torch.empty(bh * Q8_TILE_BYTES * p.tb, device=dev, dtype=torch.int8)
        qpf = torch.empty(bh * Q8_FIELDS, device=dev, dtype=torch.float32)
    if p.empty:  # nothing to attend to: one empty partial
        pm.fill_(float("-inf"))
        pl.zero_()
        pacc.zero_()
    if sinks is not None:  # the last partial of each row: the sink (m in log2 units, as the kernels write theirs)
        pm[:, -1].view(b, hk, m).copy_(sinks.float().to(dev).expand(b, hk, m) * LOG2E)
        pl[:, -1].fill_(1.0)
        pacc[:, -1].zero_()
    if rotate and not p.empty:
        if p.fused_prologue:  # rotation + window programs in one launch (the window's query is the rotation's)
            c_rot = min(d, ROT_C_BLOCK)
            _prologue_kernel[(bh, d // c_rot + p.s_win)](
                q_win, r_k, mu_k, q_rot, qk_offset, k_win, v_win, wmask, pm, pl, pacc,
                m, hk, p.s_hist, p.s_tot, w, p.win_split, qk_scale, *rotation_strides(q_win, mu_k),
                *k_win.stride()[:3], *v_win.stride()[:3],
                *(wmask.stride()[0], wmask.stride()[1], wmask.stride()[3]) if wmask is not None else z3,
                D=d, M_PAD=p.m_pad, M_PAD_ROT=max(16, p.m_pad), C_BLOCK=c_rot, HAS_MU=mu_k is not None,
                HAS_WMASK=wmask is not None, LOWP=int(q_rot.is_cuda), WIN_STAGES=defaults.gluon_win_stages,
                PDL=int(p.pdl), QP8=qp8, QPF=qpf, QPRE=int(p.qpre), TB=p.tb,
                READY=ready, QFLAG=int(ready is not None), DP=dp, SOFTCAP=cap, num_warps=defaults.num_warps,
                **({} if paged is None else dict(WSLOT=paged.win_slot, PAGED=1)), **wh)
        else:
            launch_rotation(q_win, r_k, mu_k, q_rot, qk_offset)
    if p.gluon and p.s_hist:  # the history on the Gluon kernel; the split kernel runs the window programs only
        with _counters_reset_on_error(ready):
            glu.launch_history(q_rot, qk_offset, History(k, v, start, n_valid=n_valid), (pm, pl, pacc), n, qk_scale,
                               plan=p, qpre=(qp8, qpf) if p.qpre else None, ready=ready, paged=paged)
    if p.split_programs:
        _split_kernel[(bh, p.split_programs)](
            q_rot, *k, *v, start, kmask, qk_offset, n_valid,
            q_win, k_win, v_win, wmask,
            pm, pl, pacc,
            n, m, hk, p.s_hist, p.s_tot, p.split_len, w, p.win_split, qk_scale, p.pid_off,
            *q_rot.stride()[:3],
            *k.codes.stride()[:3], *k.scale.stride()[:2],
            *v.codes.stride()[:3], *v.scale.stride()[:2],
            *(kmask.stride()[0], kmask.stride()[1], kmask.stride()[3]) if kmask is not None else z3,
            *qk_offset.stride() if qk_offset is not None else z3,
            *(q_win.stride()[:3] if w else z3), *(k_win.stride()[:3] if w else z3), *(v_win.stride()[:3] if w else z3),
            *(wmask.stride()[0], wmask.stride()[1], wmask.stride()[3]) if wmask is not None else z3,
            D=d, G=group_size, M_PAD=p.m_pad, BLOCK_N=p.block_n,
            HAS_MASK=kmask is not None, HAS_OFF=qk_offset is not None,
            HAS_WIN=p.split_window, HAS_WMASK=wmask is not None, LOWP=int(q_rot.is_cuda),
            DEFERRED=int(p.deferred), N_DEV=n_valid is not None,
            # NG = 2 bf16 metadata: both groups' scale (zero) of a token as one aligned 4-byte load
            PAIR=int(d // group_size == 2 and _meta_words(k, v)),
            ASM=int(q_rot.is_cuda),  # inline PTX: not under the interpreter
            num_warps=p.split_warps, num_stages=p.split_stages,
            WIN_STAGES=p.win_stages, WIN_ONLY=int(p.pid_off > 0), DP=dp, SOFTCAP=cap, QW_AT_HEAD=int(q_at_kv_heads),
            **({"maxnreg": p.maxnreg} if p.maxnreg else {}), **pk, **wh)
    cs = p.combine
    if window:
        out_dtype = out_dtype or (q_win.dtype if q_win is not None else torch.float32)
        oh = {} if out is None else dict(OHEAD=win_heads, HK_OUT=out.shape[1], HAS_OHEAD=1)
        if out is None:
            out = torch.empty(b, hk, m, d, device=dev, dtype=out_dtype)
        grid = n_int2 = bh * m * cs.parts
        if coded is not None:  # programs past the INT2 heads' merge the retrieval heads' partials (kernels.md §3.9)
            c_s, cw = coded.pm.shape[1], next_pow2(d // cs.parts)
            oh.update(CPM=coded.pm, CPL=coded.pl, CPACC=coded.acc, CHEAD=coded.heads, C_P=coded.heads.numel(),
                      C_S_TOT=c_s, N_INT2=n_int2, C_M_PAD=coded.pm.shape[2], CW=cw, HAS_CODED=1,
                      # (a tile no larger than the INT2 rows' [S_BLOCK, D]: the same registers)
                      C_S_BLOCK=min(pow2_at_least(c_s, 1), max(1, cs.s_block * dp // cw)))
            grid += coded.acc.shape[0] * m * cs.parts
            if coded_ready is not None:
                torch.cuda.current_stream(dev).wait_event(coded_ready)
        with _counters_reset_on_error(ready):
            _combine_kernel[(grid,)](pm, pl, pacc, None, None, out, r_v, mu_v, m, hk, p.s_hist, p.s_tot,
                                     D=d, S_BLOCK=cs.s_block, C_BLOCK=cs.c_block, FINAL=True,
                                     HAS_MUV=mu_v is not None, PDL=int(p.pdl), HOIST=int(cs.hoist),
                                     SW_BLOCK=p.sw_block, PARTS=cs.parts, READY=ready,
                                     RESET=int(ready is not None), DP=dp, **oh, num_warps=cs.warps,
                                     **{"launch_pdl": True} if p.pdl else {})
        return out
    om = torch.empty(b, hk, m, device=dev, dtype=torch.float32)
    ol = torch.empty_like(om)
    oacc = torch.empty(b, hk, m, d, device=dev, dtype=torch.float32)
    _combine_kernel[(bh * m,)](pm, pl, pacc, om, ol, oacc, None, None, m, hk, p.s_tot, p.s_tot, D=d, S_BLOCK=cs.s_block,
                               C_BLOCK=cs.c_block, FINAL=False, HAS_MUV=False, PDL=0, HOIST=0, SW_BLOCK=1, DP=dp,
                               num_warps=cs.warps)
    return om, ol, oacc


def history_partial_triton(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, defaults=DEFAULTS,
                           softcap=None):
    """``int2_attention.history_partial_reference`` on the kernels: :func:`decode_attention_triton` without a window."""
    return decode_attention_triton(KVParams(None, None, None, None, group_size), None, None,
                                   History(k, v, start, key_mask), scaling, rotated=(q_rot, qk_offset),
                                   softcap=softcap, defaults=defaults)


__all__ = ["decode_attention_triton", "history_partial_triton", "kernel_supported", "num_splits"]
