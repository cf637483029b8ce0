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

from . import next_pow2


@triton.jit
def _rotate_block(
    Q, RK, MU, QR, QO, pid, c0, M, Hk,
    sqb, sqh, sqm, smb, smh,
    D: tl.constexpr, M_PAD: tl.constexpr, C_BLOCK: tl.constexpr, HAS_MU: tl.constexpr,
):
    """Columns ``[c0, c0 + C_BLOCK)`` of ``q_rot`` for the ``M`` query rows of ``pid = b * Hk + h`` (and, in the
    program of the first column block, the offset ``q · mu_K``). Shared by :func:`_rotate_query_kernel` and the
    Gluon path's prologue launch (``decode_triton._prologue_kernel``: rotation + window programs)."""
    b = pid // Hk
    h = pid % Hk
    offs_m = tl.arange(0, M_PAD)
    offs_d = tl.arange(0, D)
    offs_c = c0 + tl.arange(0, C_BLOCK)
    mrow = offs_m < M
    q = tl.load(Q + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :],
                mask=mrow[:, None], other=0.0).to(tl.float32)  # [M_PAD, D]
    if HAS_MU:  # loaded with q and R_K by every program (512 bytes), used by the first column block's: loaded only
        # there, after the product, it was a second round trip that made those programs the prologue's last to end
        # (H100, B=1/128K under the history's early loads: 6.1 against 3.3 us; timeline_hist_h100_session22e.json)
        mu = tl.load(MU + b.to(tl.int64) * smb + h * smh + offs_d).to(tl.float32)
    r = tl.load(RK + h.to(tl.int64) * D * D + offs_d[:, None] * D + offs_c[None, :])  # R_K[h][:, c-block]
    out = QR + (pid.to(tl.int64) * M + offs_m[:, None]) * D  # q_rot [B, Hk, M, D] contiguous
    tl.store(out + offs_c[None, :], tl.dot(q, r, input_precision="tf32x3"), mask=mrow[:, None])
    if HAS_MU:
        if c0 == 0:
            tl.store(QO + pid.to(tl.int64) * M + offs_m, tl.sum(q * mu[None, :], 1), mask=mrow)


@triton.jit
def _rotate_query_kernel(
    Q, RK, MU, QR, QO, M, Hk,
    sqb, sqh, sqm,  # q strides (last dim contiguous)
    smb, smh,  # mu_K strides (smb = 0: one offset per KV head for every row)
    D: tl.constexpr, M_PAD: tl.constexpr, C_BLOCK: tl.constexpr, HAS_MU: tl.constexpr,
):
    # program (b * Hk + h, c): this program's block of output channels
    _rotate_block(Q, RK, MU, QR, QO, tl.program_id(0), tl.program_id(1) * C_BLOCK, M, Hk, sqb, sqh, sqm, smb, smh,
                  D, M_PAD, C_BLOCK, HAS_MU)


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
