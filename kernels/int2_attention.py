"""Torch references of the read (docs/kernels.md §3): online-softmax partials ``(m, l, acc)`` of rotated queries over
the packed INT2 history, merged with the full-precision window's; and the dispatchers of the rotation and the partials.
"""
from __future__ import annotations

import torch

from oscar_hf.quant import QuantizedRows, dequantize_rows, rows_from, rows_group_size

from .plan import triton_enabled

NEG_INF = float("-inf")


def empty_partial(q_rot: torch.Tensor):
    """``(m, l, acc)`` of no key, ``(-inf, 0, 0)``, for ``q_rot [B, H, M, D]``."""
    b, h, m, d = q_rot.shape
    return (torch.full((b, h, m), NEG_INF, device=q_rot.device), torch.zeros(b, h, m, device=q_rot.device),
            torch.zeros(b, h, m, d, device=q_rot.device))


def _finite_max(m: torch.Tensor) -> torch.Tensor:
    """``m`` with the -inf of rows without a valid key as 0 (their exp(-inf - 0) = 0); one launch, where the
    isfinite / zeros / where form took three (eager serving's chunk steps are launch-bound)."""
    return torch.nan_to_num(m, nan=0.0, neginf=0.0)


def merge_partials(parts):
    """Combine ``(m, l, acc)`` partials over disjoint key sets by log-sum-exp."""
    m = parts[0][0]
    for p in parts[1:]:
        m = torch.maximum(m, p[0])
    m_safe = _finite_max(m)
    l = acc = None
    for pm, pl, pacc in parts:
        w = torch.exp(pm - m_safe)  # exp(-inf) = 0 for empty partials
        if l is None:
            l, acc = w * pl, w.unsqueeze(-1) * pacc
        else:
            l, acc = torch.addcmul(l, w, pl), torch.addcmul(acc, w.unsqueeze(-1), pacc)
    return m, l, acc


def partial_from_logits(logits: torch.Tensor, values: torch.Tensor):
    """Softmax partial of ``logits [..., M, N]`` (masked = -inf) over ``values [..., N, D]``."""
    m = logits.amax(-1)
    p = torch.exp(logits - _finite_max(m).unsqueeze(-1))
    return m, p.sum(-1), torch.matmul(p, values.float())


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` (Gemma 2's attention logit soft-capping), or ``logits`` for None / 0."""
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


def sink_partial(sinks: torch.Tensor, like: torch.Tensor):
    """An attention sink as a partial: ``sinks [Hk, M]`` logits (natural units, e.g. gpt-oss's ``s_aux`` by query
    row) of a key whose value is 0, i.e. ``(m = s, l = 1, acc = 0)`` shaped as ``like``'s ``[B, Hk, M]``."""
    m = sinks.float().to(like.device).expand(like.shape)
    return m, torch.ones_like(m), torch.zeros(*like.shape, 1, device=like.device)


def window_partial(q, k, v, mask, scaling: float, softcap=None):
    """The partial of ``q [B, H, M, D]`` over exact keys / values ``[B, H, W, D]`` (``mask``: None, or bool
    broadcastable to the logits ``[B, H, M, W]``)."""
    logits = soft_cap(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scaling, softcap)
    if mask is not None:
        logits = torch.where(mask, logits, NEG_INF)
    return partial_from_logits(logits, v)


def normalized(parts, out_dtype) -> torch.Tensor:
    """``acc / l`` of the merged partials in ``out_dtype`` (rows without a valid key: 0)."""
    _, l, acc = merge_partials(parts)
    return (acc / torch.where(l > 0, l, 1.0).unsqueeze(-1)).to(out_dtype)


def history_partial_reference(q_rot, k: QuantizedRows, v: QuantizedRows, start, key_mask, qk_offset, scaling,
                              group_size, block_n=1024, n_valid=None, softcap=None, dequant=None):
    """``(m, l, acc)`` of ``q_rot [B, Hk, M, D]`` (float32, rotated by ``R_K``, ``M = g * q_len`` query-head-major)
    over ``k/v`` ``QuantizedRows [B, Hk, N, *]``: running max and denominator ``[B, Hk, M]``, unnormalized
    ``sum_j p_j v_hat_j [B, Hk, M, D]`` in the rotated value space; a row without a valid key has ``(-inf, 0, 0)``.
    Logits ``scaling * (q_rot · k_hat + qk_offset)`` (``qk_offset [B, Hk, M]`` = ``q · mu_K`` or None), soft-capped
    before the mask. Valid: ``start[b] <= j`` (< ``n_valid``, 0-d or ``[B, 1, 1, 1]``) where ``key_mask`` (bool
    ``[B, Hk|1, M|1, N]``) allows. ``block_n`` tokens dequantized at a time, merged online as the split-K kernel does in
    registers; ``dequant``: a block's parts -> float32 rows (None: INT2 rows; the retrieval heads' reference its own)."""
    n = k[0].shape[-2]
    if dequant is None:  # INT2 rows, each kind at the group its metadata holds (the values' may be their own)
        if rows_group_size(rows_from(tuple(k))) != group_size:
            raise ValueError(f"the keys' rows hold groups of {rows_group_size(rows_from(tuple(k)))} channels, not "
                             f"group_size={group_size}")
        dequant = lambda parts: dequantize_rows(rows_from(parts))  # noqa: E731
    part = empty_partial(q_rot)
    pos = torch.arange(n, device=q_rot.device)
    for j0 in range(0, n, block_n):
        j1 = min(n, j0 + block_n)
        sl = slice(j0, j1)
        kb, vb = (dequant(tuple(t[:, :, sl] for t in x)) for x in (k, v))
        logits = torch.matmul(q_rot, kb.transpose(-1, -2))  # [B, Hk, M, nb]
        if qk_offset is not None:
            logits = logits + qk_offset.unsqueeze(-1)
        logits = soft_cap(logits * scaling, softcap)
        valid = (pos[sl][None, :] >= start[:, None])[:, None, None, :]  # [B, 1, 1, nb]
        if n_valid is not None:  # static storage: only entries below the device-side length
            valid = valid & (pos[sl] < n_valid)
        if key_mask is not None:
            valid = valid & key_mask[..., sl]
        logits = logits.masked_fill(~valid, NEG_INF)
        part = merge_partials([part, partial_from_logits(logits, vb)])
    return part


def rotate_query_reference(qf: torch.Tensor, r_k: torch.Tensor, mu_k: torch.Tensor | None):
    """``qf [B, Hk, M, D]`` -> ``q R_K`` (float32) and the logit offset ``q · mu_K [B, Hk, M]`` (None without
    ``mu_k``): the history holds ``(k - mu_K) R_K``."""
    qf = qf.float()
    q_rot = torch.matmul(qf, r_k.float().unsqueeze(0))
    if mu_k is None:
        return q_rot, None
    mu_k = mu_k.float()
    return q_rot, torch.matmul(qf, (mu_k[None] if mu_k.dim() == 2 else mu_k).unsqueeze(-1)).squeeze(-1)


def rotate_query_summed(qf: torch.Tensor, r_k: torch.Tensor, mu_k: torch.Tensor | None):
    """:func:`rotate_query_reference` as a product summed over ``D``: one fused reduction kernel under Inductor, where
    the float32 matmul is a cuBLAS call (0.22 against 0.26 ms of a B=1 step on an H100); eager, a [B, Hk, M, D, D]."""
    qf, r, mu = qf.float(), r_k.float(), None if mu_k is None else mu_k.float()
    q_rot = (qf.unsqueeze(-1) * (r if r.dim() == 3 else r[None])[None, :, None]).sum(-2)  # [B, Hk, M, D]
    return q_rot, None if mu is None else (qf * (mu[None] if mu.dim() == 2 else mu)[:, :, None, :]).sum(-1)


def rotate_query(qf, r_k, mu_k, use_kernels="auto"):
    """Dispatch: the summed form under compile, a Triton launch on CUDA for decode-sized queries, else the reference."""
    if torch.compiler.is_compiling():
        return rotate_query_summed(qf, r_k, mu_k)
    if triton_enabled(qf, use_kernels):
        from .query_triton import query_kernel_supported, rotate_query_triton
        if query_kernel_supported(qf):
            return rotate_query_triton(qf, r_k, mu_k)
    return rotate_query_reference(qf, r_k, mu_k)


def history_partial(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, block_n=1024, use_kernels="auto"):
    """Dispatch: split-K Triton kernels on CUDA where supported, else the reference."""
    if triton_enabled(q_rot, use_kernels):
        from .decode_triton import history_partial_triton, kernel_supported
        if kernel_supported(q_rot, k, group_size, key_mask):
            return history_partial_triton(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size)
    return history_partial_reference(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, block_n)


def decode_attention_reference(params, q, window, history, scaling, out_dtype=None, *, rotated=None, softcap=None,
                               sinks=None):
    """Torch reference of ``decode_triton.decode_attention_triton`` (same arguments): the history partial, brought
    back to the value space, merged with the window's and normalized (rows with no valid key give 0)."""
    out_dtype = out_dtype or (q.dtype if q is not None else torch.float32)
    q_rot, qk_offset = rotated if rotated is not None else rotate_query_reference(q, params.r_k, params.mu_k)
    hist = history_partial_reference(q_rot, history.k, history.v, history.start, history.key_mask, qk_offset, scaling,
                                     params.group_size, params.block_n, n_valid=history.n_valid, softcap=softcap)
    return merge_history_and_window(hist, q, window.k, window.v, window.mask, params.r_v, params.mu_v, scaling,
                                    out_dtype, softcap, sinks)


def merge_history_and_window(hist, q_win, k_win, v_win, win_mask, r_v, mu_v, scaling: float, out_dtype, softcap=None,
                             sinks=None):
    """The history partial brought back to the value space (``acc R_Vᵀ + l mu_V``; ``r_v`` None: it is there, the
    retrieval heads'), merged with the window's partial (and the sinks'), normalized, in ``out_dtype``."""
    hm, hl, hacc = hist
    if r_v is not None:
        hacc = torch.matmul(hacc, r_v.float().transpose(-1, -2).unsqueeze(0))
    if mu_v is not None:
        hacc = hacc + hl.unsqueeze(-1) * mu_v.float()[None, :, None, :]
    parts = [(hm, hl, hacc)]
    if k_win is not None and k_win.shape[-2] > 0:
        parts.append(window_partial(q_win, k_win, v_win, win_mask, scaling, softcap))
    if sinks is not None:
        parts.append(sink_partial(sinks, hm))
    return normalized(parts, out_dtype)
