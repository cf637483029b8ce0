"""Storage of a layer's retrieval heads (their history entries, in the OSCAR layer and the serving store; every slot
in the saved form): per K or V a tuple of tensors sharing (batch, head, slot), sliced, grown and saved part by part;
by ``OscarConfig.retrieval_bits`` min-max codes or the model dtype. Shapes: docs/kernels.md §1, §3.9.
"""
from __future__ import annotations

import torch

from ..kernels.heads_attention import dequantize_heads
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


def decode(parts: tuple[torch.Tensor, ...], bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Stored form -> ``[B, P, N, D]`` in ``dtype`` (16 bits: the stored rows themselves)."""
    return parts[0] if bits == 16 else dequantize_heads(parts, bits).to(dtype)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float,
              softcap: float | None = None, sinks: torch.Tensor | None = None):
    """``[B, P, M, D]``: attention of ``q [B, P, M, D]`` over ``keys/values [B, P, N, D]`` with ``mask`` (bool,
    broadcastable to ``[B, P, M, N]``). SDPA for prompt-sized ``M``; a decode step as two matmuls, since SDPA gives it
    one block per row and head and leaves the GPU idle. ``softcap`` and ``sinks`` (``[P, M]``) take the matmuls."""
    if q.shape[2] > 16 and not softcap and sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
    logits = soft_cap(torch.matmul(q, keys.transpose(-1, -2)).float() * scaling, softcap)  # [B, P, M, N]
    logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(logits, dim=-1).to(values.dtype), values)
    sink = sinks.float().to(q.device)[None, :, :, None].expand(*logits.shape[:3], 1)
    p = torch.softmax(torch.cat([logits, sink], -1), dim=-1)[..., :-1]  # the sink's column dropped
    return torch.matmul(p.to(values.dtype), values)
