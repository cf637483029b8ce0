#!/usr/bin/env python
"""The strong BF16 baseline: a BF16 decode that reads its K/V once per step, through ``generate``.

What a FlashDecoding / FlashInfer-class BF16 decode does, in Transformers' own model forward:

* ``StrongBF16Cache``: ``StaticCache``'s storage (``[B, Hk, capacity, D]`` per layer, fixed addresses), with one
  live length on the device that every layer shares and the last layer advances (no host int, no recompile);
  ``is_compileable``, so ``generate`` compiles its decode step with CUDA graphs, as for ``StaticCache`` and
  ``OscarCache``.
* the attention function ``bf16_live`` (registered; no mask function, so Transformers builds no mask at all): the
  prefill is causal SDPA over the new rows (``enable_gqa``); a decode step reads the un-repeated K/V over the live
  length only, no mask over the unused capacity, by one of
  - ``split``: a split-K Triton kernel (FlashDecoding): every program reads the length on the device and takes its
    share of it, the GQA group's query rows in one tile, so each K/V row is read once; a combine kernel merges;
  - ``flex``: FlexAttention (``enable_gqa``) with a block mask built on the device from the live length.

Unpadded prompts only (the benchmarks' are): there is no attention mask. Full-attention layers only.

    python benchmarks/strong_bf16.py --points 1x1024 1x100000 8x32768 32x32768 --out strong_bf16_op_h200.json

times one layer's decode read of each kind in a CUDA graph (L2 flushed clean before each call), its read rate (K/V
bytes over time), and SDPA over exactly the live length (not graphable across steps: its shape changes every step)
as a reference point.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

NAME = "bf16_live"
READS = ("split", "flex")


# ---- the split-K read (FlashDecoding) -------------------------------------------------------------------------------
@triton.jit
def _split_kernel(Q, K, V, LEN, PM, PL, PO, qk_scale, HK, S,
                  sqb, sqh, skb, skh, skn, svb, svh, svn,
                  GROUP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, F32: tl.constexpr):
    """Program (b·Hk + h, s): the s-th of S equal shares of the live length, for the GROUP query rows of KV head h.
    Writes the share's running max, sum and unnormalised output (log2 domain). F32: the products in float32 (the
    Triton interpreter's bf16 ``tl.dot`` is wrong)."""
    bh, s = tl.program_id(0), tl.program_id(1)
    b, h = bh // HK, bh % HK
    rows, d = tl.arange(0, M), tl.arange(0, D)
    length = tl.load(LEN).to(tl.int32)
    per = tl.cdiv(tl.cdiv(length, S), BLOCK_N) * BLOCK_N
    lo = s * per
    hi = tl.minimum(lo + per, length)
    q = tl.load(Q + b * sqb + (h * GROUP + rows)[:, None] * sqh + d[None, :], mask=(rows < GROUP)[:, None], other=0.0)
    if F32:
        q = q.to(tl.float32)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    kb, vb = K + b * skb + h * skh, V + b * svb + h * svh
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < hi
        k = tl.load(kb + n[:, None] * skn + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(vb + n[:, None] * svn + d[None, :], mask=valid[:, None], other=0.0)
        if F32:
            k, v = k.to(tl.float32), v.to(tl.float32)
        x = tl.dot(q, tl.trans(k)) * qk_scale
        x = tl.where(valid[None, :], x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))
        p = tl.exp2(x - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    part = (bh * S + s) * GROUP + rows
    keep = rows < GROUP
    tl.store(PM + part, m_i, mask=keep)
    tl.store(PL + part, l_i, mask=keep)
    tl.store(PO + part[:, None] * D + d[None, :], acc, mask=keep[:, None])


@triton.jit
def _combine_kernel(PM, PL, PO, OUT, S, GROUP: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
    """Program (b·Hk + h)·GROUP + g: one query row's S shares merged by the online-softmax rule."""
    r = tl.program_id(0)
    bh, g = r // GROUP, r % GROUP
    s, d = tl.arange(0, SP), tl.arange(0, D)
    part = (bh * S + s) * GROUP + g
    m = tl.load(PM + part, mask=s < S, other=float("-inf"))
    w = tl.exp2(m - tl.max(m, 0))  # share 0 always holds a token, so the max is finite
    l = tl.sum(tl.load(PL + part, mask=s < S, other=0.0) * w, 0)
    o = tl.load(PO + part[:, None] * D + d[None, :], mask=(s < S)[:, None], other=0.0)
    tl.store(OUT + r * D + d, (tl.sum(o * w[:, None], 0) / l).to(OUT.dtype.element_ty))


# H200, one layer's read (strong_bf16_op_h200.json, the tile sweep of strong_bf16.py at 4dc2fce): 128-token tiles
# 4-9% faster than 64 at B=1/100K, 8/32K, 32/32K
BLOCK_N, NUM_WARPS, NUM_STAGES, PROGRAMS_PER_SM = 128, 4, 3, 4
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def split_count(batch: int, kv_heads: int, capacity: int, device) -> int:
    """Shares of the live length per (row, KV head): about PROGRAMS_PER_SM programs per SM, at least 256 tokens each
    at full capacity."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    return max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, batch * kv_heads), capacity // 256))


@torch.library.custom_op("bf16_live::split_decode", mutates_args=())
def split_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[B, 1, Hq, D]``: attention of ``q [B, Hq, 1, D]`` over ``k, v [B, Hk, capacity, D]``'s first ``length``
    (a device tensor) rows."""
    b, hq, _, d = q.shape
    hk, cap = k.shape[1], k.shape[2]
    group = hq // hk
    s = split_count(b, hk, cap, q.device)
    pm = torch.empty(b * hk * s * group, device=q.device, dtype=torch.float32)
    pl = torch.empty_like(pm)
    po = torch.empty(b * hk * s * group, d, device=q.device, dtype=torch.float32)
    out = torch.empty(b, 1, hq, d, device=q.device, dtype=q.dtype)
    kw = dict(num_warps=NUM_WARPS, num_stages=NUM_STAGES) if q.is_cuda else {}
    _split_kernel[(b * hk, s)](q, k, v, length, pm, pl, po, scaling * 1.4426950408889634, hk, s,
                               q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
                               v.stride(0), v.stride(1), v.stride(2),
                               GROUP=group, M=max(16, triton.next_power_of_2(group)), D=d, BLOCK_N=BLOCK_N,
                               F32=INTERPRETED or q.dtype == torch.float32, **kw)
    _combine_kernel[(b * hk * group,)](pm, pl, po, out, s, GROUP=group, SP=triton.next_power_of_2(s), D=d)
    return out


@split_decode.register_fake
def _(q, k, v, length, scaling):
    b, hq, _, d = q.shape
    return q.new_empty(b, 1, hq, d)


# ---- the FlexAttention read ------------------------------------------------------------------------------------------
def flex_decode(q, k, v, length, scaling, block: int = 128):
    """The same read by FlexAttention: the live blocks as full blocks, the last one masked at ``length``."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    cap = k.shape[2]
    nb = triton.cdiv(cap, block)
    idx = torch.arange(nb, device=q.device, dtype=torch.int32)
    full = (length // block).to(torch.int32)
    partial = (length % block > 0).to(torch.int32)
    mask = BlockMask.from_kv_blocks(partial.view(1, 1, 1), (idx + full).clamp(max=nb - 1).view(1, 1, 1, nb),
                                    full.view(1, 1, 1), idx.view(1, 1, 1, nb), BLOCK_SIZE=block,
                                    mask_mod=lambda b, h, q_idx, kv_idx: kv_idx < length, seq_lengths=(1, cap),
                                    compute_q_blocks=False)
    return flex_attention(q, k, v, block_mask=mask, scale=scaling, enable_gqa=True).transpose(1, 2)


def reference_decode(q, k, v, length, scaling):
    """SDPA over exactly the live rows (a host int: eager only)."""
    n = int(length)
    return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], scale=scaling, enable_gqa=True).transpose(1, 2)


DECODE = dict(split=lambda *a: split_decode(*a), flex=flex_decode, reference=reference_decode)


# ---- the cache and its attention function ---------------------------------------------------------------------------
class LiveKV:
    """What a layer's ``update`` hands the attention function: the whole buffers, the live length after this
    forward's rows (a device tensor), the new rows, and the read to use."""

    __slots__ = ("keys", "values", "length", "new_k", "new_v", "read")

    def __init__(self, keys, values, length, new_k, new_v, read):
        self.keys, self.values, self.length, self.new_k, self.new_v, self.read = keys, values, length, new_k, new_v, read

    shape = property(lambda self: self.keys.shape)  # what Transformers' attention wrappers read of K
    dtype = property(lambda self: self.keys.dtype)
    device = property(lambda self: self.keys.device)


class LiveLayer(CacheLayerMixin):
    is_compileable = True
    is_sliding = False

    def __init__(self, cache: "StrongBF16Cache", index: int):
        super().__init__()
        self.cache, self.index = cache, index

    def lazy_initialization(self, key_states, value_states):
        b, hk, _, d = key_states.shape
        shape = (b, hk, self.cache.capacity, d)
        self.keys = torch.zeros(shape, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(shape, dtype=value_states.dtype, device=value_states.device)
        self.cache.length = self.cache.length.to(key_states.device)
        if not torch.compiler.is_compiling():
            for t in (self.keys, self.values, self.cache.length):
                torch._dynamo.mark_static_address(t)
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, length = key_states.shape[2], self.cache.length
        pos = length + torch.arange(n, device=length.device)
        self.keys.index_copy_(2, pos, key_states)
        self.values.index_copy_(2, pos, value_states)
        live = length + n
        if self.index == len(self.cache.layers) - 1:  # the last layer advances the shared length
            length.add_(n)
        kv = LiveKV(self.keys, self.values, live, key_states, value_states, self.cache.read)
        return kv, kv

    def get_seq_length(self):
        return self.cache.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int, *args, **kwargs):
        return self.cache.capacity, 0

    def get_max_length(self) -> int:
        return self.cache.capacity

    get_max_cache_shape = get_max_length  # (older Transformers' name)

    def reset(self) -> None:
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()
        self.cache.length.zero_()


class StrongBF16Cache(Cache):
    """BF16 K/V of ``max_cache_len`` tokens per layer, read over the live length only (module docstring).
    Building it routes ``model``'s attention through ``bf16_live`` (``restore(model)`` switches back)."""

    def __init__(self, model, max_cache_len: int, read: str = "split"):
        if read not in DECODE:
            raise ValueError(f"read={read!r}: one of {sorted(DECODE)}")
        cfg = model.config.get_text_config(decoder=True)
        if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
            raise ValueError("StrongBF16Cache: full-attention models only")
        self.capacity, self.read = max_cache_len, read
        self.length = torch.zeros((), dtype=torch.long)
        super().__init__(layers=[LiveLayer(self, i) for i in range(cfg.num_hidden_layers)])
        enable(model)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``bf16_live``: ``query [B, Hq, L, D]`` against a ``LiveKV``; returns ``([B, L, Hq, D], None)``."""
    if not isinstance(key, LiveKV):
        raise TypeError("attn_implementation 'bf16_live' needs StrongBF16Cache")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if query.shape[2] == 1:
        return DECODE[key.read](query, key.keys, key.values, key.length, scaling), None
    if torch.compiler.is_compiling():
        raise NotImplementedError("bf16_live compiles the decode step only (one new token)")
    n = query.shape[2]
    live = int(key.length)
    if live == n:  # prefill of an empty cache: causal over the new rows
        out = F.scaled_dot_product_attention(query, key.new_k, key.new_v, is_causal=True, scale=scaling,
                                             enable_gqa=True)
    else:  # several new rows after a past: causal over past + new
        seen = torch.arange(live, device=query.device)[None, :] <= torch.arange(live - n, live, device=query.device)[:, None]
        out = F.scaled_dot_product_attention(query, key.keys[:, :, :live], key.values[:, :, :live], attn_mask=seen,
                                             scale=scaling, enable_gqa=True)
    return out.transpose(1, 2), None


AttentionInterface.register(NAME, attention)


def enable(model) -> None:
    """Route ``model``'s attention through ``bf16_live`` (remembering the implementation to restore)."""
    if model.config._attn_implementation != NAME:
        model._strong_bf16_restore = model.config._attn_implementation
        model.set_attn_implementation(NAME)


def restore(model) -> None:
    if model.config._attn_implementation == NAME:
        model.set_attn_implementation(getattr(model, "_strong_bf16_restore", "sdpa"))


# ---- one layer's read, timed -----------------------------------------------------------------------------------------
def bench_op(points, hq=32, hk=8, d=128) -> list[dict]:
    import bench_kernels as bk  # its timer: median of CUDA-graph replays, the L2 flushed clean before each

    dev = torch.device("cuda")
    bk.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows = []
    for b, t in points:
        cap = t + 64
        q = torch.randn(b, hq, 1, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hk, cap, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        length = torch.tensor(t, device=dev)
        ref = reference_decode(q, k, v, length, d ** -0.5)
        row = dict(batch=b, context=t, kv_bytes=2 * b * hk * t * d * 2)
        flex = torch.compile(flex_decode, fullgraph=True)
        for name, fn in (("split", split_decode), ("flex", flex), ("sdpa_exact", reference_decode)):
            try:
                err = (fn(q, k, v, length, d ** -0.5).float() - ref.float()).abs().max().item()
                if name == "sdpa_exact":
                    kk, vv = k[:, :, :t], v[:, :, :t]
                    call = lambda: F.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)  # noqa: E731
                else:
                    call = lambda: fn(q, k, v, length, d ** -0.5)  # noqa: E731
                us = 1000 * bk.timed(call, graph=True, iters=20)
                row[name] = dict(us=us, read_tb_s=row["kv_bytes"] / us / 1e6, max_err=err)
            except Exception as e:  # noqa: BLE001 (record and go on)
                row[name] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print(json.dumps(row), flush=True)
        rows.append(row)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", nargs="+", default=["1x1024", "1x100000", "8x32768", "32x32768"], help="BxT")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = bench_op([tuple(map(int, x.split("x"))) for x in a.points])
    doc = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               command="python strong_bf16.py " + " ".join(argv or sys.argv[1:]),
               config=dict(BLOCK_N=BLOCK_N, NUM_WARPS=NUM_WARPS, NUM_STAGES=NUM_STAGES,
                           PROGRAMS_PER_SM=PROGRAMS_PER_SM), results=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=2)


if __name__ == "__main__":
    main()
