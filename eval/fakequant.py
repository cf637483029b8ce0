"""Teacher-forced fake-quantized attention: score a whole window in ONE forward, with exactly the
keys/values each position would see while decoding token by token through a quantized cache.

A :class:`FakeQuantSpec` describes a KV method by two things:

* ``layer_kv(layer_idx, k, v) -> (k_hat, v_hat) | None``: the reconstruction of every token's
  key/value as the cache would read it back once that token is quantized (rotate, center, clip,
  quantize, dequantize, un-rotate, un-center). Tokens are quantized once, independently of when
  (true of OSCAR's per-token rows, KIVI's fixed token groups, per-vector codebooks); ``None`` keeps
  the layer in full precision;
* ``exact_mask(n, prefill_len) -> bool [n, n]``: ``True`` where query ``p`` reads key ``j`` in full
  precision (for ``j <= p``); the other causal keys are read from the quantized copy.

The registered attention handler (prefix ``oscareval_``) concatenates ``[K_exact ; K_hat]`` (and
values) along the key axis and masks them with ``[causal & exact ; causal & ~exact]``, so both
key sets enter ONE softmax, exactly like the cache's log-sum-exp merge of its full-precision and
history partials. Positions before ``prefill_len`` are the prompt: exact (OscarCache's prefill is
exact on the prompt's own K/V). Layer ``i``'s input at position ``p`` already comes from the
quantized view of every lower layer at ``p``, so one forward reproduces token-by-token decoding
(:func:`oscar_hf.eval.perplexity.cache_nll`), proven equal in ``tests/eval/test_perplexity.py``.

The forward may also continue an exact prefix held in a ``DynamicCache`` (``use_cache=True`` after a plain
prefill of ``prefill_len`` tokens): the queries are then the last ``n`` of ``kv`` positions and the masks are
the matching rows (the needle scorer's fast path, :func:`oscar_hf.eval.needle.fast_answer_scores`).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from oscar_hf.patching import patched, register_handler
from oscar_hf.quant import dequantize_minmax, quantize_minmax

PREFIX = "oscareval_"
_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("oscar_eval_spec", default=None)
_PREFILL: contextvars.ContextVar = contextvars.ContextVar("oscar_eval_prefill", default=1)


class FakeQuantSpec:
    """Base class: subclasses implement :meth:`layer_kv` and :meth:`exact_mask`."""

    name = "spec"

    def layer_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        raise NotImplementedError

    def exact_mask(self, n: int, prefill_len: int, device) -> torch.Tensor:
        raise NotImplementedError


def window_exact_mask(n: int, prefill_len: int, sink: int, recent: int, device=None) -> torch.Tensor:
    """OscarCache's rule. A decode query at position ``p`` has ``T = p`` committed slots; once
    ``T - recent > sink`` the slots ``[sink, T - recent)`` are INT2 history, everything else (sink,
    the last ``recent`` slots, the query's own token) is full precision. Nothing is quantized while
    ``T - recent <= sink``, nor for prompt positions ``p < prefill_len``."""
    p = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    quantizing = (p - recent > sink) & (p >= prefill_len)
    return ~quantizing | (j < sink) | (j >= p - recent)


def residual_exact_mask(n: int, prefill_len: int, residual: int, device=None) -> torch.Tensor:
    """KIVI's rule: after ``T`` committed tokens, the first ``residual * floor(T / residual)`` are
    quantized (flushed in whole blocks of ``residual``), the rest and the query itself are exact."""
    p = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    n_quant = torch.div(p, residual, rounding_mode="floor") * residual
    return (p < prefill_len) | (j >= n_quant)


def _allowed(attention_mask, n: int, kv: int):
    """The model's own mask as bool ``[B|1, 1, n, kv]`` (True = may attend), or None."""
    if attention_mask is None or not isinstance(attention_mask, torch.Tensor):
        return None
    if attention_mask.dim() != 4:
        raise ValueError(f"fake-quant attention expects a 4D mask, got {tuple(attention_mask.shape)}")
    m = attention_mask[:, :, -n:, -kv:]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    return m


def _handler(module, query, key, value, attention_mask, *args, base: str, dropout: float = 0.0, scaling=None,
             sliding_window=None, softcap=None, **kwargs):
    spec = _ACTIVE.get()
    if spec is None or not isinstance(key, torch.Tensor) or sliding_window is not None:
        return NotImplemented
    n, kv = query.shape[2], key.shape[2]
    if kv < n:
        raise RuntimeError(f"fake-quant attention got {n} queries but only {kv} keys")
    off = kv - n  # > 0: the queries are the last n positions after an exact prefix held by a DynamicCache
    if kwargs.get("sinks") is not None:
        raise NotImplementedError("fake-quant attention does not implement per-token attention sinks (`sinks`)")
    fq = spec.layer_kv(module.layer_idx, key, value)
    if fq is None:
        return NotImplemented
    k_hat, v_hat = fq
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    dev = query.device
    causal = torch.arange(kv, device=dev)[None, :] <= (off + torch.arange(n, device=dev))[:, None]  # [n, kv]
    exact = spec.exact_mask(kv, _PREFILL.get(), dev)[off:]
    mask = torch.cat([causal & exact, causal & ~exact], dim=-1)  # [n, 2 kv]
    allowed = _allowed(attention_mask, n, kv)
    if allowed is not None:
        mask = mask & torch.cat([allowed, allowed], dim=-1)
    keys = torch.cat([key.float(), k_hat.float()], dim=2)
    values = torch.cat([value.float(), v_hat.float()], dim=2)
    s_aux = kwargs.get("s_aux")
    if softcap or s_aux is not None:  # what SDPA cannot express: the logits written out (Gemma 2, gpt-oss)
        out = _explicit_attention(query.float(), keys, values, mask, scaling, softcap, s_aux)
    else:
        out = F.scaled_dot_product_attention(
            query.float(), keys, values, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
    return out.transpose(1, 2).to(query.dtype).contiguous(), None


def _explicit_attention(q, keys, values, mask, scaling: float, softcap, s_aux) -> torch.Tensor:
    """``[B, Hq, n, D]``: softmax attention of ``q [B, Hq, n, D]`` over ``keys/values [B, Hk, N, D]`` with ``mask``
    (bool, broadcastable to ``[B, Hq, n, N]``), the logits soft-capped (``softcap * tanh(x / softcap)``, before the
    mask, as Gemma 2's eager attention) and a learned sink per query head (``s_aux [Hq]``: one more logit in the
    softmax whose value is 0, as gpt-oss's)."""
    g = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    logits = torch.matmul(q, keys.transpose(-1, -2)) * scaling
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~mask, float("-inf"))
    if s_aux is not None:
        sink = s_aux.float().reshape(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(logits, -1)
    return torch.matmul(probs, values)


register_handler(PREFIX, _handler)


def minmax_fake_quant(x: torch.Tensor, bits: int, meta_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``x [..., D]`` -> the same shape and dtype, each row stored as ``bits``-bit codes with an asymmetric min-max
    scale and zero (one group over the whole row, no clipping) and read back: at most ``2**bits`` distinct values per
    row (:func:`oscar_hf.quant.quantize_minmax`, the storage of the caches' retrieval heads at 8 or 4 bits)."""
    return dequantize_minmax(quantize_minmax(x, bits, meta_dtype), x.dtype)


@contextlib.contextmanager
def fake_quant(model, spec: FakeQuantSpec | None, prefill_len: int = 1):
    """Within the block, ``model(ids, use_cache=False)`` attends through ``spec`` (None: plain model)."""
    if spec is None:
        yield model
        return
    t1, t2 = _ACTIVE.set(spec), _PREFILL.set(prefill_len)
    try:
        with patched(model, PREFIX):
            yield model
    finally:
        _ACTIVE.reset(t1)
        _PREFILL.reset(t2)
