"""3-bit keys (``OscarConfig.key_bits=3``): the codes (INT2 planes of the low bits + a plane of the high bit), what
they read back, the cache's storage and bit counts, saving and loading, the refusals, the settings search trying them,
The decode op against the multi-token path and (GPU) the compiled step under CUDA graphs giving the eager tokens:
``test_value_groups.py``, with the values' own groups."""
import pytest
import torch

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.compat import cache_kwargs
from oscar_hf.quant import (QuantizedRows, QuantizedRows3, dequantize_rows, pack_bits1, quantize_rows, unpack_bits1,
                            unpack_int2)

from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes the history after 12 tokens


def test_bit_plane_round_trip_and_layout():
    torch.manual_seed(0)
    bits = torch.randint(0, 2, (3, 5, 64))
    packed = pack_bits1(bits)
    assert packed.shape == (3, 5, 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits1(packed), bits.to(torch.uint8))
    one = torch.zeros(64, dtype=torch.long)
    one[8 * 3 + 5] = 1  # channel k * D/8 + i -> byte i, bit k (the INT2 planes' order)
    assert pack_bits1(one).tolist() == [0, 0, 0, 0, 0, 1 << 3, 0, 0]


@pytest.mark.parametrize("group_size", [32, 64])
def test_three_bit_codes_levels_error_and_low_planes(group_size):
    torch.manual_seed(1)
    x = torch.randn(4, 3, 64) * 3 + 0.5
    q3, q2 = quantize_rows(x, group_size, bits=3), quantize_rows(x, group_size)
    assert isinstance(q3, QuantizedRows3) and isinstance(q2, QuantizedRows) and q3.bits == 3 and q2.hi is None
    codes = unpack_int2(q3.codes).long() + 4 * unpack_bits1(q3.hi).long()  # [..., D] in 0..7
    assert codes.min() >= 0 and codes.max() == 7 and len(codes.unique()) == 8
    y3, y2 = dequantize_rows(q3, group_size), dequantize_rows(q2, group_size)
    step = q3.scale.float().repeat_interleave(group_size, -1)  # (range / 7 per group)
    assert ((y3 - x).abs() <= step / 2 + 1e-2).all()
    assert (y3 - x).pow(2).mean() < 0.3 * (y2 - x).pow(2).mean()  # 8 levels, not 4
    assert q3.map(lambda t: t[:, :1]).hi.shape == (4, 1, 8)  # slicing keeps the high plane


def test_config_checks_and_bits():
    assert OscarConfig(key_bits=3).history_bits(64) == pytest.approx(3.0)  # (3.5 + 2.5) / 2 at group 64
    assert OscarConfig(key_bits=3, group_size=32).history_bits(256) == pytest.approx(3.5)
    for bad in (4, 1, True, "3"):
        with pytest.raises(ValueError, match="key_bits"):
            OscarConfig(key_bits=bad)
    with pytest.raises(ValueError, match="minmax"):
        OscarConfig(key_bits=3, quantizer="std")
    with pytest.raises(ValueError, match="multiple of 8"):
        quantize_rows(torch.zeros(2, 12), 4, bits=3)


def _prefill_and_decode(model, ids, cache, steps):
    with torch.no_grad():
        out = [model(ids[:, :-steps], **cache_kwargs(model, cache)).logits[:, -1]]
        for j in range(ids.shape[1] - steps, ids.shape[1]):
            out.append(model(ids[:, j : j + 1], **cache_kwargs(model, cache)).logits[:, -1])
    return torch.stack(out, 1)


def test_cache_stores_three_bit_keys_closer_to_the_exact_ones():
    """The history's keys (written by the multi-token path and by decode steps) read back closer to the model's
    rotated keys than INT2 ones; the values are the INT2 ones either way; memory counts one more bit a key."""
    torch.manual_seed(0)
    m = tiny_model("llama", head_dim=64)
    ids = torch.randint(0, m.config.vocab_size, (2, 48))
    caches = {b: OscarCache(m, key_bits=b, compile=False, **SMALL) for b in (2, 3)}
    for c in caches.values():
        _prefill_and_decode(m, ids, c, steps=8)
    from transformers import DynamicCache
    dyn = DynamicCache(config=m.config)  # the model's exact keys
    with torch.no_grad():
        m(ids, **cache_kwargs(m, dyn))
    n = 48 - 1 - 8 - 4  # history entries after 48 tokens (the last decode step's demotion pending: one fewer)
    err, mem = {}, {}
    for b, c in caches.items():
        layer = c.layers[1]
        mu_k, _ = layer.offsets()
        k = dyn.layers[1].keys[:, :, 4 : 4 + n].float()
        k_rot = (k - (0 if mu_k is None else mu_k[None, :, None])) @ layer.params.r_k.unsqueeze(0)
        got = dequantize_rows(layer.hist_k.map(lambda t: t[:, :, :n]), 32)
        err[b] = ((got - k_rot).pow(2).mean() / k_rot.pow(2).mean()).item()
        mem[b] = layer.memory()
        assert (layer.key_hi is not None) == (b == 3)
        assert torch.equal(caches[2].layers[1].hist_v.codes[:, :, :n], layer.hist_v.codes[:, :, :n])  # values alike
    assert err[3] < 0.35 * err[2], err
    assert mem[3]["history_codes"] == mem[2]["history_codes"] * 5 // 4  # (3 + 2) / (2 + 2) bits a K/V pair
    assert mem[3]["allocated"] == mem[2]["allocated"] + caches[3].layers[1].key_hi.numel()


def test_save_and_load_keep_the_high_plane(tmp_path):
    torch.manual_seed(0)
    m = tiny_model("llama", head_dim=64)
    ids = torch.randint(0, m.config.vocab_size, (1, 40))
    c = OscarCache(m, key_bits=3, compile=False, **SMALL)
    with torch.no_grad():
        m(ids, **cache_kwargs(m, c))
    c.save(tmp_path / "c")
    back = OscarCache.load(tmp_path / "c", m)
    assert back.oscar_config.key_bits == 3
    n = 40 - 8 - 4 - 1
    assert torch.equal(back.layers[0].key_hi[:, :, :n], c.layers[0].key_hi[:, :, :n])
    nxt = torch.tensor([[5]])
    with torch.no_grad():
        a = m(nxt, **cache_kwargs(m, c)).logits
        b = m(nxt, **cache_kwargs(m, back)).logits
    assert torch.allclose(a, b, atol=1e-5)
    # a save whose config says INT2 keys but that holds a high plane (edited, or another writer): refused
    meta = next(f for f in (tmp_path / "c").iterdir() if f.suffix == ".json")
    meta.write_text(meta.read_text().replace('"key_bits": 3', '"key_bits": 2'))
    with pytest.raises(ValueError, match="hist_k_hi"):
        OscarCache.load(tmp_path / "c", m)


def test_the_serving_store_holds_three_bit_keys():
    """The serving store keeps 3-bit keys as the cache does (their high bits a pool tensor of their own, paid for in
    its pages); serving's tokens against OscarCache's: tests/serving/test_generate_batch.py."""
    from oscar_hf.serving.store import OscarPagedStore

    m = tiny_model("llama", head_dim=64)
    settings = {k: v for k, v in SMALL.items() if k != "method"}
    store = OscarPagedStore(m, None, OscarConfig(key_bits=3, **settings), num_pages=4, page_size=16)
    int2 = OscarPagedStore(m, None, OscarConfig(**settings), num_pages=4, page_size=16)
    k, v = store.pool.rows(0, "k"), store.pool.rows(0, "v")
    assert (k.bits, v.bits, k.hi.shape[-1]) == (3, 2, 64 // 8)
    hk, layers = m.config.num_key_value_heads, m.config.num_hidden_layers
    assert store.page_bytes(16) - int2.page_bytes(16) == 16 * layers * hk * 64 // 8
