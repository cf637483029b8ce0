"""Host side of the split-K decode attention over the packed INT2 history: plan the grid and launch the kernels.

Entry points (each takes ``defaults``, a :class:`~oscar_hf.kernels.plan.DecodeDefaults`; the dispatcher in
:mod:`~oscar_hf.kernels.int2_attention` calls them only for the shapes :func:`kernel_supported` accepts and falls back
to the torch reference otherwise):

* :func:`history_partial_triton` -- the contract of ``int2_attention.history_partial_reference``: online-softmax
  partials ``(m, l, acc)`` of the history in the rotated value space. Two launches: the split kernel
  (:mod:`~oscar_hf.kernels.decode_split`, grid ``(B * Hk, S)``), then the combine (:mod:`~oscar_hf.kernels.decode_combine`,
  one program per query row).
* :func:`decode_attention_triton` -- the whole decode attention of one layer: INT2 history + a full-precision window
  (sink + recent, unrotated) -> normalized output in the value space. The split kernel gets extra programs for the
  window (which then runs concurrently with the history); the combine merges history and window partials, rotates
  the merged history row back (``acc R_Vᵀ + l mu_V``) and normalizes.
* :func:`decode_attention_rotating_triton` -- the same op from the *unrotated* query (the dynamic cache's attention):
  the op launches the query rotation itself.

Where the history runs on the Gluon kernel (:mod:`~oscar_hf.kernels.decode_gluon`: CUDA, D = 128, G = 64, <= 8 query
rows per KV head, bf16 metadata, no key mask, at least ``gluon_min_work`` history token-heads), the split kernel runs
the window programs only (``PID_OFF``); from the unrotated query the op is three launches -- the rotation with the
window programs (``_prologue_kernel``), the Gluon history, the combine -- with programmatic dependent launch between
them (sm_90+): the history's first loads under the rotation, the combine's launch under the history's tail, and the
history programs waiting for counters their head's rotation programs raise (``QFLAG``), not for the rotation's grid.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from oscar_hf.quant import QuantizedRows

from .decode_combine import _combine_kernel
from .decode_split import _prologue_kernel, _split_kernel
from .plan import (DEFAULTS, M_PAD_MIN, cdiv, combine_shape, cuda_major, device_sms, few_rows, gluon_plan,
                   long_splits, merge_step, num_splits, pow2_at_least, pow2_below_within, resident_programs,
                   wave_splits)
from .query_triton import C_BLOCK as ROT_C_BLOCK
from .query_triton import Q8_FIELDS, Q8_TILE_BYTES, launch_rotation, rotation_args, rotation_strides

LOG2E = 1.4426950408889634


def _mask_4d(mask, b, hk, n):
    """``mask`` (None or bool broadcastable to [B, Hk, 1, N]) -> (uint8 view expanded to [B, Hk, 1, N], ok)."""
    if mask is None:
        return None, True
    if mask.dim() != 4 or mask.shape[2] != 1 or mask.shape[3] != n or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, hk):
        return None, False
    if mask.dtype != torch.bool:  # additive float masks etc.: the reference decides
        return None, False
    m = mask.expand(b, hk, 1, n)
    # Eager: a free uint8 view. Compiled (static cache): a small uint8 copy, since the functionalized
    # graph must not see a kernel argument that aliases a bool tensor.
    return (m.to(torch.uint8) if torch.compiler.is_compiling() else m.view(torch.uint8)), True


def kernel_supported(q_rot, k: QuantizedRows, group_size: int, key_mask) -> bool:
    """Shapes the kernels serve (anything else: the reference)."""
    b, hk, m, d = q_rot.shape
    n = k.codes.shape[-2]
    pow2 = lambda x: x > 0 and (x & (x - 1)) == 0  # noqa: E731
    return (
        pow2(d) and 64 <= d <= 256 and pow2(group_size) and group_size <= d and d % group_size == 0
        and 1 <= m <= 64 and _mask_4d(key_mask, b, hk, n)[1]
    )


def _rows_layout(x: QuantizedRows) -> QuantizedRows:
    """The kernel reads codes with contiguous bytes per token and metadata as contiguous
    ``[token, group]`` rows with one shared layout for scale and zero (what the cache's storage
    and its ``[:, :, :N]`` views are); anything else is copied once."""
    codes, scale, zero = x
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    ng = scale.shape[-1]
    if scale.stride(-1) != 1 or scale.stride(-2) != ng or zero.stride() != scale.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    return QuantizedRows(codes, scale, zero)


def _pairable(k: QuantizedRows, v: QuantizedRows, d: int, group_size: int) -> bool:
    """Whether the deferred loop may read both groups' bf16 scale (zero) of a token as one aligned 4-byte word."""
    return d // group_size == 2 and all(
        t.dtype == torch.bfloat16 and t.data_ptr() % 4 == 0 and all(st % 2 == 0 for st in t.stride()[:-1])
        for t in (k.scale, k.zero, v.scale, v.zero))



_READY = {}  # device -> [int32 counters of QFLAG (prologue -> history), zero between calls; the last stream]


def _ready_counters(dev: torch.device, n: int):
    """``n`` zeroed int32 counters for the prologue -> history handoff (``QFLAG``), one buffer per
    device: each call's combine sets them back to 0, so successive calls reuse them. A call from another stream than
    the last one's first waits for that stream's work (the last call's combine) -- except while a CUDA graph is being
    captured, whose replays must then not overlap the op on another stream. None while capturing if no buffer that
    large exists yet (the call then takes the PDL wait; allocating here would capture a memset into every replay)."""
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
    """Around the launches after the prologue raised ``ready``'s counters: if one fails (say, a kernel that does not
    compile), the counters are set back to 0 here (the combine that would have done it never runs), so that the next
    call's history cannot take them for its own prologue's and read its operands before they are written."""
    try:
        yield
    except BaseException:
        if ready is not None:
            ready.zero_()
        raise



@functools.lru_cache(maxsize=None)
def _gluon_module():
    """kernels/decode_gluon.py, or None where this Triton has no Gluon (it needs ``triton.experimental.gluon``)."""
    try:
        from . import decode_gluon
    except Exception:  # noqa: BLE001 -- an older Triton: the split kernel serves every shape
        return None
    return decode_gluon


def _fused_prologue(gluon: bool) -> bool:
    """Whether the op from the unrotated query launches the rotation with the window programs (``_prologue_kernel``)
    where it has both history and window: on the Gluon path, whose window programs leave the history's launch anyway
    (tests force it on the split-kernel path, to run that launch under the interpreter)."""
    return gluon


def _launch(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, window=None, defaults=DEFAULTS,
            n_valid=None, splits=None, rotate=None):
    """Shared host code; ``window`` = (q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype) or None.
    ``rotate``: None (``q_rot`` / ``qk_offset`` hold the rotated query), or ``(qf, r_k, mu_k)`` from
    :func:`~oscar_hf.kernels.query_triton.rotation_args` (``q_rot`` / ``qk_offset`` are its empty outputs): the
    query is rotated here, by the first launch -- on the Gluon path the same launch as the window programs
    (:func:`_prologue_kernel`), so that the op takes three launches, not four.
    ``n_valid``: None, or a 0-d int device tensor (history entries ``< n_valid`` are valid; the grid is
    sized by the capacity and ``splits`` history programs per (row, head), so that a CUDA graph of
    this call stays valid while the cache grows)."""
    df = defaults
    b, hk, m, d = q_rot.shape
    n = k.codes.shape[-2]
    dev = q_rot.device
    q_rot = q_rot.float()
    if q_rot.stride(-1) != 1:
        q_rot = q_rot.contiguous()
    k, v = _rows_layout(k), _rows_layout(v)
    if start is None:
        start = torch.zeros(b, dtype=torch.int32, device=dev)
    elif not isinstance(start, torch.Tensor):
        start = torch.full((b,), int(start), dtype=torch.int32, device=dev)
    start = start.to(device=dev).reshape(b)
    kmask, _ = _mask_4d(key_mask, b, hk, n)
    if qk_offset is not None:
        qk_offset = qk_offset.float().expand(b, hk, m)

    m_pad = pow2_at_least(m, M_PAD_MIN)
    # the defaults were tuned for D = 128 and <= 16 query rows per KV head; other shapes take 64-token blocks (larger
    # tiles would spill registers there)
    block_n = df.block_n if (d == 128 and m_pad <= 16) else 64
    # the deferred loop: G >= D/4 (each plane inside one group) and at most 16 query rows per KV head (its
    # elementwise [BLOCK_N, M_PAD] tiles would spill registers beyond); the dequant loop serves the rest
    deferred = group_size >= d // 4 and m_pad <= 16
    # the register cap was measured for the deferred loop's default tile only; the static cache's variant (length
    # read on the device) would spill 184 bytes under it (tests/kernels/test_compile_sm90.py)
    maxnreg = df.maxnreg if (n_valid is None and deferred and d == 128) else None
    bh = b * hk
    pairable = _pairable(k, v, d, group_size)
    # the Gluon kernel pays off from ~0.5 M history token-heads per call (docs/kernels.md); below that the split
    # kernel runs everything
    glu = _gluon_module() if (q_rot.is_cuda and b * hk * n >= df.gluon_min_work) else None
    if glu is not None and not glu.gluon_supported(q_rot, k, v, group_size, kmask, pairable):
        glu = None
    gp = None
    if glu is not None:
        # the Gluon kernel's step (16 or 32 tokens) and residency; the static cache's `splits` (sized for the split
        # kernel) are not used: its grid follows from the capacity alone, so it is just as fixed
        gp = gluon_plan(df, glu.tokens_per_step(m), n, bh, dev)
        block_n = gp.block_n
        splits = None
    few = few_rows(bh * m, dev)  # combine programs (one per query row) fewer than SMs
    # (the static cache's own `splits` serve as given; the dynamic path sizes its grid itself)
    if n == 0:
        s_hist = 0
    elif n_valid is not None and splits:
        s_hist = splits
    elif gp is not None:
        s_hist = gp.splits
    else:
        s_hist = wave_splits(n, bh, device_sms(dev), block_n, df.min_split, df.max_waves,
                             resident_programs(df, maxnreg))
    if window is not None and few and not splits:  # the combine's tile of a row's splits full (splits_pow2_slack)
        s_hist = pow2_below_within(s_hist, df.splits_pow2_slack)
    if n_valid is not None:  # static: fixed grid, split bounds computed in the kernel from n_valid
        split_len = 0
    else:
        split_len = cdiv(cdiv(max(n, 1), max(s_hist, 1)), block_n) * block_n
        s_hist = cdiv(n, split_len) if n > 0 else 0  # drop splits that would be empty
    fused = window is not None
    if fused:
        q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype = window
        w = 0 if k_win is None else k_win.shape[-2]
        win_split = df.win_split
        # few window programs on the Gluon path: their own launch, after the history, is on the critical path
        if glu is not None and bh * cdiv(w, df.gluon_win_split) <= 8 * device_sms(dev):
            win_split = df.gluon_win_split
        s_win = cdiv(w, win_split)
        if w:
            q_win = q_win if q_win.stride(-1) == 1 else q_win.contiguous()
            k_win = k_win if k_win.stride(-1) == 1 else k_win.contiguous()
            v_win = v_win if v_win.stride(-1) == 1 else v_win.contiguous()
        wmask, _ = _mask_4d(win_mask, b, hk, w)
        r_v = r_v.to(device=dev, dtype=torch.float32).contiguous()
        mu_v = None if mu_v is None else mu_v.to(device=dev, dtype=torch.float32).contiguous()
    else:
        w, s_win, wmask, win_split = 0, 0, None, df.win_split
        q_win = k_win = v_win = r_v = mu_v = None
    s_tot = s_hist + s_win
    # programmatic dependent launch (sm_90+) on the Gluon path where this call launches the rotation itself, right
    # before the history (what the history reads before its wait must be complete before the launch it overlaps):
    # the history kernel loads its first steps, then waits for the rotation; each history program lets the combine
    # launch after its loop (the combine waits for the history grid's completion before it reads the partials)
    pdl = bool(glu is not None and s_hist and rotate is not None and dev.type == "cuda" and cuda_major(dev) >= 9)

    pm = torch.empty(bh, max(s_tot, 1), m, device=dev, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(bh, max(s_tot, 1), m, d, device=dev, dtype=torch.float32)
    ready = None
    if s_tot == 0:  # nothing to attend to: one empty partial
        pm.fill_(float("-inf"))
        pl.zero_()
        pacc.zero_()
        s_tot = 1
    else:
        z3 = (0, 0, 0)
        pid_off = 0
        fused_pro = bool(rotate is not None and s_hist and s_win and _fused_prologue(glu is not None))
        k8 = glu is not None and long_splits(df, n, s_hist)
        # the int8 key path's query operands built once per (row, KV head) by the prologue's rotation programs, one per
        # plane, not by every history program
        qpre = bool(fused_pro and k8)
        # ... and the history programs' wait for them: on counters the rotation programs raise, not the PDL wait for
        # the whole prologue grid
        ready = _ready_counters(dev, bh) if (qpre and pdl) else None
        c_rot = min(d, ROT_C_BLOCK)
        qp8 = qpf = None
        if qpre:
            tb = glu.tokens_per_step(m) // 16
            qp8 = torch.empty(bh * Q8_TILE_BYTES * tb, device=dev, dtype=torch.int8)
            qpf = torch.empty(bh * Q8_FIELDS, device=dev, dtype=torch.float32)
        if rotate is not None:
            qf_r, r_k_r, mu_k_r = rotate
            if fused_pro:  # rotation + window programs in one launch (the window's query is qf_r: see the caller)
                _prologue_kernel[(bh, d // c_rot + s_win)](
                    qf_r, r_k_r, mu_k_r, q_rot, qk_offset, k_win, v_win, wmask, pm, pl, pacc,
                    m, hk, s_hist, s_tot, w, win_split, float(scaling) * LOG2E, *rotation_strides(qf_r, mu_k_r),
                    *k_win.stride()[:3], *v_win.stride()[:3],
                    *(wmask.stride()[0], wmask.stride()[1], wmask.stride()[3]) if wmask is not None else z3,
                    D=d, M_PAD=m_pad, M_PAD_ROT=max(16, m_pad), C_BLOCK=c_rot, HAS_MU=mu_k_r is not None,
                    HAS_WMASK=wmask is not None, LOWP=int(q_rot.is_cuda), WIN_STAGES=df.gluon_win_stages,
                    PDL=int(pdl), QP8=qp8, QPF=qpf, QPRE=int(qpre), TB=glu.tokens_per_step(m) // 16 if qpre else 2,
                    READY=ready, QFLAG=int(ready is not None), num_warps=df.num_warps,
                )
            else:
                launch_rotation(qf_r, r_k_r, mu_k_r, q_rot, qk_offset)
        if glu is not None:  # history on the Gluon kernel; the split kernel runs the window programs only
            if s_hist:
                with _counters_reset_on_error(ready):
                    glu.launch_history(q_rot, k, v, start, qk_offset, n_valid, pm, pl, pacc, n, s_hist, s_tot,
                                       split_len, float(scaling) * LOG2E,
                                       stages=df.gluon_stages_long if k8 else df.gluon_stages, maxnreg=gp.maxnreg,
                                       pdl=pdl, k8=k8, qpre=(qp8, qpf) if qpre else None, ready=ready)
            pid_off = s_hist
        s_run = s_hist if fused_pro else s_tot  # the window programs ran in the prologue launch
        if s_run > pid_off:
            _split_kernel[(bh, s_run - pid_off)](
                q_rot, *k, *v, start, kmask, qk_offset, n_valid,
                q_win, k_win, v_win, wmask,
                pm, pl, pacc,
                n, m, hk, s_hist, s_tot, split_len, w, win_split, float(scaling) * LOG2E, pid_off,
                *q_rot.stride()[:3],
                *k.codes.stride()[:3], *k.scale.stride()[:2],
                *v.codes.stride()[:3], *v.scale.stride()[:2],
                *(kmask.stride()[0], kmask.stride()[1], kmask.stride()[3]) if kmask is not None else z3,
                *qk_offset.stride() if qk_offset is not None else z3,
                *(q_win.stride()[:3] if w else z3), *(k_win.stride()[:3] if w else z3), *(v_win.stride()[:3] if w else z3),
                *(wmask.stride()[0], wmask.stride()[1], wmask.stride()[3]) if wmask is not None else z3,
                D=d, G=group_size, M_PAD=m_pad, BLOCK_N=block_n,
                HAS_MASK=kmask is not None, HAS_OFF=qk_offset is not None,
                HAS_WIN=s_win > 0 and not fused_pro, HAS_WMASK=wmask is not None, LOWP=int(q_rot.is_cuda),
                DEFERRED=int(deferred), N_DEV=n_valid is not None,
                PAIR=int(pairable),  # NG = 2 bf16 metadata: one 4-byte load per token and tensor for both groups
                ASM=int(q_rot.is_cuda),  # inline PTX: not under the interpreter
                # D = 256 or 64 query rows: 8 warps (and 2 stages for D = 256) keep the tiles in registers
                # (checked without spills by tests/kernels/test_compile_sm90.py)
                num_warps=8 if (d > 128 or m_pad >= 64) else df.num_warps,
                num_stages=2 if d > 128 else df.num_stages,
                WIN_STAGES=df.gluon_win_stages if pid_off else 1, WIN_ONLY=int(pid_off > 0),
                **({"maxnreg": maxnreg} if (maxnreg and glu is None) else {}),
            )
    if fused:
        cs = combine_shape(df, d, bh * m, s_hist, s_win, dev, few)
        out = torch.empty(b, hk, m, d, device=dev, dtype=out_dtype)
        hoist = cs.hoist
        with _counters_reset_on_error(ready):
            _combine_kernel[(bh * m * cs.parts,)](
                pm, pl, pacc, None, None, out, r_v, mu_v, m, hk, s_hist, s_tot,
                D=d, S_BLOCK=cs.s_block, C_BLOCK=cs.c_block, FINAL=True, HAS_MUV=mu_v is not None, PDL=int(pdl),
                HOIST=int(hoist), SW_BLOCK=pow2_at_least(s_tot - s_hist, 1) if hoist else 1, PARTS=cs.parts,
                READY=ready, RESET=int(ready is not None),
                num_warps=cs.warps,
                **({"launch_pdl": True} if pdl else {}),
            )
        return out
    om = torch.empty(b, hk, m, device=dev, dtype=torch.float32)
    ol = torch.empty_like(om)
    oacc = torch.empty(b, hk, m, d, device=dev, dtype=torch.float32)
    _combine_kernel[(bh * m,)](
        pm, pl, pacc, om, ol, oacc, None, None, m, hk, s_tot, s_tot,
        D=d, S_BLOCK=merge_step(df, s_hist, s_win, few), C_BLOCK=min(d, 32), FINAL=False, HAS_MUV=False, PDL=0,
        HOIST=0, SW_BLOCK=1, num_warps=4,
    )
    return om, ol, oacc


def decode_supported(q, k: QuantizedRows, group_size: int, key_mask, win_mask=None, w: int = 0) -> bool:
    """:func:`kernel_supported`, and a window mask (over ``w`` window tokens) the kernels take."""
    b, hk = q.shape[:2]
    return kernel_supported(q, k, group_size, key_mask) and _mask_4d(win_mask, b, hk, w)[1]


def history_partial_triton(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, defaults=DEFAULTS):
    """Triton version of ``int2_attention.history_partial_reference`` (same contract, for the shapes
    :func:`kernel_supported` accepts). Two launches."""
    return _launch(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, defaults=defaults)


def decode_attention_triton(
    q_rot, k, v, start, key_mask, qk_offset, scaling, group_size,
    q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype=None, n_valid=None, splits=None, defaults=DEFAULTS,
):
    """Decode attention of one layer over INT2 history + full-precision window, in two launches (three with the
    Gluon history), for the shapes :func:`decode_supported` accepts.

    Args (``B`` batch, ``Hk`` KV heads, ``M`` query rows per KV head, ``D`` head_dim):
        q_rot, k, v, start, key_mask, qk_offset, scaling, group_size: as for ``history_partial``
            (history keys/values rotated by R_K/R_V and centered).
        q_win: ``[B, Hk, M, D]`` the *unrotated* queries (any float dtype), for the window keys.
        k_win, v_win: ``[B, Hk, W, D]`` unrotated full-precision window (sink + recent, one buffer),
            or None.
        win_mask: None or bool broadcastable to ``[B, Hk, 1, W]`` (False = masked).
        r_v: ``[Hk, D, D]`` float32 value rotation; mu_v: ``[Hk, D]`` or None.
        out_dtype: dtype of the result (default: q_win's).
        n_valid, splits: the static cache's device-side history length (0-d int tensor) and its
            fixed number of history splits (see :func:`_launch`); None for the dynamic cache.
    Returns ``[B, Hk, M, D]``: softmax attention over history and window, in the value space.
    Rows without any valid key are 0.
    """
    out_dtype = out_dtype or (q_win.dtype if q_win is not None else torch.float32)
    return _launch(
        q_rot, k, v, start, key_mask, qk_offset, scaling, group_size,
        window=(q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype), defaults=defaults, n_valid=n_valid,
        splits=splits,
    )


def decode_attention_rotating_triton(
    qf, r_k, mu_k, k, v, start, key_mask, scaling, group_size,
    k_win, v_win, win_mask, r_v, mu_v, out_dtype=None, n_valid=None, splits=None, defaults=DEFAULTS,
):
    """:func:`decode_attention_triton` from the unrotated query: ``qf [B, Hk, M, D]`` is rotated here (``q R_K`` and
    ``q · mu_K``, ``int2_attention.rotate_query_reference``; ``r_k [Hk, D, D]``, ``mu_k`` None, ``[Hk, D]`` or
    ``[B, Hk, D]``) and is also the window's query. Three launches on the Gluon path (rotation + window, history,
    combine), else the rotation's launch and :func:`decode_attention_triton`'s two. For the shapes
    :func:`decode_supported` and ``query_triton.query_kernel_supported`` accept."""
    out_dtype = out_dtype or qf.dtype
    qf_r, r_k_r, mu_k_r, q_rot, qk_off = rotation_args(qf, r_k, mu_k)
    return _launch(
        q_rot, k, v, start, key_mask, qk_off, scaling, group_size,
        window=(qf_r, k_win, v_win, win_mask, r_v, mu_v, out_dtype), defaults=defaults, n_valid=n_valid,
        splits=splits, rotate=(qf_r, r_k_r, mu_k_r),
    )


__all__ = [
    "history_partial_triton", "decode_attention_triton", "decode_attention_rotating_triton", "decode_supported",
    "kernel_supported", "num_splits",
]
