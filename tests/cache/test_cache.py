"""OscarLayer / OscarCache bookkeeping against a brute-force model, and the Cache contract."""
import inspect

import pytest
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.cache import OscarLayer
from oscar_hf.quant import dequantize_rows, quantize_rows
from oscar_hf.rotations import LayerRotation

from tiny_models import tiny_config

D, HK = 32, 2


def identity_layer(sink, recent, g=32):
    eye = torch.eye(D).expand(HK, D, D).contiguous()
    cfg = OscarConfig(sink=sink, recent=recent, group_size=g, meta_dtype="float32", prefill_chunk=4)
    return OscarLayer(cfg, LayerRotation(eye, eye), 0)


def parts_of(st, b, sink):
    """Which part each slot of row b is in, read off the layer's saved form ``st`` (``export_state``)."""
    p = int(st["pad"][b])
    out = {}
    for s in range(st["seq_len"]):
        if s < p:
            out[s] = "pad"
        elif s >= st["tail_start"]:
            out[s] = "recent"
        elif s - p < sink:
            out[s] = "sink"
        else:
            out[s] = "history"
    return out


def brute_force(total, pad, sink, recent):
    """The rule: nothing is quantized while T - recent <= sink; then recent = last `recent` slots."""
    out = {}
    start = total - recent if total - recent > sink else 0
    for s in range(total):
        if s < pad:
            out[s] = "pad"
        elif s >= start:
            out[s] = "recent"
        elif s - pad < sink:
            out[s] = "sink"
        else:
            out[s] = "history"
    return out


@pytest.mark.parametrize("sink,recent", [(4, 8), (0, 1), (3, 16), (64, 256)])
def test_every_slot_in_exactly_one_part_and_data_where_it_belongs(sink, recent):
    torch.manual_seed(0)
    pads = torch.tensor([0, 3, 11])
    total = 350 if recent == 256 else 90
    K = torch.arange(total, dtype=torch.float32)[None, None, :, None].expand(3, HK, total, D).contiguous()
    K = K + torch.linspace(0, 0.5, D)  # distinct, exactly representable rows
    layer = identity_layer(sink, recent)
    t = 0
    for l in [7, 1, 1, 5] + [1] * (total - 14):
        layer.write(K[:, :, t : t + l], K[:, :, t : t + l], pads)
        t += l
        st = layer.export_state()
        for b in range(3):
            assert parts_of(st, b, sink) == brute_force(t, int(pads[b]), sink, recent), f"t={t} row={b}"
        # contents: sink holds row b's slots pad+j, tail holds [tail_start, T), history dequantizes close
        ts = st["tail_start"]
        assert torch.equal(st["tail_k"], K[:, :, ts:t])
        for b in range(3):
            p = int(pads[b])
            n_sink = min(max(ts - p, 0), sink)
            assert torch.equal(st["sink_k"][b, :, :n_sink], K[b, :, p : p + n_sink])
        n_hist = max(0, ts - sink)
        assert st["hist_k"].codes.shape[2] == n_hist
        if n_hist:
            deq = dequantize_rows(st["hist_k"], 32)
            ref = K[:, :, sink : sink + n_hist]
            for b in range(3):
                lo = int(pads[b])
                if lo < n_hist:
                    assert (deq[b, :, lo:] - ref[b, :, lo:]).abs().max() < 0.5 / 3 + 1e-5
    assert layer.get_seq_length() == total


def test_crop_within_reserve_is_exact_rollback():
    torch.manual_seed(0)
    total = 60
    K = torch.randn(2, HK, total, D)
    pads = torch.tensor([0, 5])
    a, b = identity_layer(4, 8), identity_layer(4, 8)
    for layer, n in ((a, 50), (b, 60)):
        layer.write(K[:, :, :20], K[:, :, :20], pads)
        for t in range(20, n):
            layer.write(K[:, :, t : t + 1], K[:, :, t : t + 1])
    b.crop(-10)
    assert b.get_seq_length() == a.get_seq_length() == 50

    def same(x, y):
        assert (x["seq_len"], x["tail_start"]) == (y["seq_len"], y["tail_start"])
        for name in ("tail_k", "tail_v", "sink_k", "pad"):
            assert torch.equal(x[name], y[name]), name
        assert all(torch.equal(p, q) for p, q in zip(x["hist_k"], y["hist_k"]))

    same(a.export_state(), b.export_state())
    # continue both: identical again
    for layer in (a, b):
        layer.write(K[:, :, 50:51], K[:, :, 50:51])
    same(a.export_state(), b.export_state())


def test_crop_beyond_reserve_keeps_parts_consistent():
    K = torch.randn(1, HK, 400, D)
    layer = identity_layer(4, 8)
    layer.write(K, K)
    layer.crop(-300)
    assert layer.get_seq_length() == 100
    st = layer.export_state()  # the window refilled from the history: slots [92, 100), dequantized
    assert (st["seq_len"], st["tail_start"], st["hist_k"].codes.shape[2]) == (100, 92, 88)
    assert (st["tail_k"] - K[:, :, 92:100]).abs().max() <= (K.amax() - K.amin()) / 6 + 1e-5  # half a 2-bit step
    layer.write(K[:, :, :1], K[:, :, :1])
    assert layer.get_seq_length() == 101
    with pytest.raises(ValueError, match="negative"):
        layer.crop(5)


def test_reorder_and_batch_ops_follow_rows():
    torch.manual_seed(0)
    K = torch.randn(3, HK, 40, D)
    pads = torch.tensor([0, 2, 7])
    layer = identity_layer(4, 8)
    layer.write(K, K, pads)
    names = ("sink_k", "tail_k", "pad")
    before = layer.export_state()
    before = [before[k].clone() for k in names] + [before["hist_k"].codes.clone()]
    idx = torch.tensor([2, 0, 0])
    layer.reorder_cache(idx)
    after = layer.export_state()
    for x, y in zip([after[k] for k in names] + [after["hist_k"].codes], before):
        assert torch.equal(x, y[idx])
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.batch_size == 1 and int(layer.pad[0]) == 0
    layer.batch_repeat_interleave(4)
    assert layer.batch_size == 4 and layer.win.shape[1] == 4
    layer.reset()  # (keeps its buffers, zeroed, as Transformers' layers do)
    assert layer.get_seq_length() == 0 and not layer.win.any() and not layer.pad_known


def test_update_without_oscar_attention_is_a_clear_error():
    layer = identity_layer(4, 8)
    k = torch.randn(1, HK, 3, D)
    layer.update(k, k)
    with pytest.raises(RuntimeError, match="does not go through OSCAR"):
        layer.update(k, k)


def test_unsupported_dtype_and_head_count():
    layer = identity_layer(4, 8)
    with pytest.raises(ValueError, match="dtypes"):
        layer.update(torch.randn(1, HK, 3, D, dtype=torch.float64), torch.randn(1, HK, 3, D, dtype=torch.float64))
    layer = identity_layer(4, 8)
    with pytest.raises(ValueError, match="kv_heads=2"):
        layer.update(torch.randn(1, 3, 3, D), torch.randn(1, 3, 3, D))


def test_cache_layers_per_type_and_skip_layers():
    cfg = tiny_config("gemma3_text", num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2)
    user_cfg = OscarConfig(group_size=32, skip_layers=(-1,))
    cache = OscarCache(cfg, config=user_cfg)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, OscarLayer, DynamicSlidingWindowLayer, DynamicLayer]
    assert user_cfg.skip_layers == (-1,)  # the user's config object is not mutated
    assert cache.layers[0].sliding_window == 16


def test_bad_config_values():
    with pytest.raises(ValueError, match="does not divide head_dim=32"):
        OscarCache(tiny_config("llama"), group_size=64)
    with pytest.raises(NotImplementedError, match="bits=2"):
        OscarConfig(bits=3)
    with pytest.raises(ValueError, match="meta_dtype"):
        OscarConfig(meta_dtype="int8")
    with pytest.raises(ValueError, match="clip_k"):
        OscarConfig(clip_k=1.5)
    with pytest.raises(ValueError, match="out of range"):
        OscarCache(tiny_config("llama"), group_size=32, skip_layers=(5,))
    with pytest.raises(ValueError, match="quantizer"):
        OscarConfig(quantizer="lloyd-max")


@pytest.mark.parametrize("quantizer", ["minmax", "std"])
def test_history_written_with_the_configured_quantizer(quantizer):
    """The layer's history holds exactly quantize_rows(rows, quantizer=config.quantizer) of its demoted rows, for a
    prompt's bulk write and for the token-by-token demotions after it."""
    torch.manual_seed(0)
    eye = torch.eye(D).expand(HK, D, D).contiguous()
    cfg = OscarConfig(sink=2, recent=4, group_size=16, meta_dtype="float32", quantizer=quantizer, clip_k=0.7,
                      clip_v=0.7, use_kernels=False)
    layer = OscarLayer(cfg, LayerRotation(eye, eye), 0)
    K, V = torch.randn(2, HK, 40, D), torch.randn(2, HK, 40, D)
    layer.write(K[:, :, :30], V[:, :, :30], torch.zeros(2, dtype=torch.long))
    for t in range(30, 40):
        layer.write(K[:, :, t : t + 1], V[:, :, t : t + 1])
    st = layer.export_state()
    for got, x in ((st["hist_k"], K), (st["hist_v"], V)):
        want = quantize_rows(x[:, :, 2 : 2 + got.codes.shape[2]], 16, 0.7, torch.float32, quantizer)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_base_class_signatures_have_not_drifted():
    """OscarCache relies on these Transformers 5.x signatures; fail loudly when they change."""
    assert list(inspect.signature(CacheLayerMixin.lazy_initialization).parameters) == ["self", "key_states", "value_states"]
    assert list(inspect.signature(CacheLayerMixin.get_mask_sizes).parameters)[:2] == ["self", "query_length"]
    assert list(inspect.signature(DynamicLayer.crop).parameters) == ["self", "tokens_to_remove"]
    assert "layers" in inspect.signature(Cache.__init__).parameters
    for name in ("update", "get_seq_length", "get_mask_sizes", "reorder_cache", "crop", "reset",
                 "batch_repeat_interleave", "batch_select_indices"):
        assert callable(getattr(Cache, name)), name
