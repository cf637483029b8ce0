"""Write path: rotate + center + clip + quantize + pack K/V rows into INT2 history storage.

``rotate_quantize(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0)``

* ``x``  ``[B, Hk, T, D]`` rows in the model dtype (post-RoPE keys or values),
* ``r``  ``[Hk, D, D]`` float32 rotation (row-vector convention: ``x_rot = (x - mu) @ r``),
* ``mu`` ``[Hk, D]`` float32 offset or None,
* ``clip`` float: the layer's clip ratio,
* result: :class:`oscar_hf.quant.QuantizedRows` with ``codes [B, Hk, T, D/4] uint8`` and
  ``scale``/``zero`` ``[B, Hk, T, D/G]``; when ``out`` is given the rows are written into
  ``out.*[:, :, out_offset : out_offset + T]`` instead (the cache's history storage).

This file holds the torch reference and the dispatcher :func:`rotate_quantize`, which sends supported shapes on CUDA
to the Triton kernel (``write_triton.py``) and everything else to the reference.
"""
from __future__ import annotations

import torch

from oscar_hf.quant import quantize_rows

from .plan import triton_enabled


def rotate_quantize_reference(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0):
    xf = x.float()
    if mu is not None:  # [Hk, D] (calibrated) or [B, Hk, D] (per sequence)
        xf = xf - (mu[None, :, None, :] if mu.dim() == 2 else mu[:, :, None, :])
    rows = torch.matmul(xf, r.unsqueeze(0))  # [B, Hk, T, D] @ [1, Hk, D, D]
    q = quantize_rows(rows, group_size, clip, meta_dtype)
    if out is None:
        return q
    t = x.shape[-2]
    for dst, src in zip(out, q):
        dst[:, :, out_offset : out_offset + t].copy_(src)
    return out


def rotate_quantize(x, r, mu, clip, group_size, meta_dtype, out=None, out_offset=0, use_kernels="auto"):
    """Dispatch: the Triton kernel on CUDA (when importable, allowed and the shape is supported), else the torch
    reference."""
    if triton_enabled(x, use_kernels):
        from .write_triton import kernel_supported, rotate_quantize_triton

        if kernel_supported(x, group_size, clip, meta_dtype):
            return rotate_quantize_triton(x, r, mu, clip, group_size, meta_dtype, out=out, out_offset=out_offset)
    return rotate_quantize_reference(x, r, mu, clip, group_size, meta_dtype, out=out, out_offset=out_offset)
