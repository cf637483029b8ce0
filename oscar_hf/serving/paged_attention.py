"""Read path of the paged store: the INT2 history is read through a request's block table.

:func:`paged_decode_attention` is :func:`oscar_hf.kernels.int2_attention.decode_attention_reference` with the
contiguous history replaced by pages: the history partial is accumulated over blocks of ``block_n`` entries, each
block gathered from its pages (:meth:`PagedInt2Pool.gather`: packed INT2 codes + metadata, never full precision)
and dequantized by :func:`history_partial_reference`, the blocks merged by the online-softmax rule. With ``block_n``
a multiple of the page size the blocks are the ones the contiguous reference reads, so the result is the same as
:class:`~oscar_hf.cache.dynamic.OscarLayer`'s. A split-K GPU kernel would take the block table as an argument and
load each split's pages directly (docs/serving.md); this file is its torch reference.

Shapes: ``Hk`` KV heads, ``M = g * L`` query rows per KV head (query-head-major), ``D`` head_dim, ``n`` history
entries of the request, ``P`` the page size.
"""
from __future__ import annotations

import torch

from oscar_hf.kernels.int2_attention import (empty_partial, history_partial_reference, merge_history_and_window,
                                               merge_partials, rotate_query_reference)

from .pool import PagedInt2Pool


def paged_history_partial(q_rot, pool: PagedInt2Pool, table: list[int], layer: int, n: int, qk_offset, scaling: float,
                          block_n: int):
    """``(m, l, acc)`` of ``q_rot [1, Hk, M, D]`` (rotated, float32) over history entries ``[0, n)`` of the request
    with block table ``table``, ``block_n`` entries at a time (rounded up to whole pages)."""
    p = pool.page_size
    block = max(p, block_n // p * p)
    part = empty_partial(q_rot)
    start = torch.zeros(1, dtype=torch.long, device=q_rot.device)
    for j0 in range(0, n, block):
        j1 = min(n, j0 + block)
        pages = torch.tensor(table[j0 // p : (j1 + p - 1) // p], dtype=torch.long, device=pool.codes.device)
        k = pool.gather(pages, layer, "k", j1 - j0)
        v = pool.gather(pages, layer, "v", j1 - j0)
        blk = history_partial_reference(q_rot, k, v, start, None, qk_offset, scaling, pool.group_size, block_n=block)
        part = merge_partials([part, blk])
    return part


def paged_decode_attention(qf, r_k, mu_k, pool: PagedInt2Pool, table: list[int], layer: int, n: int, scaling: float,
                           k_win, v_win, win_mask, r_v, mu_v, out_dtype, block_n: int = 1024) -> torch.Tensor:
    """``[1, Hk, M, D]``: attention of the unrotated query ``qf [1, Hk, M, D]`` over the request's INT2 history
    (``n`` entries through ``table``) and its full-precision window ``k_win/v_win [1, Hk, W, D]`` (``win_mask`` None
    or bool broadcastable to ``[1, Hk, M, W]``). The history partial is computed in the rotated space
    (``q R_K``, ``+ q·mu_K``), brought back by ``R_Vᵀ`` and ``+ l·mu_V``, merged with the window by log-sum-exp."""
    q_rot, qk_offset = rotate_query_reference(qf, r_k, mu_k)
    hist = paged_history_partial(q_rot, pool, table, layer, n, qk_offset, scaling, block_n)
    return merge_history_and_window(hist, qf, k_win, v_win, win_mask, r_v, mu_v, scaling, out_dtype)
