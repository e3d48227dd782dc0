"""Hadamard matrices for the QuaRot-style baseline (Ashkboos et al. 2024) used next to FlatQuant.

``hadamard_matrix(n)`` builds an n×n ±1 matrix with ``H Hᵀ = n I`` as a Kronecker product of a
Sylvester power of two and Paley-I blocks of order q + 1 (q prime, q ≡ 3 mod 4: 12, 20, 24, 44,
48, 60, ...). Orders that cannot be built this way (and every n that is not 1, 2 or a multiple
of 4 — no Hadamard matrix exists, e.g. 9 attention heads) raise ``ValueError`` naming n.
``random_hadamard(n, key)`` is QuaRot's randomised Hadamard ``H diag(±1) / sqrt(n)`` (orthogonal).
"""

from __future__ import annotations

import functools

import numpy as np


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    i = 2
    while i * i <= q:
        if q % i == 0:
            return False
        i += 1
    return True


def _paley1(q: int) -> np.ndarray:
    """Paley construction I: order q + 1 for a prime q ≡ 3 (mod 4)."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = np.array([0] + [1 if a in residues else -1 for a in range(1, q)])
    Q = np.array([[chi[(j - i) % q] for j in range(q)] for i in range(q)])  # skew (q ≡ 3 mod 4)
    S = np.zeros((q + 1, q + 1), dtype=np.int64)
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = Q
    return S + np.eye(q + 1, dtype=np.int64)


def _sylvester(k: int) -> np.ndarray:
    H = np.ones((1, 1), dtype=np.int64)
    for _ in range(k):
        H = np.block([[H, H], [H, -H]])
    return H


@functools.lru_cache(maxsize=None)
def _paley_orders(limit: int = 1024) -> tuple[int, ...]:
    return tuple(q + 1 for q in range(3, limit) if _is_prime(q) and q % 4 == 3)


def _decompose(n: int, depth: int = 0):
    """n = 2^k · Π (Paley orders); returns the list of Paley orders or None."""
    if n & (n - 1) == 0:
        return []
    if depth > 3:
        return None
    for p in _paley_orders():
        if p > n:
            break
        if n % p == 0:
            rest = _decompose(n // p, depth + 1)
            if rest is not None:
                return [p] + rest
    return None


@functools.lru_cache(maxsize=64)
def hadamard_matrix(n: int) -> np.ndarray:
    """±1 Hadamard matrix of order n (int64), ``H @ H.T == n * I``."""
    if n < 1 or (n > 2 and n % 4):
        raise ValueError(
            f"hadamard_matrix: no Hadamard matrix of order {n} exists "
            "(orders are 1, 2 or multiples of 4)"
        )
    parts = _decompose(n)
    if parts is None:
        raise ValueError(
            f"hadamard_matrix: order {n} is not 2^k times a product of Paley-I orders; "
            "not supported"
        )
    H = np.ones((1, 1), dtype=np.int64)
    for p in parts:
        H = np.kron(H, _paley1(p - 1))
    k = int(round(np.log2(n // H.shape[0])))
    return np.kron(H, _sylvester(k))


def has_hadamard(n: int) -> bool:
    try:
        hadamard_matrix(n)
        return True
    except ValueError:
        return False


def random_hadamard(n: int, seed: int = 0) -> np.ndarray:
    """QuaRot's randomised Hadamard: ``H · diag(s) / sqrt(n)`` with random signs s (float64,
    orthogonal)."""
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=n)
    return hadamard_matrix(n).astype(np.float64) * signs[None, :] / np.sqrt(n)
