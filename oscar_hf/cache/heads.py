"""Storage of a layer's retrieval heads: their keys and values coded, every slot in the eager
:class:`~oscar_hf.cache.dynamic.OscarLayer`, the history entries in the compiled layer and the serving store (whose
window holds the other slots). A decode step reads them in place
(:func:`~oscar_hf.kernels.heads_attention.heads_decode_attention`); a multi-token forward reads them back in the
model dtype for one SDPA call (:func:`decode`, :func:`attention`). ``OscarConfig.retrieval_bits`` picks the form, per K
or V, ``P`` heads, ``N`` slots:

* ``16``: the model dtype, one tensor ``[B, P, N, D]`` (exact);
* ``8`` / ``4``: codes ``[B, P, N, D * bits / 8] uint8`` (INT4: two per byte, :func:`~oscar_hf.quant.pack_int4`) and
  one scale and zero per token and head ``[B, P, N, 1]`` in the model dtype: min-max over the head's ``D`` channels,
  no rotation, no clipping (:func:`~oscar_hf.quant.quantize_minmax`); 8.5 / 4.5 bits per element at ``D = 64`` (why
  INT8: docs/quality.md, "Retrieval-safe defaults").

A stored form is a tuple of tensors sharing their first three dimensions (batch, head, slot): the caches slice, grow,
reorder and save them part by part, as they do the INT2 history's ``QuantizedRows``.
"""
from __future__ import annotations

import torch

from ..quant import QuantizedRows, dequantize_minmax, encode_heads, unpack_int4
from ..kernels.int2_attention import soft_cap

def part_names(bits: int) -> tuple[str, ...]:
    """Names of the stored tensors (what a saved cache calls them)."""
    return ("x",) if bits == 16 else ("codes", "scale", "zero")


def part_specs(bits: int, head_dim: int, dtype: torch.dtype) -> list[tuple[int, torch.dtype]]:
    """``(last dimension, dtype)`` of each stored tensor."""
    if bits == 16:
        return [(head_dim, dtype)]
    return [(head_dim * bits // 8, torch.uint8), (1, dtype), (1, dtype)]


def row_bytes(bits: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token of one head, keys or values."""
    return sum(n * torch.empty((), dtype=dt).element_size() for n, dt in part_specs(bits, head_dim, dtype))


def allocate(bits: int, b: int, p: int, n: int, head_dim: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """Zeroed storage of ``n`` slots."""
    return tuple(torch.zeros(b, p, n, last, dtype=dt, device=device) for last, dt in part_specs(bits, head_dim, dtype))


def encode(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """``x [B, P, L, D]`` (model dtype) -> its stored form (:func:`~oscar_hf.quant.encode_heads`, which the fused
    one-token write's reference shares)."""
    return encode_heads(x, bits)


def decode(parts: tuple[torch.Tensor, ...], bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored form -> ``[B, P, N, D]`` in ``dtype``."""
    if bits == 16:
        return parts[0]
    codes, scale, zero = parts
    return dequantize_minmax(QuantizedRows(unpack_int4(codes) if bits == 4 else codes, scale, zero), dtype)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float,
              softcap: float | None = None, sinks: torch.Tensor | None = None):
    """``[B, P, M, D]``: softmax attention of ``q [B, P, M, D]`` over ``keys/values [B, P, N, D]`` (model dtype)
    with ``mask`` (bool, broadcastable to ``[B, P, M, N]``). SDPA for prompt-sized ``M``; a decode step (``M = g``
    query heads of one KV head) as two matmuls and a softmax: SDPA's kernels give such a step one block per batch
    row and head, which leaves an H100 nearly idle over 32K keys (1.5 ms per head at B = 8), while the matmuls
    spread the keys over the whole GPU. ``softcap`` (Gemma 2's logit soft-capping) and ``sinks`` (``[P, M]`` logits
    of a zero-valued key, gpt-oss's ``s_aux``), which SDPA cannot express, take the matmuls at any ``M``."""
    if q.shape[2] > 16 and not softcap and sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    logits = soft_cap(torch.matmul(q, keys.transpose(-1, -2)).float() * scaling, softcap)  # [B, P, M, N]
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(logits, dim=-1).to(values.dtype), values)
    sink = sinks.float().to(q.device)[None, :, :, None].expand(*logits.shape[:3], 1)
    p = torch.softmax(torch.cat([logits, sink], -1), dim=-1)[..., :-1]  # the sink's column dropped
    return torch.matmul(p.to(values.dtype), values)
