"""Query prologue of a decode step in one launch: ``q R_K`` and the centering offset ``q · mu_K``.

The history's keys are stored rotated and centered, ``(k - mu_K) R_K``, so each decode step needs the
query in that space, ``q_rot = q R_K`` (float32), and the logit offset ``q · mu_K``
(:func:`~oscar_hf.kernels.int2_attention.rotate_query_reference`). In torch that is a dtype cast, a
batched GEMM and a GEMV: three or four launches, 13-15 us of a 46 us B=1 / 8K decode op on an H200
(``benchmarks/results/profile_op_h200_session7a.json``). Here program ``(row * Hk + head, c)`` multiplies
the ``M`` query rows by the ``C_BLOCK`` columns ``c`` of ``R_K`` on the tensor cores in tf32x3 (three tf32
products: float32 accuracy, as for the write path's rotation); the first column block's program also writes
the offset. (A float32 FMA dot, ``input_precision="ieee"``, took 58 us per call on the H200.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import cdiv, next_pow2


@triton.jit
def _rotate_rows(
    Q, RK, MU, QR, QO, h, r0, r1, c0, M, Hk,
    sqb, sqh, sqm, smb, smh,
    D: tl.constexpr, R_TILE: tl.constexpr, C_BLOCK: tl.constexpr, HAS_MU: tl.constexpr,
):
    """Columns ``[c0, c0 + C_BLOCK)`` of ``q_rot`` for the query rows ``r`` in ``[r0, min(r0 + R_TILE, r1))`` of KV
    head ``h``, a row ``r = b * M + m`` being query row ``m`` of batch row ``b`` (and, in the programs of the first
    column block, the offset ``q · mu_K``): ``[R_TILE, D] x [D, C_BLOCK]`` on the tensor cores, ``R_K``'s block loaded
    once for all of those rows. Shared by :func:`_rotate_query_kernel` (the ``M`` rows of one batch row) and the
    Gluon path's prologue launch (``decode_triton._prologue_kernel``: up to 64 rows of the batch a program)."""
    offs_r = r0 + tl.arange(0, R_TILE)
    rok = offs_r < r1
    b = (offs_r // M).to(tl.int64)
    m = offs_r % M
    offs_d = tl.arange(0, D)
    offs_c = c0 + tl.arange(0, C_BLOCK)
    q = tl.load(Q + b[:, None] * sqb + h * sqh + m[:, None] * sqm + offs_d[None, :],
                mask=rok[:, None], other=0.0).to(tl.float32)  # [R_TILE, D]
    r = tl.load(RK + h.to(tl.int64) * D * D + offs_d[:, None] * D + offs_c[None, :])  # R_K[h][:, c-block]
    row = (b * Hk + h) * M + m  # q_rot [B, Hk, M, D], qk_offset [B, Hk, M] contiguous
    tl.store(QR + row[:, None] * D + offs_c[None, :], tl.dot(q, r, input_precision="tf32x3"), mask=rok[:, None])
    if HAS_MU:
        if c0 == 0:
            mu = tl.load(MU + b[:, None] * smb + h * smh + offs_d[None, :], mask=rok[:, None], other=0.0)
            tl.store(QO + row, tl.sum(q * mu.to(tl.float32), 1), mask=rok)


@triton.jit
def _rotate_query_kernel(
    Q, RK, MU, QR, QO, M, Hk,
    sqb, sqh, sqm,  # q strides (last dim contiguous)
    smb, smh,  # mu_K strides (smb = 0: one offset per KV head for every row)
    D: tl.constexpr, M_PAD: tl.constexpr, C_BLOCK: tl.constexpr, HAS_MU: tl.constexpr,
):
    # program (b * Hk + h, c): this program's block of output channels for the M query rows of (b, h)
    pid = tl.program_id(0)
    b = pid // Hk
    _rotate_rows(Q, RK, MU, QR, QO, pid % Hk, b * M, b * M + M, tl.program_id(1) * C_BLOCK, M, Hk,
                 sqb, sqh, sqm, smb, smh, D, M_PAD, C_BLOCK, HAS_MU)


def rotation_args(qf: torch.Tensor, r_k: torch.Tensor, mu_k: torch.Tensor | None):
    """Host side of a rotation launch: ``(qf, r_k, mu_k)`` in the kernel's layouts (float32 ``R_K``, ``mu_K``
    expanded to ``[B, Hk, D]`` with unit last stride) and the outputs ``q_rot [B, Hk, M, D]``, ``qk_offset [B, Hk, M]``
    (None without ``mu_K``), both float32."""
    b, hk, m, d = qf.shape
    if qf.stride(-1) != 1:
        qf = qf.contiguous()
    r_k = r_k.to(device=qf.device, dtype=torch.float32).contiguous()
    q_rot = torch.empty(b, hk, m, d, device=qf.device, dtype=torch.float32)
    off = None
    if mu_k is not None:
        mu_k = mu_k.to(device=qf.device, dtype=torch.float32)
        mu_k = (mu_k if mu_k.dim() == 3 else mu_k.unsqueeze(0)).expand(b, hk, d)
        if mu_k.stride(-1) != 1:
            mu_k = mu_k.contiguous()
        off = torch.empty(b, hk, m, device=qf.device, dtype=torch.float32)
    return qf, r_k, mu_k, q_rot, off


C_BLOCK = 32  # output channels of q_rot per rotation program (4 programs per (row, KV head) at D = 128)
R_TILE_MAX = 64  # query rows (batch rows x query heads of a KV head) of one prologue rotation program


def rotation_row_tiles(rows: int) -> tuple[int, int]:
    """``(R_TILE, tiles)`` of the Gluon path's prologue rotation: ``rows = B * M`` query rows of a KV head in tiles of
    ``R_TILE`` (16 .. R_TILE_MAX, a power of two)."""
    r_tile = min(R_TILE_MAX, max(16, next_pow2(rows)))
    return r_tile, cdiv(rows, r_tile)


def rotation_strides(qf: torch.Tensor, mu_k: torch.Tensor | None) -> tuple:
    """The strides a rotation block takes (``sqb, sqh, sqm, smb, smh``), from :func:`rotation_args`' tensors."""
    return (*qf.stride()[:3], *(mu_k.stride()[:2] if mu_k is not None else (0, 0)))


def launch_rotation(qf, r_k, mu_k, q_rot, off):
    """One launch of :func:`_rotate_query_kernel` over :func:`rotation_args`' tensors (grid ``(B * Hk, D / C_BLOCK)``)."""
    b, hk, m, d = qf.shape
    c_block = min(d, C_BLOCK)
    _rotate_query_kernel[(b * hk, d // c_block)](
        qf, r_k, mu_k, q_rot, off, m, hk, *rotation_strides(qf, mu_k),
        D=d, M_PAD=max(16, next_pow2(m)), C_BLOCK=c_block, HAS_MU=mu_k is not None, num_warps=4,
    )


def rotate_query_triton(qf: torch.Tensor, r_k: torch.Tensor, mu_k: torch.Tensor | None):
    """:func:`~oscar_hf.kernels.int2_attention.rotate_query_reference` in one launch (same contract):
    ``qf [B, Hk, M, D]`` (any float dtype), ``r_k [Hk, D, D]``, ``mu_k`` None, ``[Hk, D]`` or ``[B, Hk, D]``
    -> ``(q_rot [B, Hk, M, D] float32, qk_offset [B, Hk, M] float32 or None)``."""
    qf, r_k, mu_k, q_rot, off = rotation_args(qf, r_k, mu_k)
    launch_rotation(qf, r_k, mu_k, q_rot, off)
    return q_rot, off


def query_kernel_supported(qf: torch.Tensor) -> bool:
    """Decode-sized queries (at most 16 rows per KV head) with a power-of-two head_dim in [32, 256]."""
    d, m = qf.shape[-1], qf.shape[-2]
    return qf.dim() == 4 and 32 <= d <= 256 and (d & (d - 1)) == 0 and 1 <= m <= 16
