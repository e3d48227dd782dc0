"""Small helpers shared by every kernel family in ``ops/`` (and by host-side shape code).

``default_interpret()`` is the one place that decides when Pallas kernels run in interpret mode
(on the CPU backend, where nothing else is possible); shapes are padded with ``pad_axis`` to
multiples given by ``round_up`` / ``next_pow2``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    """``x`` padded with ``value`` at the end of ``axis`` up to ``size`` (no copy when already there)."""
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


__all__ = ["default_interpret", "round_up", "next_pow2", "pad_axis"]
