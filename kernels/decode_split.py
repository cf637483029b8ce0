"""The Triton split kernel of the decode read (:func:`_split_kernel`: history programs and window programs,
:func:`_window_split`, each one ``(m, l, acc)`` partial for ``decode_combine``) and the prologue
(:func:`_prologue_kernel`). Code layout: docs/kernels.md §1; prologue §3.2; loops and token validity §3.4.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from .decode_split_ops import (DF_LIM, _block_rows, _df_meta, _df_v_plane, _hi_rows, _int2_plane, _mapped,
                               _meta_tiles, _op, _rd_logits, _soft_cap, _softmax_step, _token_block, _window_split)
from .plan import settle_cache_keys
from .query_triton import _cols_mask, _rotate_block, _rotate_plane_q8


# The split counts are not specialized: layers with retrieval heads get other counts, and Triton's divisibility-by-16
# specialization compiled the kernel twice in a first call. They only index the partials (aligned by the constexpr D).
# Nor are the lengths and the window mask's / block table's strides (per-step temporaries): in eager serving steps
# they change from step to step, and each new combination of "== 1" / "divisible by 16" compiled the kernel again
# inside a served step. The codes' and windows' row strides stay specialized (their loads' alignment).
@triton.jit(do_not_specialize=["S", "S_TOT", "PID_OFF", "N", "M", "split_len", "W", "win_split", "swb", "swh", "swn",
                               "sbt"])
def _split_kernel(
    Q, KC, KS, KZ, VC, VS, VZ, START, KMASK, QKOFF, NPTR,  # history inputs (NPTR: device history length or None)
    QW, KW, VW, WMASK,  # full-precision window (decode_attention only)
    PM, PL, PACC,  # partials [B*Hk, S_TOT, M], [B*Hk, S_TOT, M], [B*Hk, S_TOT, M, D]
    N, M, Hk, S, S_TOT, split_len, W, win_split, qk_scale, PID_OFF,
    sqb, sqh, sqm,  # q_rot strides (last dim contiguous)
    skb, skh, skn, smkb, smkh,  # K codes [.., N, D/4] / K metadata [.., N, NG] strides (rows contiguous)
    svb, svh, svn, smvb, smvh,  # V likewise
    smb, smh, smn,  # key_mask strides
    sob, soh, som,  # qk_offset strides
    sqwb, sqwh, sqwm, skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,  # window strides
    D: tl.constexpr, G: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_OFF: tl.constexpr,
    HAS_WIN: tl.constexpr, HAS_WMASK: tl.constexpr, LOWP: tl.constexpr, DEFERRED: tl.constexpr,
    N_DEV: tl.constexpr, PAIR: tl.constexpr = 0, ASM: tl.constexpr = 0, WIN_STAGES: tl.constexpr = 1,
    WIN_ONLY: tl.constexpr = 0,
    BT=None, HLEN=None, WSLOT=None, sbt=None, PAGED: tl.constexpr = 0, PAGE: tl.constexpr = 1, WHEAD=None,
    HAS_WHEAD: tl.constexpr = 0, QW_AT_HEAD: tl.constexpr = 0,
    DP: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
    KH=None, skhb=0, skhh=0, skhn=0, KBITS: tl.constexpr = 2, GV: tl.constexpr = 0,
):
    """Program ``(bh, s)``: history split ``s < S`` (``DEFERRED`` loop, else dequant) or window split ``s - S`` of one
    (row, KV head), one partial each; ``WIN_ONLY``: window programs only (``PID_OFF = S``, ``WIN_STAGES``). Flags:
    docs/kernels.md §3.4 (``PAIR``, ``ASM``), §3.8 (``PAGED``), §3.9 (``WHEAD``, ``QW_AT_HEAD``), §3.10
    (``SOFTCAP``), §7 (``DP``), §3.11 (``KBITS`` 3: the keys' high bits ``KH [B, Hk, N, D/8]``, paged
    ``[pages, Hk, P, D/8]``; ``GV`` > 0: the values' own group; the dequant loop only)."""
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    GVV: tl.constexpr = G if GV == 0 else GV  # the values' group
    NGV: tl.constexpr = D // GVV
    DPAD: tl.constexpr = D if DP == 0 else DP
    D4P: tl.constexpr = DPAD // 4
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1) + PID_OFF  # > 0: only the window programs are launched (the history ran on Gluon)
    b = pid_bh // Hk
    h = pid_bh % Hk
    offs_m = tl.arange(0, M_PAD)
    offs_j = tl.arange(0, D4P)
    mrow = offs_m < M
    qmask = _cols_mask(mrow, offs_j, D4, D4P)  # [M_PAD, D4P] query rows x real channels of a plane
    m_i = tl.full((M_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_PAD,), tl.float32)
    part = (pid_bh.to(tl.int64) * S_TOT + pid_s) * M  # first partial row of this program
    # WIN_ONLY: the window programs of the Gluon path, a launch compiled without the history branch
    hist = False if WIN_ONLY else pid_s < S
    if hist:
        # ---------------- INT2 history split ----------------
        # q planes [M_PAD, D4P] (a tuple over the 4 planes, as acc), pre-scaled so that logits come out in log2 units.
        q_ptr = Q + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqm + offs_j[None, :]
        q = ()
        for P in tl.static_range(4):
            q = q + (_op(tl.load(q_ptr + P * D4, mask=qmask, other=0.0) * qk_scale, LOWP),)
        if HAS_OFF:
            off = tl.load(QKOFF + b.to(tl.int64) * sob + h * soh + offs_m * som, mask=mrow, other=0.0) * qk_scale
        else:
            off = tl.zeros((M_PAD,), tl.float32)
        acc = (tl.zeros((M_PAD, D4P), tl.float32),) * 4
        start = tl.load(START + b).to(tl.int32)
        if N_DEV:
            # static cache (CUDA graphs): N is the capacity, the length read on the device
            n_tot = tl.minimum(tl.load(NPTR).to(tl.int32), N)
            slen = tl.cdiv(tl.cdiv(tl.maximum(n_tot, 1), S), BLOCK_N) * BLOCK_N
        else:
            n_tot = N
            slen = split_len
        if PAGED:  # per-row history length; the grid is sized for the longest row (N)
            n_tot = tl.minimum(tl.load(HLEN + b).to(tl.int32), N)
        hi = tl.minimum(pid_s * slen + slen, n_tot)
        lo = tl.maximum(pid_s * slen, (start // BLOCK_N) * BLOCK_N)  # skip all-padding blocks
        # the (row, KV head)'s bases; paged: the row's block table gives the pages' offsets (_block_rows)
        rb = 0 if PAGED else b.to(tl.int64)
        bt_row = BT + b.to(tl.int64) * sbt if PAGED else BT
        kc_base = KC + rb * skb + h * skh
        ks_base = KS + rb * smkb + h * smkh
        kz_base = KZ + rb * smkb + h * smkh
        vc_base = VC + rb * svb + h * svh
        vs_base = VS + rb * smvb + h * smvh
        vz_base = VZ + rb * smvb + h * smvh
        if DEFERRED:
            # The K operands: the query planes as the B operands [D4, M_PAD] of the transposed logits.
            PPG: tl.constexpr = G // D4  # planes per group
            OFFS = 1.0 + 1023.0 * LOWP  # the code offset of _u_plane (1024 on the GPU)
            qf = ()
            for P in tl.static_range(4):
                qf = qf + (tl.load(q_ptr + P * D4, mask=qmask, other=0.0) * qk_scale,)
            # B operands [D4, M_PAD]: q_P / 4^P (exact power-of-two scaling before the fp16 rounding)
            qts = (_op(tl.trans(qf[0]), LOWP, True), _op(tl.trans(qf[1] * 0.25), LOWP, True),
                   _op(tl.trans(qf[2] * 0.0625), LOWP, True), _op(tl.trans(qf[3] * 0.015625), LOWP, True))
            cps = (OFFS * tl.sum(qts[0].to(tl.float32), 0), OFFS * tl.sum(qts[1].to(tl.float32), 0),
                   OFFS * tl.sum(qts[2].to(tl.float32), 0), OFFS * tl.sum(qts[3].to(tl.float32), 0))
            qss = (tl.sum(qf[0], 1), tl.sum(qf[1], 1), tl.sum(qf[2], 1), tl.sum(qf[3], 1))
            # Deferred softmax (docs/kernels.md §3.3): every block exponentiated against one fixed reference phi[m],
            # the max of the first block's valid logits (0 for rows without any); l, sum p z and the max kept as
            # [BLOCK_N, M_PAD] tiles, reduced after the loop; rerun once with the true max past DF_LIM (log2 units)
            offs_n, inb, valid = _token_block(lo, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
            kro0, kmo0, vro0, vmo0 = _block_rows(lo, hi, offs_n, inb, bt_row, skb, skn, smkb, svb, svn, smvb,
                                                 NG, PAGE, BLOCK_N, PAGED)
            kb = tl.load(kc_base + kro0 + offs_j[None, :], mask=_cols_mask(inb, offs_j, D4, D4P), other=0)
            st = _rd_logits(kb, qts, cps, qss, ks_base, kz_base, kmo0, inb, off,
                            PPG, BLOCK_N, M_PAD, LOWP)
            if SOFTCAP > 0:
                st = _soft_cap(st, SOFTCAP)
            phi = tl.max(tl.where(valid[:, None], st, float("-inf")), 0)
            phi = tl.where(phi == float("-inf"), 0.0, phi)
            # the tiles carried out of the rerun loop must exist before it (they are reset per pass)
            lt = tl.zeros((BLOCK_N, M_PAD), tl.float32)
            mt = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
            zt = (tl.zeros((BLOCK_N, M_PAD), tl.float32),) * 4  # sum p z per group: tile of the group's first plane
            run = 1
            while run > 0:
                lt = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                mt = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
                zt = (tl.zeros((BLOCK_N, M_PAD), tl.float32),) * 4
                acc = (tl.zeros((M_PAD, D4P), tl.float32),) * 4
                off_phi = off - phi
                # metadata of the first block, loaded before the loop (see below)
                offs_a, inb_a, valid_a = _token_block(lo, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                kro_p, kmo_p, vro_p, vmo_p = _block_rows(lo, hi, offs_a, inb_a, bt_row, skb, skn, smkb, svb, svn,
                                                         smvb, NG, PAGE, BLOCK_N, PAGED)
                md_a = _df_meta(ks_base, kz_base, vs_base, vz_base, kmo_p, vmo_p, inb_a, valid_a, NG, PAIR)
                for n0 in range(lo, hi, BLOCK_N):
                    # the synchronous scale / zero loads stalled the loop: the next block's issued one iteration
                    # ahead (code loads with loop-carried addresses are not software-pipelined, Triton 3.6)
                    ksp, kzp, vsp, vzp = md_a
                    offs_n, inb, valid = _token_block(n0, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                    offs_a, inb_a, valid_a = _token_block(n0 + BLOCK_N, hi, start, KMASK, b, h, smb, smh, smn,
                                                          BLOCK_N, HAS_MASK)
                    kro_n, kmo_n, vro_n, vmo_n = _block_rows(n0 + BLOCK_N, hi, offs_a, inb_a, bt_row, skb, skn,
                                                             smkb, svb, svn, smvb, NG, PAGE, BLOCK_N, PAGED)
                    md_a = _df_meta(ks_base, kz_base, vs_base, vz_base, kmo_n, vmo_n, inb_a, valid_a, NG, PAIR)
                    kro, meta, vro, vmeta = _block_rows(n0, hi, offs_n, inb, bt_row, skb, skn, smkb, svb, svn,
                                                        smvb, NG, PAGE, BLOCK_N, PAGED)
                    kb = tl.load(kc_base + kro + offs_j[None, :], mask=_cols_mask(inb, offs_j, D4, D4P), other=0)
                    if SOFTCAP > 0:  # the cap takes the whole logit (q·mu_K included), then the reference goes
                        st = _rd_logits(kb, qts, cps, qss, ks_base, kz_base, meta, inb, off, PPG, BLOCK_N, M_PAD,
                                        LOWP, 1, ksp, kzp, ASM and LOWP)
                        st = _soft_cap(st, SOFTCAP) - phi[None, :]
                    else:
                        # logits relative to the reference (off_phi = off - phi: once per row, not per logit)
                        st = _rd_logits(kb, qts, cps, qss, ks_base, kz_base, meta, inb, off_phi, PPG, BLOCK_N,
                                        M_PAD, LOWP, 1, ksp, kzp, ASM and LOWP)
                    st = tl.where(valid[:, None], st, float("-inf"))
                    mt = tl.maximum(mt, st)
                    p = tl.exp2(st)
                    lt += p
                    vb = tl.load(vc_base + vro + offs_j[None, :], mask=_cols_mask(valid, offs_j, D4, D4P), other=0)
                    a0, z0 = _df_v_plane(p, vb, 0, acc[0], zt[0], D4, G, PPG, LOWP, vsp, vzp, ASM and LOWP)
                    a1, z1 = _df_v_plane(p, vb, 1, acc[1], zt[1], D4, G, PPG, LOWP, vsp, vzp, ASM and LOWP)
                    a2, z2 = _df_v_plane(p, vb, 2, acc[2], zt[2], D4, G, PPG, LOWP, vsp, vzp, ASM and LOWP)
                    a3, z3 = _df_v_plane(p, vb, 3, acc[3], zt[3], D4, G, PPG, LOWP, vsp, vzp, ASM and LOWP)
                    acc, zt = (a0, a1, a2, a3), (z0, z1, z2, z3)
                m_i = tl.max(mt, 0) + phi  # (-inf stays -inf)
                over = tl.where(m_i == float("-inf"), 0.0, m_i - phi)
                run = 0
                if tl.max(tl.where(mrow, tl.abs(over), 0.0), 0) > DF_LIM:
                    phi = tl.where(m_i == float("-inf"), phi, m_i)
                    run = 1
            # rescale from phi to the true max (rows without valid tokens: l = 0, m = -inf)
            m_safe = tl.where(m_i == float("-inf"), phi, m_i)
            alpha = tl.exp2(phi - m_safe)
            l_i = tl.sum(lt, 0) * alpha
            zs = (tl.sum(zt[0], 0), tl.sum(zt[1], 0), tl.sum(zt[2], 0), tl.sum(zt[3], 0))
            acc = ((acc[0] * 0.5 + zs[0][:, None]) * alpha[:, None],  # / KP of _v_code_operand: 2, 8, 32, 32
                   (acc[1] * 0.125 + zs[1 - 1 % PPG][:, None]) * alpha[:, None],
                   (acc[2] * 0.03125 + zs[2 - 2 % PPG][:, None]) * alpha[:, None],
                   (acc[3] * 0.03125 + zs[3 - 3 % PPG][:, None]) * alpha[:, None])
        else:
            q0, q1, q2, q3 = q
            kh_base = KH + rb * skhb + h * skhh if KBITS == 3 else KH
            for n0 in range(lo, hi, BLOCK_N):
                offs_n, inb, valid = _token_block(n0, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                kro, kmo, vro, vmo = _block_rows(n0, hi, offs_n, inb, bt_row, skb, skn, smkb, svb, svn, smvb, NG,
                                                 PAGE, BLOCK_N, PAGED, NGV)
                # K: unpack + dequantize 4 planes, logits = sum_p q_p k_p^T (one accumulator).
                kb = tl.load(kc_base + kro + offs_j[None, :], mask=_cols_mask(inb, offs_j, D4, D4P), other=0)
                hb = 0
                if KBITS == 3:  # the high bits' bytes, lane j's byte j % (D/8) (docs/kernels.md §3.11)
                    hro = _hi_rows(n0, hi, offs_n, inb, bt_row, skhb, skhn, PAGE, BLOCK_N, PAGED)
                    hb = tl.load(kh_base + hro + (offs_j % (D // 8))[None, :], mask=_cols_mask(inb, offs_j, D4, D4P),
                                 other=0)
                ks_t, kz_t, ks_row, kz_row = _meta_tiles(ks_base, kz_base, offs_n, kmo, inb, NG, PAGED,
                                                         G % D4 == 0 or D4 % G == 0)
                s = tl.dot(q0, tl.trans(_int2_plane(kb, 0, ks_t, kz_t, ks_row, kz_row, inb, D4, G, NG, LOWP, D4P,
                                                    hb, KBITS)))
                s = tl.dot(q1, tl.trans(_int2_plane(kb, 1, ks_t, kz_t, ks_row, kz_row, inb, D4, G, NG, LOWP, D4P,
                                                    hb, KBITS)), s)
                s = tl.dot(q2, tl.trans(_int2_plane(kb, 2, ks_t, kz_t, ks_row, kz_row, inb, D4, G, NG, LOWP, D4P,
                                                    hb, KBITS)), s)
                s = tl.dot(q3, tl.trans(_int2_plane(kb, 3, ks_t, kz_t, ks_row, kz_row, inb, D4, G, NG, LOWP, D4P,
                                                    hb, KBITS)), s)
                p, alpha, m_i, l_i = _softmax_step(s + off[:, None], valid, m_i, l_i, SOFTCAP)
                p = _op(p, LOWP)
                # V: only valid tokens are read, invalid ones dequantize to exactly 0.
                vb = tl.load(vc_base + vro + offs_j[None, :], mask=_cols_mask(valid, offs_j, D4, D4P), other=0)
                vs_t, vz_t, vs_row, vz_row = _meta_tiles(vs_base, vz_base, offs_n, vmo, valid, NGV, PAGED,
                                                         GVV % D4 == 0 or D4 % GVV == 0)
                acc_ = ()
                for P in tl.static_range(4):
                    v = _int2_plane(vb, P, vs_t, vz_t, vs_row, vz_row, valid, D4, GVV, NGV, LOWP, D4P)
                    acc_ = acc_ + (tl.dot(p, v, acc[P] * alpha[:, None]),)
                acc = acc_
        a_ptr = PACC + (part + offs_m[:, None]) * D + offs_j[None, :]
        for P in tl.static_range(4):
            tl.store(a_ptr + P * D4, acc[P], mask=qmask)
        tl.store(PM + part + offs_m, m_i, mask=mrow)
        tl.store(PL + part + offs_m, l_i, mask=mrow)
    elif HAS_WIN:
        hw = _mapped(h, WHEAD, HAS_WHEAD)
        _window_split(QW, KW, VW, WMASK, PM, PL, PACC, b, _mapped(b, WSLOT, PAGED), h, hw,
                      part, (pid_s - S) * win_split, W, win_split, qk_scale,
                      sqwb, sqwh, sqwm, skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,
                      M, D, M_PAD, HAS_WMASK, LOWP, WIN_STAGES, DPAD, SOFTCAP, hw if QW_AT_HEAD else h)


@triton.jit(do_not_specialize=["M", "S", "S_TOT", "W", "win_split"])  # (as _split_kernel's)
def _prologue_kernel(
    Q, RK, MU, QR, QO,  # rotation: q [B, Hk, M, D] (also the window's query), R_K, mu_K -> q_rot, q . mu_K
    KW, VW, WMASK, PM, PL, PACC,  # window keys / values / mask -> its partials (slots S .. S_TOT - 1)
    M, Hk, S, S_TOT, W, win_split, qk_scale,
    sqb, sqh, sqm, smb, smh,
    skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,
    D: tl.constexpr, M_PAD: tl.constexpr, M_PAD_ROT: tl.constexpr, C_BLOCK: tl.constexpr, HAS_MU: tl.constexpr,
    HAS_WMASK: tl.constexpr, LOWP: tl.constexpr, WIN_STAGES: tl.constexpr, PDL: tl.constexpr = 0,
    QP8=None, QPF=None, QPRE: tl.constexpr = 0, TB: tl.constexpr = 2, READY=None, QFLAG: tl.constexpr = 0,
    DP: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0, WSLOT=None, PAGED: tl.constexpr = 0, WHEAD=None,
    HAS_WHEAD: tl.constexpr = 0,
):
    """The Gluon path's first launch, grid ``(B * Hk, D / C_BLOCK + S_TOT - S)``: programs ``j < D / C_BLOCK`` rotate
    column block ``j`` (``QPRE``: and write its int8 query operands, ``QFLAG``: then count in ``READY``), the rest are
    window programs (docs/kernels.md §3.2, §3.6); ``PAGED``: the window is slot ``WSLOT[b]``."""
    DPAD: tl.constexpr = D if DP == 0 else DP
    pid_bh = tl.program_id(0)
    j = tl.program_id(1)
    NROT: tl.constexpr = D // C_BLOCK
    if PDL:  # the history kernel may launch now: it loads its first steps, then waits for the query (or QFLAG)
        gdc_launch_dependents()
    if j < NROT:
        if QPRE:  # (C_BLOCK = 32: plane j)
            _rotate_plane_q8(Q, RK, MU, QR, QO, QP8, QPF, pid_bh, j, M, Hk, qk_scale, sqb, sqh, sqm, smb, smh,
                             D, M_PAD_ROT, TB, HAS_MU, LOWP)
            if QFLAG:  # every thread's stores before the release (the barrier), then one atomic for the program
                tl.debug_barrier()
                tl.atomic_add(READY + pid_bh, 1, sem="release", scope="gpu")
        else:
            _rotate_block(Q, RK, MU, QR, QO, pid_bh, j * C_BLOCK, M, Hk, sqb, sqh, sqm, smb, smh,
                          D, M_PAD_ROT, C_BLOCK, HAS_MU, DPAD)
    else:
        b = pid_bh // Hk
        h = pid_bh % Hk
        part = (pid_bh.to(tl.int64) * S_TOT + S + (j - NROT)) * M
        _window_split(Q, KW, VW, WMASK, PM, PL, PACC, b, _mapped(b, WSLOT, PAGED), h,
                      _mapped(h, WHEAD, HAS_WHEAD), part, (j - NROT) * win_split,
                      W, win_split, qk_scale, sqb, sqh, sqm, skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,
                      M, D, M_PAD, HAS_WMASK, LOWP, WIN_STAGES, DPAD, SOFTCAP, h)


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
