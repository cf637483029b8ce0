"""The query rotation of a decode step in one launch: ``q R_K`` in tf32x3 and the offset ``q · mu_K`` (docs/kernels.md
§3.2); the same programs can build the Gluon kernel's int8 query operands (:func:`_rotate_plane_q8`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .plan import WRITE_HEAD_DIMS, last_contiguous, next_pow2, settle_cache_keys

# the rotation's largest single tl.dot over the head_dim, and the K step beyond it (larger products spill at D = 512)
ROT_K = tl.constexpr(256)
ROT_STEP = tl.constexpr(128)


@triton.jit
def _cols_mask(rows, offs, N: tl.constexpr, NP: tl.constexpr):
    """Mask of a ``[R, NP]`` tile: rows ``rows [R]`` and, where width ``N`` was padded to ``NP``, the real columns."""
    if N == NP:
        return rows[:, None]
    else:
        return rows[:, None] & (offs < N)[None, :]


@triton.jit
def _load_padded(ptr, real, PADDED: tl.constexpr):
    """``tl.load(ptr)``; where a width was padded to a power of two (``PADDED``), masked by ``real`` (0 elsewhere)."""
    if PADDED:
        return tl.load(ptr, mask=real, other=0.0)
    else:
        return tl.load(ptr)


@triton.jit
def _rotate_block(
    Q, RK, MU, QR, QO, pid, c0, M, Hk,
    sqb, sqh, sqm, smb, smh,
    D: tl.constexpr, M_PAD: tl.constexpr, C_BLOCK: tl.constexpr, HAS_MU: tl.constexpr, DP: tl.constexpr,
):
    """Columns ``[c0, c0 + C_BLOCK)`` of ``q_rot`` for the ``M`` query rows of ``pid = b * Hk + h`` (the first block's
    program also writes ``q · mu_K``), for :func:`_rotate_query_kernel` and ``decode_split._prologue_kernel``. Returns
    the query ``[M_PAD, DP]`` and the block ``[M_PAD, C_BLOCK]``, float32 (``DP``, ``ROT_STEP``: docs/kernels.md §7)."""
    b = pid // Hk
    h = pid % Hk
    offs_m = tl.arange(0, M_PAD)
    if DP <= ROT_K:
        offs_d = tl.arange(0, DP)
        offs_c = c0 + tl.arange(0, C_BLOCK)
        mrow = offs_m < M
        q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                    mask=_cols_mask(mrow, offs_d, D, DP), other=0.0).to(tl.float32)  # [M_PAD, DP]
        if HAS_MU:  # loaded with q and R_K by every program (512 bytes), used by the first column block's: loaded only
            # there, after the product, it was a second round trip that made those programs the prologue's last to end
            mu = _load_padded(MU + b.to(tl.int64) * smb + h * smh + offs_d, offs_d < D, DP > D).to(tl.float32)
        # R_K[h][:, c-block], [DP, C_BLOCK]: the padded rows 0
        r = _load_padded(RK + h.to(tl.int64) * D * D + offs_d[:, None] * D + offs_c[None, :], (offs_d < D)[:, None],
                         DP > D)
        out = QR + (pid.to(tl.int64) * M + offs_m[:, None]) * D  # q_rot [B, Hk, M, D] contiguous
        y = tl.dot(q, r, input_precision="tf32x3")
        tl.store(out + offs_c[None, :], y, mask=mrow[:, None])
        if HAS_MU:
            if c0 == 0:
                tl.store(QO + pid.to(tl.int64) * M + offs_m, tl.sum(q * mu[None, :], 1), mask=mrow)
    else:
        # D = 512: the product in ROT_STEP-channel steps; the query is then not returned whole (q: its last step;
        # _rotate_plane_q8 runs at D = 128 only)
        offs_c = c0 + tl.arange(0, C_BLOCK)
        mrow = offs_m < M
        y = tl.zeros((M_PAD, C_BLOCK), tl.float32)
        qmu = tl.zeros((M_PAD,), tl.float32)
        for k0 in tl.static_range(0, D, ROT_STEP):
            offs_d = k0 + tl.arange(0, ROT_STEP)
            q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                        mask=mrow[:, None], other=0.0).to(tl.float32)  # [M_PAD, ROT_STEP]
            r = tl.load(RK + h.to(tl.int64) * D * D + offs_d[:, None] * D + offs_c[None, :])
            y = tl.dot(q, r, y, input_precision="tf32x3")
            if HAS_MU:
                qmu += tl.sum(q * tl.load(MU + b.to(tl.int64) * smb + h * smh + offs_d).to(tl.float32)[None, :], 1)
        out = QR + (pid.to(tl.int64) * M + offs_m[:, None]) * D  # q_rot [B, Hk, M, D] contiguous
        tl.store(out + offs_c[None, :], y, mask=mrow[:, None])
        if HAS_MU:
            if c0 == 0:
                tl.store(QO + pid.to(tl.int64) * M + offs_m, qmu, mask=mrow)
    return q, y


@triton.jit
def _rotate_query_kernel(
    Q, RK, MU, QR, QO, M, Hk,
    sqb, sqh, sqm,  # q strides (last dim contiguous)
    smb, smh,  # mu_K strides (smb = 0: one offset per KV head for every row)
    D: tl.constexpr, M_PAD: tl.constexpr, C_BLOCK: tl.constexpr, HAS_MU: tl.constexpr, DP: tl.constexpr,
):
    # program (b * Hk + h, c): this program's block of output channels
    _rotate_block(Q, RK, MU, QR, QO, tl.program_id(0), tl.program_id(1) * C_BLOCK, M, Hk, sqb, sqh, sqm, smb, smh,
                  D, M_PAD, C_BLOCK, HAS_MU, DP)


def rotation_args(qf: torch.Tensor, r_k: torch.Tensor, mu_k: torch.Tensor | None):
    """Host side of a rotation launch: ``(qf, r_k, mu_k)`` in the kernel's layouts (float32 ``R_K``, ``mu_K``
    expanded to ``[B, Hk, D]`` with unit last stride) and the outputs ``q_rot [B, Hk, M, D]``, ``qk_offset [B, Hk, M]``
    (None without ``mu_K``), both float32."""
    b, hk, m, d = qf.shape
    qf = last_contiguous(qf)
    r_k = r_k.to(device=qf.device, dtype=torch.float32).contiguous()
    q_rot = torch.empty(b, hk, m, d, device=qf.device, dtype=torch.float32)
    off = None
    if mu_k is not None:
        mu_k = mu_k.to(device=qf.device, dtype=torch.float32)
        mu_k = last_contiguous((mu_k if mu_k.dim() == 3 else mu_k.unsqueeze(0)).expand(b, hk, d))
        off = torch.empty(b, hk, m, device=qf.device, dtype=torch.float32)
    return qf, r_k, mu_k, q_rot, off


C_BLOCK = 32  # output channels of q_rot per rotation program (4 programs per (row, KV head) at D = 128, 3 at D = 96)


def rotation_strides(qf: torch.Tensor, mu_k: torch.Tensor | None) -> tuple:
    """The strides a rotation block takes (``sqb, sqh, sqm, smb, smh``), from :func:`rotation_args`' tensors."""
    return (*qf.stride()[:3], *(mu_k.stride()[:2] if mu_k is not None else (0, 0)))


def launch_rotation(qf, r_k, mu_k, q_rot, off):
    """One launch of :func:`_rotate_query_kernel` over :func:`rotation_args`' tensors (grid ``(B * Hk, D / C_BLOCK)``)."""
    b, hk, m, d = qf.shape
    c_block = min(d, C_BLOCK)
    _rotate_query_kernel[(b * hk, d // c_block)](
        qf, r_k, mu_k, q_rot, off, m, hk, *rotation_strides(qf, mu_k),
        D=d, M_PAD=max(16, next_pow2(m)), C_BLOCK=c_block, HAS_MU=mu_k is not None, DP=next_pow2(d), num_warps=4)


def rotate_query_triton(qf: torch.Tensor, r_k: torch.Tensor, mu_k: torch.Tensor | None):
    """:func:`~oscar_hf.kernels.int2_attention.rotate_query_reference` in one launch (same contract):
    ``qf [B, Hk, M, D]`` (any float dtype), ``r_k [Hk, D, D]``, ``mu_k`` None, ``[Hk, D]`` or ``[B, Hk, D]``
    -> ``(q_rot [B, Hk, M, D] float32, qk_offset [B, Hk, M] float32 or None)``."""
    qf, r_k, mu_k, q_rot, off = rotation_args(qf, r_k, mu_k)
    launch_rotation(qf, r_k, mu_k, q_rot, off)
    return q_rot, off


def query_kernel_supported(qf: torch.Tensor) -> bool:
    """Decode-sized queries (at most 16 rows per KV head) with a head_dim the kernels serve (``plan.WRITE_HEAD_DIMS``:
    32 and those of the decode read)."""
    d, m = qf.shape[-1], qf.shape[-2]
    return qf.dim() == 4 and d in WRITE_HEAD_DIMS and 1 <= m <= 16


# The Gluon kernel's int8 key path (K8) takes the query as two int8 operands per plane, hi + lo / 254 of q_P / sigma_g
# (q_P = q_rot's plane P times qk_scale / 4^P), built here once per (row, KV head), one program per 32-channel plane;
# sigma_g from the largest query row norm (R_K is orthogonal; codes clamped to +-127), docs/kernels.md §3.2:
#   tiles  int8    [B * Hk, 4 planes, 2 (hi, lo), 8 columns n, 32 TB k]: column n is query row n % MH of token set
#                  n // MH (TB = 2 for <= 4 rows a KV head, else 1; MH = 8 // TB), k = 32 tb + j holds channel
#                  32 P + sigma8(j) of that row where tb = n // MH, 0 elsewhere (the block-diagonal B operand)
#   fields float32 [B * Hk, 8, 8 columns]: 0..3: the sum of plane P's channels of the column's row, times qk_scale
#                  (Qs_g is the sum of its planes'); 4, 5: 128 x the sum of plane 3's hi (lo) codes (plane 3 enters
#                  as 64 code - 128); 6, 7: sigma_g (every column)
Q8_TILE_BYTES = 4 * 2 * 8 * 32  # per token set: a (row, KV head)'s tiles are Q8_TILE_BYTES * TB bytes
Q8_FIELDS = 64
Q8_NORM_MARGIN = tl.constexpr(1.001)


@triton.jit
def _rni(x, ASM: tl.constexpr):
    """Round to the nearest integer, ties to even: ``cvt.rni`` as in the history kernel (``ASM``, the GPU), or under
    the interpreter (no inline PTX there) by adding and removing 1.5 * 2^23 (exact for ``|x| < 2^22``)."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rni.f32.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return (x + 12582912.0) - 12582912.0


@triton.jit
def _rotate_plane_q8(
    Q, RK, MU, QR, QO, QP8, QPF, pid, P, M, Hk, qk_scale,
    sqb, sqh, sqm, smb, smh,
    D: tl.constexpr, M_PAD: tl.constexpr, TB: tl.constexpr, HAS_MU: tl.constexpr, ASM: tl.constexpr,
):
    """Plane ``P`` (channels ``[32 P, 32 P + 32)``) of ``q_rot`` (:func:`_rotate_block`) and its int8 operands (above):
    query row ``m`` stored once per token set ``tb``, as column ``tb * MH + m``. ``ASM``: the rounding in inline PTX."""
    MH: tl.constexpr = 8 // TB
    q, y = _rotate_block(Q, RK, MU, QR, QO, pid, 32 * P, M, Hk, sqb, sqh, sqm, smb, smh, D, M_PAD, 32, HAS_MU, D)
    m = tl.arange(0, M_PAD)  # [M_PAD, 32]: q_rot[m, 32 P + c] (rows >= M zero)
    c = tl.arange(0, 32)
    # sigma_g from the largest row norm (the same in both planes' programs); the group's scale qk_scale / 16^g
    bound = tl.sqrt(tl.max(tl.sum(q * q, 1))) * Q8_NORM_MARGIN
    g = P // 2
    sg = tl.maximum(bound * tl.where(g == 0, qk_scale, qk_scale / 16.0), 1e-30) / 127.0
    # x = q_P qk_scale / 4^P / sigma_g (|x| <= 127 for plane 2g, 32 for 2g + 1); hi + lo / 254
    x = y * ((qk_scale * tl.where(P == 0, 1.0, tl.where(P == 1, 0.25, tl.where(P == 2, 0.0625, 0.015625)))) / sg)
    hi = tl.minimum(tl.maximum(_rni(x, ASM), -127.0), 127.0)
    lo = tl.minimum(tl.maximum(_rni((x - hi) * 254.0, ASM), -127.0), 127.0)
    # fields, per row: the plane's sum (and plane 3's codes' sums) in one reduction
    qs, hs, ls = tl.reduce((y, hi, lo), 1, _sum3)
    # tiles: row m of token set tb is column n = tb MH + m (m < MH: rows M..MH-1 are the zero padding columns);
    # channel c at k = 32 tb + sigma8^-1(c), the other token set's half of the row (TB = 2) zeros
    TILE: tl.constexpr = 32 * TB
    kj = 16 * ((c // 4) % 2) + 4 * (c // 8) + c % 4  # sigma8^-1
    plane = QP8 + pid.to(tl.int64) * (8 * 8 * TILE) + P * (2 * 8 * TILE)
    fp = QPF + pid.to(tl.int64) * 64
    rmask = m < MH
    for tb in tl.static_range(TB):
        row = plane + ((tb * MH + m) * TILE)[:, None]
        kk = 32 * tb + kj[None, :]
        tl.store(row + kk, hi.to(tl.int8), mask=rmask[:, None])
        tl.store(row + 8 * TILE + kk, lo.to(tl.int8), mask=rmask[:, None])
        if TB == 2:
            kz = 32 - 32 * tb + kj[None, :]
            zero = tl.zeros([M_PAD, 32], tl.int8)
            tl.store(row + kz, zero, mask=rmask[:, None])
            tl.store(row + 8 * TILE + kz, zero, mask=rmask[:, None])
        col = fp + tb * MH + m
        tl.store(col + 8 * P, qs * qk_scale, mask=rmask)
        if P % 2 == 0:
            tl.store(col + 8 * (6 + g), tl.zeros([M_PAD], tl.float32) + sg, mask=rmask)
        if P == 3:  # 128 x its codes' sums
            tl.store(col + 32, 128.0 * hs, mask=rmask)
            tl.store(col + 40, 128.0 * ls, mask=rmask)


@triton.jit
def _sum3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


settle_cache_keys(globals())  # (plan.settle_cache_keys: the same kernel keys in every process)
