"""The static cache's decode attention as one opaque ``torch.library`` op (``oscar::decode_attention_static``).

Under ``torch.compile`` (``generate`` compiling a :class:`~oscar_hf.StaticOscarCache`
decode step, CUDA graphs) the Triton launches of :func:`~oscar_hf.kernels.decode_triton.decode_attention_triton`
are hidden behind a custom op: dynamo records one call, inductor leaves the kernels alone (they
are compiled and tuned by Triton's own JIT, as in eager), and the CUDA graph captures the two
launches. The fake implementation only gives the output's shape and dtype. The op allocates its
output and partials, mutates nothing, and reads the history length from ``n_valid`` on the device.
"""
from __future__ import annotations

import torch

from oscar_hf.quant import QuantizedRows


@torch.library.custom_op("oscar::decode_attention_static", mutates_args=())
def decode_attention_static(
    q_rot: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, start: torch.Tensor,
    qk_offset: torch.Tensor | None, scaling: float, group_size: int,
    q_win: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, win_mask: torch.Tensor,
    r_v: torch.Tensor, mu_v: torch.Tensor | None, n_valid: torch.Tensor, splits: int, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[B, Hk, M, D]`` in ``out_dtype``: :func:`decode_attention_triton` with a device-side history length."""
    from .decode_triton import decode_attention_triton

    return decode_attention_triton(
        q_rot, QuantizedRows(k_codes, k_scale, k_zero), QuantizedRows(v_codes, v_scale, v_zero), start, None, qk_offset,
        scaling, group_size, q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype, n_valid=n_valid,
        splits=splits or None,
    )


@decode_attention_static.register_fake
def _(q_rot, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, start, qk_offset, scaling, group_size,
      q_win, k_win, v_win, win_mask, r_v, mu_v, n_valid, splits, out_dtype):
    return q_rot.new_empty(q_rot.shape, dtype=out_dtype)


def decode_attention_static_call(q_rot, k: QuantizedRows, v: QuantizedRows, start, key_mask, qk_offset, scaling,
                                 group_size, q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype=None, n_valid=None,
                                 splits=None):
    """:func:`decode_attention_triton`'s signature, for the shapes it supports (the dispatcher
    ``int2_attention.decode_attention`` checks): the static cache's calls (a device-side ``n_valid``, a window mask,
    no key mask) go through the opaque op, anything else straight to the kernels."""
    from .decode_triton import decode_attention_triton

    out_dtype = out_dtype or q_win.dtype
    if n_valid is None or key_mask is not None or win_mask is None:
        return decode_attention_triton(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, q_win, k_win,
                                       v_win, win_mask, r_v, mu_v, out_dtype, n_valid=n_valid, splits=splits)
    return decode_attention_static(
        q_rot.float().contiguous(), *k, *v, start, qk_offset, float(scaling), int(group_size),
        q_win, k_win, v_win, win_mask, r_v, mu_v, n_valid, int(splits or 0), out_dtype,
    )
