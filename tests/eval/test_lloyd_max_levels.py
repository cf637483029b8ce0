"""The eval-only Lloyd-Max quantizer of the OSCAR fake-quant path (item 3 of the good-by-default issue): 4 levels
per group in the rotated space, mean and standard deviation as the group's two metadata values."""
import pytest
import torch

from oscar_hf import OscarRotations
from oscar_hf.eval.methods import OscarFamily, OscarSpec
from oscar_hf.quant import dequantize_rows, quantize_rows

from tiny_models import tiny_model


def spec(levels, group_size=32):
    model = tiny_model("llama", head_dim=64)
    rot = OscarRotations.builtin(model, "hadamard")
    method = OscarFamily("oscar", rotations=rot, levels=levels, group_size=group_size, center=False)
    return model, rot, method.fake_spec(model)


@pytest.mark.parametrize("group_size", [32, 64])
def test_lloyd_max_rows_have_four_levels_per_group_and_beat_uniform_on_gaussian_rows(group_size):
    model, rot, lm = spec("lloyd-max", group_size)
    _, _, uni = spec("uniform", group_size)
    torch.manual_seed(0)
    x = torch.randn(1, 2, 256, 64)
    r = rot.layers[0].r_k
    rows = lm._std_levels(x, r, None)  # rotated space
    groups = rows.reshape(-1, group_size)
    assert max(len(torch.unique(g)) for g in groups) <= 4
    err_lm = (lm._fq(x, r, None, 1.0) - x).pow(2).mean()
    err_uni = (uni._fq(x, r, None, 1.0) - x).pow(2).mean()
    assert err_lm < 0.9 * err_uni, (err_lm, err_uni)  # Gaussian rows: Lloyd-Max's MSE is lower


def test_lloyd_max_is_fast_path_only():
    model, rot, _ = spec("lloyd-max")
    with pytest.raises(NotImplementedError, match="eval-only"):
        OscarFamily("oscar", rotations=rot, levels="lloyd-max").make_cache(model)
    with pytest.raises(ValueError, match="levels"):
        OscarSpec(model, rot, OscarFamily("oscar", rotations=rot).config, levels="even-std")


def test_fake_quant_path_follows_the_configured_quantizer():
    """OscarConfig.quantizer="std" reaches the fake-quant path (what --path fast scores) and changes its rows."""
    model = tiny_model("llama", head_dim=64)
    rot = OscarRotations.builtin(model, "hadamard")
    specs = {q: OscarFamily("oscar", rotations=rot, quantizer=q, center=False).fake_spec(model) for q in ("minmax", "std")}
    x, r = torch.randn(1, 2, 64, 64), rot.layers[0].r_k
    rows = {q: s._fq(x, r, None, 0.8) @ r for q, s in specs.items()}  # back in the rotated space
    want = dequantize_rows(quantize_rows(x @ r, 64, 1.0, specs["std"].config.torch_meta_dtype, "std"), 64)
    torch.testing.assert_close(rows["std"], want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(rows["std"], rows["minmax"], atol=1e-3)
