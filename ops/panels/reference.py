"""The panel layout in plain jnp: ``pack`` / ``unpack`` and the reference product.

A weight ``W [K, N]`` (N a multiple of ``PANEL``) is stored as ``W.reshape(K, N/16, 16)
.transpose(1, 0, 2)`` read back as ``[K, N]``: the same shape and the same numbers, ordered so that
each 16-column panel's K rows lie contiguously in memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PANEL = 16  # columns per panel: two 8-float AVX2 vectors


def check_shape(K: int, N: int, what: str = "weight") -> None:
    if N % PANEL:
        raise ValueError(f"panel layout: the {what}'s output width {N} (shape [{K}, {N}]) is not a multiple of {PANEL}")


def pack(w_KN: jax.Array) -> jax.Array:
    """[..., K, N] in the usual layout -> [..., K, N] holding the panels (leading axes: stacked layers)."""
    *lead, K, N = w_KN.shape
    check_shape(K, N)
    return jnp.swapaxes(w_KN.reshape(*lead, K, N // PANEL, PANEL), -3, -2).reshape(*lead, K, N)


def unpack(w_packed_KN: jax.Array) -> jax.Array:
    """The inverse of ``pack``."""
    *lead, K, N = w_packed_KN.shape
    check_shape(K, N)
    return jnp.swapaxes(w_packed_KN.reshape(*lead, N // PANEL, K, PANEL), -3, -2).reshape(*lead, K, N)


def panel_matmul_reference(x_MK: jax.Array, w_packed_KN: jax.Array) -> jax.Array:
    """x @ unpack(w) in float32."""
    return jnp.dot(x_MK.astype(jnp.float32), unpack(w_packed_KN).astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
