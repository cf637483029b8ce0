"""Patched decode attention == a straightforward fake-quantized reference (dequantize everything, then softmax)."""
import types

import pytest
import torch

from oscar_hf.cache import OscarLayer
from oscar_hf.config import OscarConfig
from oscar_hf.hadamard import hadamard_matrix
from oscar_hf.quant import dequantize_rows, quantize_rows
from oscar_hf.rotations import LayerRotation


def random_rotation(hk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(hk, d, d, generator=g, dtype=torch.float64))
    return q.float()


def make_layer(hk, d, sink, recent, g, offsets, seed=0, key_offset="calibrated"):
    gen = torch.Generator().manual_seed(seed + 1)
    rot = LayerRotation(
        r_k=random_rotation(hk, d, seed),
        r_v=(hadamard_matrix(d)[None].expand(hk, d, d).contiguous()),
        clip_k=0.95,
        clip_v=0.9,
        mu_k=torch.randn(hk, d, generator=gen) if offsets else None,
        mu_v=torch.randn(hk, d, generator=gen) if offsets else None,
    )
    cfg = OscarConfig(sink=sink, recent=recent, group_size=g, block_size=7, prefill_chunk=5, meta_dtype="float32",
                      key_offset=key_offset)
    return OscarLayer(cfg, rot, 0), rot, cfg


def fake_quant(x, r, mu, clip, g):
    """The history as the reference sees it: rotate, quantize, dequantize, rotate back, re-center
    (``mu`` ``[Hk, D]``, or ``[B, Hk, D]`` per sequence)."""
    if mu is not None:
        mu = mu[None, :, None] if mu.dim() == 2 else mu[:, :, None]
    xc = x - mu if mu is not None else x
    xh = dequantize_rows(quantize_rows(xc @ r[None], g, clip, torch.float32), g) @ r.transpose(-1, -2)[None]
    return xh + mu if mu is not None else xh


def prefill_key_mean(K, pads, sink, end, fallback):
    """key_offset="prefill" by its definition: per row the mean of the keys in slots [pad + sink, end)
    (``end`` = the end of the first demotion), ``fallback`` (or 0) for a row without such a slot."""
    out = []
    for i in range(K.shape[0]):
        a = int(pads[i]) + sink
        if a < end:
            out.append(K[i, :, a:end].float().mean(1))
        else:
            out.append(fallback if fallback is not None else torch.zeros(K.shape[1], K.shape[3]))
    return torch.stack(out)


def reference_attention(K, V, pads, t_old, q, mask2d, layer, rot, cfg, scaling, mu_k=None):
    """Brute force from the bookkeeping rule: per row, every slot's K/V from the part it belongs to."""
    b, hq, l, d = q.shape
    hk = K.shape[1]
    kq = fake_quant(K.float(), rot.r_k, rot.mu_k if mu_k is None else mu_k, rot.clip_k, cfg.group_size)
    vq = fake_quant(V.float(), rot.r_v, rot.mu_v, rot.clip_v, cfg.group_size)
    ts = layer.tail_start
    outs = []
    for i in range(b):
        p = int(pads[i])
        kk, vv = K[i].float().clone(), V[i].float().clone()
        hist = torch.zeros(K.shape[2], dtype=torch.bool)
        hist[p + cfg.sink : ts] = True  # history slots of row i
        kk[:, hist], vv[:, hist] = kq[i][:, hist], vq[i][:, hist]
        kk = kk.repeat_interleave(hq // hk, 0)
        vv = vv.repeat_interleave(hq // hk, 0)
        logits = (q[i].float() @ kk.transpose(-1, -2)) * scaling  # [Hq, L, kv]
        allowed = mask2d[i].bool()[None, :].clone().expand(l, -1).clone()
        allowed &= torch.arange(K.shape[2])[None, :] <= (t_old + torch.arange(l))[:, None]
        logits = logits.masked_fill(~allowed[None], float("-inf"))
        outs.append(torch.softmax(logits, -1) @ vv)
    return torch.stack(outs).transpose(1, 2)  # [B, L, Hq, D]


def sdpa_mask(mask2d, t_old, l):
    kv = mask2d.shape[1]
    causal = torch.arange(kv)[None, :] <= (t_old + torch.arange(l))[:, None]
    return (mask2d.bool()[:, None, :] & causal[None])[:, None]  # [B, 1, L, kv]


@pytest.mark.parametrize("key_offset", ["calibrated", "prefill"])
@pytest.mark.parametrize(
    "hq,hk,d,g,offsets",
    [(4, 4, 64, 32, False), (6, 2, 64, 64, True), (8, 2, 128, 32, True), (8, 1, 256, 64, False), (4, 1, 64, 16, True)],
)
def test_decode_attention_matches_fake_quant_reference(hq, hk, d, g, offsets, key_offset):
    torch.manual_seed(hq * 100 + d)
    b, sink, recent = 3, 3, 5
    pads = torch.tensor([0, 4, 9])
    total = 40
    K, V = torch.randn(b, hk, total, d), torch.randn(b, hk, total, d)
    K = K + 3 * torch.randn(b, hk, 1, d)  # a per-sequence key offset (what key_offset="prefill" follows)
    mask2d = (torch.arange(total)[None, :] >= pads[:, None]).long()
    layer, rot, cfg = make_layer(hk, d, sink, recent, g, offsets, key_offset=key_offset)
    # the first forward (14 tokens) demotes slots [0, 14 - recent): row 2 (pad 9) has none -> fallback
    mu_k = prefill_key_mean(K, pads, sink, 14 - recent, rot.mu_k) if key_offset == "prefill" else None
    module = types.SimpleNamespace(num_key_value_groups=hq // hk, is_causal=True, training=False)
    # prefill 14 tokens, then a 3-token chunk, then single-token decode steps: check every forward
    t, steps = 0, [14, 3] + [1] * 23
    for l in steps:
        q = torch.randn(b, hq, l, d)
        kv = t + l
        mask = sdpa_mask(mask2d[:, :kv], t, l)
        handle, _ = layer.update(K[:, :, t:kv], V[:, :, t:kv])
        out = handle.attend(q, mask, 0.125, module, "sdpa")
        # the reference uses the state *before* this forward's write: the recent window's start by the rule
        layer_before = types.SimpleNamespace(tail_start=t - recent if t - recent > sink else 0)
        ref = reference_attention(K[:, :, :kv], V[:, :, :kv], pads, t, q, mask2d[:, :kv], layer_before, rot, cfg, 0.125,
                                  mu_k=mu_k)
        real = (t + torch.arange(l))[None, :] >= pads[:, None]  # padding query rows are garbage by definition
        torch.testing.assert_close(out.float()[real], ref[real], rtol=2e-4, atol=2e-4, msg=f"mismatch at t={t}, l={l}")
        t = kv
    assert layer.get_seq_length() == total and layer.export_state()["hist_k"].codes.shape[2] > 0
    if key_offset == "prefill":
        torch.testing.assert_close(layer.mu_k_seq, mu_k)


def test_history_never_materialized_in_full_precision(monkeypatch):
    """The reference read path dequantizes at most block_size history rows at a time."""
    import oscar_hf.kernels.int2_attention as ia

    seen = []
    real = ia.dequantize_rows

    def spy(q, g=None, dtype=torch.float32):
        seen.append(q.codes.shape[-2])
        return real(q, g, dtype)

    monkeypatch.setattr(ia, "dequantize_rows", spy)
    layer, rot, cfg = make_layer(2, 64, 2, 4, 64, True)
    module = types.SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False)
    K, V = torch.randn(1, 2, 60, 64), torch.randn(1, 2, 60, 64)
    layer.write(K, V)
    q = torch.randn(1, 4, 1, 64)
    k1, v1 = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
    layer.update(k1, v1)[0].attend(q, None, 0.1, module, "sdpa")
    assert seen and max(seen) <= cfg.block_size and sum(seen) >= 2 * (60 - 2 - 4)
