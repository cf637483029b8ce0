"""The jit helpers of the split kernel (:mod:`~oscar_hf.kernels.decode_split`; the math: docs/kernels.md §1, §3.4)."""
from __future__ import annotations

import triton
import triton.language as tl

from .plan import settle_cache_keys
from .query_triton import _cols_mask

DF_LIM = tl.constexpr(64.0)  # deferred loop: largest excess of a row's max over its reference (log2 units)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _soft_cap(x, CAP: tl.constexpr):
    """``CAP tanh(x / CAP)`` in log2 units (``CAP = softcap * log2(e)``), tanh from one exp2 (docs/kernels.md §3.10);
    applied before masking (``-inf`` would become ``-CAP``)."""
    t = tl.exp2(tl.abs(x) * (-2.0 * _LOG2E / CAP))
    c = CAP * ((1.0 - t) / (1.0 + t))
    return tl.where(x < 0, -c, c)


@triton.jit
def _u_plane(bytes_, P: tl.constexpr, LOWP: tl.constexpr, EXACT: tl.constexpr):
    """Plane ``P`` of a byte tile as exact fp16 ``u = 1024 + 4^P code`` by one and-or (docs/kernels.md §1); ``EXACT``
    subtracts the 1024, else the caller does. Interpreter: ``u = 1 + 4^P code`` (``OFFS = 1``), so the offset's
    bookkeeping runs on the CPU."""
    m = bytes_ & (3 << (2 * P))
    if LOWP:
        u = (m.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        if EXACT:
            u = u - 1024.0
        return u
    else:
        u = m.to(tl.float32)
        if not EXACT:
            u = u + 1.0
        return u


# PTX of _u_plane_asm / _v_code_asm, one string per plane P (mask 3 << 2P in both 16-bit halves); the leading
# cvt + prmt is the same for the four planes of a tile, so ptxas computes it once
_K_PLANE_ASM = tl.constexpr(tuple(
    "{ .reg .b32 w; cvt.u32.u16 w, $1; prmt.b32 w, w, 0, 0x4140; "
    f"lop3.b32 $0, w, 0x{(3 << 2 * p) * 0x10001:08X}, 0x64006400, 0xEA; }}" for p in range(4)))
_V_PLANE_ASM = tl.constexpr(tuple(
    "{ .reg .b32 w; cvt.u32.u16 w, $1; prmt.b32 w, w, 0, 0x4140; " + ("shr.b32 w, w, 2; " if p == 3 else "")
    + f"lop3.b32 $0, w, 0x{(3 << 2 * min(p, 2)) * 0x10001:08X}, 0x43804380, 0xEA; }}" for p in range(4)))


@triton.jit
def _u_plane_asm(bytes_, P: tl.constexpr):
    """:func:`_u_plane` (not EXACT) in PTX, two codes at a time (``prmt``, then one ``lop3``): Triton versions differ
    in what they make of the same arithmetic. GPU only."""
    return tl.inline_asm_elementwise(_K_PLANE_ASM[P], "=r,h", [bytes_], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _gsum(t, g: tl.constexpr, PPG: tl.constexpr):
    """Sum of the per-plane vectors ``t[P]`` of the planes of group ``g`` (planes ``g*PPG ..``)."""
    acc = t[g * PPG]
    for j in tl.static_range(1, PPG):
        acc += t[g * PPG + j]
    return acc


@triton.jit
def _op(x, LOWP: tl.constexpr, F16: tl.constexpr = False):
    """bf16 (``F16``: fp16) dot operand on the GPU; float32 under the interpreter, whose ``tl.dot`` multiplies bf16's
    raw bits."""
    if LOWP:
        if F16:
            return x.to(tl.float16)
        else:
            return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _int2_plane(bytes_, P: tl.constexpr, s_tile, z_tile, s_row, z_row, nmask,
                D4: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, LOWP: tl.constexpr, D4P: tl.constexpr,
                hi=None, KBITS: tl.constexpr = 2):
    """Plane ``P`` (channels ``[P*D4, (P+1)*D4)``) of a ``[BLOCK_N, D4P]`` byte tile dequantized to the dot operand:
    ``zero[n, g(c)] + code[n, c] * scale[n, g(c)]`` (``D4P``: ``D4`` padded to a power of two). ``KBITS`` 3: ``hi``
    ``[BLOCK_N, D4P]`` holds byte ``j % (D/8)`` of the high bits' plane, whose bit ``c // (D/8)`` is channel ``c``'s
    (``oscar_hf.quant.pack_bits1``): bit ``2P + j // (D/8)`` for lane ``j`` of plane ``P``."""
    code = (bytes_ >> (2 * P)) & 3
    if KBITS == 3:
        D8: tl.constexpr = D4 // 2
        bit = 2 * P + tl.arange(0, D4P) // D8  # [D4P]
        code = code.to(tl.int32) + (((hi.to(tl.int32) >> bit[None, :]) & 1) << 2)
    code = code.to(tl.float32)
    if G % D4 == 0:
        # the plane in one group g: column g of the [BLOCK_N, NG] metadata tiles, by a one-hot sum
        onehot = tl.arange(0, NG)[None, :] == (P * D4) // G
        s = tl.sum(tl.where(onehot, s_tile, 0.0), 1)
        z = tl.sum(tl.where(onehot, z_tile, 0.0), 1)
        return _op(z[:, None] + code * s[:, None], LOWP)
    elif D4 % G == 0:
        # whole groups inside the plane (D = 256, G = 32: two): each group's column of the tiles, by one-hot sums,
        # spread over its lanes in registers (no per-channel gather of scale / zero)
        GPP: tl.constexpr = D4 // G
        lane_group = tl.arange(0, D4P) // G  # [D4P]
        s = tl.zeros_like(code)
        z = tl.zeros_like(code)
        for k in tl.static_range(GPP):
            onehot = tl.arange(0, NG)[None, :] == P * GPP + k
            inside = (lane_group == k)[None, :]
            s = tl.where(inside, tl.sum(tl.where(onehot, s_tile, 0.0), 1)[:, None], s)
            z = tl.where(inside, tl.sum(tl.where(onehot, z_tile, 0.0), 1)[:, None], z)
        return _op(z + code * s, LOWP)
    else:
        # groups inside or across planes (D=256 or 96, G=32): scale/zero gathered per channel (L1 hits)
        offs = tl.arange(0, D4P)
        g = (P * D4 + offs) // G
        s = tl.load(s_row[:, None] + g[None, :], mask=_cols_mask(nmask, offs, D4, D4P), other=0.0).to(tl.float32)
        z = tl.load(z_row[:, None] + g[None, :], mask=_cols_mask(nmask, offs, D4, D4P), other=0.0).to(tl.float32)
        return _op(z + code * s, LOWP)


@triton.jit
def _bf16_pair(base, meta, mask):
    """Scale (or zero) of groups 0 and 1 of each token (NG = 2, bf16) by one 4-byte load, not two 2-byte ones,
    widened by a 16-bit shift (group 0 in the low half)."""
    w = tl.load((base + meta).to(tl.pointer_type(tl.int32)), mask=mask, other=0)
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _meta_groups(base, meta, mask, NG: tl.constexpr):
    """Scale (or zero) of every group of a block's tokens, as a tuple of ``NG <= 4`` float32 vectors."""
    g0 = tl.load(base + meta, mask=mask, other=0.0).to(tl.float32)
    if NG == 1:
        return (g0,)
    elif NG == 2:
        return (g0, tl.load(base + meta + 1, mask=mask, other=0.0).to(tl.float32))
    else:
        return (g0, tl.load(base + meta + 1, mask=mask, other=0.0).to(tl.float32),
                tl.load(base + meta + 2, mask=mask, other=0.0).to(tl.float32),
                tl.load(base + meta + 3, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _df_meta(ks_base, kz_base, vs_base, vz_base, kmeta, vmeta, inb, valid, NG: tl.constexpr, PAIR: tl.constexpr):
    """The deferred loop's metadata of one block, tuples over the groups: K scale / zero (in-bounds tokens) and V
    scale / zero (valid tokens only: stale storage may hold NaN). ``kmeta`` / ``vmeta``: row offsets ``[BLOCK_N]``."""
    if PAIR:
        return (_bf16_pair(ks_base, kmeta, inb), _bf16_pair(kz_base, kmeta, inb),
                _bf16_pair(vs_base, vmeta, valid), _bf16_pair(vz_base, vmeta, valid))
    else:
        return (_meta_groups(ks_base, kmeta, inb, NG), _meta_groups(kz_base, kmeta, inb, NG),
                _meta_groups(vs_base, vmeta, valid, NG), _meta_groups(vz_base, vmeta, valid, NG))


@triton.jit
def _rd_logits(kb, qts, cps, qss, ks_base, kz_base, meta, inb, off, PPG: tl.constexpr,
               BLOCK_N: tl.constexpr, M_PAD: tl.constexpr, LOWP: tl.constexpr, PRE: tl.constexpr = 0,
               s_pre=None, z_pre=None, ASM: tl.constexpr = 0):
    """Logits ``[BLOCK_N, M_PAD]`` (log2, ``off`` included) of a K byte tile ``kb [BLOCK_N, D/4]``, four plane dots then
    per group ``s (sum_P u_P . q_P / 4^P - C_g) + z Qs_g`` (``u_P``: :func:`_u_plane`; ``C_g = cps``, the offset from
    the dot's own rounded operands; ``Qs_g = qss``). ``PRE``: scale / zero preloaded (:func:`_df_meta`)."""
    st = tl.zeros((BLOCK_N, M_PAD), tl.float32) + off[None, :]
    d = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    for P in tl.static_range(4):
        if ASM:
            d = tl.dot(_u_plane_asm(kb, P), qts[P], d)
        else:
            d = tl.dot(_u_plane(kb, P, LOWP, False), qts[P], d)
        if P % PPG == PPG - 1:  # last plane of group g: apply its scale / zero
            if PRE:
                sg = s_pre[P // PPG]
                zg = z_pre[P // PPG]
            else:
                sg = tl.load(ks_base + meta + P // PPG, mask=inb, other=0.0).to(tl.float32)
                zg = tl.load(kz_base + meta + P // PPG, mask=inb, other=0.0).to(tl.float32)
            # s (d - C) + z Qs as three fused multiply-adds (rounding within the tensor cores' own error in d)
            st = tl.fma(sg[:, None], d, st)
            st = tl.fma(-sg[:, None], _gsum(cps, P // PPG, PPG)[None, :], st)
            st = tl.fma(zg[:, None], _gsum(qss, P // PPG, PPG)[None, :], st)
            d = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    return st


@triton.jit
def _v_code_operand(vb, P: tl.constexpr, LOWP: tl.constexpr):
    """Codes of plane ``P`` of a value byte tile as exact bf16 ``KP * code`` (``KP = 2 * 4^min(P, 2)``) without a
    shift: ``byte & (3 << 2P)`` or-ed into the bit pattern of 256.0 (mantissa LSB worth 2) reads as ``256 + KP code``,
    minus 256 exactly. Plane 3 is shifted down by 2 first (its bits would reach the exponent)."""
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
def _v_code_asm(vb, P: tl.constexpr):
    """:func:`_v_code_operand` in PTX, two codes at a time (as :func:`_u_plane_asm`)."""
    u = tl.inline_asm_elementwise(_V_PLANE_ASM[P], "=r,h", [vb], dtype=tl.bfloat16, is_pure=True, pack=2)
    return u - 256.0


@triton.jit
def _df_v_plane(p, vb, P: tl.constexpr, acc, zt, D4: tl.constexpr, G: tl.constexpr, PPG: tl.constexpr,
                LOWP: tl.constexpr, s_pre, z_pre, ASM: tl.constexpr = 0):
    """Deferred-loop values of plane ``P`` (group ``g``): ``acc += bf16((p s_g)ᵀ) . (KP code_P)`` (bf16: ``p`` is
    relative to a fixed reference and may exceed 1; ``KP`` divided out after the loop) and ``zt += p z_g`` (by the
    group's first plane; reduced after the loop). Planes of a group share ``W_g`` (CSE: one transposition)."""
    g: tl.constexpr = (P * D4) // G
    s = s_pre[g]
    z = z_pre[g]
    w = _op(tl.trans(p * s[:, None]), LOWP)
    if ASM:
        acc = tl.dot(w, _v_code_asm(vb, P), acc)
    else:
        acc = tl.dot(w, _v_code_operand(vb, P, LOWP).to(w.dtype), acc)
    if P % PPG == 0:
        zt += p * z[:, None]
    return acc, zt


@triton.jit
def _meta_tiles(s_base, z_base, offs_n, rows, nmask, NG: tl.constexpr, PAGED: tl.constexpr = 0,
                TILES: tl.constexpr = 1):
    """``[BLOCK_N, NG]`` float32 scale/zero tiles of a block (one vectorized load per tensor) and the row pointers
    (``PAGED``: row offsets ``rows [BLOCK_N]``). ``TILES`` 0: the row pointers only (``NG`` may be 3 there)."""
    if PAGED:
        row = rows
    else:
        row = offs_n.to(tl.int64) * NG
    if TILES:
        if PAGED:
            offs = rows[:, None] + tl.arange(0, NG)[None, :]
        else:
            offs = offs_n.to(tl.int64)[:, None] * NG + tl.arange(0, NG)[None, :]
        s_tile = tl.load(s_base + offs, mask=nmask[:, None], other=0.0).to(tl.float32)
        z_tile = tl.load(z_base + offs, mask=nmask[:, None], other=0.0).to(tl.float32)
    else:
        s_tile = 0.0
        z_tile = 0.0
    return s_tile, z_tile, s_base + row, z_base + row


@triton.jit
def _token_block(n0, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
    """Tokens ``[n0, n0 + BLOCK_N)``: indices, in bounds (``< hi``), valid (also ``>= start``, not masked)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    inb = offs_n < hi
    valid = inb & (offs_n >= start)
    if HAS_MASK:
        km = tl.load(KMASK + b.to(tl.int64) * smb + h * smh + offs_n * smn, mask=inb, other=0)
        valid = valid & (km != 0)
    return offs_n, inb, valid


@triton.jit
def _block_rows(n0, hi, offs_n, inb, BT_ROW, skb, skn, smkb, svb, svn, smvb, NG: tl.constexpr, PAGE: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGED: tl.constexpr, NGV: tl.constexpr = 0):
    """Int64 element offsets of a block's tokens from the (row, KV head) bases:
    ``(K codes [BLOCK_N, 1], K metadata [BLOCK_N], V codes [BLOCK_N, 1], V metadata [BLOCK_N])``; ``PAGED``: through
    ``BT_ROW`` (docs/kernels.md §3.8). ``NGV``: the values' groups a token where they have a group of their own."""
    NV: tl.constexpr = NG if NGV == 0 else NGV
    if PAGED:
        pg, r = _page_rows(n0, hi, offs_n, inb, BT_ROW, PAGE, BLOCK_N)
        return (pg * skb + r * skn)[:, None], pg * smkb + r * NG, (pg * svb + r * svn)[:, None], pg * smvb + r * NV
    else:
        return (offs_n[:, None].to(tl.int64) * skn, offs_n.to(tl.int64) * NG, offs_n[:, None].to(tl.int64) * svn,
                offs_n.to(tl.int64) * NV)


@triton.jit
def _page_rows(n0, hi, offs_n, inb, BT_ROW, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """A paged block's tokens as ``(page [BLOCK_N] or [], row in the page [BLOCK_N])`` int64: one block-table load
    where a block never straddles pages, else one a token."""
    if PAGE % BLOCK_N == 0:
        pg = tl.load(BT_ROW + n0 // PAGE, mask=n0 < hi, other=0).to(tl.int64)
        r = (n0 % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
    else:
        pg = tl.load(BT_ROW + offs_n // PAGE, mask=inb, other=0).to(tl.int64)
        r = (offs_n % PAGE).to(tl.int64)
    return pg, r


@triton.jit
def _hi_rows(n0, hi, offs_n, inb, BT_ROW, skhb, skhn, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr):
    """Int64 offsets ``[BLOCK_N, 1]`` of a block's 3-bit keys' high-bit rows from the (row, KV head) base
    (``PAGED``: page stride ``skhb``, as :func:`_block_rows`)."""
    if PAGED:
        pg, r = _page_rows(n0, hi, offs_n, inb, BT_ROW, PAGE, BLOCK_N)
        return (pg * skhb + r * skhn)[:, None]
    return offs_n[:, None].to(tl.int64) * skhn


@triton.jit
def _softmax_step(s, valid, m_i, l_i, SOFTCAP: tl.constexpr = 0.0):
    """Online-softmax update in base 2 for a ``[M_PAD, BLOCK_N]`` logit tile, soft-capped first where ``SOFTCAP`` > 0
    (:func:`_soft_cap`). Fully masked rows keep ``m = -inf`` and contribute nothing (``m_safe`` avoids ``-inf - -inf``);
    returns ``(p, alpha, m_new, l_new)``."""
    if SOFTCAP > 0:
        s = _soft_cap(s, SOFTCAP)
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _window_split(QW, KW, VW, WMASK, PM, PL, PACC, b, bw, h, hw, part, w0, W, win_split, qk_scale,
                  sqwb, sqwh, sqwm, skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,
                  M, D: tl.constexpr, M_PAD: tl.constexpr, HAS_WMASK: tl.constexpr, LOWP: tl.constexpr,
                  WIN_STAGES: tl.constexpr, DP: tl.constexpr, SOFTCAP: tl.constexpr, hq):
    """One window program: full-precision window tokens ``[w0, w0 + win_split)`` of one (row, KV head), partial
    ``(m, l, acc)`` at ``part``. ``bw`` / ``hw``: the row's window (or pool slot) and KV head in ``KW`` / ``VW``;
    ``hq``: the query's head in ``QW`` (``h``, or ``hw`` where ``QW`` is the layer's query)."""
    BLOCK_W: tl.constexpr = 32  # window tokens per step
    offs_m = tl.arange(0, M_PAD)
    offs_d = tl.arange(0, DP)
    mrow = offs_m < M
    m_i = tl.full((M_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_PAD,), tl.float32)
    qw = tl.load(QW + b.to(tl.int64) * sqwb + hq * sqwh + offs_m[:, None] * sqwm + offs_d[None, :],
                 mask=_cols_mask(mrow, offs_d, D, DP), other=0.0).to(tl.float32)
    qw = _op(qw * qk_scale, LOWP)
    acc = tl.zeros((M_PAD, DP), tl.float32)
    w1 = tl.minimum(w0 + win_split, W)
    # not pipelined when history programs share the launch: their shared memory, not this branch's, sets occupancy
    for n0 in tl.range(w0, w1, BLOCK_W, num_stages=WIN_STAGES):
        offs_n = n0 + tl.arange(0, BLOCK_W)
        valid = offs_n < w1
        if HAS_WMASK:
            wm = tl.load(WMASK + b.to(tl.int64) * swb + h * swh + offs_n * swn, mask=valid, other=0)
            valid = valid & (wm != 0)
        # keys and values loaded together: one round of memory latency per step, not two
        kw = tl.load(KW + bw.to(tl.int64) * skwb + hw * skwh + offs_n[:, None] * skwn + offs_d[None, :],
                     mask=_cols_mask(valid, offs_d, D, DP), other=0.0)
        vw = tl.load(VW + bw.to(tl.int64) * svwb + hw * svwh + offs_n[:, None] * svwn + offs_d[None, :],
                     mask=_cols_mask(valid, offs_d, D, DP), other=0.0)
        p, alpha, m_i, l_i = _softmax_step(tl.dot(qw, tl.trans(_op(kw, LOWP))), valid, m_i, l_i, SOFTCAP)
        acc = tl.dot(_op(p, LOWP), _op(vw, LOWP), acc * alpha[:, None])
    tl.store(PACC + (part + offs_m[:, None]) * D + offs_d[None, :], acc, mask=_cols_mask(mrow, offs_d, D, DP))
    tl.store(PM + part + offs_m, m_i, mask=mrow)
    tl.store(PL + part + offs_m, l_i, mask=mrow)


@triton.jit
def _mapped(i, TABLE, HAS_TABLE: tl.constexpr):
    """``i``, or ``TABLE[i]``: a batch row's window row (its slot of the serving store's window pool) or a head's KV
    head of the window (INT2 heads reading a layer's window in place)."""
    if HAS_TABLE:
        return tl.load(TABLE + i)
    else:
        return i


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
