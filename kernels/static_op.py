"""The compiled storage's ops (``torch.library``, opaque to the compiler): its decode attention
(``oscar::decode_attention_static``), its one-token write (``oscar::append_token_``) and the retrieval heads' read
(``oscar::heads_decode``).

Under ``torch.compile`` (``generate`` compiling a :class:`~oscar_hf.StaticOscarCache`
decode step, CUDA graphs) the Triton launches of :func:`~oscar_hf.kernels.decode_triton.decode_attention_triton`
are hidden behind a custom op: dynamo records one call, inductor leaves the kernels alone (they
are compiled and tuned by Triton's own JIT, as in eager), and the CUDA graph captures their
launches. The fake implementation only gives the output's shape and dtype. The op allocates its
output and partials, mutates nothing, and reads the history length from ``n_valid`` on the device.

The decode step's write (``oscar::append_token_``, :func:`append_token_op`) is a second op, with the same
reasons: it mutates one layer's window and history (the INT2 heads' and the retrieval heads' entries; the stacked
tensors of the compiled storage, :mod:`oscar_hf.cache.static`) in place
(declared in ``mutates_args``, so functionalization tracks it), touches only the rows that change (one fused launch on
CUDA, the torch reference elsewhere) and returns nothing.
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
    sinks: torch.Tensor | None = None, softcap: float = 0.0,
) -> torch.Tensor:
    """``[B, Hk, M, D]`` in ``out_dtype``: :func:`~oscar_hf.kernels.decode_triton.decode_attention_triton` (the
    launcher) with a device-side history length ``n_valid`` and ``splits`` history programs (0: the wave model's),
    for the shapes it supports (``int2_attention.decode_attention_rotating`` checks and calls this op); ``softcap``
    0: no logit soft-capping."""
    from .decode_triton import decode_attention_triton

    return decode_attention_triton(
        q_rot, QuantizedRows(k_codes, k_scale, k_zero), QuantizedRows(v_codes, v_scale, v_zero), start, key_mask,
        qk_offset, scaling, group_size, q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype, n_valid=n_valid,
        splits=splits or None, sinks=sinks, softcap=softcap or None,
    )


@decode_attention_static.register_fake
def _(q_rot, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, start, key_mask, qk_offset, scaling, group_size,
      q_win, k_win, v_win, win_mask, r_v, mu_v, n_valid, splits, out_dtype, sinks=None, softcap=0.0):
    return q_rot.new_empty(q_rot.shape, dtype=out_dtype)


_USE_KERNELS = {"auto": "auto", True: "on", False: "off"}  # the op's string form of ``use_kernels``


@torch.library.custom_op(
    "oscar::append_token_",
    mutates_args=("win", "codes", "meta", "ck_x", "ck_scale", "ck_zero", "cv_x", "cv_scale", "cv_zero"),
)
def append_token_(
    new_k: torch.Tensor, new_v: torch.Tensor, win: torch.Tensor, codes: torch.Tensor, meta: torch.Tensor,
    length: torch.Tensor, pad: torch.Tensor, hist_heads: torch.Tensor | None,
    r: torch.Tensor, mu_k: torch.Tensor | None, clip_k: float, mu_v: torch.Tensor | None,
    clip_v: float, group_size: int, meta_dtype: torch.dtype, sink: int, recent: int, use_kernels: str,
    quantizer: str, ck_x: torch.Tensor | None, ck_scale: torch.Tensor | None, ck_zero: torch.Tensor | None,
    cv_x: torch.Tensor | None, cv_scale: torch.Tensor | None, cv_zero: torch.Tensor | None,
    coded_of: torch.Tensor | None, coded_bits: int,
) -> None:
    """:func:`~oscar_hf.kernels.write_path.append_token` on the compiled storage's stacked tensors (keys at index 0,
    values at 1: ``win [2, B, Hk, S0 + R, D]``, ``codes [2, B, Hq, N, D/4]``, ``meta [2, 2 (scale, zero), B, Hq, N,
    D/G]``, ``r [2, Hq, D, D]``) and flattened :class:`~oscar_hf.kernels.write_path.CodedSlots` (``coded_of`` None:
    no retrieval heads; 16-bit stores have no scale or zero); ``use_kernels`` is ``"auto"``, ``"on"`` or ``"off"``.
    The op takes the whole tensors, not their K and V views: functionalization then tracks three mutated inputs, not
    ten views of them (a view mutated by an op costs the compile its base's bookkeeping, per layer)."""
    from .write_path import CodedSlots, append_token

    kernels = {"auto": "auto", "on": True, "off": False}[use_kernels]
    coded = None
    if coded_of is not None:
        k, v = ((x,) if coded_bits == 16 else (x, sc, z) for x, sc, z in ((ck_x, ck_scale, ck_zero),
                                                                          (cv_x, cv_scale, cv_zero)))
        coded = CodedSlots(k, v, coded_of, coded_bits)
    hist_k, hist_v = (QuantizedRows(codes[i], meta[i, 0], meta[i, 1]) for i in (0, 1))
    append_token(new_k, new_v, win[0], win[1], hist_k, hist_v, length, pad, hist_heads, r[0], mu_k, clip_k, r[1],
                 mu_v, clip_v, group_size, meta_dtype, sink, recent, use_kernels=kernels, quantizer=quantizer,
                 coded=coded)


@append_token_.register_fake
def _(new_k, new_v, win, codes, meta, length, pad, hist_heads, r, mu_k, clip_k, mu_v, clip_v, group_size,
      meta_dtype, sink, recent, use_kernels, quantizer, ck_x, ck_scale, ck_zero, cv_x, cv_scale, cv_zero, coded_of,
      coded_bits):
    return None


def append_token_op(new_k, new_v, win, codes, meta, length, pad, hist_heads, r, mu_k, clip_k, mu_v, clip_v,
                    group_size, meta_dtype, sink, recent, use_kernels="auto", quantizer="minmax", coded=None) -> None:
    """:func:`~oscar_hf.kernels.write_path.append_token` through the opaque op ``oscar::append_token_`` (for
    ``torch.compile`` / CUDA graphs), on the stacked tensors of :func:`append_token_` (``win``, ``codes``, ``meta``,
    ``r``: keys at index 0, values at 1): mutates the window and history in place, returns None.

    Under ``mode="reduce-overhead"`` the mutated tensors must be static inputs (``torch._dynamo.mark_static_address``)
    for the step to be recorded as a CUDA graph."""
    if use_kernels not in _USE_KERNELS:
        raise ValueError(f"use_kernels must be 'auto', True or False, got {use_kernels!r}")
    for name, t, lead, dims in (("win", win, (2,), 5), ("codes", codes, (2,), 5), ("meta", meta, (2, 2), 6),
                                ("r", r, (2,), 4)):
        if t.dim() != dims or tuple(t.shape[: len(lead)]) != lead:
            raise ValueError(f"{name} must stack keys and values: {dims} dimensions, leading {lead}; got shape "
                             f"{tuple(t.shape)}")
    parts = (None,) * 6 if coded is None else (*_parts3(coded.k), *_parts3(coded.v))
    append_token_(new_k, new_v, win, codes, meta, length, pad, hist_heads, r, mu_k, float(clip_k), mu_v,
                  float(clip_v), int(group_size), meta_dtype, int(sink), int(recent), _USE_KERNELS[use_kernels],
                  quantizer, *parts, None if coded is None else coded.coded_of, 0 if coded is None else int(coded.bits))


@torch.library.custom_op("oscar::heads_decode", mutates_args=())
def heads_decode(
    q: torch.Tensor, heads: torch.Tensor, k_x: torch.Tensor, k_scale: torch.Tensor | None, k_zero: torch.Tensor | None,
    v_x: torch.Tensor, v_scale: torch.Tensor | None, v_zero: torch.Tensor | None, bits: int, lo: torch.Tensor,
    hi_dev: torch.Tensor | None, hi_host: int, win_k: torch.Tensor, win_v: torch.Tensor,
    win_mask: torch.Tensor | None, scaling: float, out_dtype: torch.dtype, sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> torch.Tensor:
    """``[B, P, M, D]``: :func:`~oscar_hf.kernels.heads_triton.heads_decode_triton` (the retrieval heads' read);
    ``hi_dev`` (0-d device tensor) or else ``hi_host`` bounds the history; ``sinks`` ``[P, M]`` or None; ``softcap``
    0: none."""
    from .heads_triton import heads_decode_triton

    k = (k_x,) if bits == 16 else (k_x, k_scale, k_zero)
    v = (v_x,) if bits == 16 else (v_x, v_scale, v_zero)
    return heads_decode_triton(q, heads, k, v, bits, lo, hi_dev if hi_dev is not None else hi_host, win_k, win_v,
                               win_mask, scaling, out_dtype, sinks=sinks, softcap=softcap or None)


@heads_decode.register_fake
def _(q, heads, k_x, k_scale, k_zero, v_x, v_scale, v_zero, bits, lo, hi_dev, hi_host, win_k, win_v, win_mask,
      scaling, out_dtype, sinks=None, softcap=0.0):
    b, _, m, d = q.shape
    return q.new_empty((b, heads.shape[0], m, d), dtype=out_dtype)


def heads_decode_op(q, heads, k, v, bits: int, lo, hi, win_k, win_v, win_mask, scaling: float, out_dtype, sinks=None,
                    softcap=None):
    """The retrieval heads' Triton read: straight to the launcher in eager code, through the opaque op
    ``oscar::heads_decode`` while ``torch.compile`` traces (inductor leaves the kernels to Triton's JIT; the CUDA graph
    captures the two launches)."""
    if not torch.compiler.is_compiling():
        from .heads_triton import heads_decode_triton

        return heads_decode_triton(q, heads, k, v, bits, lo, hi, win_k, win_v, win_mask, scaling, out_dtype,
                                   sinks=sinks, softcap=softcap)
    hi_dev = hi if isinstance(hi, torch.Tensor) else None
    return heads_decode(q, heads, *_parts3(k), *_parts3(v), int(bits), lo, hi_dev, 0 if hi_dev is not None else int(hi),
                        win_k, win_v, win_mask, float(scaling), out_dtype, sinks, float(softcap or 0.0))


def _parts3(parts):
    """A head store's parts as ``(x, scale, zero)``, None for the 16-bit form's missing metadata."""
    return tuple(parts) if len(parts) == 3 else (parts[0], None, None)
