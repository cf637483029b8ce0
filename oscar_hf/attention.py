"""Read path: the attention function that consumes an :class:`~oscar_hf.cache.OscarKV` handle.

Registered as ``oscar_<base>`` for every base implementation (``oscar_sdpa``, ``oscar_eager``, ...,
see :mod:`oscar_hf.patching`); any call whose ``key`` is a plain tensor (other caches, sliding or
skipped layers) goes to the user's own implementation untouched.

For one layer and a forward of ``L`` new tokens at slots ``[T, T + L)``:

* nothing quantized yet (``tail_start == 0``): the tail holds every slot in order, so the base
  implementation runs on ``cat(tail, new)`` with the model's own mask: bit-identical to a
  ``DynamicCache`` (prompts shorter than ``sink + recent``);
* otherwise three online-softmax partials, merged by log-sum-exp:
  1. full precision: sink (row ``b``'s slots ``pad[b] + j``), recent tail ``[tail_start, T)``
     and the new rows (causal among themselves);
  2. INT2 history ``[S0 + pad[b], tail_start)``: ``q`` is rotated once by ``R_K``
     (``q·k = (q R_K)·(k R_K)``), logits get ``+ q·mu_K``; the values are accumulated in the
     rotated space, rotated back once by ``R_Vᵀ`` and get ``+ (Σ_history p)·mu_V``. The history
     is read in bounded blocks (torch reference) or by the split-K Triton kernel (CUDA): no
     full-precision copy of it is ever built;
* full-precision heads (``OscarConfig.full_precision_heads``): those KV heads keep every slot in
  ``layer.fp_k/v`` and are read by one SDPA call over them, as a ``DynamicCache`` would
  (:func:`full_precision_heads_attention`); the two parts above run on the other heads only;
* then :meth:`OscarLayer.commit` demotes/appends.

The attention mask (left padding, holes, custom 4D masks) is honoured in all three parts by
indexing it at each part's absolute slots.
"""
from __future__ import annotations

import torch

from oscar_hf.kernels import triton_enabled
from oscar_hf.kernels.int2_attention import decode_attention_rotating

from .cache import OscarKV
from .quant import QuantizedRows
from .static_cache import StaticOscarLayer
from .patching import base_attention_function, patch_model, register_handler, unpatch_model

PREFIX = "oscar_"


def _allowed(mask: torch.Tensor | None, b: int, l: int, kv: int, t_old: int) -> torch.Tensor | None:
    """Normalize any Transformers mask to bool ``[B, L, kv]`` (True = may attend) or None (all, causal)."""
    if mask is None:
        return None
    if mask.dim() == 2:  # flash-style padding mask [B, kv]: add causality for the new rows
        pos = torch.arange(kv, device=mask.device)
        causal = pos[None, :] <= (t_old + torch.arange(l, device=mask.device))[:, None]
        return mask.bool()[:, None, :kv] & causal[None]
    if mask.dim() != 4:
        raise ValueError(f"unsupported attention mask shape {tuple(mask.shape)}")
    m = mask[:, 0, -l:, :kv]
    if m.dtype != torch.bool:  # additive float mask (eager): 0 = attend, large negative = masked
        m = m > torch.finfo(m.dtype).min / 2
    return m.expand(b, l, kv)


def _first_real_slot(allowed: torch.Tensor | None, b: int, device) -> torch.Tensor:
    """Row ``b``'s first attended slot, read from the last query row (left padding)."""
    if allowed is None:
        return torch.zeros(b, dtype=torch.long, device=device)
    last = allowed[:, -1, :]
    first = last.to(torch.int8).argmax(-1)
    return torch.where(last.any(-1), first, torch.full_like(first, last.shape[-1]))


# one forward's answer of _left_padding_only, shared by its layers: (mask, t_old, answer); the mask held so that its id
# cannot be reused while the entry lives
_LEFT_PAD_MEMO: list = [None]


def _left_padding_only(attention_mask, allowed: torch.Tensor, t_old: int) -> bool:
    """Whether a decode step's mask (``allowed [B, 1, kv]``) only hides a left-padding prefix of each row (every row
    False...False True...True). Then the history's key mask says no more than a per-row start (its first allowed
    slot), which the decode op takes without a mask -- and so can run on the Gluon history kernel, which has none.
    One host sync per forward: the answer is kept for the other layers given the same mask (a layer with another
    mask, e.g. a sliding window, gets its own); none while compiling or capturing a CUDA graph (the mask is kept)."""
    if torch.compiler.is_compiling() or (allowed.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    memo = _LEFT_PAD_MEMO[0]
    if memo is not None and memo[0] is attention_mask and memo[1] == t_old:
        return memo[2]
    row = allowed[:, -1, :]
    ok = bool((row[:, 1:] >= row[:, :-1]).all())
    _LEFT_PAD_MEMO[0] = (attention_mask, t_old, ok)
    return ok


def _group(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[B, Hq, L, D]`` -> ``[B, Hk, g*L, D]`` (query heads of one KV head, query-head-major)."""
    b, hq, l, d = x.shape
    return x.reshape(b, hk, (hq // hk) * l, d)


def _mask_rows(m: torch.Tensor, g: int) -> torch.Tensor:
    """``[B, L, N]`` -> ``[B, 1, g*L, N]`` matching :func:`_group`'s row order."""
    b, l, n = m.shape
    return m[:, None, None].expand(b, 1, g, l, n).reshape(b, 1, g * l, n)


def full_precision_heads_attention(layer, query, new_k, new_v, allowed, t_old: int, scaling: float) -> torch.Tensor:
    """``[B, P, g*L, D]``: exact attention of the layer's full-precision heads over their slots ``[0, T + L)``
    (SDPA in the model dtype, the model's mask or causal, left padding masked from ``layer.pad``)."""
    b, hq, l, d = query.shape
    hk = new_k.shape[1]
    g = hq // hk
    layer.write_full_precision_heads(new_k, new_v, t_old)
    kv = t_old + l
    dev = query.device
    if allowed is None and l == 1 and layer.pad_max == 0:
        mask = None  # one decode row without padding: every slot (the common step, no mask built)
    elif allowed is None:
        slot = torch.arange(kv, device=dev)
        ok = slot[None, :] <= (t_old + torch.arange(l, device=dev))[:, None]  # causal among the new rows
        ok = ok[None] & (slot[None, None, :] >= layer.pad[:, None, None])  # [B, L, kv]
        mask = _mask_rows(ok, g)
    else:
        mask = _mask_rows(allowed, g)  # [B, 1, g*L, kv]
    q = _group(query, hk).index_select(1, layer.fp_idx)  # [B, P, g*L, D]
    return torch.nn.functional.scaled_dot_product_attention(
        q, layer.fp_k[:, :, :kv], layer.fp_v[:, :, :kv], attn_mask=mask, scale=scaling
    )


def oscar_decode_attention(layer, handle: OscarKV, query, attention_mask, scaling: float, module, base: str, **kwargs):
    """Attention for one forward through an OSCAR layer; commits the new rows. Returns ``[B, L, Hq, D]``."""
    new_k, new_v = handle.key_states, handle.value_states
    b, hq, l, d = query.shape
    hk = new_k.shape[1]
    g = hq // hk
    t_old = layer.seq_len
    kv = t_old + l
    allowed = _allowed(attention_mask, b, l, kv, t_old)
    pad = _first_real_slot(allowed, b, query.device) if layer.pad is None else None

    if layer.tail_start == 0:
        # Nothing quantized yet: exactly what DynamicCache + the user's attention would compute.
        tk, tv = layer.tail_view()
        keys = torch.cat([tk, new_k], 2) if tk.shape[2] else new_k
        values = torch.cat([tv, new_v], 2) if tv.shape[2] else new_v
        out, _ = base_attention_function(module, base)(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)
        layer.commit(new_k, new_v, pad)
        return out

    qf = _group(query.float(), hk)  # [B, Hk, M, D], M = g*L
    s0 = layer.config.sink
    dev = query.device
    # 1. full-precision window: sink (row b's slots pad[b] + j) + recent tail + the new rows.
    #    Its size is bounded (S0 + W + L), independent of the context length.
    tk, tv = layer.tail_view()
    win_k = torch.cat([layer.sink_k, tk, new_k], 2)  # [B, Hk, S0 + (T - tail_start) + L, D]
    win_v = torch.cat([layer.sink_v, tv, new_v], 2)
    sinks_full = allowed is None and layer.tail_start >= layer.pad_max + s0
    if sinks_full and l == 1:
        win_mask = None  # decode without padding: every window slot is valid (the common fast case)
    else:
        sink_slot = layer.pad[:, None] + torch.arange(s0, device=dev)[None, :]  # [B, S0]
        sink_ok = (torch.arange(s0, device=dev)[None, :] < layer.sink_count()[:, None])[:, None, :].expand(b, l, s0)
        if allowed is not None:
            sink_ok = sink_ok & allowed.gather(2, sink_slot.clamp(max=kv - 1)[:, None, :].expand(b, l, s0))
            tail_ok = allowed[:, :, layer.tail_start :]
        else:  # causal among the new rows
            tail_ok = torch.arange(layer.tail_start, kv, device=dev)[None, :] <= (t_old + torch.arange(l, device=dev))[:, None]
            tail_ok = tail_ok[None].expand(b, l, -1)
        ok = torch.cat([sink_ok, tail_ok], -1)  # [B, L, window]
        win_mask = ok[:, None] if l == 1 else _mask_rows(ok, g)  # [B, 1, 1|M, window]
    out_fp = None
    if layer.fp_heads:  # full-precision heads apart; the rest reads window + INT2 history below
        out_fp = full_precision_heads_attention(layer, query, new_k, new_v, allowed, t_old, scaling)
        qf, win_k, win_v = (x.index_select(1, layer.q_idx) for x in (qf, win_k, win_v))

    # 2. INT2 history, in the rotated space: q rotated once; + q.mu_K on logits; values rotated back once.
    rot = layer.rot
    hist_k, hist_v = layer.hist_view()
    n = hist_k.codes.shape[2]
    key_mask = None
    hist_start = layer.pad  # history entry j of row b is slot s0 + j; entries below pad[b] are sink or padding
    if allowed is not None:
        if l == 1 and _left_padding_only(attention_mask, allowed, t_old):
            # the mask's padding prefix as a later start, not a key mask (same entries; on the GPU the Gluon kernel)
            hist_start = torch.maximum(layer.pad, _first_real_slot(allowed, b, dev) - s0)
        else:
            hm = allowed[:, :, s0 : s0 + n]
            key_mask = hm[:, None] if l == 1 else _mask_rows(hm, g)
    mu_k, mu_v = layer.offsets()
    # 1 + 2 merged by log-sum-exp, the query rotated inside: three Triton launches on CUDA (rotation + window,
    # split-K history, combine), torch reference elsewhere.
    out = decode_attention_rotating(
        qf, rot.r_k, mu_k, hist_k, hist_v, hist_start, key_mask, scaling, layer.config.group_size,
        win_k, win_v, win_mask, rot.r_v, mu_v, out_dtype=query.dtype, block_n=layer.config.block_size,
        use_kernels=layer.config.use_kernels,
    )
    if out_fp is not None:
        full = out.new_empty(b, hk, out.shape[2], d)
        full[:, layer.q_idx] = out
        full[:, layer.fp_idx] = out_fp.to(out.dtype)
        out = full
    out = out.reshape(b, hq, l, d).transpose(1, 2).contiguous()
    layer.commit(new_k, new_v, pad)
    return out


def oscar_static_attention(layer, handle: OscarKV, query, attention_mask, scaling: float, module, base: str, **kwargs):
    """Attention through a :class:`~oscar_hf.static_cache.StaticOscarLayer`. One-token steps write
    first, then read the stored state with tensor ops only (what ``torch.compile`` / CUDA graphs
    capture); multi-token forwards (prefill, eager) read the old state + the new rows, then write."""
    new_k, new_v = handle.key_states, handle.value_states
    b, hq, l, d = query.shape
    hk = new_k.shape[1]
    g = hq // hk
    s0, cfg = layer.config.sink, layer.config
    dev = query.device
    t_old = None
    if not layer.pad_known:  # first forward of this cache (eager): left padding from the mask
        t_old = int(layer.length)
        allowed = _allowed(attention_mask, b, l, t_old + l, t_old)
        layer.set_pad(_first_real_slot(allowed, b, dev))
    rot = layer.rot
    mu_v = layer.offsets()[1]

    if l == 1:
        # Decode step: the static mask is not read: left padding was recorded at the first forward.
        layer.write_one(new_k, new_v)
        t = layer.length  # slot of the new token; the window holds slots [T - W, T]
        qf = _group(query.float(), hk)  # [B, Hk, g, D]
        win_mask = layer.window_mask(t + 1, cfg.recent + 1)[:, None, None, :]  # [B, 1, 1, S0 + W + 1]
        n_valid = layer.n_hist(t)
        hist_k, hist_v = layer.hist_k, layer.hist_v
        if not torch.compiler.is_compiling() and not triton_enabled(query, cfg.use_kernels):
            n = int(n_valid)  # eager reference: read only the filled part
            hist_k, hist_v = (QuantizedRows(*(x[:, :, :n] for x in q)) for q in (hist_k, hist_v))
            n_valid = None
        out = decode_attention_rotating(
            qf, rot.r_k, layer.offsets()[0], hist_k, hist_v, layer.pad, None, scaling, cfg.group_size,
            layer.win_k, layer.win_v, win_mask, rot.r_v, mu_v, out_dtype=query.dtype, block_n=cfg.block_size,
            use_kernels=cfg.use_kernels, n_valid=n_valid, splits=layer.splits,
        )
        layer.demote_one()
        return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous()

    t_old = int(layer.length) if t_old is None else t_old
    kv = t_old + l
    if t_old == 0:  # prefill of an empty cache: exactly the user's attention over the prompt
        mask = attention_mask[..., :l] if attention_mask is not None and attention_mask.dim() == 4 else attention_mask
        out, _ = base_attention_function(module, base)(module, query, new_k, new_v, mask, scaling=scaling, **kwargs)
        layer.commit_bulk(new_k, new_v)
        return out
    # A multi-token forward on a non-empty cache (next turn): stored window + new rows, history.
    allowed = _allowed(attention_mask, b, l, kv, t_old)
    if allowed is None:  # causal among the new rows
        allowed = (torch.arange(kv, device=dev)[None, :] <= (t_old + torch.arange(l, device=dev))[:, None])[None].expand(b, l, kv)
    t = torch.tensor(t_old, device=dev)
    slots = torch.cat([layer.pad[:, None] + torch.arange(s0, device=dev)[None, :],  # sink j
                       layer.ring_slots(t).clamp(min=0).expand(b, -1)], 1)  # ring entries
    ok = layer.window_mask(t, cfg.recent)[:, None, :] & allowed.gather(2, slots.clamp(max=kv - 1)[:, None, :].expand(b, l, -1))
    ok = torch.cat([ok, allowed[:, :, t_old:]], -1)  # [B, L, S0 + W + L]
    qf = _group(query.float(), hk)
    n = int(layer.n_hist(t))
    hist_k, hist_v = (QuantizedRows(*(x[:, :, :n] for x in q)) for q in (layer.hist_k, layer.hist_v))
    out = decode_attention_rotating(
        qf, rot.r_k, layer.offsets()[0], hist_k, hist_v, layer.pad, _mask_rows(allowed[:, :, s0 : s0 + n], g), scaling,
        cfg.group_size, torch.cat([layer.win_k, new_k], 2), torch.cat([layer.win_v, new_v], 2), _mask_rows(ok, g),
        rot.r_v, mu_v, out_dtype=query.dtype, block_n=cfg.block_size, use_kernels=cfg.use_kernels,
    )
    layer.commit_bulk(new_k, new_v)
    return out.reshape(b, hq, l, d).transpose(1, 2).contiguous()


def _handler(module, query, key, value, attention_mask, *args, base: str, dropout: float = 0.0, scaling=None,
             sliding_window=None, softcap=None, **kwargs):
    if not isinstance(key, OscarKV):
        return NotImplemented
    if softcap is not None:
        raise NotImplementedError("OSCAR attention does not implement logit soft-capping")
    if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        raise NotImplementedError("OSCAR attention does not implement attention sinks (s_aux) / position_bias")
    if dropout and module.training:
        raise NotImplementedError("OSCAR attention is for inference; attention dropout in training mode is not supported")
    if args:
        raise TypeError(f"unexpected positional arguments to the attention function: {len(args)}")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    kwargs.pop("is_causal", None)
    if isinstance(key.layer, StaticOscarLayer):
        return oscar_static_attention(key.layer, key, query, attention_mask, scaling, module, base, dropout=dropout, **kwargs), None
    out = oscar_decode_attention(key.layer, key, query, attention_mask, scaling, module, base, dropout=dropout, **kwargs)
    return out, None


register_handler(PREFIX, _handler)


def enable_oscar(model) -> str:
    """Route ``model``'s attention through OSCAR (keeps the user's implementation for other caches)."""
    return patch_model(model, PREFIX)


def disable_oscar(model) -> str:
    """Restore the user's attention implementation."""
    return unpatch_model(model)
