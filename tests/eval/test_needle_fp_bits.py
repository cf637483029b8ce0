"""``--full-precision-bits``: the full-precision heads stored as b-bit codes (simulated on write), the rest of the
cache untouched, the original write restored, and the history bits counted at b + 2 * 16 / D for those heads."""
import pytest
import torch

from oscar_hf import OscarCache
from oscar_hf.cache import OscarLayer
from oscar_hf.compat import cache_kwargs
from oscar_hf.eval.fakequant import minmax_fake_quant
from oscar_hf.eval.needle import full_precision_head_bits, history_bits, quantized_full_precision_heads
from oscar_hf.models import tiny_model

SMALL = dict(method="hadamard", sink=4, recent=8, group_size=32)  # quantizes the history after 12 tokens
FP_PAIR = (0, 1)  # tiny llama: 2 layers x 2 KV heads; layer 0's K/V do not depend on its own attention


def distinct_per_row(x: torch.Tensor) -> int:
    """Most distinct values in one row ``x[..., :]`` over all rows."""
    rows = x.reshape(-1, x.shape[-1])
    return max(len(torch.unique(r)) for r in rows)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_minmax_fake_quant_levels_range_and_error(bits):
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


def test_minmax_fake_quant_constant_row_and_bad_bits():
    x = torch.full((2, 64), 0.375)
    assert torch.equal(minmax_fake_quant(x, 4), x)
    for bad in (0, 9, 4.0, True):
        with pytest.raises(ValueError, match="bits must be an int"):
            minmax_fake_quant(x, bad)


def test_full_precision_head_bits():
    assert full_precision_head_bits(16, 64) == 16.0
    assert full_precision_head_bits(8, 64) == 8.5
    assert full_precision_head_bits(4, 64) == 4.5
    assert full_precision_head_bits(4, 128) == 4.25
    with pytest.raises(ValueError, match="one of"):
        full_precision_head_bits(3, 64)
    with pytest.raises(ValueError, match="one of"):
        with quantized_full_precision_heads(2):
            pass


def run_cache(model, ids: torch.Tensor, decode: int) -> OscarCache:
    """Prefill ``ids[:-decode]`` then feed the last ``decode`` tokens one by one (both write paths)."""
    cache = OscarCache(model, **SMALL, full_precision_heads=(FP_PAIR,))
    n = ids.shape[1] - decode
    with torch.no_grad():
        model(ids[:, :n], **cache_kwargs(model, cache), use_cache=True)
        for t in range(n, ids.shape[1]):
            model(ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True)
    return cache


@pytest.mark.parametrize("bits", [4, 8])
def test_patch_quantizes_exactly_the_full_precision_heads_and_restores(bits):
    model = tiny_model("llama", head_dim=64)
    ids = torch.randint(1, 256, (1, 30), generator=torch.Generator().manual_seed(1))
    original = OscarLayer.__dict__["write_full_precision_heads"]
    ref = run_cache(model, ids, decode=6)
    with quantized_full_precision_heads(bits):
        assert OscarLayer.__dict__["write_full_precision_heads"] is not original
        got = run_cache(model, ids, decode=6)
    assert OscarLayer.__dict__["write_full_precision_heads"] is original

    r0, g0 = ref.layers[0], got.layers[0]
    assert r0.fp_heads == g0.fp_heads == (FP_PAIR[1],)
    t = g0.seq_len
    assert t == ids.shape[1] and g0.n_hist > 0  # prefill and decode rows written, history quantized
    for ref_buf, got_buf in ((r0.fp_k, g0.fp_k), (r0.fp_v, g0.fp_v)):  # [B, P, cap, D]
        ref_rows, got_rows = ref_buf[:, :, :t], got_buf[:, :, :t]
        assert torch.equal(got_rows, minmax_fake_quant(ref_rows, bits))  # every slot, prefill and decode
        assert not torch.equal(got_rows, ref_rows)
        assert distinct_per_row(got_rows) <= 2**bits
        if 2**bits < ref_rows.shape[-1]:  # (at D = 64, 8-bit codes cannot be told apart by counting)
            assert distinct_per_row(ref_rows) > 2**bits  # the BF16 rows would fail the check above
    # everything else layer 0 holds is written from the same K/V and is identical: the other head's INT2 history,
    # the window buffers of every head (the full-precision head's window copy included)
    for rows_ref, rows_got in zip(r0.hist_view(), g0.hist_view()):  # keys, values: QuantizedRows
        for a, b in zip(rows_ref, rows_got):  # codes, scale, zero
            assert torch.equal(a, b)
    for name in ("tail_k", "tail_v", "sink_k", "sink_v"):
        assert torch.equal(getattr(r0, name), getattr(g0, name)), name
    # layer 1 has no full-precision head: nothing of it is quantized on the side
    assert got.layers[1].fp_heads == () and got.layers[1].fp_k is None


def test_patch_restores_after_an_error_and_16_is_a_no_op():
    original = OscarLayer.__dict__["write_full_precision_heads"]
    with pytest.raises(RuntimeError, match="boom"):
        with quantized_full_precision_heads(4):
            raise RuntimeError("boom")
    assert OscarLayer.__dict__["write_full_precision_heads"] is original
    with quantized_full_precision_heads(16):
        assert OscarLayer.__dict__["write_full_precision_heads"] is original


def test_history_bits_counts_full_precision_heads_at_their_bits():
    model = tiny_model("llama", head_dim=64)  # 2 layers x 2 KV heads, INT2 rows at group 32: 2 + 32 / 32 = 3 bits
    cache = OscarCache(model, **SMALL, full_precision_heads=(FP_PAIR,))
    q = cache.oscar_config.history_bits(64)
    assert q == 3.0
    assert history_bits(cache) == dict(full_precision_heads=1, kv_heads=4, full_precision_head_bits=16.0,
                                       history_bits=(3 * q + 16) / 4)
    assert history_bits(cache, 4.5)["history_bits"] == (3 * q + 4.5) / 4
    assert history_bits(cache)["history_bits"] == cache.memory_report()["history_bits_per_element"]
    assert history_bits(OscarCache(model, **SMALL), 4.5)["history_bits"] == q
