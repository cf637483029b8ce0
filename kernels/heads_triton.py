"""Triton kernels of the retrieval heads' decode read (:mod:`.heads_attention`): a split kernel over the codes, read
as they are, and a combine (docs/kernels.md §3.9). ``qk_scale`` multiplies the float32 logits, so the query stays exact
in its dtype; ``HI_DEV``: ``hi`` read on the device, the grid sized by the capacity.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode_combine import _coded_row
from .decode_split_ops import _soft_cap, _softmax_step
from .decode_triton import LOG2E
from .kv import CodedPartials, Window
from .plan import (HEADS_DEFAULTS, HeadsDefaults, heads_plan, last_contiguous, next_pow2, pow2_at_least,
                   settle_cache_keys)
from .query_triton import _cols_mask

_OPS = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}
OFFSET_LIMIT = 2**31 - 1  # the split kernel's 32-bit element offsets of a contiguous store
# deferred loop: the largest excess (log2 units) of a row's max over its reference before the split is rerun, so
# p <= 2**limit: 64 where p enters the value dot as bf16 / float32 (far inside their range; the float32 sums of a
# split too), 15 where it enters it as fp16 beside fp16 16-bit values (fp16's largest: 65504)
DEFER_LIMIT = tl.constexpr(64.0)
DEFER_LIMIT_F16 = tl.constexpr(15.0)


@triton.jit
def _op(x, OP: tl.constexpr):
    """Dot operand: bf16 (1) / fp16 (2) on the GPU, float32 (0) for float32 models and the interpreter."""
    if OP == 1:
        return x.to(tl.bfloat16)
    elif OP == 2:
        return x.to(tl.float16)
    else:
        return x.to(tl.float32)


@triton.jit
def _slot_offsets(BT, b, offs, valid, skb, skn, sksb, sksn, svb, svn, svsb, svsn, sbt, PAGE: tl.constexpr):
    """Element offsets ``[BLOCK_N]`` of row ``b``'s slots ``offs``: key / value codes, key / value metadata. ``PAGE``
    > 0: slot ``n`` at offset ``n % PAGE`` of page ``BT[b, n // PAGE]`` (the ``b`` strides: the page strides)."""
    if PAGE > 0:  # (row, slot) -> (page, offset): the block table's entry, then the slot's place in that page
        page = tl.load(BT + b * sbt + offs // PAGE, mask=valid, other=0).to(tl.int64)
        slot = offs % PAGE
        k_row, v_row = page * skb + slot * skn, page * svb + slot * svn
        ks_row, vs_row = page * sksb + slot * sksn, page * svsb + slot * svsn
    else:  # (32-bit offsets: a 64-bit row base costs 20 registers more, measured at 4 warps)
        k_row, v_row = b * skb + offs * skn, b * svb + offs * svn
        ks_row, vs_row = b * sksb + offs * sksn, b * svsb + offs * svsn
    return k_row, v_row, ks_row, vs_row


@triton.jit
def _key_logits(qa, qb, qsum, KC, KS, KZ, k_row, ks_row, valid, cmask, offs_c, qk_scale, BITS: tl.constexpr,
                OP: tl.constexpr, SOFTCAP: tl.constexpr):
    """A block's logits ``[M_PAD, BLOCK_N]`` in log2 units, soft-capped, -inf where not ``valid``, from its key codes
    (``KC`` / ``KS`` / ``KZ``: the head's bases; 16 bits: the keys themselves)."""
    kt = tl.load(KC + k_row[:, None] + offs_c[None, :], mask=cmask, other=0)  # [BLOCK_N, DCP]
    if BITS == 16:
        logit = tl.dot(_op(qa, OP), tl.trans(_op(kt, OP)))
    else:
        ks = tl.load(KS + ks_row, mask=valid, other=0.0).to(tl.float32)
        kz = tl.load(KZ + ks_row, mask=valid, other=0.0).to(tl.float32)
        if BITS == 8:
            qc = tl.dot(_op(qa, OP), tl.trans(_op(kt, OP)))
        else:
            qc = tl.dot(_op(qa, OP), tl.trans(_op(kt & 15, OP)))
            qc += tl.dot(_op(qb, OP), tl.trans(_op(kt >> 4, OP)))
        logit = qc * ks[None, :] + qsum[:, None] * kz[None, :]
    logit = logit * qk_scale
    if SOFTCAP > 0:
        logit = _soft_cap(logit, SOFTCAP)
    return tl.where(valid[None, :], logit, float("-inf"))


@triton.jit
def _deferred_pass(qa, qb, qsum, ref, n_lo, n_hi, KC, KS, KZ, VC, VS, VZ, BT, b, skb, skn, sksb, sksn, svb, svn,
                   svsb, svsn, sbt, qk_scale, DC: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   BITS: tl.constexpr, PAGE: tl.constexpr, OP: tl.constexpr, DCP: tl.constexpr, SOFTCAP: tl.constexpr,
                   STAGES: tl.constexpr = None):
    """One pass over slots ``[n_lo, n_hi)`` of row ``b`` (the head's bases ``KC`` .. ``VZ``), every block exponentiated
    against the reference ``ref [M_PAD]``: ``l``, ``sum p z`` and the max kept as elementwise ``[M_PAD, BLOCK_N]`` tiles
    and ``acc`` never rescaled, so the loop has no cross-thread reduction. ``(max, l, acc_a, acc_b)``, relative to
    ``ref``. ``STAGES``: the loop's pipeline stages (None: the launch's)."""
    VOP: tl.constexpr = 1 if OP == 2 else OP  # coded values: bf16 for fp16 models too (p past 65504; codes exact)
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, DCP)
    l_t = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    z_t = tl.zeros([M_PAD, BLOCK_N], tl.float32)  # sum p z (z: the values' zero points)
    mx_t = tl.full([M_PAD, BLOCK_N], float("-inf"), tl.float32)
    acc_a = tl.zeros([M_PAD, DCP], tl.float32)
    acc_b = tl.zeros([M_PAD, DCP], tl.float32)
    for n0 in tl.range(n_lo, n_hi, BLOCK_N, num_stages=STAGES):
        offs = n0 + offs_n
        valid = offs < n_hi
        k_row, v_row, ks_row, vs_row = _slot_offsets(BT, b, offs, valid, skb, skn, sksb, sksn, svb, svn, svsb, svsn,
                                                     sbt, PAGE)
        cmask = _cols_mask(valid, offs_c, DC, DCP)
        lg = _key_logits(qa, qb, qsum, KC, KS, KZ, k_row, ks_row, valid, cmask, offs_c, qk_scale, BITS, OP, SOFTCAP)
        vt = tl.load(VC + v_row[:, None] + offs_c[None, :], mask=cmask, other=0)  # [BLOCK_N, DCP]
        mx_t = tl.maximum(mx_t, lg)
        pr = tl.exp2(lg - ref[:, None])  # [M_PAD, BLOCK_N]: 0 where masked, <= 2**limit once the guard passed
        l_t += pr
        if BITS == 16:
            acc_a = tl.dot(_op(pr, OP), _op(vt, OP), acc_a)
        else:
            vs = tl.load(VS + vs_row, mask=valid, other=0.0).to(tl.float32)
            vz = tl.load(VZ + vs_row, mask=valid, other=0.0).to(tl.float32)
            z_t += pr * vz[None, :]
            ps = _op(pr * vs[None, :], VOP)
            if BITS == 8:
                acc_a = tl.dot(ps, _op(vt, VOP), acc_a)
            else:
                acc_a = tl.dot(ps, _op(vt & 15, VOP), acc_a)
                acc_b = tl.dot(ps, _op(vt >> 4, VOP), acc_b)
    zsum = tl.sum(z_t, 1)[:, None]
    return tl.max(mx_t, 1), tl.sum(l_t, 1), acc_a + zsum, acc_b + zsum


@triton.jit
def _history_part(qa, qb, KC, KS, KZ, VC, VS, VZ, LO, HI, BT, b, p, s,
                  skb, skp, skn, sksb, sksp, sksn, svb, svp, svn, svsb, svsp, svsn, shi, sbt, hi_host, split_len,
                  qk_scale, DC: tl.constexpr, NPL: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr,
                  HI_DEV: tl.constexpr, PAGE: tl.constexpr, OP: tl.constexpr, DCP: tl.constexpr,
                  SOFTCAP: tl.constexpr, M_PAD: tl.constexpr):
    """History split ``s``: slots ``[s * split_len, (s + 1) * split_len)`` within ``[lo[b], hi[b])``, read as codes
    with a deferred softmax (:func:`_deferred_pass`; docs/kernels.md §3.9). ``(m, l, acc_a, acc_b)``, ``l`` and
    ``acc`` relative to ``m``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, DCP)
    lo = tl.load(LO + b).to(tl.int32)
    if HI_DEV:
        hi = tl.load(HI + b * shi).to(tl.int32)
    else:
        hi = hi_host
    n_lo = tl.maximum(s * split_len, lo)
    n_hi = tl.minimum((s + 1) * split_len, hi)
    qsum = tl.sum(qa.to(tl.float32), 1)
    if NPL == 2:
        qsum += tl.sum(qb.to(tl.float32), 1)
    # against phi, the max logit of the split's first block, rerun once against the true max past the limit
    LIM: tl.constexpr = DEFER_LIMIT_F16 if BITS == 16 and OP == 2 else DEFER_LIMIT  # (fp16 p beside fp16 values)
    kc, ksb, kzb = KC + p * skp, KS + p * sksp, KZ + p * sksp  # the head's bases
    vc, vsb, vzb = VC + p * svp, VS + p * svsp, VZ + p * svsp
    phi = tl.full([M_PAD], float("-inf"), tl.float32)  # (-inf: an empty split, whose partial is (-inf, 0, 0))
    if n_lo < n_hi:  # (a region apart, or the loop's query operand is this one, hoisted: 40 registers more)
        valid = n_lo + offs_n < n_hi
        k_row, v_row, ks_row, vs_row = _slot_offsets(BT, b, n_lo + offs_n, valid, skb, skn, sksb, sksn, svb, svn,
                                                     svsb, svsn, sbt, PAGE)
        phi = tl.max(_key_logits(qa, qb, qsum, kc, ksb, kzb, k_row, ks_row, valid,
                                 _cols_mask(valid, offs_c, DC, DCP), offs_c, qk_scale, BITS, OP, SOFTCAP), 1)
    ref = tl.where(phi == float("-inf"), 0.0, phi)
    top, l_i, acc_a, acc_b = _deferred_pass(qa, qb, qsum, ref, n_lo, n_hi, kc, ksb, kzb, vc, vsb, vzb, BT, b, skb,
                                            skn, sksb, sksn, svb, svn, svsb, svsn, sbt, qk_scale, DC, M_PAD,
                                            BLOCK_N, BITS, PAGE, OP, DCP, SOFTCAP)
    # the rerun: a second pass under an if, unpipelined (a while loop around one pass took 80 registers more, a
    # pipelined second pass 40: sm_90, INT8, D = 128)
    if tl.max(top - ref, 0) > LIM:
        ref = top
        top, l_i, acc_a, acc_b = _deferred_pass(qa, qb, qsum, ref, n_lo, n_hi, kc, ksb, kzb, vc, vsb, vzb, BT, b,
                                                skb, skn, sksb, sksn, svb, svn, svsb, svsn, sbt, qk_scale, DC,
                                                M_PAD, BLOCK_N, BITS, PAGE, OP, DCP, SOFTCAP, 1)
    m_i = tl.where(phi == float("-inf"), phi, ref)
    return m_i, l_i, acc_a, acc_b


@triton.jit
def _window_part(qa, qb, m_i, l_i, acc_a, acc_b, WK, WV, WM, b, bw, h, swb, swh, swn, swvb, swvh, swvn, smb, W,
                 qk_scale, DC: tl.constexpr, NPL: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WMASK: tl.constexpr,
                 OP: tl.constexpr, DCP: tl.constexpr, SOFTCAP: tl.constexpr):
    """The window: exact keys and values in the model dtype (row ``bw`` of ``WK`` / ``WV``: ``b``, or its slot of the
    serving store's window pool), entries masked by row ``b`` of ``WM``."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, DCP)
    kbase = WK + bw * swb + h * swh
    vbase = WV + bw * swvb + h * swvh
    for n0 in range(0, W, BLOCK_N):
        offs = n0 + offs_n
        inb = offs < W
        valid = inb
        if HAS_WMASK:
            valid = valid & (tl.load(WM + b * smb + offs, mask=inb, other=0) != 0)
        kptr = kbase + offs[:, None] * swn + offs_c[None, :]
        vptr = vbase + offs[:, None] * swvn + offs_c[None, :]
        cmask = _cols_mask(inb, offs_c, DC, DCP)
        logit = tl.dot(_op(qa, OP), tl.trans(_op(tl.load(kptr, mask=cmask, other=0.0), OP)))
        if NPL == 2:
            logit += tl.dot(_op(qb, OP), tl.trans(_op(tl.load(kptr + DC, mask=cmask, other=0.0), OP)))
        pr, alpha, m_i, l_i = _softmax_step(logit * qk_scale, valid, m_i, l_i, SOFTCAP)
        acc_a = acc_a * alpha[:, None] + tl.dot(_op(pr, OP), _op(tl.load(vptr, mask=cmask, other=0.0), OP))
        if NPL == 2:
            acc_b = acc_b * alpha[:, None] + tl.dot(_op(pr, OP),
                                                    _op(tl.load(vptr + DC, mask=cmask, other=0.0), OP))
    return m_i, l_i, acc_a, acc_b


@triton.jit
def _heads_split_kernel(
    Q, HEADS, KC, KS, KZ, VC, VS, VZ, LO, HI, BT, WK, WV, WM, PM, PL, PACC,
    sqb, sqh, sqm, skb, skp, skn, sksb, sksp, sksn, svb, svp, svn, svsb, svsp, svsn, shi, sbt,
    swb, swh, swn, swvb, swvh, swvn, smb, P, M, W, hi_host, split_len, s_hist, s_tot, qk_scale,
    DC: tl.constexpr, NPL: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr,
    HI_DEV: tl.constexpr, PAGE: tl.constexpr, HAS_WMASK: tl.constexpr, OP: tl.constexpr, DCP: tl.constexpr,
    SOFTCAP: tl.constexpr, WSLOT=None, HAS_WSLOT: tl.constexpr = 0,
):
    """``DCP``: the plane width ``DC`` padded to a power of two (``DC`` itself where it is one); ``SOFTCAP``: the
    logits' cap in log2 units (0: none); ``HAS_WSLOT``: row ``b``'s window is row ``WSLOT[b]`` of ``WK`` / ``WV`` (the
    serving store's window pool, read in place)."""
    bp = tl.program_id(0)
    s = tl.program_id(1)
    b = bp // P
    p = bp % P
    h = tl.load(HEADS + p)
    offs_m = tl.arange(0, M_PAD)
    offs_c = tl.arange(0, DCP)
    qrow = _cols_mask(offs_m < M, offs_c, DC, DCP)
    qptr = Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_c[None, :]
    qa = tl.load(qptr, mask=qrow, other=0.0)  # [M_PAD, DCP] channels [0, DC)
    qb = qa
    if NPL == 2:
        qb = tl.load(qptr + DC, mask=qrow, other=0.0)  # channels [DC, D)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc_a = tl.zeros([M_PAD, DCP], tl.float32)
    acc_b = tl.zeros([M_PAD, DCP], tl.float32)
    if s < s_hist:
        m_i, l_i, acc_a, acc_b = _history_part(
            qa, qb, KC, KS, KZ, VC, VS, VZ, LO, HI, BT, b, p, s,
            skb, skp, skn, sksb, sksp, sksn, svb, svp, svn, svsb, svsp, svsn, shi, sbt, hi_host, split_len, qk_scale,
            DC, NPL, BLOCK_N, BITS, HI_DEV, PAGE, OP, DCP, SOFTCAP, M_PAD)
    else:
        bw = b
        if HAS_WSLOT:  # (64-bit: a pool of many slots is past 2**31 elements sooner than a row's store)
            bw = tl.load(WSLOT + b).to(tl.int64)
        m_i, l_i, acc_a, acc_b = _window_part(
            qa, qb, m_i, l_i, acc_a, acc_b, WK, WV, WM, b, bw, h, swb, swh, swn, swvb, swvh, swvn, smb, W, qk_scale,
            DC, NPL, BLOCK_N, HAS_WMASK, OP, DCP, SOFTCAP)
    part = bp * s_tot + s  # (s_tot: the partials per row, one more than the programs with a sink)
    tl.store(PM + part * M_PAD + offs_m, m_i)
    tl.store(PL + part * M_PAD + offs_m, l_i)
    aptr = PACC + (part * M_PAD + offs_m[:, None]) * (NPL * DC) + offs_c[None, :]
    tl.store(aptr, acc_a, mask=qrow)
    if NPL == 2:
        tl.store(aptr + DC, acc_b, mask=qrow)


@triton.jit
def _heads_combine_kernel(PM, PL, PACC, OUT, M, S_TOT, M_PAD: tl.constexpr, D: tl.constexpr,
                          S_BLOCK: tl.constexpr, DP: tl.constexpr):
    """Program ``bp * M + row``: the log-sum-exp merge of the row's ``S_TOT`` partials, normalized (0 when empty), into
    ``OUT [B, P, M, D]`` (the INT2 heads' combine's merge of them, ``decode_combine._coded_row``). ``DP``: ``D`` padded
    to a power of two."""
    _coded_row(PM, PL, PACC, PM, OUT, tl.program_id(0), M, 1, S_TOT, 1, D, 1, M_PAD, S_BLOCK, DP, DENSE=1)


def heads_decode_triton(q, heads, coded, bits: int, bounds, window, scaling: float, out_dtype, *, pages=None,
                        sinks=None, softcap=None, defaults: HeadsDefaults = HEADS_DEFAULTS) -> torch.Tensor:
    """:func:`~oscar_hf.kernels.heads_attention.heads_decode_attention` in two launches (arguments checked there);
    any head_dim (a plane that is no power of two is padded inside), ``softcap`` (natural units) capped in the
    kernel."""
    parts = heads_partials(q, heads, coded, bits, bounds, window, scaling, pages=pages, sinks=sinks, softcap=softcap,
                           defaults=defaults)
    b, _, m, d = q.shape
    if parts is None:  # (a store past 2**31 elements: in row chunks, same results)
        (k, v), (lo, hi), win_k, win_v, win_mask = coded, bounds, window.k, window.v, window.mask_2d()
        slot, rows = window.slot, _rows_per_launch(coded, pages)  # (slot: the store's window pool, read in place)

        def rows_of(x, a, z):
            return x[a:z] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == b else x

        return torch.cat([heads_decode_triton(
            q[a : a + rows], heads, tuple(tuple(t[a : a + rows] for t in x) for x in (k, v)), bits,
            (lo[a : a + rows], rows_of(hi, a, a + rows)),
            Window(win_k, win_v, None if win_mask is None else win_mask[a : a + rows], slot[a : a + rows])
            if slot is not None else
            Window(win_k[a : a + rows], win_v[a : a + rows], None if win_mask is None else win_mask[a : a + rows]),
            scaling, out_dtype, sinks=sinks, softcap=softcap, defaults=defaults) for a in range(0, b, rows)])
    out = torch.empty(b, heads.numel(), m, d, dtype=out_dtype, device=q.device)
    _heads_combine_kernel[(b * heads.numel() * m,)](
        parts.pm, parts.pl, parts.acc, out, m, parts.pm.shape[1], M_PAD=parts.pm.shape[2], D=d,
        S_BLOCK=min(defaults.merge_block, pow2_at_least(parts.pm.shape[1], 1)), DP=next_pow2(d),
        num_warps=defaults.merge_warps_xwide if d > 256 else 4)
    return out


def _rows_per_launch(coded, pages) -> int:
    """The rows one split launch takes: all with a paged store, else those whose element offsets fit its int32."""
    if pages is not None:
        return 2**62
    k, v = coded
    kc, vc = last_contiguous(k[0]), last_contiguous(v[0])
    ks, vs = (k[1], v[1]) if len(k) > 1 else (kc, vc)
    return OFFSET_LIMIT // max(x.stride(0) for x in (kc, vc, ks, vs))


def heads_partials(q, heads, coded, bits: int, bounds, window, scaling: float, *, pages=None, sinks=None,
                   softcap=None, defaults: HeadsDefaults = HEADS_DEFAULTS) -> CodedPartials | None:
    """The split launch of :func:`heads_decode_triton`: the retrieval heads' float32 partials (history splits, the
    window, the sink) for a combine to merge, or None where the store needs row chunks (the two launches serve)."""
    (k, v), (lo, hi), win_k, win_v, win_mask = coded, bounds, window.k, window.v, window.mask_2d()
    slot = window.slot  # None, or [B]: row b's window is row slot[b] of win_k / win_v (the store's pool, in place)
    block_table, max_len = (None, None) if pages is None else (pages.table, pages.max_len)
    b, _, m, d = q.shape
    if b > _rows_per_launch(coded, pages):
        return None
    p, w = heads.numel(), win_k.shape[2]
    dev = q.device
    q, win_k, win_v, kc, vc = (last_contiguous(x) for x in (q, win_k, win_v, k[0], v[0]))
    ks, kz, vs, vz = (k[1], k[2], v[1], v[2]) if bits != 16 else (kc, kc, vc, vc)  # (unused at 16 bits)
    if ks.stride() != kz.stride() or vs.stride() != vz.stride():
        raise ValueError("a head store's scale and zero must share their strides")
    npl = 2 if bits == 4 else 1
    page = 0 if block_table is None else kc.shape[2]
    n = kc.shape[2] if block_table is None else block_table.shape[1] * page  # slots the store can address per row
    hi_dev = isinstance(hi, torch.Tensor)
    n_hist = min(n, int(max_len)) if max_len is not None else n if hi_dev else max(0, min(n, int(hi)))
    plan = heads_plan(b * p, n_hist, m, dev, defaults, d)
    s_hist, split_len, m_pad = plan.splits, plan.split_len, plan.m_pad
    s_tot = s_hist + 1 + (sinks is not None)  # history splits, the window, the sink (a partial the combine merges)
    pm = torch.empty(b * p, s_tot, m_pad, dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pacc = torch.empty(b * p, s_tot, m_pad, d, dtype=torch.float32, device=dev)
    if sinks is not None:  # [P, M] logits of a zero-valued key: (m = s in log2 units, l = 1, acc = 0)
        pm[:, -1, :m].view(b, p, m).copy_(sinks.float().to(dev).expand(b, p, m) * LOG2E)
        pl[:, -1].fill_(1.0)
        pacc[:, -1].zero_()
    op = _OPS[q.dtype] if q.is_cuda else 0
    warps, stages = defaults.launch(bits, d)
    lo = lo.reshape(b)
    wm = win_mask if win_mask is not None else lo  # (placeholder pointers where there is no mask / table / hi)
    bt = block_table if block_table is not None else lo
    hi_t = hi.reshape(-1) if hi_dev else lo
    _heads_split_kernel[(b * p, s_hist + 1)](
        q, heads, kc, ks, kz, vc, vs, vz, lo, hi_t, bt, win_k, win_v, wm, pm, pl, pacc,
        *(st for t in (q, kc, ks, vc, vs) for st in t.stride()[:3]),
        hi_t.stride(0) if hi_dev and hi_t.numel() > 1 else 0, bt.stride(0) if block_table is not None else 0,
        *win_k.stride()[:3], *win_v.stride()[:3], wm.stride(0) if win_mask is not None else 0,
        p, m, w, 0 if hi_dev else n_hist, split_len, s_hist, s_tot, float(scaling) * LOG2E,
        DC=d // npl, NPL=npl, M_PAD=m_pad, BLOCK_N=plan.block_n, BITS=bits, HI_DEV=hi_dev, PAGE=page,
        HAS_WMASK=win_mask is not None, OP=op, DCP=next_pow2(d // npl),
        SOFTCAP=float(softcap) * LOG2E if softcap else 0.0, num_warps=warps, num_stages=stages,
        **({} if slot is None else dict(WSLOT=slot, HAS_WSLOT=1)))
    return CodedPartials(pm, pl, pacc, heads)


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
