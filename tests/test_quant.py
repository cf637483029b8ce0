"""INT2 quantizer reference: packing, error bounds, clipping, metadata dtypes."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from oscar_hf.quant import (
    STD_STEP,
    QuantizedRows,
    bits_per_element,
    check_group_size,
    dequantize_rows,
    pack_int2,
    quantize_rows,
    unpack_int2,
)


@given(d4=st.integers(1, 64), rows=st.integers(1, 5), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_pack_unpack_roundtrip(d4, rows, seed):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4, (rows, 4 * d4), generator=g, dtype=torch.uint8)
    packed = pack_int2(codes)
    assert packed.shape == (rows, d4) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int2(packed), codes)


def test_pack_plane_layout():
    # byte j holds channel j + p*D/4 in bits 2p..2p+1
    codes = torch.zeros(8, dtype=torch.uint8)
    codes[1], codes[3], codes[5], codes[7] = 1, 2, 3, 1  # channels of byte 1: 1, 3, 5, 7 (D/4 = 2)
    assert pack_int2(codes).tolist() == [0, 1 | (2 << 2) | (3 << 4) | (1 << 6)]


@pytest.mark.parametrize("meta", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("g", [16, 32, 64])
def test_error_bounded_by_half_scale(meta, g):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 64) * torch.rand(3, 7, 1) * 5
    q = quantize_rows(x, g, clip=1.0, meta_dtype=meta)
    assert q.codes.shape == (3, 7, 16) and q.scale.shape == (3, 7, 64 // g) and q.scale.dtype == meta
    xh = dequantize_rows(q, g)
    scale = q.scale.float().repeat_interleave(g, -1)
    # half a step, plus the metadata rounding of the top of the range (relative eps of the dtype)
    eps = torch.finfo(meta).eps * (x.abs().reshape(3, 7, -1, g).amax(-1).repeat_interleave(g, -1) + 1)
    assert ((x - xh).abs() <= scale / 2 + 2 * eps + 1e-6).all()


def test_constant_and_zero_rows_exact():
    x = torch.stack([torch.zeros(64), torch.full((64,), 3.25), torch.full((64,), -1.5)])
    xh = dequantize_rows(quantize_rows(x, 32, clip=0.9, meta_dtype=torch.float32), 32)
    assert torch.equal(xh, x)


def test_clipping_saturates_and_shrinks_range():
    x = torch.linspace(-1, 1, 64)[None]
    x[0, 0], x[0, -1] = -10.0, 10.0  # outliers
    full = quantize_rows(x, 64, clip=1.0, meta_dtype=torch.float32)
    clipped = quantize_rows(x, 64, clip=0.5, meta_dtype=torch.float32)
    assert torch.allclose(clipped.scale, full.scale * 0.5)
    assert torch.allclose(clipped.zero, torch.tensor([[-5.0]]))
    xh = dequantize_rows(clipped, 64)
    assert xh.min() == -5.0 and xh.max() == 5.0  # outliers saturate to the clipped ends
    assert (unpack_int2(clipped.codes)[0, [0, -1]] == torch.tensor([0, 3], dtype=torch.uint8)).all()


def test_clip_per_head_tensor():
    x = torch.randn(2, 3, 5, 32)
    clip = torch.tensor([1.0, 0.9, 0.8])[None, :, None, None]
    q = quantize_rows(x, 32, clip=clip, meta_dtype=torch.float32)
    for h, c in enumerate([1.0, 0.9, 0.8]):
        qh = quantize_rows(x[:, h], 32, clip=c, meta_dtype=torch.float32)
        assert torch.equal(q.codes[:, h], qh.codes)


def test_bad_group_size_is_clear():
    with pytest.raises(ValueError, match="does not divide head_dim=96"):
        check_group_size(96, 64)
    with pytest.raises(ValueError, match="does not divide"):
        quantize_rows(torch.randn(2, 96), 64)


def test_bits_per_element():
    assert bits_per_element(128, 64, torch.bfloat16) == 2.5
    assert bits_per_element(128, 128, torch.float16) == 2.25
    assert isinstance(QuantizedRows(*quantize_rows(torch.randn(1, 8), 8)), tuple)


# ------------------------------------------------------------------------------ quantizer="std": mean / std grid


def test_std_grid_metadata_and_levels():
    """scale = 0.996 std, zero = mean - 1.5 scale per group; each value decodes to the nearest of the 4 levels."""
    torch.manual_seed(1)
    x = torch.randn(4, 5, 64) * 3 + torch.randn(4, 5, 1)
    q = quantize_rows(x, 32, meta_dtype=torch.float32, quantizer="std")
    xg = x.reshape(4, 5, 2, 32)
    mean, std = xg.mean(-1), xg.std(-1, unbiased=False)
    torch.testing.assert_close(q.scale, STD_STEP * std)
    torch.testing.assert_close(q.zero, mean - 1.5 * STD_STEP * std)
    levels = q.zero[..., None] + q.scale[..., None] * torch.arange(4.0)  # [4, 5, 2, 4]
    nearest = levels.gather(-1, (xg[..., None] - levels[..., None, :]).abs().argmin(-1))
    torch.testing.assert_close(dequantize_rows(q, 32).reshape(4, 5, 2, 32), nearest)


def test_std_grid_beats_range_on_gaussian_groups():
    """For Gaussian groups (what a rotation makes of K/V), the std grid's squared error is well below the unclipped
    range's and below a good clip's: the reason it exists."""
    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(0))
    err = {name: (dequantize_rows(quantize_rows(x, 64, clip, torch.float32, qz), 64) - x).square().mean().item()
           for name, clip, qz in (("range", 1.0, "minmax"), ("clip", 0.8, "minmax"), ("std", 1.0, "std"))}
    assert err["std"] < 0.95 * err["clip"] < 0.95 * err["range"], err


def test_std_grid_constant_rows_exact_and_clip_unused():
    x = torch.stack([torch.zeros(64), torch.full((64,), 3.25)])
    assert torch.equal(dequantize_rows(quantize_rows(x, 32, meta_dtype=torch.float32, quantizer="std"), 32), x)
    y = torch.randn(3, 64)
    a, b = (quantize_rows(y, 64, c, torch.bfloat16, "std") for c in (1.0, 0.5))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    with pytest.raises(ValueError, match="quantizer must be one of"):
        quantize_rows(y, 64, quantizer="lloyd")
