"""The combine kernel of the decode read path: the log-sum-exp merge of the split partials ``[B * Hk, S_TOT, M]``
(``m``, ``l``, log2 units) and ``[B * Hk, S_TOT, M, D]`` (``acc``), the history's rotated back, normalized.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .plan import settle_cache_keys
from .query_triton import _cols_mask, _load_padded

LN2 = 0.6931471805599453
_LN2 = tl.constexpr(LN2)  # jit code may only read constexpr globals


@triton.jit
def _history_window_weights(m_h, l_h, m_w, l_w):
    """The decode op's final merge of the history's ``(m_h, l_h)`` and the window's ``(m_w, l_w)`` (log2 units):
    ``(m_safe, w_h, w_w, w_h l_h, 1 / l_tot)`` with ``w = exp2(m_part - m)``, ``m_safe`` = the joint max (0 when both
    are -inf) and ``1 / l_tot`` 0 for a row without any valid key."""
    m = tl.maximum(m_h, m_w)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_h = tl.exp2(m_h - m_safe)
    w_w = tl.exp2(m_w - m_safe)
    lh = w_h * l_h
    l_tot = lh + l_w * w_w
    return m_safe, w_h, w_w, lh, tl.where(l_tot > 0, 1.0 / tl.where(l_tot > 0, l_tot, 1.0), 0.0)


@triton.jit
def _coded_row(CPM, CPL, CPACC, CHEAD, OACC, pid, M, C_P, C_S_TOT, HK_OUT, D: tl.constexpr, PARTS: tl.constexpr,
               C_M_PAD: tl.constexpr, C_S_BLOCK: tl.constexpr, CW: tl.constexpr, DENSE: tl.constexpr = 0):
    """A retrieval head's query row (``pid``: its program among theirs, ``(b, p, query row)`` x part): the log-sum-exp
    merge of its ``C_S_TOT`` partials ``[B * P, C_S_TOT, C_M_PAD(, D)]`` (already in the value space: no rotation),
    normalized (0 for a row without a valid key), into channels ``[pc D / PARTS, (pc + 1) D / PARTS)`` (``CW``: their
    count padded to a power of two) of its output row at KV head ``CHEAD[p]`` of ``HK_OUT`` (``DENSE``: of the
    retrieval heads' own ``[B, P, M, D]`` output, ``CHEAD`` unread); ``C_S_BLOCK`` partials a step."""
    row = pid // PARTS  # = bp * M + mm
    bp = row // M
    mm = row % M
    if DENSE:
        orow = row
    else:
        orow = ((bp // C_P) * HK_OUT + tl.load(CHEAD + bp % C_P)) * M + mm
    offs_s = tl.arange(0, C_S_BLOCK)
    offs_c = (pid % PARTS) * (D // PARTS) + tl.arange(0, CW)  # this program's channels
    cols = tl.arange(0, CW) < D // PARTS
    base = bp.to(tl.int64) * C_S_TOT * C_M_PAD + mm  # partial (bp, s, mm) lives at base + s * C_M_PAD
    m_run = tl.max(tl.full((C_S_BLOCK,), float("-inf"), tl.float32), 0)
    l_run = tl.sum(tl.zeros((C_S_BLOCK,), tl.float32), 0)
    acc = tl.zeros((CW,), tl.float32)
    for s0 in range(0, C_S_TOT, C_S_BLOCK):
        ok = s0 + offs_s < C_S_TOT
        part = base + (s0 + offs_s) * C_M_PAD
        mv = tl.load(CPM + part, mask=ok, other=float("-inf"))
        lv = tl.load(CPL + part, mask=ok, other=0.0)
        av = tl.load(CPACC + part[:, None] * D + offs_c[None, :], mask=ok[:, None] & cols[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(mv, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(mv - m_safe)  # [C_S_BLOCK]
        alpha = tl.exp2(m_run - m_safe)  # 0 while m_run = -inf
        l_run = l_run * alpha + tl.sum(w * lv, 0)
        acc = acc * alpha + tl.sum(w[:, None] * av, 0)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    tl.store(OACC + orow.to(tl.int64) * D + offs_c, out.to(OACC.dtype.element_ty), mask=cols)


@triton.jit(do_not_specialize=["M", "S_HIST", "S_TOT", "C_S_TOT", "N_INT2"])  # (as _split_kernel's lengths)
def _combine_kernel(
    PM, PL, PACC, OM, OL, OACC, RV, MUV, M, Hk, S_HIST, S_TOT,
    D: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, FINAL: tl.constexpr, HAS_MUV: tl.constexpr,
    PDL: tl.constexpr = 0, HOIST: tl.constexpr = 0, SW_BLOCK: tl.constexpr = 1, PARTS: tl.constexpr = 1,
    READY=None, RESET: tl.constexpr = 0, DP: tl.constexpr = 0, OHEAD=None, HK_OUT=1, HAS_OHEAD: tl.constexpr = 0,
    CPM=None, CPL=None, CPACC=None, CHEAD=None, C_P=1, C_S_TOT=1, N_INT2=0, C_M_PAD: tl.constexpr = 1,
    C_S_BLOCK: tl.constexpr = 1, CW: tl.constexpr = 1, HAS_CODED: tl.constexpr = 0,
):
    """Program ``(b, h, query row)`` x part ``pc < PARTS`` (channels ``[pc D / PARTS, (pc + 1) D / PARTS)``): merges
    history splits ``[0, S_HIST)`` and window splits by log-sum-exp (docs/kernels.md §3.5; ``RESET`` §3.6, ``OHEAD``
    §3.9). ``FINAL``: the output (0 for rows without a valid key); else ``m`` (natural units), ``l``, ``acc``.
    ``HAS_CODED``: programs from ``N_INT2`` on merge the layer's retrieval heads' partials instead (:func:`_coded_row`),
    so that their rows need no combine of their own (§3.9)."""
    if HAS_CODED and tl.program_id(0) >= N_INT2:
        _coded_row(CPM, CPL, CPACC, CHEAD, OACC, tl.program_id(0) - N_INT2, M, C_P, C_S_TOT, HK_OUT, D, PARTS,
                   C_M_PAD, C_S_BLOCK, CW)
    else:
        row = tl.program_id(0) // PARTS  # = bh * M + mm
        c_lo = (tl.program_id(0) % PARTS) * (D // PARTS)  # this program's first output channel
        bh = row // M
        mm = row % M
        h = bh % Hk
        DPAD: tl.constexpr = D if DP == 0 else DP
        orow = row  # the output row
        if HAS_OHEAD:
            orow = ((bh // Hk) * HK_OUT + tl.load(OHEAD + h)) * M + mm
        offs_s = tl.arange(0, S_BLOCK)
        offs_d = tl.arange(0, DPAD)
        base = bh.to(tl.int64) * S_TOT * M + mm  # partial (bh, s, mm) lives at base + s * M
        if FINAL and C_BLOCK == D:
            r_all = tl.load(RV + h * D * D + offs_d[:, None] * D + offs_d[None, :])  # issued before the partials
        real = (offs_d < D)[None, :]  # R_V's real columns (D = DPAD: every one, no mask)
        if FINAL and HOIST:  # R_V's first chunk of this program's channels
            r_next = _load_padded(RV + h * D * D + (c_lo + tl.arange(0, C_BLOCK))[:, None] * D + offs_d[None, :], real,
                                  DPAD > D)
        if PDL:  # programmatic dependent launch: the partials are ready once the grid before this one completed
            gdc_wait()
        if RESET:
            if tl.program_id(0) % (M * PARTS) == 0:  # (query row 0, part 0 of each (b, h))
                tl.store(READY + bh, 0)
        if FINAL and HOIST:  # the window partials [SW_BLOCK] / [SW_BLOCK, D], loaded with the history's
            offs_w = S_HIST + tl.arange(0, SW_BLOCK)
            wm = offs_w < S_TOT
            pm_w = tl.load(PM + base + offs_w * M, mask=wm, other=float("-inf"))
            pl_w = tl.load(PL + base + offs_w * M, mask=wm, other=0.0)
            a_w = tl.load(PACC + (base + offs_w[:, None] * M) * D + offs_d[None, :],
                          mask=_cols_mask(wm, offs_d, D, DPAD),
                          other=0.0)
        # history splits: online log-sum-exp (log2 units), blocks of S_BLOCK splits
        m_h = tl.max(tl.full((S_BLOCK,), float("-inf"), tl.float32), 0)
        l_h = tl.sum(tl.zeros((S_BLOCK,), tl.float32), 0)
        acc = tl.zeros((DPAD,), tl.float32)
        for s0 in range(0, S_HIST, S_BLOCK):
            sm = s0 + offs_s < S_HIST
            pm = tl.load(PM + base + (s0 + offs_s) * M, mask=sm, other=float("-inf"))
            pl = tl.load(PL + base + (s0 + offs_s) * M, mask=sm, other=0.0)
            a = tl.load(PACC + (base + (s0 + offs_s)[:, None] * M) * D + offs_d[None, :],
                        mask=_cols_mask(sm, offs_d, D, DPAD), other=0.0)
            m_new = tl.maximum(m_h, tl.max(pm, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_h - m_safe)  # 0 while m_h = -inf (empty splits so far)
            w = tl.exp2(pm - m_safe)
            l_h = l_h * alpha + tl.sum(w * pl, 0)
            acc = acc * alpha + tl.sum(w[:, None] * a, 0)
            m_h = m_new
        if FINAL and HOIST:
            # window (value space): its max, sum and weighted row [D] from the hoisted partials
            m_w = tl.max(pm_w, 0)
            w_w = tl.exp2(pm_w - tl.where(m_w == float("-inf"), 0.0, m_w))
            l_w = tl.sum(w_w * pl_w, 0)
            o_w = tl.reshape(tl.sum(w_w[:, None] * a_w, 0), (DPAD // C_BLOCK, C_BLOCK))  # [chunk, C_BLOCK]
            m_safe, w_h, ww, lh, inv = _history_window_weights(m_h, l_h, m_w, l_w)
            acc = acc * w_h
            for ci in tl.static_range(D // C_BLOCK // PARTS):
                offs_c = c_lo + ci * C_BLOCK + tl.arange(0, C_BLOCK)
                r = r_next
                if ci + 1 < D // C_BLOCK // PARTS:  # the next chunk's load in flight while this one is used
                    r_next = _load_padded(RV + h * D * D + (offs_c + C_BLOCK)[:, None] * D + offs_d[None, :], real,
                                          DPAD > D)
                o = tl.sum(r * acc[None, :], 1)
                if HAS_MUV:
                    o += lh * tl.load(MUV + h * D + offs_c)
                # this chunk of the window's row (a masked sum over the chunk axis: no slicing of register tensors)
                o += ww * tl.sum(tl.where(tl.arange(0, DPAD // C_BLOCK)[:, None] == c_lo // C_BLOCK + ci, o_w, 0.0), 0)
                tl.store(OACC + orow.to(tl.int64) * D + offs_c, (o * inv).to(OACC.dtype.element_ty))
        elif FINAL:
            # window splits (value space): their max and sum in one online pass; their acc rows per output chunk below
            m_w = tl.max(tl.full((S_BLOCK,), float("-inf"), tl.float32), 0)
            l_w = tl.sum(tl.zeros((S_BLOCK,), tl.float32), 0)
            for s0 in range(S_HIST, S_TOT, S_BLOCK):
                sm = s0 + offs_s < S_TOT
                pm = tl.load(PM + base + (s0 + offs_s) * M, mask=sm, other=float("-inf"))
                m_new = tl.maximum(m_w, tl.max(pm, 0))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_w = l_w * tl.exp2(m_w - m_safe) + tl.sum(tl.exp2(pm - m_safe) * tl.load(PL + base + (s0 + offs_s) * M,
                                                                                       mask=sm, other=0.0), 0)
                m_w = m_new
            m_safe, w_h, ww, lh, inv = _history_window_weights(m_h, l_h, m_w, l_w)
            acc = acc * w_h
            for c0 in tl.static_range(0, D // PARTS, C_BLOCK):
                offs_c = c_lo + c0 + tl.arange(0, C_BLOCK)
                # history: (acc R_Vᵀ)[c] = sum_d R_V[c, d] acc[d], plus l_h * mu_V[c]
                if C_BLOCK == D:
                    r = r_all
                else:  # [C_BLOCK, DP]: R_V's padded columns 0
                    r = _load_padded(RV + h * D * D + offs_c[:, None] * D + offs_d[None, :], real, DPAD > D)
                o = tl.sum(r * acc[None, :], 1)
                if HAS_MUV:
                    o += lh * tl.load(MUV + h * D + offs_c)
                # window splits: already in the value space
                for s0 in range(S_HIST, S_TOT, S_BLOCK):
                    sm = s0 + offs_s < S_TOT
                    w = tl.exp2(tl.load(PM + base + (s0 + offs_s) * M, mask=sm, other=float("-inf")) - m_safe)
                    a = tl.load(PACC + (base + (s0 + offs_s)[:, None] * M) * D + offs_c[None, :], mask=sm[:, None],
                                other=0.0)
                    o += tl.sum(w[:, None] * a, 0)
                tl.store(OACC + orow.to(tl.int64) * D + offs_c, (o * inv).to(OACC.dtype.element_ty))
        else:
            tl.store(OM + row, m_h * _LN2)
            tl.store(OL + row, l_h)
            tl.store(OACC + row.to(tl.int64) * D + offs_d, acc, mask=offs_d < D if DPAD > D else None)


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
