"""KV method specs: registry, quantizer structure, bit accounting."""
import math

import pytest
import torch

from oscar_hf.compat import cache_kwargs
from oscar_hf.eval.fakequant import residual_exact_mask
from oscar_hf.eval.methods import METHODS, KiviSpec, TurboSpec, get_method, lloyd_max_gaussian

from tiny_models import tiny_model


def test_registry_and_errors():
    assert {"fp", "identity", "hadamard", "oscar", "pca-kv", "kivi", "turbo", "hf-quanto", "hf-hqq"} <= set(METHODS)
    with pytest.raises(ValueError):
        get_method("nope")
    with pytest.raises(NotImplementedError):
        get_method("hf-quanto").fake_spec(None)
    with pytest.raises(ValueError):
        get_method("kivi", group_size=64, residual=100)


def test_lloyd_max_levels_are_the_known_gaussian_quantizers():
    lv = lloyd_max_gaussian(4)
    assert torch.allclose(lv, torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104]), atol=2e-4)
    lv8 = lloyd_max_gaussian(8)
    assert torch.allclose(lv8[4:], torch.tensor([0.2451, 0.7560, 1.3440, 2.1520]), atol=2e-4)


def test_kivi_keys_per_channel_values_per_token():
    torch.manual_seed(0)
    k = torch.randn(1, 2, 40, 16) * torch.linspace(0.1, 10, 16)  # channel-dependent scales
    v = torch.randn(1, 2, 40, 16)
    kh, vh = KiviSpec(2, 8, 16, torch.float32).layer_kv(0, k, v)
    for t0 in range(0, 40, 8):  # every (token group, channel) has at most 4 distinct key levels
        for c in range(16):
            assert kh[0, 0, t0 : t0 + 8, c].unique().numel() <= 4
    assert vh[0, 0, 3, :8].unique().numel() <= 4 and vh[0, 0, 3, 8:].unique().numel() <= 4  # per token, 8-channel groups
    assert vh[0, 0, :, 0].unique().numel() > 4  # ... not per channel
    assert (kh - k).abs().max() > 0  # really quantized
    m = residual_exact_mask(40, 1, 16)
    assert m[15].all() and not m[16, :16].any() and m[16, 16:].all() and not m[33, :32].any()


def test_turbo_reconstruction_error_matches_lloyd_max_distortion():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 4000, 64)
    spec = TurboSpec(3, 0, 0, seed=0, norm_dtype=torch.float32)
    xh, _ = spec.layer_kv(0, x, x)
    rel = ((xh - x).norm(dim=-1) ** 2 / x.norm(dim=-1) ** 2).mean().item()
    assert 0.02 < rel < 0.05  # Lloyd-Max 3-bit Gaussian distortion is 0.0345


def test_bits_accounting():
    osc = get_method("hadamard", sink=64, recent=256, group_size=64)
    assert osc.bits(300, 64) == 16.0  # nothing quantized yet
    assert math.isclose(osc.bits(2048, 64), (320 * 16 + 1728 * 2.5) / 2048)
    assert math.isclose(get_method("turbo", bits=3).bits(2048, 64), 3.25)
    assert math.isclose(get_method("kivi", group_size=64, residual=128).bits(2048, 64), 2.5)
    assert math.isclose(get_method("kivi", group_size=64, residual=128).bits(2100, 64), (52 * 16 + 2048 * 2.5) / 2100)
    assert math.isclose(get_method("hf-quanto", nbits=4).bits(2048, 64, prefill_len=2048), 4.5)


def test_hf_quantized_cache_backends_build_or_explain():
    model = tiny_model("llama")
    for name in ("hf-quanto", "hf-hqq"):
        try:
            cache = get_method(name, nbits=2, group_size=32).make_cache(model)
        except ImportError as e:
            pytest.skip(f"{name}: {e}")
        with torch.no_grad():
            out = model(torch.randint(0, 256, (1, 8)), **cache_kwargs(model, cache), use_cache=True)
            out = model(torch.randint(0, 256, (1, 1)), **cache_kwargs(model, cache), use_cache=True)
        assert torch.isfinite(out.logits).all()
