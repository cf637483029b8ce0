"""Fused write path: center + rotate + clip + INT2-quantize + pack in one Triton kernel, for the shapes
:func:`kernel_supported` takes (docs/kernels.md §1 the layout, §2 the steps). D = 96 runs in the *plane-padded* layout
of ``DP = 128`` lanes (:func:`_padded_cols`), its groups reduced by mask (:func:`_quantize_masked`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_hf.quant import LEVELS, QUANTIZERS, STD_STEP, QuantizedRows, check_group_size

from .plan import WRITE_HEAD_DIMS, cdiv, group_fits, next_pow2, settle_cache_keys
from .query_triton import _cols_mask

_LEVELS = tl.constexpr(float(LEVELS))  # 3.0; jit code may only read constexpr globals
_STD_STEP = tl.constexpr(STD_STEP)

_META_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

# Bulk writes (prefill) at D <= 128: each program reads and splits its head's fp32 R once, so taller tiles amortize it;
# 128 rows on 8 warps were the fastest without spills. D = 256 / 512 take 16-row tiles; short writes (decode-time
# demotion) the smallest power of two >= T, at least 16, on 4 warps.
BLOCK_T = 128
NUM_WARPS = 8  # for tiles of >= 128 rows
NUM_WARPS_XWIDE = 16  # D = 512 (GPU time not measured yet)
R_TILE = 16384  # elements of one [BLOCK_K, D] block of R in registers (D = 256: 64 rows; D = 512: 32)


def block_k(d: int) -> int:
    """Input channels of R per step of the rotation's K loop: at most 64 and ``R_TILE / D``, dividing ``D``."""
    k = min(64, R_TILE // d, d)
    while d % k:
        k //= 2
    return k


@triton.jit
def _rint(y):
    """Round half to even (what ``torch.round`` does) for |y| < 2**22: adding and subtracting
    1.5 * 2**23 leaves no fraction bits, so the FPU's round-to-nearest-even does the rounding."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _round_meta(v, META_KIND: tl.constexpr):
    """Round float32 ``v`` to the metadata dtype (0: bf16, 1: fp16, 2: fp32), round-to-nearest-even like torch.
    Returns ``(stored, stored as float32)``. The bf16 rounding is done on the bits: the Triton interpreter truncates
    on float32 -> bfloat16 casts, the GPU rounds; bit arithmetic gives the torch result on both."""
    if META_KIND == 0:
        bits = v.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # RNE on the 16 dropped bits
        hi16 = bits >> 16
        stored = hi16.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        vf = (hi16 << 16).to(tl.float32, bitcast=True)
    elif META_KIND == 1:
        stored = v.to(tl.float16)
        vf = stored.to(tl.float32)
    else:
        stored = v
        vf = v
    return stored, vf


@triton.jit
def _group_grid(xg, clip, AXIS: tl.constexpr, G: tl.constexpr, STD: tl.constexpr, MASKED: tl.constexpr = 0,
                mask=None, LEVELS: tl.constexpr = 3.0):
    """Float32 ``(scale, zero)`` of each group of ``G`` values along ``AXIS`` of ``xg`` as ``oscar_hf.quant``: ``STD``
    the std grid (``clip`` unused; INT2 only), else the clipped range over ``LEVELS`` steps (7 for 3-bit codes);
    ``MASKED``: a group is its ``mask`` entries."""
    if STD:
        if MASKED:
            mean = tl.sum(tl.where(mask, xg, 0.0), AXIS) / G
            dev = tl.where(mask, xg - tl.expand_dims(mean, AXIS), 0.0)
        else:
            mean = tl.sum(xg, AXIS) / G
            dev = xg - tl.expand_dims(mean, AXIS)
        scale = _STD_STEP * tl.sqrt_rn(tl.sum(dev * dev, AXIS) / G)
        zero = mean - 1.5 * scale
    else:
        if MASKED:
            lo = tl.min(tl.where(mask, xg, float("inf")), AXIS)
            hi = tl.max(tl.where(mask, xg, float("-inf")), AXIS)
        else:
            lo = tl.min(xg, AXIS)
            hi = tl.max(xg, AXIS)
        half = (hi - lo) * 0.5 * clip
        scale = tl.math.div_rn(2.0 * half, LEVELS)
        zero = (hi + lo) * 0.5 - half
    return scale, zero


@triton.jit
def _codes(x, z, s, LEVELS: tl.constexpr, AXIS: tl.constexpr = -1):
    """``clamp(rint((x - z) / s), 0, LEVELS)`` as int32 (0 where ``s`` = 0: a zero-range group reconstructs as
    ``z``), against the stored (rounded) metadata ``z``, ``s``: broadcast against ``x``, or (``AXIS`` >= 0) once
    expanded at ``AXIS``."""
    safe = tl.where(s > 0, s, 1.0)
    if AXIS >= 0:
        z = tl.expand_dims(z, AXIS)
        safe = tl.expand_dims(safe, AXIS)
        s = tl.expand_dims(s, AXIS)
    y = tl.math.div_rn(x - z, safe)
    y = tl.minimum(tl.maximum(y, -1.0), LEVELS + 1.0)  # keep _rint's argument small
    q = tl.minimum(tl.maximum(_rint(y), 0.0), LEVELS)
    return tl.where(s > 0, q, 0.0).to(tl.int32)


@triton.jit
def _padded_cols(DP: tl.constexpr, PARTS: tl.constexpr, W: tl.constexpr):
    """Lane ``c'`` of ``DP`` holds channel ``(c' // WP) * W + c' % WP``, ``WP = DP / PARTS``, real where
    ``c' % WP < W``: ``PARTS`` parts of ``W`` channels (INT2 planes 4, INT4 halves 2, end padding 1). Returns
    ``(channel, real)``, ``[DP]``."""
    WP: tl.constexpr = DP // PARTS
    offs = tl.arange(0, DP)
    return (offs // WP) * W + offs % WP, offs % WP < W


@triton.jit
def _quantize_masked(rot, ch, real, clip, S_PTR, Z_PTR, smask, G: tl.constexpr, NG: tl.constexpr, AXIS: tl.constexpr,
                     STD: tl.constexpr, META_KIND: tl.constexpr):
    """Steps 2-3 in the plane-padded layout (:func:`_padded_cols`, ``rot [.., DP]`` along ``AXIS``): each group's scale
    / zero by mask (groups need not be contiguous), stored at ``S_PTR + g`` / ``Z_PTR + g`` (rows ``smask``), and the
    codes ``[.., DP]`` against them (0 in the padding)."""
    s_c = tl.zeros_like(rot)  # each lane's group's stored scale / zero (0 / 0 in the padding: code 0)
    z_c = tl.zeros_like(rot)
    for g in tl.static_range(NG):
        in_g = real & (ch // G == g)
        scale, zero = _group_grid(rot, clip, AXIS, G, STD, 1, in_g)
        scale_m, sv = _round_meta(scale, META_KIND)
        zero_m, zv = _round_meta(zero, META_KIND)
        tl.store(S_PTR + g, scale_m, mask=smask)
        tl.store(Z_PTR + g, zero_m, mask=smask)
        if AXIS == 1:
            sv = sv[:, None]
            zv = zv[:, None]
        s_c = tl.where(in_g, sv, s_c)
        z_c = tl.where(in_g, zv, z_c)
    return _codes(rot, z_c, s_c, _LEVELS)


@triton.jit
def _rotate_quantize_kernel(
    X, R, MU, CODES, SCALE, ZERO,
    T, Hk, out_offset, clip,
    smb,  # mu's batch stride: 0 for a per-head offset [Hk, D], Hk*D for a per-sequence one [B, Hk, D]
    sxb, sxh, sxt, sxd,  # x strides [B, Hk, T, D]
    scb, sch, sct,  # codes strides [B, Hk, cap, D/4] (last dim contiguous)
    ssb, ssh, sst,  # scale/zero strides [B, Hk, cap, D/G] (last dim contiguous)
    D: tl.constexpr, G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_MU: tl.constexpr, META_KIND: tl.constexpr, PRECISION: tl.constexpr, STD: tl.constexpr, DP: tl.constexpr,
):
    """``DP``: ``D`` padded to a power of two (``D`` itself where it is one): the plane-padded layout (module
    docstring) where ``DP > D``."""
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // Hk
    h = pid_bh % Hk
    NG: tl.constexpr = D // G
    D4: tl.constexpr = D // 4
    D4P: tl.constexpr = DP // 4
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    offs_d = tl.arange(0, DP)
    offs_k = tl.arange(0, BLOCK_K)
    if DP > D:  # each lane's channel (R's column) and whether it is one
        ch, real = _padded_cols(DP, 4, D4)
    # 1. rot = (x - mu) @ R[h], accumulated over BLOCK_K input channels at a time.
    x_base = X + b.to(tl.int64) * sxb + h * sxh + rows[:, None].to(tl.int64) * sxt
    r_base = R + h * D * D
    rot = tl.zeros((BLOCK_T, DP), dtype=tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):
        x = tl.load(x_base + (k0 + offs_k)[None, :] * sxd, mask=rmask[:, None], other=0.0).to(tl.float32)
        if HAS_MU:
            x = x - tl.load(MU + b.to(tl.int64) * smb + h * D + k0 + offs_k)[None, :]
        if DP > D:
            r = tl.load(r_base + (k0 + offs_k)[:, None] * D + ch[None, :], mask=real[None, :], other=0.0)
        else:
            r = tl.load(r_base + (k0 + offs_k)[:, None] * D + offs_d[None, :])
        rot = tl.dot(x, r, rot, input_precision=PRECISION)
    if DP > D:
        # 2-3. per group (by mask), its metadata stored at once; codes [BLOCK_T, DP]
        orow = (out_offset + rows).to(tl.int64)
        m_row = b.to(tl.int64) * ssb + h * ssh + orow * sst  # [BLOCK_T] metadata row offsets
        q = _quantize_masked(rot, ch, real, clip, SCALE + m_row, ZERO + m_row, rmask, G, NG, 1, STD, META_KIND)
    else:
        # 2. per-group scale and zero; metadata rounded to the stored dtype.
        xg = tl.reshape(rot, (BLOCK_T, NG, G))
        scale, zero = _group_grid(xg, clip, 2, G, STD)
        scale_m, s = _round_meta(scale, META_KIND)
        zero_m, z = _round_meta(zero, META_KIND)
        # 3. codes against the stored metadata; a zero-range group gets code 0 (x_hat = zero exactly).
        q = _codes(xg, z, s, _LEVELS, 2)
    # 4. pack the plane layout: channel p * D/4 + j goes to bits 2p..2p+1 of byte j. Reshaping the
    # channel axis to (4, D/4) puts plane p on axis 1 (the padded layout: (4, DP/4)); the shifted planes share no
    # bits, so a sum is an OR.
    q4 = tl.reshape(q, (BLOCK_T, 4, D4P))
    shift = 2 * tl.arange(0, 4)
    packed = tl.sum(q4 << shift[None, :, None], axis=1).to(tl.uint8)
    if DP == D:
        orow = (out_offset + rows).to(tl.int64)
    offs_j = tl.arange(0, D4P)
    c_ptr = CODES + b.to(tl.int64) * scb + h * sch + orow[:, None] * sct + offs_j[None, :]
    tl.store(c_ptr, packed, mask=_cols_mask(rmask, offs_j, D4, D4P))
    if DP == D:
        m_off = b.to(tl.int64) * ssb + h * ssh + orow[:, None] * sst + tl.arange(0, NG)[None, :]
        tl.store(SCALE + m_off, scale_m, mask=rmask[:, None])
        tl.store(ZERO + m_off, zero_m, mask=rmask[:, None])


def kernel_supported(x: torch.Tensor, group_size: int, clip, meta_dtype=torch.bfloat16) -> bool:
    """The writes the kernels serve (the write and the decode step's append; anything else: the reference)."""
    d = x.shape[-1]
    return d in WRITE_HEAD_DIMS and group_fits(d, group_size) and (
        not isinstance(clip, torch.Tensor) or clip.numel() == 1
    ) and meta_dtype in _META_KIND


def rotate_quantize_triton(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0, block_t=BLOCK_T,
                           quantizer="minmax"):
    """Triton version of :func:`~oscar_hf.kernels.write_path.rotate_quantize_reference` (same contract, for the
    shapes :func:`kernel_supported` accepts). ``block_t``: rows per program of bulk writes at D <= 128."""
    b, hk, t, d = x.shape
    check_group_size(d, group_size)
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
    ng = d // group_size
    if out is None:
        res = QuantizedRows(torch.empty(b, hk, t, d // 4, dtype=torch.uint8, device=x.device),
                            *(torch.empty(b, hk, t, ng, dtype=meta_dtype, device=x.device) for _ in range(2)))
        offset = 0
    else:
        res, offset = out, int(out_offset)
        if out.scale.dtype != meta_dtype or out.zero.dtype != meta_dtype:
            raise ValueError(f"out metadata dtype {out.scale.dtype} != meta_dtype {meta_dtype}")
        if offset < 0 or offset + t > out.codes.shape[2]:
            raise ValueError(f"rows [{offset}, {offset + t}) do not fit the storage capacity {out.codes.shape[2]}")
    if t == 0 or b == 0:
        return res
    codes, scale, zero = res
    assert codes.stride(-1) == 1 and scale.stride(-1) == 1 and zero.stride(-1) == 1, "storage must be contiguous in D"
    assert scale.stride() == zero.stride(), "scale and zero storage must share a layout"
    r = r.to(device=x.device, dtype=torch.float32).contiguous()
    mu = None if mu is None else mu.to(device=x.device, dtype=torch.float32).contiguous()
    clip = float(clip)
    if d <= 128:
        block_t = min(block_t, max(16, next_pow2(t)))
        warps = NUM_WARPS if block_t >= 128 else 4
    else:  # D = 256, 512: smaller row tiles, no register spills
        block_t, warps = 16, (NUM_WARPS_XWIDE if d > 256 else 8)
    grid = (cdiv(t, block_t), b * hk)
    _rotate_quantize_kernel[grid](x, r, mu if mu is not None else r, codes, scale, zero, t, hk, offset, clip,
                                  hk * d if mu is not None and mu.dim() == 3 else 0, *x.stride(), *codes.stride()[:3],
                                  *scale.stride()[:3], D=d, G=group_size, BLOCK_T=block_t, BLOCK_K=block_k(d),
                                  HAS_MU=mu is not None, META_KIND=_META_KIND[meta_dtype],
                                  PRECISION="tf32x3" if x.is_cuda else "ieee", STD=quantizer == "std", DP=next_pow2(d),
                                  num_warps=warps)
    return res


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
