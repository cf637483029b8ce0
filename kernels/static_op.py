"""The compiled storage's ops (``torch.library``, opaque to the compiler): its decode attention
(``oscar::decode_attention_static``), its one-token write (``oscar::append_token_``) and one-slot write of the
full-precision heads (``oscar::write_slot_``).

Under ``torch.compile`` (``generate`` compiling a :class:`~oscar_hf.StaticOscarCache`
decode step, CUDA graphs) the Triton launches of :func:`~oscar_hf.kernels.decode_triton.decode_attention_triton`
are hidden behind a custom op: dynamo records one call, inductor leaves the kernels alone (they
are compiled and tuned by Triton's own JIT, as in eager), and the CUDA graph captures their
launches. The fake implementation only gives the output's shape and dtype. The op allocates its
output and partials, mutates nothing, and reads the history length from ``n_valid`` on the device.

The decode step's write (``oscar::append_token_``, :func:`append_token_op`) is a second op, with the same
reasons: it mutates one layer's window and INT2 history in place (declared in ``mutates_args``, so functionalization
tracks it), touches only the rows that change (one fused launch on CUDA, the torch reference elsewhere) and returns
nothing. ``oscar::write_slot_`` writes one slot of a full-precision buffer in place for the same reason.
"""
from __future__ import annotations

import torch

from oscar_hf.quant import QuantizedRows


@torch.library.custom_op("oscar::decode_attention_static", mutates_args=())
def decode_attention_static(
    q_rot: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor, start: torch.Tensor,
    key_mask: torch.Tensor | None, qk_offset: torch.Tensor | None, scaling: float, group_size: int,
    q_win: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor, win_mask: torch.Tensor | None,
    r_v: torch.Tensor, mu_v: torch.Tensor | None, n_valid: torch.Tensor, splits: int, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[B, Hk, M, D]`` in ``out_dtype``: :func:`~oscar_hf.kernels.decode_triton.decode_attention_triton` (the
    launcher) with a device-side history length ``n_valid`` and ``splits`` history programs (0: the wave model's),
    for the shapes it supports (``int2_attention.decode_attention_rotating`` checks and calls this op)."""
    from .decode_triton import decode_attention_triton

    return decode_attention_triton(
        q_rot, QuantizedRows(k_codes, k_scale, k_zero), QuantizedRows(v_codes, v_scale, v_zero), start, key_mask,
        qk_offset, scaling, group_size, q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype, n_valid=n_valid,
        splits=splits or None,
    )


@decode_attention_static.register_fake
def _(q_rot, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, start, key_mask, qk_offset, scaling, group_size,
      q_win, k_win, v_win, win_mask, r_v, mu_v, n_valid, splits, out_dtype):
    return q_rot.new_empty(q_rot.shape, dtype=out_dtype)


_USE_KERNELS = {"auto": "auto", True: "on", False: "off"}  # the op's string form of ``use_kernels``


@torch.library.custom_op(
    "oscar::append_token_",
    mutates_args=("win_k", "win_v", "k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"),
)
def append_token_(
    new_k: torch.Tensor, new_v: torch.Tensor, win_k: torch.Tensor, win_v: torch.Tensor,
    k_codes: torch.Tensor, k_scale: torch.Tensor, k_zero: torch.Tensor,
    v_codes: torch.Tensor, v_scale: torch.Tensor, v_zero: torch.Tensor,
    length: torch.Tensor, pad: torch.Tensor, hist_heads: torch.Tensor | None,
    r_k: torch.Tensor, mu_k: torch.Tensor | None, clip_k: float, r_v: torch.Tensor, mu_v: torch.Tensor | None,
    clip_v: float, group_size: int, meta_dtype: torch.dtype, sink: int, recent: int, use_kernels: str,
    quantizer: str,
) -> None:
    """:func:`~oscar_hf.kernels.write_path.append_token` on flattened :class:`QuantizedRows`; ``use_kernels`` is
    ``"auto"``, ``"on"`` or ``"off"``."""
    from .write_path import append_token

    kernels = {"auto": "auto", "on": True, "off": False}[use_kernels]
    append_token(new_k, new_v, win_k, win_v, QuantizedRows(k_codes, k_scale, k_zero),
                 QuantizedRows(v_codes, v_scale, v_zero), length, pad, hist_heads, r_k, mu_k, clip_k, r_v, mu_v,
                 clip_v, group_size, meta_dtype, sink, recent, use_kernels=kernels, quantizer=quantizer)


@append_token_.register_fake
def _(new_k, new_v, win_k, win_v, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, length, pad, hist_heads,
      r_k, mu_k, clip_k, r_v, mu_v, clip_v, group_size, meta_dtype, sink, recent, use_kernels, quantizer):
    return None


def append_token_op(new_k, new_v, win_k, win_v, hist_k: QuantizedRows, hist_v: QuantizedRows, length, pad,
                    hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, group_size, meta_dtype, sink, recent,
                    use_kernels="auto", quantizer="minmax") -> None:
    """:func:`~oscar_hf.kernels.write_path.append_token`'s signature through the opaque op ``oscar::append_token_``
    (for ``torch.compile`` / CUDA graphs): mutates the window and history in place, returns None.

    Under ``mode="reduce-overhead"`` the mutated buffers must be static inputs (``torch._dynamo.mark_static_address``)
    for the step to be recorded as a CUDA graph; pass distinct tensors for ``r_k`` and ``r_v`` (with torch 2.11 the
    same tensor in both, next to two distinct per-step inputs, lost every static-input mark and the graph was
    skipped for "mutated inputs")."""
    if use_kernels not in _USE_KERNELS:
        raise ValueError(f"use_kernels must be 'auto', True or False, got {use_kernels!r}")
    append_token_(new_k, new_v, win_k, win_v, *hist_k, *hist_v, length, pad, hist_heads, r_k, mu_k, float(clip_k),
                  r_v, mu_v, float(clip_v), int(group_size), meta_dtype, int(sink), int(recent),
                  _USE_KERNELS[use_kernels], quantizer)


@torch.library.custom_op("oscar::write_slot_", mutates_args=("buf",))
def write_slot_(buf: torch.Tensor, new: torch.Tensor, slot: torch.Tensor) -> None:
    """``buf[:, :, slot] = new[:, :, 0]`` (``slot`` a 0-d device tensor): opaque to the compiler, so that the
    compiled step writes one row in place instead of a functional copy of the whole buffer."""
    buf.index_copy_(2, slot.reshape(1), new)


@write_slot_.register_fake
def _(buf, new, slot) -> None:
    return None


def write_slot_op(buf: torch.Tensor, new: torch.Tensor, slot: torch.Tensor) -> None:
    write_slot_(buf, new.contiguous(), slot)


@torch.library.custom_op("oscar::heads_decode", mutates_args=())
def heads_decode(
    q: torch.Tensor, heads: torch.Tensor, k_x: torch.Tensor, k_scale: torch.Tensor | None, k_zero: torch.Tensor | None,
    v_x: torch.Tensor, v_scale: torch.Tensor | None, v_zero: torch.Tensor | None, bits: int, lo: torch.Tensor,
    hi_dev: torch.Tensor | None, hi_host: int, win_k: torch.Tensor, win_v: torch.Tensor,
    win_mask: torch.Tensor | None, scaling: float, out_dtype: torch.dtype,
) -> torch.Tensor:
    """``[B, P, M, D]``: :func:`~oscar_hf.kernels.heads_triton.heads_decode_triton` (the retrieval heads' read);
    ``hi_dev`` (0-d device tensor) or else ``hi_host`` bounds the history."""
    from .heads_triton import heads_decode_triton

    k = (k_x,) if bits == 16 else (k_x, k_scale, k_zero)
    v = (v_x,) if bits == 16 else (v_x, v_scale, v_zero)
    return heads_decode_triton(q, heads, k, v, bits, lo, hi_dev if hi_dev is not None else hi_host, win_k, win_v,
                               win_mask, scaling, out_dtype)


@heads_decode.register_fake
def _(q, heads, k_x, k_scale, k_zero, v_x, v_scale, v_zero, bits, lo, hi_dev, hi_host, win_k, win_v, win_mask,
      scaling, out_dtype):
    b, _, m, d = q.shape
    return q.new_empty((b, heads.shape[0], m, d), dtype=out_dtype)


def heads_decode_op(q, heads, k, v, bits: int, lo, hi, win_k, win_v, win_mask, scaling: float, out_dtype):
    """The retrieval heads' Triton read: straight to the launcher in eager code, through the opaque op
    ``oscar::heads_decode`` while ``torch.compile`` traces (inductor leaves the kernels to Triton's JIT; the CUDA graph
    captures the two launches)."""
    if not torch.compiler.is_compiling():
        from .heads_triton import heads_decode_triton

        return heads_decode_triton(q, heads, k, v, bits, lo, hi, win_k, win_v, win_mask, scaling, out_dtype)
    hi_dev = hi if isinstance(hi, torch.Tensor) else None
    return heads_decode(q, heads, *_parts3(k), *_parts3(v), int(bits), lo, hi_dev, 0 if hi_dev is not None else int(hi),
                        win_k, win_v, win_mask, float(scaling), out_dtype)


def _parts3(parts):
    """A head store's parts as ``(x, scale, zero)``, None for the 16-bit form's missing metadata."""
    return tuple(parts) if len(parts) == 3 else (parts[0], None, None)
