"""Small helpers shared by every kernel family in ``ops/`` (and by host-side shape code).

``default_interpret()`` says whether Pallas kernels run in interpret mode by default (on the CPU
backend, where nothing else is possible; ``ops.dispatch`` picks the variant); shapes are padded
with ``pad_axis`` to multiples given by ``round_up`` / ``next_pow2``; ``dot`` is the float32-
accumulating matmul every kernel body uses (full precision for float32 operands).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def default_interpret() -> bool:
    """Pallas kernels run in interpret mode on CPU (the only mode XLA:CPU supports)."""
    return jax.default_backend() == "cpu"


def round_up(n: int, m: int) -> int:
    """The smallest multiple of ``m`` that is >= ``n``."""
    return -(-int(n) // int(m)) * int(m)


def next_pow2(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum)."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """``x`` padded with ``value`` at the end of ``axis`` up to ``size`` (no copy when it is)."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def dot(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """[M,K] x [K,N] (a: [K,M] with ``trans_a``; b: [N,K] with ``trans_b``) -> float32. Float32
    operands ask for full precision (no TF32 on GPU, no single bf16 pass on TPU)."""
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(
        a,
        b,
        dims,
        preferred_element_type=jnp.float32,
        precision=lax.Precision.HIGHEST if exact else None,
    )


__all__ = ["default_interpret", "round_up", "next_pow2", "pad_axis", "dot"]
