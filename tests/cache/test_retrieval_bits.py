"""Full-precision (retrieval) heads stored as INT8 / INT4 codes with a scale and zero per token and head
(``OscarConfig.retrieval_bits``, ``oscar_hf.cache.heads``): the codes, what they read back, the rest of the
cache untouched, the bit counts, saving and loading."""
import pytest
import torch

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.cache import heads
from oscar_hf.compat import cache_kwargs
from oscar_hf.eval.fakequant import minmax_fake_quant
from oscar_hf.eval.needle import history_bits
from oscar_hf.quant import pack_int4, unpack_int4

from tiny_models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes the history after 12 tokens
FP_PAIR = (0, 1)  # tiny llama: 2 layers x 2 KV heads; layer 0's K/V do not depend on its own attention


def distinct_per_row(x: torch.Tensor) -> int:
    """Most distinct values in one row ``x[..., :]`` over all rows."""
    rows = x.reshape(-1, x.shape[-1])
    return max(len(torch.unique(r)) for r in rows)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_minmax_levels_range_and_error(bits):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=torch.bfloat16) * 4 + 1
    y = minmax_fake_quant(x, bits)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert distinct_per_row(y) <= 2**bits
    xf, yf = x.float(), y.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    step = (hi - lo) / (2**bits - 1)
    # half a step of rounding, plus the BF16 rounding of scale, zero and the read-back value
    assert ((yf - xf).abs() <= step * 0.5 + 0.02 * (hi - lo) + 0.02 * xf.abs()).all()
    assert distinct_per_row(minmax_fake_quant(x, 8)) > 16  # more bits, more levels (the test can tell them apart)


def test_minmax_constant_row_bad_bits_and_int4_packing():
    x = torch.full((2, 64), 0.375)
    assert torch.equal(minmax_fake_quant(x, 4), x)
    for bad in (0, 9, 4.0, True):
        with pytest.raises(ValueError, match="bits must be an int"):
            minmax_fake_quant(x, bad)
    codes = torch.randint(0, 16, (3, 7, 64), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (3, 7, 32) and torch.equal(unpack_int4(packed), codes)


def test_config_bits_and_budget():
    c = OscarConfig()
    assert c.retrieval_bits == 8  # the default
    assert [OscarConfig(retrieval_bits=b).retrieval_head_bits(64) for b in (16, 8, 4)] == [16.0, 8.5, 4.5]
    assert c.retrieval_head_bits(128) == 8.25
    # SmolLM2's 90 KV heads under the 3.0-bit cap: 3 heads at 16 bits, 7 at INT8, 22 at INT4 (2.5-bit rows at group 64)
    assert [OscarConfig(retrieval_bits=b).retrieval_head_budget(64, 90) for b in (16, 8, 4)] == [3, 7, 22]
    assert c.history_bits(64, 7 / 90) == pytest.approx((83 * 2.5 + 7 * 8.5) / 90)
    for bad in (2, 3, 32, True, "4"):
        with pytest.raises(ValueError, match="retrieval_bits"):
            OscarConfig(retrieval_bits=bad)


def run_cache(model, ids: torch.Tensor, decode: int, **kw) -> OscarCache:
    """Prefill ``ids[:-decode]`` then feed the last ``decode`` tokens one by one (both write paths)."""
    cache = OscarCache(model, **SMALL, retrieval_heads=(FP_PAIR,), **kw)
    n = ids.shape[1] - decode
    with torch.no_grad():
        model(ids[:, :n], **cache_kwargs(model, cache), use_cache=True)
        for t in range(n, ids.shape[1]):
            model(ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True)
    return cache


@pytest.mark.parametrize("bits", [4, 8])
def test_codes_read_back_as_their_fake_quantization_and_nothing_else_changes(bits):
    model = tiny_model("llama", head_dim=64)
    ids = torch.randint(1, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    ref = run_cache(model, ids, decode=6, retrieval_bits=16)
    got = run_cache(model, ids, decode=6, retrieval_bits=bits)
    r0, g0 = ref.layers[0], got.layers[0]
    assert r0.retrieval_heads == g0.retrieval_heads == (FP_PAIR[1],)
    rs, gs = r0.export_state(), g0.export_state()  # (the retrieval heads' every slot: history codes + window coded)
    t, n = gs["seq_len"], gs["hist_k"].codes.shape[2]
    assert t == ids.shape[1] and n > 0  # prefill and decode rows written, history quantized
    codes, scale, zero = (x[:, :, SMALL["sink"] : SMALL["sink"] + n] for x in gs["fp_k"])  # the stored history codes
    assert codes.dtype == torch.uint8 and codes.shape[-1] == 64 * bits // 8 and scale.shape[-1] == zero.shape[-1] == 1
    for kind in ("fp_k", "fp_v"):  # [B, P, T, D], every slot: prefill and decode
        ref_rows, got_rows = heads.decode(rs[kind], 16, torch.float32), heads.decode(gs[kind], bits, torch.float32)
        assert torch.equal(got_rows, minmax_fake_quant(ref_rows, bits, ref_rows.dtype))
        assert not torch.equal(got_rows, ref_rows) and distinct_per_row(got_rows) <= 2**bits
    # everything else layer 0 holds is written from the same K/V and is identical
    for kind in ("hist_k", "hist_v"):
        for a, b in zip(rs[kind], gs[kind]):
            assert torch.equal(a, b)
    for name in ("tail_k", "tail_v", "sink_k", "sink_v"):
        assert torch.equal(rs[name], gs[name]), name
    assert got.layers[1].retrieval_heads == () and got.layers[1].coded_x is None
    # the memory the cache reports: the history entries' codes + a float32 scale and zero per token and head (this
    # model is float32; the window slots are counted with the window)
    assert got.layers[0].memory()["retrieval_heads"] == 2 * n * 1 * (64 * bits // 8 + 2 * 4)
    assert ref.layers[0].memory()["retrieval_heads"] == 2 * n * 1 * 64 * 4


def test_history_bits_count_the_stored_form():
    model = tiny_model("llama", head_dim=64)  # 2 layers x 2 KV heads, INT2 rows at group 32: 2 + 32 / 32 = 3 bits
    for bits, head_bits in ((16, 16.0), (8, 8.5), (4, 4.5)):
        cache = OscarCache(model, **SMALL, retrieval_heads=(FP_PAIR,), retrieval_bits=bits)
        assert history_bits(cache) == dict(retrieval_heads=1, kv_heads=4, retrieval_head_bits=head_bits,
                                           history_bits=(3 * 3.0 + head_bits) / 4)
        assert history_bits(cache)["history_bits"] == cache.memory_report()["history_bits_per_element"]
    assert history_bits(OscarCache(model, **SMALL))["history_bits"] == 3.0


@pytest.mark.parametrize("compile", [False, True])
def test_save_load_continues_exactly(tmp_path, compile):
    model = tiny_model("llama", head_dim=64)
    ids = torch.randint(1, 256, (1, 30), generator=torch.Generator().manual_seed(2))
    cache = run_cache(model, ids, decode=3, retrieval_bits=4, compile=compile)
    cache.save(tmp_path / "c")
    loaded = OscarCache.load(tmp_path / "c", model, compile=compile)
    assert loaded.oscar_config.retrieval_bits == 4
    nxt = torch.randint(1, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = (model(nxt, **cache_kwargs(model, c)).logits for c in (cache, loaded))
    torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-5)
    assert heads.part_names(4) == ("codes", "scale", "zero")
