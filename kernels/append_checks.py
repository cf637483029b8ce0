"""Input checks of the one-token write, shared by its references (``write_path``) and kernels (``append_triton``)
without either importing the other. Reads no device data."""
from __future__ import annotations

from typing import NamedTuple

import torch

from oscar_hf.quant import check_group_size


class CodedSlots(NamedTuple):
    """The retrieval heads' entries the one-token write fills: ``k``/``v`` parts ``[B, P, N, *]`` (``encode_heads``:
    ``(x,)`` at 16 bits, ``(codes, scale, zero)`` at 8 / 4), ``coded_of [Hk]`` int64 (-1: an INT2 head), ``bits``."""

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    coded_of: torch.Tensor
    bits: int


def coded_slots(params, history) -> CodedSlots | None:
    """The retrieval heads' rows of a write (``history.coded`` with ``params.heads``), None without."""
    if history.coded is None:
        return None
    return CodedSlots(history.coded[0], history.coded[1], params.heads.coded_of, params.heads.bits)


def write_operands(params, window, history) -> tuple:
    """A write's operands from its bundles, as the references and the launchers read them: ``(win_k, win_v, hist_k,
    hist_v, hist_heads, r_k, mu_k, clip_k, r_v, mu_v, clip_v, coded)``."""
    p = params
    return (window.k, window.v, history.k, history.v, p.hist_of, p.r_k, p.mu_k, p.clip_k, p.r_v, p.mu_v, p.clip_v,
            coded_slots(params, history))


def check_append_inputs(params, new_k, new_v, window, history, at) -> tuple[int, int, int]:
    """Shape checks of the contiguous one-token write (``write_path.append`` at a ``Ring``; host-side metadata only:
    no device sync). Returns ``(R, N, H2)``: ring entries, history capacity, quantized heads."""
    win_k, win_v, length, pad, sink, recent = window.k, window.v, at.length, at.pad, at.sink, at.recent
    if new_k.dim() != 4 or new_k.shape[2] != 1 or new_v.shape != new_k.shape:
        raise ValueError(f"new_k/new_v must be [B, Hk, 1, D] of one shape, got {tuple(new_k.shape)}, "
                         f"{tuple(new_v.shape)}")
    b, hk, _, d = new_k.shape
    check_group_size(d, params.group_size)
    if sink < 0 or recent < 0:
        raise ValueError(f"sink={sink} and recent={recent} must be >= 0")
    if win_k.dim() != 4 or win_v.shape != win_k.shape or win_k.shape[:2] != (b, hk) or win_k.shape[3] != d:
        raise ValueError(f"win_k/win_v must be [B={b}, Hk={hk}, S0 + R, D={d}], got {tuple(win_k.shape)}, "
                         f"{tuple(win_v.shape)}")
    _check_dtypes(new_k, new_v, win_k, win_v)
    ring = win_k.shape[2] - sink
    if ring < recent + 1:
        raise ValueError(f"the ring has {ring} entries (window {win_k.shape[2]} - sink {sink}); it needs at least "
                         f"recent + 1 = {recent + 1}")
    h2, n = history.k.codes.shape[1], history.k.codes.shape[2]
    _check_history(params, history, (b, h2, n), "B, H2, N", d, hk)
    mu_k, mu_v = params.mu_k, params.mu_v
    if mu_k is not None and mu_k.shape not in ((h2, d), (b, h2, d)):
        raise ValueError(f"mu_k must be None, [H2, D] or [B, H2, D] = {(b, h2, d)}, got {tuple(mu_k.shape)}")
    if mu_v is not None and mu_v.shape != (h2, d):
        raise ValueError(f"mu_v must be None or [H2, D] = {(h2, d)}, got {tuple(mu_v.shape)}")
    if length.dim() != 0 or pad.shape != (b,):
        raise ValueError(f"length must be a 0-d tensor and pad [B={b}], got {tuple(length.shape)}, {tuple(pad.shape)}")
    check_coded_slots(coded_slots(params, history), win_k, n)
    return ring, n, h2


def _check_dtypes(new_k, new_v, win_k, win_v) -> None:
    if win_k.dtype != new_k.dtype or win_v.dtype != new_v.dtype:
        raise ValueError(f"window dtype {win_k.dtype}/{win_v.dtype} != new token dtype {new_k.dtype}/{new_v.dtype}")


def _check_history(params, history, lead: tuple, lead_names: str, d: int, hk: int) -> None:
    """The INT2 rows ``[*lead, D/4]`` uint8 and ``[*lead, D/G]`` metadata (``lead[1]`` = H2 quantized heads), the
    KV head -> history head map and the rotations ``[H2, D, D]``: the contiguous and the paged write alike."""
    h2, group_size, meta_dtype, hist_heads = lead[1], params.group_size, params.meta_dtype, params.hist_of
    for name, q in (("hist_k", history.k), ("hist_v", history.v)):
        if q.codes.shape != (*lead, d // 4) or q.codes.dtype != torch.uint8:
            raise ValueError(f"{name}.codes must be uint8 [{lead_names}, D/4] = {(*lead, d // 4)}, got "
                             f"{q.codes.dtype} {tuple(q.codes.shape)}")
        for t in (q.scale, q.zero):
            if t.shape != (*lead, d // group_size) or t.dtype != meta_dtype:
                raise ValueError(f"{name} metadata must be {meta_dtype} [{lead_names}, D/G] = "
                                 f"{(*lead, d // group_size)}, got {t.dtype} {tuple(t.shape)}")
    if hist_heads is None:
        if h2 != hk:
            raise ValueError(f"hist_heads=None means every KV head is quantized, but the history has {h2} heads, "
                             f"not Hk={hk}")
    elif hist_heads.shape != (hk,) or hist_heads.dtype != torch.long:
        raise ValueError(f"hist_heads must be int64 [Hk={hk}], got {hist_heads.dtype} {tuple(hist_heads.shape)}")
    for name, r in (("r_k", params.r_k), ("r_v", params.r_v)):
        if r.shape != (h2, d, d):
            raise ValueError(f"{name} must be [H2={h2}, D, D], got {tuple(r.shape)}")


def check_coded_slots(coded, win_k, n: int) -> None:
    """Shape checks of the retrieval heads' part of the one-token write (``coded``: a ``CodedSlots`` or None) against
    the window ``win_k [B, Hk, S0 + R, D]`` and the history capacity ``n``."""
    if coded is None:
        return
    b, hk, _, d = win_k.shape
    if coded.bits not in (4, 8, 16):
        raise ValueError(f"coded heads are stored at 4, 8 or 16 bits, got {coded.bits}")
    parts = 1 if coded.bits == 16 else 3
    if len(coded.k) != parts or len(coded.v) != parts:
        raise ValueError(f"a {coded.bits}-bit coded store has {parts} parts, got {len(coded.k)} / {len(coded.v)}")
    p = coded.k[0].shape[1]
    want = [(d if coded.bits == 16 else d * coded.bits // 8, win_k.dtype if coded.bits == 16 else torch.uint8)]
    want += [(1, win_k.dtype)] * (parts - 1)
    for name, store in (("k", coded.k), ("v", coded.v)):
        for x, (last, dt) in zip(store, want):
            if x.shape != (b, p, n, last) or x.dtype != dt or x.stride(-1) != 1:
                raise ValueError(f"coded {name} part {x.dtype} {tuple(x.shape)} is not {dt} [B, P, N, {last}] = "
                                 f"{(b, p, n, last)}, contiguous in its last dimension")
    if coded.coded_of.shape != (hk,) or coded.coded_of.dtype != torch.long:
        raise ValueError(f"coded_of must be int64 [Hk={hk}], got {coded.coded_of.dtype} {tuple(coded.coded_of.shape)}")


def check_paged_inputs(params, new_k, new_v, window, history, rows) -> int:
    """Shape checks of the paged one-token write (``write_path.append`` at ``PagedRows``; host-side metadata only).
    Returns ``H2``, the quantized heads."""
    win_k, win_v, coded = window.k, window.v, coded_slots(params, history)
    if new_k.dim() != 3 or new_v.shape != new_k.shape:
        raise ValueError(f"new_k/new_v must be [Hk, Q, D] of one shape, got {tuple(new_k.shape)}, {tuple(new_v.shape)}")
    hk, _, d = new_k.shape
    check_group_size(d, params.group_size)
    if win_k.dim() != 4 or win_v.shape != win_k.shape or win_k.shape[1] != hk or win_k.shape[3] != d:
        raise ValueError(f"win_k/win_v must be [slots, Hk={hk}, S0 + R, D={d}], got {tuple(win_k.shape)}, "
                         f"{tuple(win_v.shape)}")
    _check_dtypes(new_k, new_v, win_k, win_v)
    bp = rows.pos.shape[0]
    for name, x in zip(("pos", "slots", "new_entry", "sink_entry", "demote_entry", "demote_page", "demote_off"),
                       rows.tensors()):
        if x.shape != (bp,) or x.dtype != torch.long:
            raise ValueError(f"rows.{name} must be int64 [Bp={bp}], got {x.dtype} {tuple(x.shape)}")
    pages, h2, p = history.k.codes.shape[:3]
    _check_history(params, history, (pages, h2, p), "pages, H2, P", d, hk)
    for name, mu in (("mu_k", params.mu_k), ("mu_v", params.mu_v)):
        if mu is not None and mu.shape != (h2, d):
            raise ValueError(f"{name} must be None or [H2, D] = {(h2, d)}, got {tuple(mu.shape)}")
    if coded is not None:  # the coded pages as a history of `pages` rows of P entries
        check_coded_slots(coded, torch.empty((pages, hk, 1, d), dtype=win_k.dtype, device="meta"), p)
    return h2
