"""The one-token write as one Triton launch: ``append_token_triton`` at a contiguous storage's ring,
``paged_append_triton`` at the serving store's rows, both demoting with ``_demote_row`` / ``_code_row`` and each the
torch references' contract (``write_path``). Design: docs/kernels.md §2.1, docs/serving.md §3 ("The paged write").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .append_checks import check_append_inputs, check_paged_inputs
from .plan import last_contiguous, next_pow2, plain_fits, settle_cache_keys
from .write_triton import _LEVELS, _META_KIND, _codes, _group_grid, _padded_cols, _quantize_masked, _round_meta

MIN_WARPS, MAX_WARPS = 4, 16
WARP_TILE = 1024  # elements of the rotation chunk [BLOCK_K, DP] in registers per warp: 32 fp32 a thread


def launch_shape(d: int) -> tuple[int, int]:
    """``(num_warps, BLOCK_K)`` for head_dim ``d``: ``BLOCK_K`` rows of R per step of the matvec, the largest power of
    two that divides ``D`` and fits ``MAX_WARPS`` warps' tiles over ``DP`` (``D`` padded to a power of two), and the
    warps that chunk needs: the program's latency is the serial chain of its steps' loads, so the whole rotation in one
    step where it fits (``benchmarks/bench_append.py``)."""
    k = 1
    while d % (2 * k) == 0 and 2 * k * next_pow2(d) <= MAX_WARPS * WARP_TILE:
        k *= 2
    warps = min(MAX_WARPS, max(MIN_WARPS, k * next_pow2(d) // WARP_TILE))
    return warps, k


@triton.jit
def _demote_row(SRC, R, MU, CODES, SCALE, ZERO, c_off, m_off, clip,
                D: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MU: tl.constexpr,
                META_KIND: tl.constexpr, STD: tl.constexpr, DP: tl.constexpr,
                HI=None, h_off=0, BITS: tl.constexpr = 2):
    """Quantize one window row: ``SRC`` -> ``D`` contiguous model-dtype values, ``R`` -> the head's ``[D, D]``
    rotation, ``MU`` -> its ``D`` offsets; stores ``D/4`` codes at ``CODES + c_off`` and ``D/G`` scale / zero at
    ``SCALE/ZERO + m_off``. ``DP > D``: in the plane-padded layout of ``DP`` lanes (``write_triton``). ``BITS`` 3
    (``DP = D``, min-max): 8 levels, the codes' low two bits at ``CODES``, their high bits' plane (``D/8`` bytes,
    ``oscar_hf.quant.pack_bits1``) at ``HI + h_off``."""
    NG: tl.constexpr = D // G
    D4: tl.constexpr = D // 4
    D4P: tl.constexpr = DP // 4
    offs_d = tl.arange(0, DP)
    offs_k = tl.arange(0, BLOCK_K)
    if DP > D:  # each lane's channel (R's column) and whether it is one
        ch, real = _padded_cols(DP, 4, D4)
    # rot[n] = sum_k (x[k] - mu[k]) * R[k, n], BLOCK_K rows of R at a time (a [BLOCK_K, DP] tile in registers)
    rot = tl.zeros((DP,), dtype=tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):
        x = tl.load(SRC + k0 + offs_k).to(tl.float32)
        if HAS_MU:
            x = x - tl.load(MU + k0 + offs_k)
        if DP > D:
            r = tl.load(R + (k0 + offs_k)[:, None] * D + ch[None, :], mask=real[None, :], other=0.0)
        else:
            r = tl.load(R + (k0 + offs_k)[:, None] * D + offs_d[None, :])
        rot += tl.sum(x[:, None] * r, axis=0)
    if DP > D:  # per group by mask (its metadata stored here), codes [DP]
        q = _quantize_masked(rot, ch, real, clip, SCALE + m_off, ZERO + m_off, None, G, NG, 0, STD, META_KIND)
    else:
        # per group: scale and zero rounded to the stored dtype before the codes (as write_triton)
        LEVELS: tl.constexpr = 3.0 if BITS == 2 else 7.0
        xg = tl.reshape(rot, (NG, G))
        scale, zero = _group_grid(xg, clip, 1, G, STD, LEVELS=LEVELS)
        scale_m, s = _round_meta(scale, META_KIND)
        zero_m, z = _round_meta(zero, META_KIND)
        q = _codes(xg, z, s, LEVELS, 1)
        if BITS == 3:  # channel k * D/8 + i -> bit k of byte i (disjoint bits: the sum is an OR), then the low bits
            qh = tl.reshape(q >> 2, (8, D // 8))
            hi = tl.sum(qh << tl.arange(0, 8)[:, None], axis=0).to(tl.uint8)
            tl.store(HI + h_off + tl.arange(0, D // 8), hi)
            q = q & 3
    # plane packing: channel p * D/4 + j -> bits 2p..2p+1 of byte j (disjoint bits: the sum is an OR)
    q4 = tl.reshape(q, (4, D4P))
    packed = tl.sum(q4 << (2 * tl.arange(0, 4))[:, None], axis=0).to(tl.uint8)
    tl.store(CODES + c_off + tl.arange(0, D4P), packed, mask=tl.arange(0, D4P) < D4 if DP > D else None)
    if DP == D:  # (DP > D: _quantize_masked stored the metadata)
        tl.store(SCALE + m_off + tl.arange(0, NG), scale_m)
        tl.store(ZERO + m_off + tl.arange(0, NG), zero_m)


@triton.jit
def _code_row(SRC, X, SCALE, ZERO, x_off, m_off, D: tl.constexpr, BITS: tl.constexpr, META_KIND: tl.constexpr,
              DP: tl.constexpr):
    """Code one window row ``SRC`` (``D`` model-dtype values) of a retrieval head as ``oscar_hf.quant.encode_heads``: 16
    bits as they are at ``X + x_off``, 8 / 4 bits as min-max codes there, scale / zero at ``SCALE/ZERO + m_off``.
    ``DP > D``: ``DP`` lanes (``write_triton._padded_cols``)."""
    HALVES: tl.constexpr = 2 if BITS == 4 else 1
    if DP > D:
        offs, real = _padded_cols(DP, HALVES, D // HALVES)
        x = tl.load(SRC + offs, mask=real, other=0.0)
    else:
        offs = tl.arange(0, D)
        real = None  # (every lane a channel: the stores below unmasked)
        x = tl.load(SRC + offs)
    if BITS == 16:
        tl.store(X + x_off + offs, x, mask=real)
    else:
        LEVELS: tl.constexpr = (1 << BITS) - 1
        xf = x.to(tl.float32)
        if DP > D:
            lo = tl.min(tl.where(real, xf, float("inf")), 0)
            hi = tl.max(tl.where(real, xf, float("-inf")), 0)
        else:
            lo = tl.min(xf, 0)
            hi = tl.max(xf, 0)
        scale_m, s = _round_meta(tl.math.div_rn(hi - lo, LEVELS * 1.0), META_KIND)
        zero_m, z = _round_meta(lo, META_KIND)
        q = _codes(xf, z, s, LEVELS)
        if BITS == 8:
            tl.store(X + x_off + offs, q.to(tl.uint8), mask=real)
        else:  # a byte per channel pair (j, j + D/2): the halves' lanes j and DP/2 + j
            q2 = tl.reshape(q, (2, DP // 2))
            packed = tl.sum(q2 << (4 * tl.arange(0, 2))[:, None], axis=0).to(tl.uint8)
            tl.store(X + x_off + tl.arange(0, DP // 2), packed, mask=tl.arange(0, DP // 2) < D // 2 if DP > D else None)
        tl.store(SCALE + m_off, scale_m)
        tl.store(ZERO + m_off, zero_m)


@triton.jit
def _put_row(x, WIN, dst, sink, to_sink, offs_d, dm):
    """The new token's row ``x [DP]`` into ring entry ``WIN + dst``, and into ``WIN + sink`` where ``to_sink``."""
    tl.store(WIN + dst + offs_d, x, mask=dm)
    if to_sink:
        tl.store(WIN + sink + offs_d, x, mask=dm)


@triton.jit
def _append_token_kernel(
    NEW_K, NEW_V, WIN_K, WIN_V, KC, KS, KZ, VC, VS, VZ, HEADS, RK, MUK, RV, MUV,
    CKX, CKS, CKZ, CVX, CVS, CVZ, CODED_OF,  # the retrieval heads' stores [B | pages, P, N, *], KV head -> index map
    KH, shb, shh, shn, svsb, svsh, svsn,  # 3-bit keys' high bits [B | pages, H2, N | P, D/8]; the values' own metadata
    clip_k, clip_v, Hk,
    LENGTH, PAD, N, S0, RING, W,  # contiguous: the 0-d length T, pad [B], history capacity, sink, ring, recent
    POS, SLOTS, NEW_ENTRY, SINK_ENTRY, DEM_ENTRY, DEM_PAGE, DEM_OFF,  # PAGED: the rows' plan, [Bp] each
    snkb, snkh, snvb, snvh,  # new_k / new_v strides of a row and a head (D contiguous): [B, Hk, 1, D]; PAGED [Hk, Q, D]
    swb, swh, sws,  # window strides [B, Hk, S0 + R, D] (PAGED: the pool's [slots, ...]), shared by K and V
    scb, sch, scn,  # history codes strides [B | pages, H2, N | P, D/4], shared by K and V
    ssb, ssh, ssn,  # history scale / zero strides [B | pages, H2, N | P, D/G], shared by all four
    smkb,  # mu_k's batch stride: 0 for [H2, D], H2 * D for [B, H2, D]
    sxb, sxp, sxn,  # coded codes (or 16-bit rows) strides [B | pages, P, N | F, *], shared by K and V
    szb, szp, szn,  # coded scale / zero strides [B | pages, P, N | F, 1], shared by all four
    D: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr, HAS_HEADS: tl.constexpr,
    HAS_MU_K: tl.constexpr, HAS_MU_V: tl.constexpr, META_KIND: tl.constexpr, STD: tl.constexpr,
    CODED_BITS: tl.constexpr, WIN_KIND: tl.constexpr,  # 0: no coded heads; the window dtype's kind (their metadata)
    DP: tl.constexpr,  # D padded to a power of two (D where it is one)
    PAGED: tl.constexpr,  # 0: a contiguous storage's ring; 1: the serving store's rows (docs/serving.md §3)
    DEMOTE: tl.constexpr,  # 0: no row demotes this step (the paged plan's ``demote``)
    PUT: tl.constexpr = 1,  # 0: the new token is not written (contiguous: the demotion alone)
    KBITS: tl.constexpr = 2, GV: tl.constexpr = 0,  # 3-bit keys; the values' group (0: G) (DP = D)
):
    VG: tl.constexpr = G if GV == 0 else GV  # the values' group
    pid = tl.program_id(0)
    if PAGED:  # one program per row and KV head, writing K and V
        b = pid // Hk
        h = pid % Hk
        win = tl.load(SLOTS + b) * swb + h * swh  # int64: the row's window slot, head h
        # ring entry DEM_ENTRY[b] demoted into (DEM_PAGE[b], DEM_OFF[b]) (the pool's trash page when it demotes none)
        src = win + tl.load(DEM_ENTRY + b) * sws
        page = tl.load(DEM_PAGE + b)
        e = tl.load(DEM_OFF + b)
        live = True
        do_k = True
    else:  # two programs per row and KV head: the keys (kv = 0) and the values
        kv = pid % 2
        b = (pid // 2 // Hk).to(tl.int64)
        h = pid // 2 % Hk
        win = b * swb + h * swh
        t = tl.load(LENGTH)  # int64: the new token's slot
        s = t - W  # slot T - W demoted (its ring entry is not the new token's: R > W)
        e = s - S0
        src = win + (S0 + s % RING) * sws
        page = b
        live = (e >= 0) & (e < N)
        do_k = kv == 0
    # 1. demote the entry at src
    if DEMOTE:
        if HAS_HEADS:
            hh = tl.load(HEADS + h)
        else:
            hh = h.to(tl.int64)
        if live & (hh >= 0):  # (live: True where PAGED)
            c_off = page * scb + hh * sch + e * scn
            m_off = page * ssb + hh * ssh + e * ssn
            if do_k:  # (PAGED: the keys, then the values; else one of them)
                _demote_row(WIN_K + src, RK + hh * D * D, MUK + b * smkb + hh * D, KC, KS, KZ, c_off, m_off,
                            clip_k, D, G, BLOCK_K, HAS_MU_K, META_KIND, STD, DP, KH, page * shb + hh * shh + e * shn,
                            KBITS)
            if PAGED or not do_k:
                vm_off = m_off
                if GV > 0:  # (the values' metadata: a tensor of its own, D/GV groups a row)
                    vm_off = page * svsb + hh * svsh + e * svsn
                _demote_row(WIN_V + src, RV + hh * D * D, MUV + hh * D, VC, VS, VZ, c_off, vm_off, clip_v,
                            D, VG, BLOCK_K, HAS_MU_V, META_KIND, STD, DP)
        if CODED_BITS > 0:  # a retrieval head: the same entry, coded
            cp = tl.load(CODED_OF + h)
            if live & (cp >= 0):
                x_off = page * sxb + cp * sxp + e * sxn
                m_off = page * szb + cp * szp + e * szn
                if do_k:
                    _code_row(WIN_K + src, CKX, CKS, CKZ, x_off, m_off, D, CODED_BITS, WIN_KIND, DP)
                if PAGED or not do_k:
                    _code_row(WIN_V + src, CVX, CVS, CVZ, x_off, m_off, D, CODED_BITS, WIN_KIND, DP)
        # every thread's loads of the old ring row come before any thread's store of the new one: the same entry
        # where the demoted slot and the new token share it (PAGED with R = W + 1; contiguous with W = 0, since it
        # demotes slot T - W with R > W)
        tl.debug_barrier()
    # 2. the new token: its ring entry, and its sink entry where to_sink
    if not PUT:
        return
    if PAGED:
        row = tl.load(POS + b)  # the new token's position in the packed batch
        ne = tl.load(NEW_ENTRY + b)
        se = tl.load(SINK_ENTRY + b)
        dst, sink, to_sink = win + ne * sws, win + se * sws, se != ne
    else:
        row = b
        j = t - tl.load(PAD + b)  # the new token's sink entry while the row's sink is filling
        dst, sink, to_sink = win + (S0 + t % RING) * sws, win + j * sws, (j >= 0) & (j < S0)
    offs_d = tl.arange(0, DP)
    dm = offs_d < D if DP > D else None  # (D = 96: the row's 96 of 128 lanes)
    new_k = NEW_K + row * snkb + h * snkh + offs_d
    new_v = NEW_V + row * snvb + h * snvh + offs_d
    if PAGED:  # (both loads in flight before the stores)
        nk = tl.load(new_k, mask=dm)
        nv = tl.load(new_v, mask=dm)
        _put_row(nk, WIN_K, dst, sink, to_sink, offs_d, dm)
        _put_row(nv, WIN_V, dst, sink, to_sink, offs_d, dm)
    elif kv == 0:
        _put_row(tl.load(new_k, mask=dm), WIN_K, dst, sink, to_sink, offs_d, dm)
    else:
        _put_row(tl.load(new_v, mask=dm), WIN_V, dst, sink, to_sink, offs_d, dm)


def _launch(params, new_k, new_v, window, history, grid: int, layout: tuple, new_strides: tuple, smkb: int,
            paged: bool, demote: bool, put: bool = True) -> None:
    """The write kernel's launch, once the layouts it assumes beyond the shapes (``append_checks``) are checked:
    rotations float32 and contiguous; the retrieval heads' three parts of K and of V, a 16-bit store's one part
    thrice. ``layout``: the contiguous storage's ``(length, pad)`` or the paged plan's seven tensors, whose first is
    passed for pointers never read (no ``hist_of``, no ``mu``, no coded heads, the other layout's)."""
    p, win_k, win_v, hist_k, hist_v, coded = params, window.k, window.v, history.k, history.v, history.coded
    placeholder = layout[0]
    if p.meta_dtype not in _META_KIND:
        raise ValueError(f"metadata dtype {p.meta_dtype} is not supported by the kernel; use one of {list(_META_KIND)}")
    if win_k.stride() != win_v.stride() or win_k.stride(-1) != 1:
        raise ValueError(f"win_k and win_v must share a layout contiguous in D, got {win_k.stride()}, {win_v.stride()}")
    # 3-bit keys' high bits and a values' group of their own (DP = D: a power-of-two head_dim)
    k_hi, own = hist_k.hi, hist_v.scale.shape[-1] != hist_k.scale.shape[-1]
    metas = (hist_k.scale, hist_k.zero) + ((hist_v.scale, hist_v.zero) if not own else ())
    if hist_k.codes.stride() != hist_v.codes.stride() or hist_k.codes.stride(-1) != 1 or any(
        m.stride() != hist_k.scale.stride() for m in metas
    ) or hist_k.scale.stride(-1) != 1 or (own and (hist_v.zero.stride() != hist_v.scale.stride()
                                                   or hist_v.scale.stride(-1) != 1)):
        raise ValueError("hist_k and hist_v must share one codes layout and one metadata layout (a values' group of "
                         "their own: scale and zero one), contiguous in the last dimension")
    if (k_hi is not None or own) and not plain_fits(win_k.shape[-1]):
        raise ValueError("3-bit keys and a values' group of their own: a power-of-two head_dim only")
    if k_hi is not None and k_hi.stride(-1) != 1:
        raise ValueError(f"the keys' high bits must be contiguous in the last dimension, got {k_hi.stride()}")
    ck = cv = (placeholder,) * 3
    coded_strides = (0,) * 6
    if coded is not None:
        ck, cv = (parts * 3 if len(parts) == 1 else parts for parts in coded)
        if any(a.stride() != c.stride() for a, c in zip(ck, cv)) or ck[1].stride() != ck[2].stride():
            raise ValueError("the coded K and V stores must share one layout (and scale and zero one)")
        coded_strides = (*ck[0].stride()[:3], *ck[1].stride()[:3])
    r_k, mu_k, r_v, mu_v = (None if t is None else t.to(device=win_k.device, dtype=torch.float32).contiguous()
                            for t in (p.r_k, p.mu_k, p.r_v, p.mu_v))
    other = (placeholder,) * 7 if not paged else (placeholder,) * 2 + (0,) * 4  # (the other layout's arguments)
    d = win_k.shape[-1]
    warps, blk = launch_shape(d)
    _append_token_kernel[(grid,)](
        new_k, new_v, win_k, win_v, *hist_k[:3], *hist_v[:3], placeholder if p.hist_of is None else p.hist_of, r_k,
        r_k if mu_k is None else mu_k, r_v, r_v if mu_v is None else mu_v, *ck, *cv,
        placeholder if coded is None else p.heads.coded_of,
        placeholder if k_hi is None else k_hi, *((0, 0, 0) if k_hi is None else k_hi.stride()[:3]),
        *(hist_v.scale.stride()[:3] if own else (0, 0, 0)), float(p.clip_k), float(p.clip_v), new_k.shape[-3],
        *(other + layout if paged else layout + other), *new_strides, *win_k.stride()[:3], *hist_k.codes.stride()[:3],
        *hist_k.scale.stride()[:3], smkb, *coded_strides,
        D=d, G=p.group_size, BLOCK_K=blk, HAS_HEADS=p.hist_of is not None, HAS_MU_K=mu_k is not None,
        HAS_MU_V=mu_v is not None, META_KIND=_META_KIND[p.meta_dtype], STD=p.quantizer == "std",
        CODED_BITS=0 if coded is None else p.heads.bits, WIN_KIND=_META_KIND[win_k.dtype], DP=next_pow2(d),
        PAGED=int(paged), DEMOTE=int(demote), PUT=int(put), KBITS=2 if k_hi is None else 3,
        GV=hist_v.codes.shape[-1] * 4 // hist_v.scale.shape[-1] if own else 0, num_warps=warps)


def append_token_triton(params, new_k, new_v, window, history, at, demote: bool = True):
    """:func:`~oscar_hf.kernels.write_path.append_token_reference` in one launch of ``2 B Hk`` programs, no host
    synchronisation; ``new_k = new_v = None``: the demotion alone
    (:func:`~oscar_hf.kernels.write_path.demote_reference`); ``demote=False``: the new token alone."""
    ring, n, h2 = check_append_inputs(params, new_k, new_v, window, history, at)
    b, hk, _, d = window.k.shape
    if b == 0 or hk == 0:
        return
    if at.length.dtype != torch.long or at.pad.dtype != torch.long:
        raise ValueError(f"length and pad must be int64, got {at.length.dtype}, {at.pad.dtype}")
    put = new_k is not None
    if put:
        new_k, new_v = (last_contiguous(x) for x in (new_k, new_v))
    else:  # (pointers never read)
        new_k = new_v = window.k
    mu_k = params.mu_k
    _launch(params, new_k, new_v, window, history, b * hk * 2, (at.length, at.pad, n, at.sink, ring, at.recent),
            (*new_k.stride()[:2], *new_v.stride()[:2]), h2 * d if mu_k is not None and mu_k.dim() == 3 else 0,
            paged=False, demote=demote, put=put)


def paged_append_triton(params, new_k, new_v, window, history, rows):
    """:func:`~oscar_hf.kernels.write_path.paged_append_reference` in one launch of ``Bp * Hk`` programs, no host
    synchronisation; the sink write is skipped per row where ``sink_entry = new_entry`` (``write_sink`` only tells the
    reference)."""
    h2 = check_paged_inputs(params, new_k, new_v, window, history, rows)
    hk, bp = new_k.shape[0], rows.pos.shape[0]
    if bp == 0 or hk == 0:
        return
    if new_k.stride(-1) != 1 or new_v.stride() != new_k.stride():
        new_k, new_v = new_k.contiguous(), new_v.contiguous()
    tensors = tuple(x.contiguous() for x in rows.tensors())  # (views of the plan's buffers: already contiguous)
    coded_heads = 0 if history.coded is None else history.coded[0][0].shape[1]
    _launch(params, new_k, new_v, window, history, bp * hk, tensors, (new_k.stride(1), new_k.stride(0)) * 2, 0,
            paged=True, demote=bool(rows.demote) and h2 + coded_heads > 0)


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
