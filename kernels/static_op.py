"""The compiled storage's opaque op ``oscar::decode_step_`` (``torch.library``): one layer's one-token write and read
as one call, whose launches the CUDA graph captures. The flat schema exists here only (:class:`StepStorage`,
:class:`StepHeads`, :class:`StepConfig` in; :mod:`.kv`'s bundles out). Design: docs/kernels.md §3.7.
"""
from __future__ import annotations

import inspect
from typing import NamedTuple

import torch

from oscar_hf.quant import QuantizedRows, rows_from

from . import settings
from .decode import decode, side_stream
from .kv import HeadSplit, History, KVParams, Ring, Window
from .write_path import append


class StepStorage(NamedTuple):
    """A layer's op arguments that change only when its storage is (re)allocated, in the op's order."""

    win: torch.Tensor
    codes: torch.Tensor
    meta: torch.Tensor
    key_hi: torch.Tensor | None  # [B, H2, N, D/8]: 3-bit keys' high bit plane, None for INT2 keys
    value_meta: torch.Tensor | None  # [2, B, H2, N, D/Gv]: values at a group of their own (then meta holds the keys')
    r: torch.Tensor
    clip_k: float
    clip_v: float


class StepHeads(NamedTuple):
    """A layer's retrieval heads in the op's arguments; a layer without passes the shared :data:`NO_HEADS` (the
    compiled step guards its Nones once, not per layer)."""

    heads_index: torch.Tensor | None  # [2 Hk + H2 + P] int64: hist_of [Hk], coded_of [Hk], int2_idx [H2], coded_idx [P]
    cx: torch.Tensor | None  # [2, B, P, N, X]: the keys' and values' codes (rows at 16 bits)
    cmeta: torch.Tensor | None  # [2, 2 (scale, zero), B, P, N, 1], None at 16 bits


NO_HEADS = StepHeads(None, None, None)


class StepConfig(NamedTuple):
    """The op's last arguments, one tuple shared by every layer (its constants guarded once, not per layer)."""

    group_size: int
    meta_dtype: torch.dtype
    sink: int
    recent: int
    use_kernels: str
    quantizer: str
    coded_bits: int
    block_n: int


_USE_KERNELS = {"auto": "auto", True: "on", False: "off"}  # the op's string form of ``use_kernels``


def step_storage(win, codes, meta, key_hi, value_meta, r, clip_k, clip_v) -> StepStorage:
    """The :class:`StepStorage` of a layer (its stacked tensors checked)."""
    _check_stacked(win, codes, meta, r, value_meta)
    return StepStorage(win, codes, meta, key_hi, value_meta, r, float(clip_k), float(clip_v))


def step_heads(heads_index, cx, cmeta) -> StepHeads:
    """The :class:`StepHeads` of a layer with retrieval heads."""
    if heads_index.dim() != 1 or cx.dim() != 5 or cx.shape[0] != 2 or (cmeta is not None and cmeta.shape[:2] != (2, 2)):
        raise ValueError(f"retrieval heads' stores must stack keys and values: cx [2, B, P, N, X], cmeta [2, 2, B, P, "
                         f"N, 1], a 1-d index; got {tuple(cx.shape)}, {None if cmeta is None else tuple(cmeta.shape)}, "
                         f"{tuple(heads_index.shape)}")
    return StepHeads(heads_index, cx, cmeta)


def join_heads_index(hist_of, coded_of, int2_idx, coded_idx) -> torch.Tensor:
    """A layer's four retrieval-head indices as one ``heads_index [2 Hk + H2 + P]``: ``hist_of`` / ``coded_of [Hk]``
    (KV head -> INT2 / coded head, -1 elsewhere), then ``int2_idx [H2]`` / ``coded_idx [P]``."""
    return torch.cat([torch.as_tensor(x, dtype=torch.long) for x in (hist_of, coded_of, int2_idx, coded_idx)])


def split_heads_index(heads_index: torch.Tensor, hk: int, hq: int) -> tuple[torch.Tensor, ...]:
    """``(hist_of, coded_of, int2_idx, coded_idx)``: views of :func:`join_heads_index`'s tensor."""
    return (heads_index[:hk], heads_index[hk : 2 * hk], heads_index[2 * hk : 2 * hk + hq],
            heads_index[2 * hk + hq :])


def step_config(group_size, meta_dtype, sink, recent, use_kernels, quantizer, coded_bits, block_n) -> StepConfig:
    """The :class:`StepConfig` of a cache's configuration; ``use_kernels`` ``"auto"``, True or False."""
    if use_kernels not in _USE_KERNELS:
        raise ValueError(f"use_kernels must be 'auto', True or False, got {use_kernels!r}")
    return StepConfig(int(group_size), meta_dtype, int(sink), int(recent), _USE_KERNELS[use_kernels], quantizer,
                      int(coded_bits), int(block_n))


def _check_stacked(win, codes, meta, r, value_meta=None) -> None:
    """Keys and values stacked in one tensor per kind of storage (``meta`` the keys' alone beside a ``value_meta``)."""
    kv_meta = (1 if value_meta is not None else 2, 2)
    for name, t, lead, dims in (("win", win, (2,), 5), ("codes", codes, (2,), 5), ("meta", meta, kv_meta, 6),
                                ("r", r, (2,), 4), ("value_meta", value_meta, (2,), 5)):
        if t is None:
            continue
        if t.dim() != dims or tuple(t.shape[: len(lead)]) != lead:
            raise ValueError(f"{name} must have {dims} dimensions, leading {lead} (keys and values stacked; scale and "
                             f"zero in the metadata); got shape {tuple(t.shape)}")


def decode_step(q: torch.Tensor, q_rot: torch.Tensor | None, qk_off: torch.Tensor | None, new_k: torch.Tensor,
                new_v: torch.Tensor, length: torch.Tensor, pad: torch.Tensor, win_mask: torch.Tensor,
                hist_len: torch.Tensor, mu_k: torch.Tensor | None, mu_v: torch.Tensor | None, scaling: float,
                out_dtype: torch.dtype, sinks: torch.Tensor | None, softcap: float, win: torch.Tensor,
                codes: torch.Tensor, meta: torch.Tensor, key_hi: torch.Tensor | None, value_meta: torch.Tensor | None,
                r: torch.Tensor, clip_k: float, clip_v: float,
                heads_index: torch.Tensor | None, cx: torch.Tensor | None, cmeta: torch.Tensor | None, group_size: int,
                meta_dtype: torch.dtype, sink: int, recent: int, use_kernels: str, quantizer: str, coded_bits: int,
                block_n: int) -> torch.Tensor:
    """One decode step of one layer of the compiled storage: the write (:func:`~.write_path.append`: slot ``T - W``
    demoted, the new token put), then the attention -> ``[B, Hk, g, D]`` in ``out_dtype``. At
    batches up to ``WriteDefaults.beside_max_batch`` (CUDA): the put alone before the read, the demotion on a side
    stream beside it (:func:`_write_stream`; the read does not touch the demoted slot's history entry).

    ``q [B, Hk, g, D]`` the grouped query; ``q_rot [B, H2, g, D]`` float32 / ``qk_off`` the INT2 heads' rotated
    query and logit offset (None: no INT2 head); ``new_k/new_v [B, Hk, 1, D]``; ``length`` (0-d ``T``); ``pad [B]``;
    ``win_mask [B, 1, 1, S0 + R]``; ``hist_len`` (0-d: entries ``[pad, hist_len)`` read);
    ``sinks [Hk, g]`` or None; ``softcap`` (0: none). Stacked storage, keys at index 0, values at 1:
    ``win [2, B, Hk, S0 + R, D]``, ``codes [2, B, H2, N, D/4]``, ``meta [2, 2, B, H2, N, D/G]``, ``r [2, H2, D, D]``,
    ``key_hi [B, H2, N, D/8]`` (3-bit keys) or None; ``value_meta [2, B, H2, N, D/Gv]`` (values at a group of
    their own, ``meta`` then ``[1, 2, ...]``: the keys') or None;
    retrieval heads (:class:`StepHeads`) ``cx`` / ``cmeta`` (no metadata at 16 bits)."""
    _check_stacked(win, codes, meta, r, value_meta)
    kernels = {"auto": "auto", "on": True, "off": False}[use_kernels]
    heads = coded = None
    if heads_index is not None:
        hist_of, coded_of, int2_idx, coded_idx = split_heads_index(heads_index, win.shape[2], codes.shape[2])
        heads = HeadSplit(int2_idx, coded_idx, coded_of, coded_bits)
        coded = tuple((cx[i],) if cmeta is None else (cx[i], cmeta[i, 0], cmeta[i, 1]) for i in (0, 1))
    params = KVParams(r[0], mu_k, r[1], mu_v, group_size, clip_k, clip_v, meta_dtype, quantizer, block_n,
                      None if heads is None else hist_of, heads)
    window = Window(win[0], win[1], win_mask)  # [B, Hk, S0 + R, D]
    k = rows_from((codes[0], meta[0, 0], meta[0, 1]) + (() if key_hi is None else (key_hi,)))
    v_meta = meta[1] if value_meta is None else value_meta  # [2 (scale, zero), B, H2, N, D/Gv]
    history = History(k, QuantizedRows(codes[1], v_meta[0], v_meta[1]), start=pad, n_valid=hist_len, coded=coded)
    at, side = Ring(length, pad, sink, recent), _write_stream(win, kernels)
    append(params, new_k, new_v, window, history, at, use_kernels=kernels, demote=side is None)
    if side is not None:  # the demotion beside the read
        main = torch.cuda.current_stream(win.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            append(params, None, None, window, history, at, use_kernels=kernels)
    out = decode(params, q, window, history, scaling, out_dtype, rotated=None if q_rot is None else (q_rot, qk_off),
                 softcap=softcap or None, sinks=sinks, use_kernels=kernels)
    if side is not None:  # (the join: the next step's read, and the length's increment, see the demoted row)
        main.wait_stream(side)
    return out


def _write_stream(win: torch.Tensor, kernels) -> torch.cuda.Stream | None:
    """The stream the demotion runs on beside the read (forked and joined inside the op: its latency-bound launch
    beside the read's instead of before it), or None: one launch before the read (CPU, the references, batches
    ``win [2, B, ...]`` larger than ``WriteDefaults.beside_max_batch``)."""
    if not (win.is_cuda and kernels is not False and win.shape[1] <= settings.WRITE_DEFAULTS.beside_max_batch):
        return None
    return side_stream(win.device, "write")


decode_step_ = torch.library.custom_op("oscar::decode_step_", decode_step,
                                       mutates_args=("win", "codes", "meta", "key_hi", "value_meta", "cx",
                                                                     "cmeta"))


@decode_step_.register_fake
def _(*args):
    a = inspect.signature(decode_step).bind(*args).arguments
    _check_stacked(a["win"], a["codes"], a["meta"], a["r"], a["value_meta"])
    return a["q"].new_empty(a["q"].shape, dtype=a["out_dtype"])
