"""Input checks of the one-token write (:func:`~oscar_hf.kernels.write_path.append`), shared by its references
(``write_path``) and kernels (``append_triton``) without either importing the other. Host-side metadata only: no
device sync."""
from __future__ import annotations

import torch

from oscar_hf.quant import check_group_size


def check_append_inputs(params, new_k, new_v, window, history, at) -> tuple[int, int, int]:
    """The contiguous write at a ``Ring`` (``new_k = new_v = None``: the demotion alone). Returns ``(R, N, H2)``:
    ring entries, history capacity, quantized heads."""
    win_k, win_v, length, pad, sink, recent = window.k, window.v, at.length, at.pad, at.sink, at.recent
    if (new_k is None) != (new_v is None) or new_k is not None and (
            new_k.dim() != 4 or new_k.shape[2] != 1 or new_v.shape != new_k.shape):
        shapes = [None if x is None else tuple(x.shape) for x in (new_k, new_v)]
        raise ValueError(f"new_k/new_v must be [B, Hk, 1, D] of one shape (or both None), got {shapes}")
    if win_k.dim() != 4:
        raise ValueError(f"win_k must be [B, Hk, S0 + R, D], got {tuple(win_k.shape)}")
    b, hk, _, d = new_k.shape if new_k is not None else win_k.shape
    if sink < 0 or recent < 0:
        raise ValueError(f"sink={sink} and recent={recent} must be >= 0")
    if win_v.shape != win_k.shape or win_k.shape[:2] != (b, hk) or win_k.shape[3] != d:
        raise ValueError(f"win_k/win_v must be [B={b}, Hk={hk}, S0 + R, D={d}], got {tuple(win_k.shape)}, "
                         f"{tuple(win_v.shape)}")
    if new_k is not None:
        _check_dtypes(new_k, new_v, win_k, win_v)
    ring = win_k.shape[2] - sink
    if ring < recent + 1:
        raise ValueError(f"the ring has {ring} entries (window {win_k.shape[2]} - sink {sink}); it needs at least "
                         f"recent + 1 = {recent + 1}")
    h2, n = history.k.codes.shape[1], history.k.codes.shape[2]
    _check_history(params, history, (b, h2, n), "B, H2, N", d, hk, win_k.dtype, mu_rows=b)
    if length.dim() != 0 or pad.shape != (b,):
        raise ValueError(f"length must be a 0-d tensor and pad [B={b}], got {tuple(length.shape)}, {tuple(pad.shape)}")
    return ring, n, h2


def _check_dtypes(new_k, new_v, win_k, win_v) -> None:
    if win_k.dtype != new_k.dtype or win_v.dtype != new_v.dtype:
        raise ValueError(f"window dtype {win_k.dtype}/{win_v.dtype} != new token dtype {new_k.dtype}/{new_v.dtype}")


def _check_history(params, history, lead: tuple, lead_names: str, d: int, hk: int, dtype, mu_rows=None) -> None:
    """The group size, the INT2 rows ``[*lead, D/4]`` uint8 and ``[*lead, D/G]`` metadata (``lead[1]`` = H2 quantized
    heads), the KV head -> history head map, the rotations ``[H2, D, D]``, the offsets ``[H2, D]`` (``mu_k`` also
    ``[mu_rows, H2, D]`` where given: the contiguous write's per-row offsets) and the retrieval heads' rows
    (``dtype``: the window's) of the contiguous and the paged write alike."""
    h2, group_size, meta_dtype, hist_heads = lead[1], params.group_size, params.meta_dtype, params.hist_of
    check_group_size(d, group_size)
    for name, q in (("hist_k", history.k), ("hist_v", history.v)):
        if q.codes.shape != (*lead, d // 4) or q.codes.dtype != torch.uint8:
            raise ValueError(f"{name}.codes must be uint8 [{lead_names}, D/4] = {(*lead, d // 4)}, got "
                             f"{q.codes.dtype} {tuple(q.codes.shape)}")
        g = group_size if name == "hist_k" else d // max(q.scale.shape[-1], 1)  # (values: a group of their own)
        check_group_size(d, g)
        for t in (q.scale, q.zero):
            if t.shape != (*lead, d // g) or t.dtype != meta_dtype:
                raise ValueError(f"{name} metadata must be {meta_dtype} [{lead_names}, D/G] = "
                                 f"{(*lead, d // g)}, got {t.dtype} {tuple(t.shape)}")
    hi = history.k.hi  # (3-bit keys: their high bits' plane; values are INT2)
    if hi is not None and (hi.shape != (*lead, d // 8) or hi.dtype != torch.uint8) or history.v.hi is not None:
        raise ValueError(f"3-bit keys' high bits must be uint8 [{lead_names}, D/8] = {(*lead, d // 8)} and the values "
                         f"INT2, got {None if hi is None else (hi.dtype, tuple(hi.shape))} / values of "
                         f"{history.v.bits} bits")
    if hist_heads is None:
        if h2 != hk:
            raise ValueError(f"hist_heads=None means every KV head is quantized, but the history has {h2} heads, "
                             f"not Hk={hk}")
    elif hist_heads.shape != (hk,) or hist_heads.dtype != torch.long:
        raise ValueError(f"hist_heads must be int64 [Hk={hk}], got {hist_heads.dtype} {tuple(hist_heads.shape)}")
    for name, r in (("r_k", params.r_k), ("r_v", params.r_v)):
        if r.shape != (h2, d, d):
            raise ValueError(f"{name} must be [H2={h2}, D, D], got {tuple(r.shape)}")
    mu_k_shapes = ((h2, d),) if mu_rows is None else ((h2, d), (mu_rows, h2, d))
    for name, mu, shapes in (("mu_k", params.mu_k, mu_k_shapes), ("mu_v", params.mu_v, ((h2, d),))):
        if mu is not None and mu.shape not in shapes:
            raise ValueError(f"{name} must be None or of a shape in {shapes}, got {tuple(mu.shape)}")
    if history.coded is not None:  # the retrieval heads' parts [B or pages, P, N or P, *] and their coded_of [Hk]
        check_coded_store(*history.coded, params.heads.bits, lead[0], history.coded[0][0].shape[1], lead[2], d, dtype)
        coded_of = params.heads.coded_of
        if coded_of.shape != (hk,) or coded_of.dtype != torch.long:
            raise ValueError(f"coded_of must be int64 [Hk={hk}], got {coded_of.dtype} {tuple(coded_of.shape)}")


def check_coded_store(k, v, bits: int, rows: int, p: int, n: int, d: int, dtype=None) -> None:
    """A retrieval heads' store (:mod:`oscar_hf.cache.heads`): ``k`` / ``v`` parts ``[rows, P, n, *]`` (rows: B, or
    pages of ``n`` entries) at ``bits``, codes ``D * bits / 8`` columns; with ``dtype`` (the writes) every part's
    last dimension and dtype too, contiguous in its last dimension."""
    if bits not in (4, 8, 16):
        raise ValueError(f"retrieval heads are stored at 4, 8 or 16 bits, got {bits}")
    parts = 1 if bits == 16 else 3
    if len(k) != parts or len(v) != parts:
        raise ValueError(f"a {bits}-bit head store has {parts} parts, got {len(k)} / {len(v)}")
    want = [(d if bits == 16 else d * bits // 8, dtype if bits == 16 else torch.uint8)] + [(1, dtype)] * (parts - 1)
    full = dtype is not None  # (the read takes any dtype and stride: it copies what the kernel cannot read)
    for name, store in zip("kv", (k, v)):
        for x, (last, dt) in zip(store, want):
            if x.shape[:3] != (rows, p, n) or full and (x.shape[3:] != (last,) or x.dtype != dt or x.stride(-1) != 1):
                raise ValueError(f"head store {name} part {x.dtype} {tuple(x.shape)} is not [rows, P, N, {last}] = "
                                 f"{(rows, p, n, last)}{f' {dt}, contiguous in its last dimension' if full else ''}")
    if k[0].shape[-1] != want[0][0]:
        raise ValueError(f"{bits}-bit head codes of head_dim {d} have {want[0][0]} columns, got {k[0].shape[-1]}")


def check_paged_inputs(params, new_k, new_v, window, history, rows) -> int:
    """The paged write at ``PagedRows``. Returns ``H2``, the quantized heads."""
    win_k, win_v = window.k, window.v
    if new_k.dim() != 3 or new_v.shape != new_k.shape:
        raise ValueError(f"new_k/new_v must be [Hk, Q, D] of one shape, got {tuple(new_k.shape)}, {tuple(new_v.shape)}")
    hk, _, d = new_k.shape
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
    _check_history(params, history, (pages, h2, p), "pages, H2, P", d, hk, win_k.dtype)
    return h2
