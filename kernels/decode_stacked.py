"""The "stacked" history loop of the split-K decode kernel (``CONFIG["loop"] = "stacked"``).

Why: with GQA a KV head has few query rows (``M`` = 4 for Hq=32, Hk=8), but the tensor cores need
16 columns, so the deferred loop's ``[BLOCK_N, 16]`` logit tile is three quarters padding -- and the
elementwise work on that tile (scale/zero, mask, exp2, max, sums, ``p s`` for the values) was the
largest share of the hot loop's instructions (``scripts/sass_report.py``).

The trick: fill the padding with *tokens* instead. With ``MP`` = M padded to a power of two (>= 4) and
``R = 16 // MP`` token classes, row ``r`` of a step's tile stands for the ``R`` consecutive tokens
``n0 + R r + i`` (``i < R``) and column ``(i, m)`` (index ``i * MP + m``) holds the logit of token
``n0 + R r + i`` for query row ``m``. The K dot gets it from

    A[r, (i, j)] = code of byte j of token n0 + R r + i   ([BQ, R*D/4]: R consecutive code rows,
                                                            one contiguous span of memory)
    B[(i, j), (i', m)] = [i == i'] q[m, j + P D/4]         ([R*D/4, 16]: block-diagonal query)

so the MMA does R times the multiply-adds of a plain ``[BQ, D/4] x [D/4, MP]`` product (the zeros of
B), which costs nothing that matters (the MMAs per token equal the deferred loop's), while the
elementwise tile ``[BQ, 16]`` now covers ``R * BQ`` tokens with no padding at all (``M`` = 4).
Values: ``acc[(i, m), c] += sum_r W[r, (i, m)] V[n0 + R r + i, c]`` is one dot with a block-diagonal
``[16, R*BQ]`` left operand (``W`` transposed, broadcast over the token classes and masked to its
own class) against the value codes gathered in class-major order (row ``i*BQ + r`` = token
``n0 + R r + i``); the R classes' rows are summed once after the loop.

Everything else is the deferred loop (``kernels/decode_triton.py``): the rowdot K operand
(``_u_plane``), one fixed reference ``phi`` per query row (the max of the split's first block) with
a rerun against the true max if some row strays more than ``DF_LIM`` from it, value codes as exact
bf16 ``KP * code`` (``_v_code_operand``), ``l``, ``max`` and ``sum p z`` kept as elementwise tiles
and reduced once after the loop.
"""
from __future__ import annotations

import triton
import triton.language as tl

DF_LIM = tl.constexpr(64.0)  # as in decode_triton: largest excess of a row's max over its reference (log2 units)


@triton.jit
def _cols(x, R: tl.constexpr, MP: tl.constexpr):
    """``[MP]`` per query row -> ``[R*MP]`` per stacked column ``(i, m)`` (the same for every class ``i``)."""
    return tl.reshape(tl.broadcast_to(x[None, :], (R, MP)), (R * MP,))


@triton.jit
def _fold_sum(x, R: tl.constexpr, MP: tl.constexpr):
    """``[R*MP]`` -> ``[MP]``: sum over the token classes."""
    return tl.sum(tl.reshape(x, (R, MP)), 0)


@triton.jit
def _fold_max(x, R: tl.constexpr, MP: tl.constexpr):
    return tl.max(tl.reshape(x, (R, MP)), 0)


@triton.jit
def _q_block_diag(qf, P: tl.constexpr, R: tl.constexpr, MP: tl.constexpr, D4: tl.constexpr, LOWP: tl.constexpr):
    """B operand of plane ``P`` (``[R*D4, R*MP]``, fp16 on the GPU): ``[i == i'] q_P[m, j] / 4^P``
    (the exact power-of-two scaling of the rowdot operand, see ``_u_plane``)."""
    qt = tl.trans(qf * (1.0 / (1 << (2 * P))))  # [D4, MP]
    ii = tl.arange(0, R)
    bd = tl.where(ii[:, None, None, None] == ii[None, None, :, None], qt[None, :, None, :], 0.0)  # [R, D4, R, MP]
    bd = tl.reshape(bd, (R * D4, R * MP))
    if LOWP:
        return bd.to(tl.float16)
    else:
        return bd


@triton.jit
def _u_code(bytes_, P: tl.constexpr, LOWP: tl.constexpr):
    """Codes of plane ``P`` as ``OFFS + 4^P code``: fp16 ``1024 + 4^P code`` from one and-or on the GPU
    (the rowdot K operand, ``_u_plane`` of decode_triton), float32 ``1 + 4^P code`` under the interpreter."""
    m = bytes_ & (3 << (2 * P))
    if LOWP:
        return (m.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    else:
        return m.to(tl.float32) + 1.0


@triton.jit
def _v_code(vb, P: tl.constexpr, LOWP: tl.constexpr):
    """Value codes of plane ``P`` as exact bf16 ``KP code``, ``KP = 2 * 4^min(P, 2)`` (``_v_code_operand`` of
    decode_triton: or-ed into the bit pattern of 256.0, minus 256)."""
    if P < 3:
        m = vb & (3 << (2 * P))
    else:
        m = (vb >> 2) & 0x30
    u = (m.to(tl.uint16) | 0x4380).to(tl.bfloat16, bitcast=True)
    if LOWP:
        return u - 256.0
    else:
        return u.to(tl.float32) - 256.0


@triton.jit
def _tokens(n0, hi, start, KMASK, b, h, smb, smh, smn, tok, HAS_MASK: tl.constexpr):
    """In-bounds and valid flags of a tile of token indices ``tok`` (any shape)."""
    inb = tok < hi
    valid = inb & (tok >= start)
    if HAS_MASK:
        km = tl.load(KMASK + b.to(tl.int64) * smb + h * smh + tok * smn, mask=inb, other=0)
        valid = valid & (km != 0)
    return inb, valid


@triton.jit
def _stk_logits(kc_base, ks_base, kz_base, n0, hi, tok_s, inb_s, skn, qbd, cps, qss, off_c,
                NG: tl.constexpr, PPG: tl.constexpr, R: tl.constexpr, BQ: tl.constexpr, D4: tl.constexpr,
                NC: tl.constexpr, LOWP: tl.constexpr, KROWS: tl.constexpr):
    """Stacked logits ``[BQ, NC]`` (log2 units, offset included) of tokens ``[n0, n0 + R*BQ)``: the K dot of
    the module doc per plane, and after the last plane of group ``g`` its scale / zero
    (``s (d - C_g) + z Qs_g``, the rowdot algebra) from ``[BQ, NC]`` metadata tiles (token of the column's class)."""
    rows = tl.arange(0, BQ)
    cols = tl.arange(0, R * D4)
    tok_k = n0 + R * rows
    kmask = (tok_k[:, None] + (cols // D4)[None, :]) < hi
    if KROWS:  # code rows contiguous (skn == D4): R consecutive rows are one span of R*D4 bytes
        kb = tl.load(kc_base + (tok_k.to(tl.int64) * D4)[:, None] + cols[None, :], mask=kmask, other=0)
    else:
        kb = tl.load(kc_base + tok_k.to(tl.int64)[:, None] * skn + ((cols // D4) * skn + cols % D4)[None, :],
                     mask=kmask, other=0)
    meta = tok_s.to(tl.int64) * NG
    st = tl.zeros((BQ, NC), tl.float32) + off_c[None, :]
    d = tl.zeros((BQ, NC), tl.float32)
    for P in tl.static_range(4):
        d = tl.dot(_u_code(kb, P, LOWP), qbd[P], d)
        if P % PPG == PPG - 1:  # last plane of group P // PPG
            sg = tl.load(ks_base + meta + P // PPG, mask=inb_s, other=0.0).to(tl.float32)
            zg = tl.load(kz_base + meta + P // PPG, mask=inb_s, other=0.0).to(tl.float32)
            cg = cps[P - PPG + 1]
            for j in tl.static_range(P - PPG + 2, P + 1):
                cg += cps[j]
            st += sg * (d - cg[None, :]) + zg * qss[P // PPG][None, :]
            d = tl.zeros((BQ, NC), tl.float32)
    return st


@triton.jit
def _stacked_history(
    q_ptr, QKOFF_ROW, HAS_OFF: tl.constexpr, qk_scale, M,
    kc_base, ks_base, kz_base, vc_base, vs_base, vz_base, skn, svn,
    start, lo, hi, KMASK, b, h, smb, smh, smn, HAS_MASK: tl.constexpr,
    PACC, PM, PL, part,
    D: tl.constexpr, G: tl.constexpr, MP: tl.constexpr, BLOCK_N: tl.constexpr, LOWP: tl.constexpr,
    KROWS: tl.constexpr,
):
    """History partials ``(m, l, acc)`` of one split ``[lo, hi)`` with the stacked loop, stored at rows
    ``part + m`` (``m < M``) of ``PM``/``PL``/``PACC``. ``q_ptr``: ``[MP, D/4]`` pointers of the query's
    plane 0 (row stride of q, planes ``D/4`` apart); ``QKOFF_ROW``: ``[MP]`` pointers of ``q . mu_K``."""
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    PPG: tl.constexpr = G // D4  # planes per group (each plane lies in one group: G >= D/4)
    R: tl.constexpr = 16 // MP  # token classes
    NC: tl.constexpr = R * MP  # = 16 stacked columns
    BQ: tl.constexpr = BLOCK_N // R  # tile rows per step
    OFFS = 1.0 + 1023.0 * LOWP  # the code offset of _u_code
    offs_m = tl.arange(0, MP)
    mrow = offs_m < M
    offs_j = tl.arange(0, D4)
    rows = tl.arange(0, BQ)
    cls = tl.arange(0, NC) // MP  # token class of each stacked column

    # query operands (built once): block-diagonal B per plane, its offset sums, the per-group row sums
    qf0 = tl.load(q_ptr + 0 * D4, mask=mrow[:, None], other=0.0) * qk_scale
    qf1 = tl.load(q_ptr + 1 * D4, mask=mrow[:, None], other=0.0) * qk_scale
    qf2 = tl.load(q_ptr + 2 * D4, mask=mrow[:, None], other=0.0) * qk_scale
    qf3 = tl.load(q_ptr + 3 * D4, mask=mrow[:, None], other=0.0) * qk_scale
    qbd = (_q_block_diag(qf0, 0, R, MP, D4, LOWP), _q_block_diag(qf1, 1, R, MP, D4, LOWP),
           _q_block_diag(qf2, 2, R, MP, D4, LOWP), _q_block_diag(qf3, 3, R, MP, D4, LOWP))
    cps = (OFFS * tl.sum(qbd[0].to(tl.float32), 0), OFFS * tl.sum(qbd[1].to(tl.float32), 0),
           OFFS * tl.sum(qbd[2].to(tl.float32), 0), OFFS * tl.sum(qbd[3].to(tl.float32), 0))
    qs = (tl.sum(qf0, 1), tl.sum(qf1, 1), tl.sum(qf2, 1), tl.sum(qf3, 1))
    if PPG == 1:
        qss = (_cols(qs[0], R, MP), _cols(qs[1], R, MP), _cols(qs[2], R, MP), _cols(qs[3], R, MP))
    elif PPG == 2:
        qss = (_cols(qs[0] + qs[1], R, MP), _cols(qs[2] + qs[3], R, MP))
    else:
        qss = (_cols(qs[0] + qs[1] + qs[2] + qs[3], R, MP),)
    if HAS_OFF:
        off = tl.load(QKOFF_ROW, mask=mrow, other=0.0) * qk_scale
    else:
        off = tl.zeros((MP,), tl.float32)
    off_c = _cols(off, R, MP)

    # phi: max of the first block's valid logits per query row (0 for rows without any there)
    tok_s = lo + R * rows[:, None] + cls[None, :]  # [BQ, NC] token of each stacked logit
    inb_s, valid_s = _tokens(lo, hi, start, KMASK, b, h, smb, smh, smn, tok_s, HAS_MASK)
    st = _stk_logits(kc_base, ks_base, kz_base, lo, hi, tok_s, inb_s, skn, qbd, cps, qss, off_c,
                     NG, PPG, R, BQ, D4, NC, LOWP, KROWS)
    phi = _fold_max(tl.max(tl.where(valid_s, st, float("-inf")), 0), R, MP)
    phi = tl.where(phi == float("-inf"), 0.0, phi)
    # value rows in class-major order: row k = i * BQ + r is token n0 + R r + i
    kv = tl.arange(0, R * BQ)
    vrow = R * (kv % BQ) + kv // BQ
    lt = tl.zeros((BQ, NC), tl.float32)
    mt = tl.full((BQ, NC), float("-inf"), tl.float32)
    zt0 = tl.zeros((BQ, NC), tl.float32)  # sum p z of value group g: tile of the group's first plane
    zt1 = tl.zeros((BQ, NC), tl.float32)
    zt2 = tl.zeros((BQ, NC), tl.float32)
    zt3 = tl.zeros((BQ, NC), tl.float32)
    acc0 = tl.zeros((NC, D4), tl.float32)
    acc1 = tl.zeros((NC, D4), tl.float32)
    acc2 = tl.zeros((NC, D4), tl.float32)
    acc3 = tl.zeros((NC, D4), tl.float32)
    m_i = phi
    run = 1
    while run > 0:
        phi_c = _cols(phi, R, MP)
        lt = tl.zeros((BQ, NC), tl.float32)
        mt = tl.full((BQ, NC), float("-inf"), tl.float32)
        zt0 = tl.zeros((BQ, NC), tl.float32)
        zt1 = tl.zeros((BQ, NC), tl.float32)
        zt2 = tl.zeros((BQ, NC), tl.float32)
        zt3 = tl.zeros((BQ, NC), tl.float32)
        acc0 = tl.zeros((NC, D4), tl.float32)
        acc1 = tl.zeros((NC, D4), tl.float32)
        acc2 = tl.zeros((NC, D4), tl.float32)
        acc3 = tl.zeros((NC, D4), tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            tok_s = n0 + R * rows[:, None] + cls[None, :]
            inb_s, valid_s = _tokens(n0, hi, start, KMASK, b, h, smb, smh, smn, tok_s, HAS_MASK)
            st = _stk_logits(kc_base, ks_base, kz_base, n0, hi, tok_s, inb_s, skn, qbd, cps, qss, off_c,
                             NG, PPG, R, BQ, D4, NC, LOWP, KROWS)
            st = tl.where(valid_s, st, float("-inf"))
            mt = tl.maximum(mt, st)
            p = tl.exp2(st - phi_c[None, :])  # 0 for invalid tokens
            lt += p
            # values: codes of in-bounds tokens (any byte is a finite code; p = 0 where invalid), metadata
            # only of valid ones (stale storage may hold NaN)
            tok_v = n0 + vrow
            vb = tl.load(vc_base + tok_v.to(tl.int64)[:, None] * svn + offs_j[None, :], mask=(tok_v < hi)[:, None],
                         other=0)
            meta = tok_s.to(tl.int64) * NG
            for g in tl.static_range(NG):
                vs = tl.load(vs_base + meta + g, mask=valid_s, other=0.0).to(tl.float32)
                vz = tl.load(vz_base + meta + g, mask=valid_s, other=0.0).to(tl.float32)
                # W_g transposed, spread over the classes: wbd[(i, m), (i', r)] = [i == i'] p s_g of token n0+R r+i
                wt = tl.trans(p * vs)  # [NC, BQ]
                wbd = tl.where(cls[:, None, None] == tl.arange(0, R)[None, :, None], wt[:, None, :], 0.0)
                wbd = tl.reshape(wbd, (NC, R * BQ))
                if LOWP:
                    wbd = wbd.to(tl.bfloat16)
                for j in tl.static_range(PPG):
                    if g * PPG + j == 0:
                        acc0 = tl.dot(wbd, _v_code(vb, 0, LOWP).to(wbd.dtype), acc0)
                    elif g * PPG + j == 1:
                        acc1 = tl.dot(wbd, _v_code(vb, 1, LOWP).to(wbd.dtype), acc1)
                    elif g * PPG + j == 2:
                        acc2 = tl.dot(wbd, _v_code(vb, 2, LOWP).to(wbd.dtype), acc2)
                    else:
                        acc3 = tl.dot(wbd, _v_code(vb, 3, LOWP).to(wbd.dtype), acc3)
                if g == 0:
                    zt0 += p * vz
                elif g == 1:
                    zt1 += p * vz
                elif g == 2:
                    zt2 += p * vz
                else:
                    zt3 += p * vz
        m_i = _fold_max(tl.max(mt, 0), R, MP)
        over = tl.where(m_i == float("-inf"), 0.0, m_i - phi)
        run = 0
        if tl.max(tl.where(mrow, tl.abs(over), 0.0), 0) > DF_LIM:
            phi = tl.where(m_i == float("-inf"), phi, m_i)
            run = 1
    # rescale from phi to the true max (rows without valid tokens: l = 0, m = -inf); fold the classes
    m_safe = tl.where(m_i == float("-inf"), phi, m_i)
    alpha = tl.exp2(phi - m_safe)
    l_i = _fold_sum(tl.sum(lt, 0), R, MP) * alpha
    zs = (_fold_sum(tl.sum(zt0, 0), R, MP), _fold_sum(tl.sum(zt1, 0), R, MP),
          _fold_sum(tl.sum(zt2, 0), R, MP), _fold_sum(tl.sum(zt3, 0), R, MP))
    # / KP of _v_code: 2, 8, 32, 32; the zero term of plane P's group
    a0 = (tl.sum(tl.reshape(acc0, (R, MP, D4)), 0) * 0.5 + zs[0][:, None]) * alpha[:, None]
    a1 = (tl.sum(tl.reshape(acc1, (R, MP, D4)), 0) * 0.125 + zs[1 // PPG][:, None]) * alpha[:, None]
    a2 = (tl.sum(tl.reshape(acc2, (R, MP, D4)), 0) * 0.03125 + zs[2 // PPG][:, None]) * alpha[:, None]
    a3 = (tl.sum(tl.reshape(acc3, (R, MP, D4)), 0) * 0.03125 + zs[3 // PPG][:, None]) * alpha[:, None]
    a_ptr = PACC + (part + offs_m[:, None]) * D + offs_j[None, :]
    tl.store(a_ptr + 0 * D4, a0, mask=mrow[:, None])
    tl.store(a_ptr + 1 * D4, a1, mask=mrow[:, None])
    tl.store(a_ptr + 2 * D4, a2, mask=mrow[:, None])
    tl.store(a_ptr + 3 * D4, a3, mask=mrow[:, None])
    tl.store(PM + part + offs_m, m_i, mask=mrow)
    tl.store(PL + part + offs_m, l_i, mask=mrow)
