"""The decode step's query prologue (``q R_K`` and ``q · mu_K`` in one launch) against its torch reference:
under the Triton interpreter on the CPU, compiled on a GPU (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch
from kernel_utils import HAS_CUDA, random_rotation, rel_err, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from oscar_hf.kernels.int2_attention import rotate_query, rotate_query_reference  # noqa: E402

interp = pytest.mark.skipif(not INTERPRETED, reason="CPU interpreter tests (TRITON_INTERPRET=1 without CUDA)")
on_gpu = pytest.mark.skipif(not HAS_CUDA or INTERPRETED, reason="needs CUDA (compiled kernels)")


def _case(b, hk, m, d, mu, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hk * m * 2, d, generator=gen) * 3).to(dtype)[:, ::2].reshape(b, hk, m, d)  # strided rows
    r_k = random_rotation(hk, d, gen)
    mu_k = {None: None, "head": torch.randn(hk, d, generator=gen), "row": torch.randn(b, hk, d, generator=gen)}[mu]
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(q), to(r_k), to(mu_k)


def _check(q, r_k, mu_k, tol):
    from oscar_hf.kernels.query_triton import rotate_query_triton

    got_q, got_off = rotate_query_triton(q, r_k, mu_k)
    ref_q, ref_off = rotate_query_reference(q.cpu().double(), r_k.cpu().double(), None if mu_k is None else mu_k.cpu().double())
    assert got_q.dtype == torch.float32 and got_q.shape == ref_q.shape
    assert rel_err(got_q.cpu().double(), ref_q) < tol
    if mu_k is None:
        assert got_off is None
    else:
        assert got_off.shape == ref_off.shape and rel_err(got_off.cpu().double(), ref_off) < tol


@interp
@pytest.mark.parametrize("b,hk,m,d,mu,dtype", [
    (1, 2, 1, 64, None, torch.float32),  # MHA decode row
    (2, 3, 4, 128, "head", torch.bfloat16),  # GQA 4, calibrated offsets
    (2, 1, 7, 32, "row", torch.float16),  # odd M, per-sequence offsets (key_offset="prefill")
    (1, 2, 16, 256, "head", torch.float32),  # the largest M the kernel serves
    (2, 2, 4, 96, "head", torch.bfloat16),  # head_dim 96: 3 column blocks, the query's 96 channels padded to 128 lanes
    (1, 1, 3, 512, "row", torch.float32),  # head_dim 512: the product K-blocked
])
def test_rotate_query_kernel(b, hk, m, d, mu, dtype):
    _check(*_case(b, hk, m, d, mu, dtype, "cpu", seed=m), 1e-6)


@interp
def test_rotate_query_kernel_uses_each_heads_rotation_and_offset():
    """A kernel reading head 0's rotation or offset for every head would pass a one-head test: swap them."""
    from oscar_hf.kernels.query_triton import rotate_query_triton

    q, r_k, mu_k = _case(2, 2, 4, 64, "row", torch.float32, "cpu", seed=3)
    got_q, got_off = rotate_query_triton(q, r_k, mu_k)
    ref_q, ref_off = rotate_query_reference(q, r_k.flip(0), mu_k.flip(1))
    assert rel_err(got_q, ref_q) > 0.5 and rel_err(got_off, ref_off) > 0.5


@interp
def test_rotate_query_dispatch_falls_back_to_reference():
    """Prefill-sized queries (M > 16) take the torch reference even where the kernel may run
    (``use_kernels=True`` under the interpreter): bit-identical to it, which the kernel's dot is not."""
    q, r_k, mu_k = _case(1, 2, 24, 64, "head", torch.float32, "cpu")
    got = rotate_query(q, r_k, mu_k, use_kernels=True)
    ref = rotate_query_reference(q, r_k, mu_k)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("mu", [None, "head", "row"])
def test_rotate_query_under_compile_is_the_summed_form_of_the_reference(mu):
    """Under torch.compile the dispatch takes the broadcast-sum form (one fused reduction, not a float32 matmul): equal
    to the reference to float32 rounding, each head's rotation and offset its own (the swapped ones are far off)."""
    from oscar_hf.kernels.int2_attention import rotate_query_summed

    q, r_k, mu_k = _case(2, 3, 4, 64, mu, torch.bfloat16, "cpu", seed=5)
    ref_q, ref_off = rotate_query_reference(q, r_k, mu_k)
    compiled = torch.compile(lambda a, b, c: rotate_query(a, b, c, use_kernels=False), fullgraph=True, backend="eager")
    for got_q, got_off in (rotate_query_summed(q, r_k, mu_k), compiled(q, r_k, mu_k)):
        assert rel_err(got_q, ref_q) < 1e-6 and (got_off is None) == (mu_k is None)
        assert got_off is None or rel_err(got_off, ref_off) < 1e-6
    swapped = rotate_query_reference(q, r_k.flip(0), None if mu_k is None else mu_k.flip(-2))
    assert rel_err(rotate_query_summed(q, r_k, mu_k)[0], swapped[0]) > 0.5


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,mu", [(4, "head"), (8, "row"), (1, None)])
@pytest.mark.parametrize("d", [128, 96, 512])
def test_rotate_query_kernel_gpu(m, mu, d):
    _check(*_case(8, 8, m, d, mu, torch.bfloat16, "cuda", seed=m), 1e-5)


def _check_q8(q, r_k, mu_k, scale, exact):
    """The int8 key path's query operands (``q8_reference.rotate_query_q8``: the fused prologue's QPRE programs) against
    ``q8_reference.q8_operands_reference`` of the kernel's own ``q_rot``, which is checked against the rotation's reference;
    and the reference against what the operands mean: ``sigma_g (hi + lo / 254)`` is ``q_P qk_scale / 4^P`` to half
    a step of ``lo``, ``sigma_g`` from the largest norm of the head's query rows."""
    from q8_reference import q8_operands_reference, rotate_query_q8

    q_rot, off, tiles, fields = rotate_query_q8(q, r_k, mu_k, scale)
    ref_q, ref_off = rotate_query_reference(q.cpu().double(), r_k.cpu().double(),
                                            None if mu_k is None else mu_k.cpu().double())
    assert rel_err(q_rot.cpu().double(), ref_q) < 1e-5
    assert (off is None) == (mu_k is None) and (off is None or rel_err(off.cpu().double(), ref_off) < 1e-5)
    sg = fields[:, 6:8, 0].cpu()  # the kernel's sigma_g (both plane programs of a group write it)
    want_sg = q.float().cpu().reshape(-1, q.shape[2], q.shape[3]).norm(dim=-1).amax(-1)[:, None] * 1.001 * (
        scale * torch.tensor([1.0, 1 / 16.0])) / 127.0
    assert torch.allclose(sg, want_sg, rtol=1e-5)
    ref_t, ref_f = q8_operands_reference(q_rot.cpu(), scale, sg)
    tiles, fields = tiles.cpu(), fields.cpu()
    assert tiles.shape == ref_t.shape and tiles.dtype == torch.int8
    diff = (tiles.int() - ref_t.int()).abs()
    if exact:
        assert torch.equal(tiles, ref_t)
    else:  # (the GPU's float32 division may differ in its last bit: a rounding tie may then go the other way)
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    if exact:
        assert torch.equal(fields[:, 4:6], ref_f[:, 4:6])
    else:  # (128 x a sum of codes: one code a step off is 128)
        assert torch.allclose(fields[:, 4:6], ref_f[:, 4:6], atol=256)
    assert torch.allclose(fields[:, [0, 1, 2, 3, 6, 7]], ref_f[:, [0, 1, 2, 3, 6, 7]], rtol=1e-5, atol=1e-5)
    # the reference's meaning, column by column (token set n // MH of query row n % MH)
    b, hk, m, d = q.shape
    tb = ref_t.shape[-1] // 32
    mh = 8 // tb
    jj = torch.arange(32)
    sig = 8 * ((jj % 16) // 4) + 4 * (jj // 16) + jj % 4
    qr = q_rot.cpu().reshape(b * hk, m, d)
    rt, rf = ref_t.cpu().float(), ref_f.cpu()
    for n in range(8):
        t, row = n // mh, n % mh
        other = rt[:, :, :, n, 32 * (1 - t):32 * (2 - t)] if tb == 2 else torch.zeros(1)
        assert not other.any(), "the other token set's half of a column must be zero"
        for p in range(4):
            sg = rf[:, 6 + p // 2, n]  # [BH]
            approx = sg[:, None] * (rt[:, p, 0, n, 32 * t:32 * t + 32] + rt[:, p, 1, n, 32 * t:32 * t + 32] / 254.0)
            want = qr[:, row, 32 * p + sig] * scale * 0.25 ** p if row < m else torch.zeros(b * hk, 32)
            assert ((approx - want).abs() <= sg[:, None] * (0.5 / 254.0) * 1.001 + 1e-6).all(), (n, p)


@interp
@pytest.mark.parametrize("b,hk,m,mu,dtype", [
    (2, 3, 4, "head", torch.bfloat16),  # GQA 4: two token sets per column block
    (1, 2, 1, None, torch.float32),  # one row: padding columns
    (2, 2, 7, "row", torch.float16),  # one token set, padding column 7
    (1, 1, 8, "head", torch.float32),  # GQA 8
])
def test_rotate_query_q8_kernel(b, hk, m, mu, dtype):
    _check_q8(*_case(b, hk, m, 128, mu, dtype, "cpu", seed=m + 10), 128**-0.5 * 1.4426950408889634, exact=True)


@on_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,mu", [(4, "head"), (8, "row"), (1, None), (6, "head")])
def test_rotate_query_q8_kernel_gpu(m, mu):
    _check_q8(*_case(8, 8, m, 128, mu, torch.bfloat16, "cuda", seed=m), 128**-0.5 * 1.4426950408889634, exact=False)
