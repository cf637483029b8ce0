"""The retrieval heads of the paged store (``OscarConfig.full_precision_heads``, the artifact's by default): per
quantized layer its KV heads split into the ``int2`` heads (history in the pool's INT2 rows, rotated) and the
``coded`` heads, whose history entries are stored as coded rows in the same pages (:mod:`oscar_hf.cache.heads`:
INT8 by default, ``full_precision_bits``) and read unrotated, as :class:`~oscar_hf.cache.static.StaticOscarLayer`
reads its ``fp_k/fp_v``: over their coded history slots ``[S0, T - W)`` plus the exact window every head shares. A
decode step reads them in place through the block tables (:func:`~oscar_hf.kernels.heads_attention.
heads_decode_attention`, the compiled cache's read); a prompt chunk gathers one request's pages
(:func:`coded_history`).

Why history entries only: the sink and recent slots of those heads are read from the window (exact), never from their
coded rows, so only what leaves the window is coded (the same codes as coding each token when it arrives:
``heads.encode`` is per token), one more write beside the INT2 demotion, into the same page and offset.

Shapes: ``Bd`` decode rows, ``Hk`` KV heads, ``Hq_l`` / ``F_l`` int2 / coded heads of the layer, ``g`` query heads
per KV head, ``D`` head_dim, ``W`` window entries (sink + ring), ``n`` history entries.
"""
from __future__ import annotations

import dataclasses

import torch

from ..cache import heads


@dataclasses.dataclass(frozen=True)
class HeadSplit:
    """One layer's KV heads: ``int2`` (INT2 history) and ``coded`` (retrieval heads), ascending, and their device
    index tensors; ``bits`` the coded rows' form."""

    int2: tuple[int, ...]
    coded: tuple[int, ...]
    bits: int
    int2_idx: torch.Tensor  # [Hq_l] long
    coded_idx: torch.Tensor  # [F_l] long

    @classmethod
    def build(cls, num_kv_heads: int, coded, bits: int, device) -> "HeadSplit":
        coded = tuple(sorted(coded))
        int2 = tuple(h for h in range(num_kv_heads) if h not in coded)
        idx = lambda hs: torch.tensor(hs, dtype=torch.long, device=device)  # noqa: E731
        return cls(int2, coded, bits, idx(int2), idx(coded))

    def merge(self, int2_part: torch.Tensor | None, coded_part: torch.Tensor) -> torch.Tensor:
        """``[B, Hq_l, ...]`` and ``[B, F_l, ...]`` -> ``[B, Hk, ...]`` at their heads (``int2_part`` None when the
        layer keeps no head in INT2)."""
        out = coded_part.new_empty(coded_part.shape[0], len(self.int2) + len(self.coded), *coded_part.shape[2:])
        if int2_part is not None:
            out.index_copy_(1, self.int2_idx, int2_part.to(out.dtype))
        return out.index_copy_(1, self.coded_idx, coded_part)


def coded_history(pool, layer: int, kind: str, page_ids: torch.Tensor, n: int, split: HeadSplit,
                  dtype: torch.dtype) -> torch.Tensor:
    """``[B, F_l, n, D]`` in ``dtype``: the first ``n`` history entries of the coded heads, for the rows whose pages
    are ``page_ids [B, np]`` (only those pages are read and dequantized)."""
    return heads.decode(pool.gather_coded(page_ids, layer, kind, n), split.bits, dtype)
