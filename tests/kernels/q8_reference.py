"""The int8 key path's query operands outside the product (``test_query_rotation.py``): a one-launch kernel of the
fused prologue's plane programs (``query_triton._rotate_plane_q8``) and their torch reference. Imported lazily, after
``kernel_utils.setup_interpreter``: ``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is defined."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_hf.kernels import query_triton as qt
from oscar_hf.kernels.query_triton import Q8_NORM_MARGIN, _rotate_plane_q8, rotation_args, rotation_strides


@triton.jit
def _rotate_q8_kernel(
    Q, RK, MU, QR, QO, QP8, QPF, M, Hk, qk_scale,
    sqb, sqh, sqm, smb, smh,
    D: tl.constexpr, M_PAD: tl.constexpr, TB: tl.constexpr, HAS_MU: tl.constexpr, ASM: tl.constexpr,
):
    # program (b * Hk + h, P): plane P of the query rotation and its int8 operands (the fused prologue's QPRE programs)
    _rotate_plane_q8(Q, RK, MU, QR, QO, QP8, QPF, tl.program_id(0), tl.program_id(1), M, Hk, qk_scale,
                     sqb, sqh, sqm, smb, smh, D, M_PAD, TB, HAS_MU, ASM)


def rotate_query_q8(qf: torch.Tensor, r_k: torch.Tensor, mu_k: torch.Tensor | None, qk_scale: float):
    """``query_triton.rotate_query_triton`` and the int8 key path's query operands in one launch of
    ``_rotate_plane_q8`` programs, as the decode op's fused prologue runs them (``D = 128``, ``M <= 8``)
    -> ``(q_rot, qk_offset, tiles, fields)``."""
    qf, r_k, mu_k, q_rot, off = rotation_args(qf, r_k, mu_k)
    b, hk, m, d = qf.shape
    assert d == 128 and 1 <= m <= 8, (d, m)
    tb = 2 if m <= 4 else 1
    tiles = torch.empty(b * hk, 4, 2, 8, 32 * tb, device=qf.device, dtype=torch.int8)
    fields = torch.zeros(b * hk, 8, 8, device=qf.device, dtype=torch.float32)
    _rotate_q8_kernel[(b * hk, 4)](
        qf, r_k, mu_k, q_rot, off, tiles, fields, m, hk, float(qk_scale), *rotation_strides(qf, mu_k),
        D=d, M_PAD=16, TB=tb, HAS_MU=mu_k is not None, ASM=int(qf.is_cuda), num_warps=4,
    )
    assert tiles.numel() == b * hk * qt.Q8_TILE_BYTES * tb and fields.numel() == b * hk * qt.Q8_FIELDS
    return q_rot, off, tiles, fields


def q8_operands_reference(q_rot: torch.Tensor, qk_scale: float, sg: torch.Tensor | None = None):
    """:func:`_rotate_plane_q8`'s outputs in torch from ``q_rot [B, Hk, M, D]`` (D = 128, M <= 8): ``(tiles int8
    [B * Hk, 4, 2, 8, 32 TB], fields float32 [B * Hk, 8, 8])``. ``sg [B * Hk, 2]``: sigma_g as given (e.g. the
    kernel's own, so that a tie of the rounding goes the same way), else from the rows' norms as the kernel does."""
    b, hk, m, d = q_rot.shape
    assert d == 128 and 1 <= m <= 8
    tb = 2 if m <= 4 else 1
    mh = 8 // tb
    jj = torch.arange(32)
    sig = 8 * ((jj % 16) // 4) + 4 * (jj // 16) + jj % 4
    q = q_rot.float().reshape(b * hk, m, d)
    if sg is None:
        bound = q.norm(dim=-1).amax(-1) * Q8_NORM_MARGIN.value
        sg = torch.stack([torch.clamp(bound * s, min=1e-30) / 127.0 for s in (qk_scale, qk_scale / 16.0)], -1)
    rows = torch.zeros(b * hk, 8, d, device=q.device)  # column n: row n % MH where it exists
    for n in range(8):
        if n % mh < m:
            rows[:, n] = q[:, n % mh]
    tiles = torch.zeros(b * hk, 4, 2, 8, 32 * tb, dtype=torch.int8, device=q.device)
    fields = torch.zeros(b * hk, 8, 8, device=q.device)
    for p in range(4):
        plane = rows[..., 32 * p + sig]  # [BH, 8, 32] in the operand's order
        f = torch.full_like(sg[:, p // 2], qk_scale * 0.25 ** p) / sg[:, p // 2]  # (scalar / tensor: a reciprocal)
        x = plane * f[:, None, None]
        hi = torch.round(x).clamp(-127, 127)
        lo = torch.round((x - hi) * 254.0).clamp(-127, 127)
        for n in range(8):
            t = n // mh
            tiles[:, p, 0, n, 32 * t:32 * t + 32] = hi[:, n].to(torch.int8)
            tiles[:, p, 1, n, 32 * t:32 * t + 32] = lo[:, n].to(torch.int8)
        fields[:, p] = plane.sum(-1) * qk_scale
        if p == 3:
            fields[:, 4] = 128.0 * hi.sum(-1)
            fields[:, 5] = 128.0 * lo.sum(-1)
    fields[:, 6:8] = sg[:, :, None]
    return tiles, fields
