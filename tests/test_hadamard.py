"""Hadamard matrices, bit-reversal permutation and the OSCAR rotation R = U·H·P_br."""
from __future__ import annotations

import pytest
import torch

from oscar_hf.hadamard import (
    bit_reversal_permutation,
    hadamard_matrix,
    oscar_rotation,
    permutation_matrix,
)


def _bitrev(i: int, bits: int) -> int:
    return int(format(i, f"0{bits}b")[::-1], 2)


@pytest.mark.parametrize("d", [1, 2, 8, 32, 64, 128, 256, 12, 24, 80, 96, 160])
def test_hadamard_orthogonal_with_equal_magnitudes(d):
    h = hadamard_matrix(d, torch.float64)
    assert h.shape == (d, d)
    torch.testing.assert_close(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12, rtol=0)
    # a Hadamard matrix: every entry is +-1/sqrt(d)
    torch.testing.assert_close(h.abs(), torch.full((d, d), d**-0.5, dtype=torch.float64), atol=1e-12, rtol=0)
    assert hadamard_matrix(d).dtype == torch.float32


@pytest.mark.parametrize("d", [8, 64, 128, 96])
def test_lemma1_hadamard_equalizes_diagonal(d):
    """diag(H Λ Hᵀ) = tr(Λ)/d for any diagonal Λ (the paper's Lemma 1)."""
    g = torch.Generator().manual_seed(d)
    for _ in range(3):
        lam = torch.rand(d, generator=g, dtype=torch.float64) ** 4 * 10  # very uneven spectrum
        h = hadamard_matrix(d, torch.float64)
        diag = torch.diagonal(h @ torch.diag(lam) @ h.T)
        torch.testing.assert_close(diag, torch.full((d,), float(lam.sum()) / d, dtype=torch.float64), rtol=1e-10, atol=0)
    # and it is not a property of any orthogonal matrix: a random rotation does not equalize
    q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    diag = torch.diagonal(q @ torch.diag(lam) @ q.T)
    assert (diag - lam.sum() / d).abs().max() > 1e-3


def test_bit_reversal_d8():
    assert bit_reversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]


@pytest.mark.parametrize("d", [2, 4, 64, 128])
def test_bit_reversal_powers_of_two(d):
    bits = d.bit_length() - 1
    perm = bit_reversal_permutation(d)
    assert perm.tolist() == [_bitrev(i, bits) for i in range(d)]
    assert sorted(perm.tolist()) == list(range(d))
    assert torch.equal(perm[perm], torch.arange(d))  # an involution


@pytest.mark.parametrize("d", [64, 128, 96])
@pytest.mark.parametrize("groups", [2, 4, 8])
def test_bit_reversal_gives_every_group_one_of_each_level(d, groups):
    """Importance levels k*groups .. (k+1)*groups-1 land in `groups` different groups of contiguous channels."""
    if d % groups:
        pytest.skip("group count does not divide d")
    perm = bit_reversal_permutation(d)
    gsize = d // groups
    for k in range(d // groups):
        levels = perm[k * groups : (k + 1) * groups]
        assert sorted((levels // gsize).tolist()) == list(range(groups)), (k, levels)


def test_bit_reversal_non_power_of_two_is_a_permutation():
    for d in (12, 24, 96):
        assert sorted(bit_reversal_permutation(d).tolist()) == list(range(d))


def test_permutation_matrix_semantics():
    perm = bit_reversal_permutation(8)
    p = permutation_matrix(perm, torch.float64)
    x = torch.arange(8, dtype=torch.float64)[None]
    y = x @ p
    for i in range(8):
        assert y[0, perm[i]] == x[0, i]
    torch.testing.assert_close(p @ p.T, torch.eye(8, dtype=torch.float64))


@pytest.mark.parametrize("d", [100, 52, 6, 3])
def test_hadamard_without_construction_raises_clearly(d):
    with pytest.raises(ValueError, match=rf"No Hadamard matrix .* head_dim={d}"):
        hadamard_matrix(d)


def test_hadamard_rejects_non_positive():
    with pytest.raises(ValueError, match="positive"):
        hadamard_matrix(0)


@pytest.mark.parametrize("d", [64, 96])
def test_oscar_rotation_is_u_h_p(d):
    g = torch.Generator().manual_seed(1)
    u = torch.linalg.qr(torch.randn(2, d, d, generator=g, dtype=torch.float64))[0]
    r = oscar_rotation(u)
    assert r.shape == (2, d, d) and r.dtype == torch.float32
    expect = u @ hadamard_matrix(d, torch.float64) @ permutation_matrix(bit_reversal_permutation(d), torch.float64)
    torch.testing.assert_close(r.double(), expect, atol=1e-6, rtol=0)
    torch.testing.assert_close(r.transpose(-1, -2) @ r, torch.eye(d).expand(2, d, d), atol=1e-5, rtol=0)
    # the top eigen-direction u_0 is spread evenly over all channels, led into channel perm[0] = 0 first
    e0 = u[0, :, 0] @ r[0].double()
    torch.testing.assert_close(e0.abs(), torch.full((d,), d**-0.5, dtype=torch.float64), atol=1e-6, rtol=0)
