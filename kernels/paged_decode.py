"""Decode attention over a *paged* INT2 history (the serving pool, ``[num_pages, Hk, P, *]``; row ``b``'s entry ``j``
at row ``j % P`` of page ``table[b, j // P]``) and a pool of full-precision windows (docs/kernels.md §3.8). On CUDA
the contiguous path's kernels in their ``PAGED`` mode read it; elsewhere the torch references here.
"""
from __future__ import annotations

import dataclasses

import torch

from oscar_hf.quant import QuantizedRows

from .int2_attention import (decode_attention_reference, history_partial_reference, merge_history_and_window,
                             rotate_query_reference)
from .kv import History, KVParams, Pages, Window
from .plan import cdiv, group_fits, plain_fits, triton_enabled
from .settings import DEFAULTS

ROW_TILE = 64  # query rows of one program of the chunk read (the split-K kernel's most); a tile reads the history once
# the chunk read's tile at D = 128: 4 warps, not the decode's 8 for 64 rows (a 512-row chunk over 15,872 entries,
# H200, one scratch timing: 1.06 against 1.61 ms, the same partials; 16- / 32-row tiles 1.45 / 2.96; docs/serving.md)
CHUNK_DEFAULTS = dataclasses.replace(DEFAULTS, num_warps_wide=4)
LOGITS_BUDGET = 256 << 20  # bytes of float32 logits a chunk read materializes at once (reference blocks, window slices)


def check_paged_inputs(qf, pages_k: QuantizedRows, pages_v: QuantizedRows, pages: Pages, window: Window) -> None:
    """Raise a clear ValueError for shapes that do not fit together (values are not checked: no device sync)."""
    if qf.dim() != 4:
        raise ValueError(f"qf must be [B, Hk, M, D], got {tuple(qf.shape)}")
    b, hk, _, d = qf.shape
    for name, rows in (("pages_k", pages_k), ("pages_v", pages_v)):
        codes, scale, zero = rows[:3]
        if codes.dim() != 4 or codes.shape[1] != hk or codes.shape[3] * 4 != d or codes.dtype != torch.uint8:
            raise ValueError(f"{name}.codes must be uint8 [num_pages, Hk={hk}, P, D/4={d // 4}], got {codes.dtype} "
                             f"{tuple(codes.shape)}")
        if scale.shape != zero.shape or scale.shape[:3] != codes.shape[:3] or d % scale.shape[3]:
            raise ValueError(f"{name}.scale / zero must be [num_pages, Hk, P, D/G] like its codes, got "
                             f"{tuple(scale.shape)} / {tuple(zero.shape)} for codes {tuple(codes.shape)}")
    if pages_k.hi is not None and pages_k.hi.shape != (*pages_k.codes.shape[:3], d // 8):
        raise ValueError(f"pages_k.hi (3-bit keys' high bits) must be [num_pages, Hk, P, D/8={d // 8}], got "
                         f"{tuple(pages_k.hi.shape)}")
    if pages_v.hi is not None:
        raise ValueError("values are stored in INT2: pages_v has no high bits")
    if pages_k.codes.shape != pages_v.codes.shape:  # (the values' metadata may be at a group of their own)
        raise ValueError(f"pages_k and pages_v differ in shape: {tuple(pages_k.codes.shape)} / "
                         f"{tuple(pages_v.codes.shape)}")
    table = pages.table
    if table.dim() != 2 or table.shape[0] != b or table.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_table must be int32/int64 [B={b}, max_pages], got {table.dtype} {tuple(table.shape)}")
    slot = window.slot if window.slot is not None else torch.zeros(b, dtype=torch.long)
    for name, t in (("hist_len", pages.lengths), ("win_slot", slot)):
        if t.shape != (b,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32/int64 [B={b}], got {t.dtype} {tuple(t.shape)}")
    win_k, win_v = window.k, window.v
    if window.kv_heads is not None and (window.kv_heads.shape != (hk,) or window.kv_heads.dtype != torch.long):
        raise ValueError(f"the window's kv_heads must be long [Hk={hk}], got {tuple(window.kv_heads.shape)}")
    if (win_k.dim() != 4 or win_k.shape != win_v.shape or win_k.shape[3] != d
            or (window.kv_heads is None and win_k.shape[1] != hk)):  # (kv_heads: a layer's INT2 heads, read in place)
        raise ValueError(f"win_k / win_v must be [num_slots, Hk={hk}, W, D={d}], got {tuple(win_k.shape)} / "
                         f"{tuple(win_v.shape)}")
    mask = window.mask_2d()
    if mask is None or mask.shape != (b, win_k.shape[2]) or mask.dtype != torch.bool:
        raise ValueError(f"win_mask must be bool [B={b}, W={win_k.shape[2]}], got "
                         f"{None if mask is None else (mask.dtype, tuple(mask.shape))}")


def gather_rows(parts, block_table: torch.Tensor, n: int):
    """The first ``n`` entries of every row of a paged store's parts ``[num_pages, H, P, X]`` -> ``[B, H, n, X]``
    each (a copy; the same tuple type; entries past a row's pages read page 0, for the caller to mask). Static
    shapes, no host sync."""
    b, p = block_table.shape[0], parts[0].shape[-2]
    cols = cdiv(n, p)
    ids = block_table[:, :cols].long().clamp(min=0).reshape(-1)  # [B * cols]

    def cut(t):
        x = t.index_select(0, ids).view(b, cols, *t.shape[1:])  # [B, cols, H, P, X]
        return x.transpose(1, 2).reshape(b, t.shape[1], cols * p, t.shape[-1])[:, :, :n]

    out = tuple(cut(t) for t in parts)
    return type(parts)(*out) if hasattr(parts, "_fields") else out  # (QuantizedRows / QuantizedRows3 as given)


def paged_decode_batched(params: KVParams, qf, window: Window, history: History, scaling, out_dtype):
    """The paged read's torch reference: every row's history gathered to the host bound ``pages.max_len`` (entries
    past a row's length masked, and zeroed: stale storage may hold NaN), then the contiguous reference. No host sync,
    so the serving step runs it off CUDA and a graph may capture it."""
    pages, n = history.pages, int(history.pages.max_len)
    key_mask = (torch.arange(n, device=qf.device)[None, :] < pages.lengths.to(qf.device)[:, None])[:, None, None, :]
    keep = key_mask.transpose(-1, -2)  # [B, 1, n, 1]

    def valid_only(rows):  # [B, H2, n, *] (QuantizedRows, or QuantizedRows3 for 3-bit keys)
        rows = gather_rows(rows, pages.table, n)
        return rows._replace(**{f: torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))
                                for f, x in (("scale", rows.scale), ("zero", rows.zero))})

    win, start = window.gathered(), torch.zeros(qf.shape[0], dtype=torch.long, device=qf.device)
    return decode_attention_reference(params, qf, Window(win.k, win.v, win.mask_2d()[:, None, None, :]),
                                      History(valid_only(history.k), valid_only(history.v), start, key_mask), scaling,
                                      out_dtype)


def paged_supported(qf, pages_k: QuantizedRows, pages_v: QuantizedRows, group_size: int, win_k) -> bool:
    """Shapes and layouts the Triton path serves, reading the pool in place (else: the reference)."""
    _, _, m, d = qf.shape
    ng = d // group_size if group_size > 0 else 0
    # 3-bit keys or the values at a group of their own: the split kernel's dequant loop (power-of-two head_dim)
    plain = pages_k.hi is not None or pages_v.scale.shape[-1] != ng
    ok = (d in (64, 128, 256) and 0 < group_size <= d and group_size & (group_size - 1) == 0 and 1 <= m <= 64
          and qf.device == pages_k.codes.device == win_k.device and (not plain or plain_fits(d))
          and pages_k.scale.shape[-1] == ng and (pages_k.hi is None or pages_k.hi.stride(-1) == 1))
    for codes, scale, zero in (pages_k[:3], pages_v[:3]):
        ok = ok and codes.stride(-1) == 1 and scale.stride(-1) == 1 and scale.stride(-2) == scale.shape[-1]
        ok = ok and zero.stride() == scale.stride() and group_fits(d, d // scale.shape[-1])
    return ok


def paged_history_partial(q_rot, qk_offset, history: History, scaling: float, group_size: int, block_n: int = 1024,
                          use_kernels="auto"):
    """``(m, l, acc)`` partials of ``q_rot [1, Hk, M, D]`` (any ``M``: a prompt chunk's rows) over one request's paged
    history (``history.pages``: table ``[1, np]``, ``max_len`` its length). On CUDA tiles of ``ROW_TILE`` rows are the
    launch's batch rows, sharing the block table; the reference's blocks keep their logits within ``LOGITS_BUDGET``."""
    from . import decode_triton as dt

    pages, (_, hk, m, d) = history.pages, q_rot.shape
    n = int(pages.max_len)
    tile_ok = n and paged_supported(q_rot[:, :, :ROW_TILE], history.k, history.v, group_size, q_rot)
    if triton_enabled(q_rot, use_kernels) and tile_ok:
        t = cdiv(m, ROW_TILE)

        def tiles(x):  # [1, Hk, M, *] -> [T, Hk, ROW_TILE, *] (zero rows past M: computed, then dropped)
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 3) + (0, t * ROW_TILE - m))
            return x.view(hk, t, ROW_TILE, *x.shape[3:]).transpose(0, 1).contiguous()

        rows = Pages(pages.table.expand(t, -1), pages.lengths.expand(t).contiguous(), n)
        part = dt.decode_attention_triton(KVParams(None, None, None, None, group_size), None, None,
                                          History(history.k, history.v, pages=rows), scaling,
                                          rotated=(tiles(q_rot), None if qk_offset is None else
                                                   tiles(qk_offset[..., None])[..., 0]),
                                          defaults=CHUNK_DEFAULTS if d == 128 else DEFAULTS)
        return tuple(x.transpose(0, 1).reshape(1, hk, t * ROW_TILE, *x.shape[3:])[:, :, :m] for x in part)
    p = history.k.codes.shape[-2]
    block = max(p, min(block_n, LOGITS_BUDGET // (4 * hk * m)) // p * p)
    k, v = (gather_rows(x, pages.table[:1], n) for x in (history.k, history.v))  # [1, Hk, n, *]
    start = torch.zeros(1, dtype=torch.long, device=q_rot.device)
    return history_partial_reference(q_rot, k, v, start, None, qk_offset, scaling, group_size, block_n=block)


def paged_multi_token_attention(params: KVParams, qf, window: Window, history: History, scaling: float, out_dtype,
                                use_kernels="auto") -> torch.Tensor:
    """``[1, Hk, M, D]``: attention of the unrotated ``qf [1, Hk, M, D]`` over one request's paged history and its
    window ``[1, Hk, W, D]`` (``window.mask`` broadcastable to ``[1, Hk, M, W]``: a chunk's causal rows)."""
    q_rot, qk_offset = rotate_query_reference(qf, params.r_k, params.mu_k)
    hist = paged_history_partial(q_rot, qk_offset, history, scaling, params.group_size, params.block_n, use_kernels)
    return merge_history_and_window(hist, qf, window.k, window.v, window.mask, params.r_v, params.mu_v, scaling,
                                    out_dtype)
