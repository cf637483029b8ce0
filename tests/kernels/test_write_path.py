"""Fused write kernel (rotate + center + clip + INT2 quantize + pack) against the torch reference.

CPU: the kernel runs under the Triton interpreter on CPU tensors (see kernel_utils). GPU (``-m gpu``):
the compiled kernel at real shapes.
"""
from __future__ import annotations

import pytest
import torch
from kernel_utils import HAS_CUDA, random_rotation, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from oscar_hf.kernels.write_path import rotate_quantize, rotate_quantize_reference  # noqa: E402
from oscar_hf.quant import STD_STEP, QuantizedRows, dequantize_rows, unpack_int2  # noqa: E402

interp = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter tests (TRITON_INTERPRET=1 without CUDA)")


def _triton():
    from oscar_hf.kernels.write_triton import rotate_quantize_triton

    return rotate_quantize_triton


def _inputs(b, hk, t, d, *, dtype=torch.bfloat16, center=True, seed=0, device="cpu", outliers=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, hk, t, d, generator=gen)
    if outliers:  # a few large channels, as in real keys
        x[..., : max(1, d // 32)] *= 8.0
    r = random_rotation(hk, d, gen)
    mu = torch.randn(hk, d, generator=gen) * 0.5 if center else None
    x = x.to(dtype)
    return x.to(device), r.to(device), (mu.to(device) if mu is not None else None)


def check_against_reference(got: QuantizedRows, x, r, mu, clip, g, meta, ref: QuantizedRows | None = None,
                            quantizer="minmax"):
    """Metadata ~1e-3 relative, < 0.5% of codes differ (matmul-order ties), and every unclipped
    element (inside the grid's end levels) within scale/2 of the exact (float64) rotated row."""
    ref = ref if ref is not None else rotate_quantize_reference(x, r, mu, clip, g, meta, quantizer=quantizer)
    for name in ("scale", "zero"):
        a, b = getattr(got, name).double(), getattr(ref, name).double()
        assert getattr(got, name).dtype == meta
        # 1e-3 of the range, plus one step of the stored dtype: a value whose fp32 computation (tf32x3
        # matmul on the GPU vs the reference's) straddles a rounding boundary of ``meta`` lands one ulp apart
        tol = 1e-3 * b.abs().amax().clamp_min(1e-6) + torch.finfo(meta).eps * b.abs()
        assert ((a - b).abs() <= tol).all(), f"{name} differs by {(a - b).abs().max():.3g}"
    codes_g, codes_r = unpack_int2(got.codes), unpack_int2(ref.codes)
    assert codes_g.shape == codes_r.shape
    frac = (codes_g != codes_r).double().mean().item()
    assert frac < 5e-3, f"{frac:.2%} of codes differ"
    # error bound against the exact rotated rows
    xf = x.double().cpu()
    if mu is not None:  # [Hk, D] or, per sequence, [B, Hk, D]
        mu64 = mu.double().cpu()
        xf = xf - (mu64[None, :, None, :] if mu64.dim() == 2 else mu64[:, :, None, :])
    rows = torch.matmul(xf, r.double().cpu().unsqueeze(0))
    d = rows.shape[-1]
    rg = rows.reshape(*rows.shape[:-1], d // g, g)
    if quantizer == "std":
        mid, half = rg.mean(-1, keepdim=True), 1.5 * STD_STEP * rg.std(-1, unbiased=False, keepdim=True)
    else:
        lo, hi = rg.amin(-1, keepdim=True), rg.amax(-1, keepdim=True)
        mid, half = (hi + lo) / 2, (hi - lo) / 2 * clip
    unclipped = (rg >= mid - half) & (rg <= mid + half)
    xhat = dequantize_rows(QuantizedRows(got.codes.cpu(), got.scale.cpu(), got.zero.cpu()), g, torch.float64)
    err = (xhat.reshape_as(rg) - rg).abs()
    scale = got.scale.double().cpu().unsqueeze(-1)
    # scale/2 + the rounding of the stored zero and scale (the ends of [zero, zero + 3 scale] move by
    # up to ~2 half-ulps of the group's magnitude) + float slack
    eps = 1e-5 + 2 * torch.finfo(meta).eps * rg.abs().amax(-1, keepdim=True)
    bad = unclipped & (err > scale / 2 + eps)
    assert bad.double().mean().item() <= frac + 1e-9, f"{int(bad.sum())} unclipped elements beyond scale/2"


@interp
@pytest.mark.parametrize(
    "b,hk,t,d,g,meta,center,clip",
    [
        (1, 2, 1, 64, 32, torch.bfloat16, True, 0.96),  # a single row (the decode-time demotion)
        (2, 2, 37, 64, 64, torch.float16, False, 1.0),  # odd length
        (1, 3, 63, 128, 32, torch.bfloat16, True, 0.92),  # BLOCK_T - 1
        (1, 1, 64, 128, 64, torch.bfloat16, True, 0.96),  # BLOCK_T
        (2, 1, 65, 128, 128, torch.float16, True, 0.9),  # BLOCK_T + 1
        (1, 2, 17, 256, 64, torch.float32, True, 0.95),  # D = 256 (BLOCK_T = 16) + 1, fp32 metadata
        # D = 96 (Phi-3), the plane-padded layout: groups across planes (G = 32), whole planes (48), one per head (96)
        (2, 1, 37, 96, 32, torch.bfloat16, True, 0.96),
        (1, 2, 5, 96, 48, torch.float16, False, 0.92),
        (1, 1, 65, 96, 96, torch.float32, True, 1.0),
        (1, 1, 17, 512, 64, torch.bfloat16, True, 0.96),  # D = 512 (Gemma 4's full layers): BLOCK_T = 16, BLOCK_K = 32
    ],
)
def test_kernel_matches_reference(b, hk, t, d, g, meta, center, clip):
    x, r, mu = _inputs(b, hk, t, d, center=center, seed=t + d)
    got = _triton()(x, r, mu, clip, g, meta)
    check_against_reference(got, x, r, mu, clip, g, meta)


@interp
@pytest.mark.parametrize("b,hk,t,d,g,meta", [(1, 2, 1, 64, 32, torch.bfloat16), (2, 1, 65, 128, 64, torch.float16),
                                             (1, 2, 17, 256, 256, torch.float32), (1, 2, 9, 96, 32, torch.bfloat16),
                                             (1, 1, 5, 96, 96, torch.float32), (1, 1, 4, 96, 24, torch.bfloat16),
                                             (1, 1, 3, 512, 128, torch.bfloat16)])
def test_kernel_matches_reference_std_grid(b, hk, t, d, g, meta):
    """quantizer="std": the kernel's mean / std grid is the reference's (the clip ratio passed is unused)."""
    x, r, mu = _inputs(b, hk, t, d, seed=t + g)
    got = _triton()(x, r, mu, 0.5, g, meta, quantizer="std")
    check_against_reference(got, x, r, mu, 1.0, g, meta, quantizer="std")
    minmax = rotate_quantize_reference(x, r, mu, 1.0, g, meta)
    assert not torch.equal(got.scale, minmax.scale)


@interp
def test_kernel_per_sequence_offset():
    """key_offset="prefill": one offset per (row, KV head), ``mu [B, Hk, D]``; rows with very different
    offsets must each be centered on their own (a per-head offset would leave row 1 badly quantized)."""
    x, r, _ = _inputs(3, 2, 40, 64, seed=5)
    mu = torch.randn(3, 2, 64) * 4.0
    x = (x.float() + mu[:, :, None]).to(torch.bfloat16)
    got = _triton()(x, r, mu, 0.96, 32, torch.bfloat16)
    check_against_reference(got, x, r, mu, 0.96, 32, torch.bfloat16)
    wrong = rotate_quantize_reference(x, r, mu[0], 0.96, 32, torch.bfloat16)  # row 0's offset for every row
    assert not torch.equal(wrong.codes[1:], got.codes[1:])


@interp
@pytest.mark.parametrize("meta", [torch.bfloat16, torch.float16])
def test_out_storage_offset_and_strided_input(meta):
    """Writes only rows [off, off + T) of preallocated storage; x may be a transposed view."""
    b, hk, t, d, g, cap, off = 2, 2, 21, 64, 32, 50, 17
    x, r, mu = _inputs(b, hk, t, d, seed=3)
    x = x.transpose(1, 2).contiguous().transpose(1, 2)  # [B, T, Hk, D] storage viewed as [B, Hk, T, D]
    assert not x.is_contiguous()
    store = QuantizedRows(
        torch.full((b, hk, cap, d // 4), 0xAB, dtype=torch.uint8),
        torch.full((b, hk, cap, d // g), float("nan"), dtype=meta),
        torch.full((b, hk, cap, d // g), float("nan"), dtype=meta),
    )
    res = _triton()(x, r, mu, 0.95, g, meta, out=store, out_offset=off)
    assert res is store
    sl = slice(off, off + t)
    got = QuantizedRows(store.codes[:, :, sl], store.scale[:, :, sl], store.zero[:, :, sl])
    check_against_reference(got, x, r, mu, 0.95, g, meta)
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[sl] = False
    assert (store.codes[:, :, untouched] == 0xAB).all()
    assert store.scale[:, :, untouched].isnan().all() and store.zero[:, :, untouched].isnan().all()
    with pytest.raises(ValueError):
        _triton()(x, r, mu, 0.95, g, meta, out=store, out_offset=cap - t + 1)


@interp
def test_constant_and_zero_rows():
    """Zero-range groups: scale 0, codes 0, exact reconstruction of the constant."""
    b, hk, t, d, g = 1, 2, 5, 64, 32
    r = torch.eye(d).expand(hk, d, d).contiguous()
    x = torch.zeros(b, hk, t, d)
    x[:, :, 1] = 1.5
    x[:, :, 2, :g] = -3.25  # one constant group, one zero group
    x[:, :, 3] = torch.randn(d)  # a normal row among them
    x[:, :, 4, g:] = 7.0
    x = x.to(torch.bfloat16)
    got = _triton()(x, r, None, 0.9, g, torch.bfloat16)
    ref = rotate_quantize_reference(x, r, None, 0.9, g, torch.bfloat16)
    for a, b_ in zip(got, ref):
        assert torch.equal(a, b_)
    const = torch.tensor([0, 1, 2, 4])
    assert (got.scale[:, :, const] == 0).all()  # every group of these rows has a zero range
    xhat = dequantize_rows(got, g)
    assert torch.equal(xhat[:, :, const], x[:, :, const].float())


@interp
def test_ties_round_half_to_even():
    """Values exactly halfway between levels round like torch.round (half to even)."""
    d, g = 64, 32
    r = torch.eye(d).expand(1, d, d).contiguous()
    row = torch.tensor([0.0, 3.0, 0.5, 1.5, 2.5, 1.0, 2.0, 0.25] * (d // 8))  # lo 0, hi 3 -> scale 1
    x = row.expand(1, 1, 3, d).clone()
    got = _triton()(x, r, None, 1.0, g, torch.float32)
    ref = rotate_quantize_reference(x, r, None, 1.0, g, torch.float32)
    assert (ref.scale == 1).all() and (ref.zero == 0).all()
    assert torch.equal(unpack_int2(got.codes), unpack_int2(ref.codes))
    assert unpack_int2(ref.codes)[0, 0, 0, :8].tolist() == [0, 3, 0, 2, 2, 1, 2, 0]


@interp
def test_dispatch_and_fallback(monkeypatch):
    """The dispatcher runs the kernel for every head_dim it claims (plan.WRITE_HEAD_DIMS, 96 included) and the
    reference, bit-identical, for the others (80: not served)."""
    import oscar_hf.kernels.write_triton as wt
    from oscar_hf.kernels.plan import WRITE_HEAD_DIMS

    launches = []
    real = wt.rotate_quantize_triton
    monkeypatch.setattr(wt, "rotate_quantize_triton",
                        lambda *a, **kw: (launches.append(a[0].shape[-1]), real(*a, **kw))[1])
    for d in (64, 96):
        x, r, mu = _inputs(1, 2, 9, d, seed=5)
        ref = rotate_quantize_reference(x, r, mu, 0.96, 32, torch.bfloat16)
        got = rotate_quantize(x, r, mu, 0.96, 32, torch.bfloat16, use_kernels=True)
        check_against_reference(got, x, r, mu, 0.96, 32, torch.bfloat16, ref)
    assert launches == [64, 96]
    assert WRITE_HEAD_DIMS == (32, 64, 96, 128, 256, 512)
    assert all(wt.kernel_supported(torch.empty(1, 1, 1, d), 32, 0.96) for d in WRITE_HEAD_DIMS)
    x96 = torch.empty(1, 1, 1, 96)
    assert wt.kernel_supported(x96, 96, 0.96) and wt.kernel_supported(x96, 48, 1)
    assert not wt.kernel_supported(torch.empty(1, 1, 1, 96), 12, 0.96)  # 12: neither a power of two nor whole planes
    x, r, mu = _inputs(1, 1, 7, 80, seed=6)
    assert not wt.kernel_supported(x, 16, 0.96, torch.bfloat16)
    got = rotate_quantize(x, r, mu, 0.96, 16, torch.bfloat16, use_kernels=True)
    ref = rotate_quantize_reference(x, r, mu, 0.96, 16, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(got, ref)) and launches == [64, 96]


@interp
def test_property_random_shapes():
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=8, deadline=None, derandomize=True)
    @given(
        b=st.integers(1, 2), hk=st.integers(1, 2), t=st.integers(1, 70), d=st.sampled_from([64, 128]),
        g_div=st.sampled_from([1, 2, 4]), meta=st.sampled_from([torch.bfloat16, torch.float16]),
        clip=st.floats(0.8, 1.0), log_mag=st.floats(-3.0, 3.0), center=st.booleans(), seed=st.integers(0, 10**6),
    )
    def prop(b, hk, t, d, g_div, meta, clip, log_mag, center, seed):
        g = d // g_div if d // g_div >= 32 else 32
        x, r, mu = _inputs(b, hk, t, d, center=center, seed=seed, dtype=torch.float32)
        x = (x * 10.0**log_mag).to(torch.bfloat16)
        mu = mu * 10.0**log_mag if mu is not None else None
        check_against_reference(_triton()(x, r, mu, clip, g, meta), x, r, mu, clip, g, meta)

    del hypothesis
    prop()


# --------------------------------------------------------------------------------- GPU, real shapes


@pytest.mark.parametrize("t,d,g,meta,quantizer", [(1, 128, 64, torch.bfloat16, "minmax"),
                                                 (32768, 128, 64, torch.bfloat16, "minmax"),
                                                 (4099, 128, 128, torch.float16, "minmax"),
                                                 (32768, 128, 64, torch.bfloat16, "std"),
                                                 (4099, 128, 128, torch.float16, "std"),
                                                 # Phi-3 (D = 96) and Gemma 4's full layers (D = 512)
                                                 (1, 96, 32, torch.bfloat16, "minmax"),
                                                 (32768, 96, 32, torch.bfloat16, "minmax"),
                                                 (4099, 96, 96, torch.float32, "std"),
                                                 (1, 512, 64, torch.bfloat16, "minmax"),
                                                 (4099, 512, 64, torch.bfloat16, "minmax"),
                                                 (4099, 512, 128, torch.bfloat16, "std")])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs CUDA (compiled kernels)")
def test_gpu_real_shapes(t, d, g, meta, quantizer):
    x, r, mu = _inputs(1, 8, t, d, seed=t, device="cuda")
    got = _triton()(x, r, mu, 0.96, g, meta, quantizer=quantizer)
    ref = rotate_quantize_reference(x, r, mu, 0.96, g, meta, quantizer=quantizer)
    check_against_reference(got, x, r, mu, 0.96, g, meta, ref, quantizer=quantizer)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs CUDA (compiled kernels)")
def test_gpu_per_sequence_offset():
    """key_offset="prefill" on the GPU: mu [B, Hk, D], rows with very different offsets, real shapes."""
    x, r, _ = _inputs(4, 8, 4099, 128, seed=7, device="cuda")
    mu = torch.randn(4, 8, 128, device="cuda") * 4.0
    x = (x.float() + mu[:, :, None]).to(torch.bfloat16)
    got = _triton()(x, r, mu, 0.96, 64, torch.bfloat16)
    check_against_reference(got, x, r, mu, 0.96, 64, torch.bfloat16)
