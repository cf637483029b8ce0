"""The OSCAR rotation ``R = U · H · P_br`` (eigenvectors, normalized Hadamard, bit-reversal permutation) and its
parts, with Hadamard matrices of every head_dim (Sylvester, Paley); what each factor does: docs/calibration.md, "The
rotation".
"""
from __future__ import annotations

import functools

import torch


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, int(n**0.5) + 1))


def _legendre(a: int, q: int) -> int:
    a %= q
    return 0 if a == 0 else 1 if pow(a, (q - 1) // 2, q) == 1 else -1


def _bordered_jacobsthal(q: int, column: float) -> torch.Tensor:
    """``[[0, 1ᵀ], [column · 1, Q]]`` ``[q + 1, q + 1]`` around the Jacobsthal matrix ``Q[i, j] = legendre(j - i, q)``
    (the core of both Paley constructions)."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:] = 1
    c[1:, 0] = column
    c[1:, 1:] = torch.tensor([[_legendre(j - i, q) for j in range(q)] for i in range(q)], dtype=torch.float64)
    return c


def _paley(n: int) -> torch.Tensor | None:
    """Unnormalized ±1 Hadamard matrix of order ``n`` by Paley I/II, or None."""
    q = n - 1  # Paley I: q prime, q = 3 (mod 4), order q + 1
    if _is_prime(q) and q % 4 == 3:
        return torch.eye(n, dtype=torch.float64) + _bordered_jacobsthal(q, -1)
    if n % 2 == 0:  # Paley II: q prime, q = 1 (mod 4), order 2(q + 1)
        q = n // 2 - 1
        if _is_prime(q) and q % 4 == 1:
            A = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
            B = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
            return (torch.kron(_bordered_jacobsthal(q, 1), A)
                    + torch.kron(torch.eye(q + 1, dtype=torch.float64), B))
    return None


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=None)
def _hadamard_f64(d: int) -> torch.Tensor:
    if d <= 0:
        raise ValueError(f"head_dim must be positive, got {d}")
    pow2 = d & -d  # largest power of two dividing d
    h, p = (_sylvester(d) if pow2 == d else None), pow2
    while h is None and p >= 1:  # move factors of two into the Paley order until one is known (24 = 24·1 or 12·2)
        base = _paley(d // p)
        if base is not None:
            h = torch.kron(base, _sylvester(p))
        p //= 2
    if h is None:
        raise ValueError(
            f"No Hadamard matrix is known to this library for head_dim={d} (= {d // pow2}·2^k with no Paley "
            f"construction of order {d // pow2}·2^j). Supported: powers of two and 2^k times 12, 20, 24, 28, 36, ...")
    hn = h / (d**0.5)
    err = (hn @ hn.T - torch.eye(d, dtype=torch.float64)).abs().max().item()
    assert err < 1e-9, f"internal error: Hadamard of order {d} is not orthogonal ({err})"
    return hn


def hadamard_matrix(d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normalized Hadamard matrix ``[d, d]`` (orthogonal, entries ±1/sqrt(d))."""
    return _hadamard_f64(d).to(dtype).clone()


def bit_reversal_permutation(d: int) -> torch.Tensor:
    """``perm[i]`` = position of importance level ``i``: the mixed-radix digit reversal of ``i`` over ``d``'s prime
    factors (twos first), the bit reversal for ``d = 2^k``."""
    radices, n, p = [], d, 2  # d's prime factors, ascending: twos first
    while n > 1:
        while n % p == 0:
            radices.append(p)
            n //= p
        p += 1
    perm = []
    for i in range(d):
        pos, r = 0, i
        for rad in radices:  # i's digits least significant first: the least significant becomes the most significant
            pos, r = pos * rad + r % rad, r // rad
        perm.append(pos)
    return torch.tensor(perm, dtype=torch.long)


def permutation_matrix(perm: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``P`` with ``P[i, perm[i]] = 1``: ``(x @ P)[perm[i]] = x[i]``."""
    return torch.eye(perm.numel(), dtype=dtype)[perm]


def oscar_rotation(eigvecs: torch.Tensor) -> torch.Tensor:
    """``R = U · H · P_br`` for ``U [..., d, d]`` with eigenvectors as columns in descending order."""
    d = eigvecs.shape[-1]
    hp = hadamard_matrix(d, torch.float64) @ permutation_matrix(bit_reversal_permutation(d), torch.float64)
    return (eigvecs.to(torch.float64) @ hp).to(torch.float32)
