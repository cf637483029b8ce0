"""Numerics at the edges: model dtypes, zero/constant rows, outlier channels, NaN/Inf, random shapes."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscar_hf import OscarCache
from oscar_hf.compat import cache_kwargs
from oscar_hf.kernels.int2_attention import history_partial_reference
from oscar_hf.quant import dequantize_rows, quantize_rows

from tiny_models import tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_model_dtypes(dtype):
    m = tiny_model("llama", dtype=dtype)
    ids = torch.randint(1, 200, (2, 40))
    cache = OscarCache(m, method="hadamard", sink=4, recent=8, group_size=32)
    with torch.no_grad():
        out = m(ids, **cache_kwargs(m, cache), use_cache=True)
        step = m(ids[:, :1], **cache_kwargs(m, cache), use_cache=True)
    assert torch.isfinite(out.logits).all() and torch.isfinite(step.logits).all()
    assert cache.layers[0].win.dtype == dtype and cache.layers[0].export_state()["hist_k"].codes.shape[2] > 0


@pytest.mark.parametrize("meta", [torch.bfloat16, torch.float32])
def test_outlier_channels_stay_finite_and_bounded(meta):
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 64)
    x[..., 5] *= 1e4  # one outlier channel, 10^4 x the others
    q = quantize_rows(x, 32, 1.0, meta)
    xh = dequantize_rows(q, 32)
    assert torch.isfinite(xh).all()
    scale = q.scale.float().repeat_interleave(32, -1)
    rel = torch.finfo(meta).eps * x.abs().reshape(4, 3, 16, 2, 32).amax(-1).repeat_interleave(32, -1)
    assert ((x - xh).abs() <= scale / 2 + 2 * rel + 1e-5).all()


def test_zero_and_constant_kv_through_the_cache():
    layer_in = torch.zeros(1, 2, 50, 32)
    layer_in[:, :, 25:] = 7.0
    from oscar_hf.cache import OscarLayer
    from oscar_hf.config import OscarConfig
    from oscar_hf.rotations import LayerRotation

    eye = torch.eye(32).expand(2, 32, 32).contiguous()
    layer = OscarLayer(OscarConfig(sink=2, recent=4, group_size=32, meta_dtype="float32"), LayerRotation(eye, eye), 0)
    layer.write(layer_in, layer_in)
    hk = layer.export_state()["hist_k"]
    assert torch.equal(dequantize_rows(hk, 32), layer_in[:, :, 2 : 2 + hk.codes.shape[2]])


def test_nan_in_inputs_propagates_like_bf16_without_crashing():
    """Documented behaviour: a NaN key/value poisons the outputs that attend to it (as with DynamicCache)."""
    m = tiny_model("llama")
    cache = OscarCache(m, method="hadamard", sink=4, recent=8, group_size=32)
    ids = torch.randint(1, 200, (2, 40))
    with torch.no_grad():
        m(ids, **cache_kwargs(m, cache), use_cache=True)
        layer = cache.layers[0]
        layer.hist_k.scale[0, :, 3] = float("nan")  # corrupt one history token of row 0 only
        out = m(ids[:, :1], **cache_kwargs(m, cache), use_cache=True).logits
    assert torch.isnan(out[0]).any() and torch.isfinite(out[1]).all()


@given(
    b=st.integers(1, 3), hk=st.integers(1, 3), g_ratio=st.sampled_from([1, 2, 4]), m=st.integers(1, 6),
    n=st.integers(1, 40), d=st.sampled_from([16, 32, 64]), block=st.integers(1, 17), seed=st.integers(0, 999),
)
@settings(max_examples=40, deadline=None)
def test_history_partial_equals_softmax_over_dequantized(b, hk, g_ratio, m, n, d, block, seed):
    torch.manual_seed(seed)
    g = d // g_ratio if d // g_ratio >= 4 else d
    k, v = torch.randn(b, hk, n, d) * 3, torch.randn(b, hk, n, d)
    qk, qv = quantize_rows(k, g, 0.9, torch.float32), quantize_rows(v, g, 0.9, torch.float32)
    q = torch.randn(b, hk, m, d)
    start = torch.randint(0, n, (b,))
    off = torch.randn(b, hk, m)
    mx, l, acc = history_partial_reference(q, qk, qv, start, None, off, 0.3, g, block_n=block)
    kd, vd = dequantize_rows(qk, g), dequantize_rows(qv, g)
    logits = (q @ kd.transpose(-1, -2) + off[..., None]) * 0.3
    valid = torch.arange(n)[None, :] >= start[:, None]
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    ref = torch.softmax(logits, -1) @ vd
    torch.testing.assert_close(acc / l[..., None], ref, rtol=1e-4, atol=1e-4)
