"""Adam with low-precision moments (FP8-LM, Peng et al. 2023; the mixed precision that Wang et al.,
"Optimizing Large Language Model Training Using FP4 Quantization", ICML 2025, train with): the
first moment stored in FP8 E4M3, the second in FP16, each with one scale per tensor.

Per step, per tensor: dequantize ``m = m_q · s_m``, ``v = v_q · s_v``; update
``m ← β1·m + (1−β1)·g``, ``v ← β2·v + (1−β2)·g²``; emit the bias-corrected Adam direction
``m̂ / (√v̂ + ε)`` from the float32 values; store again with the power-of-two scale of the new
values' amax, ``s = 2^-floor(log2(FMT_MAX / amax))`` (E4M3 448, FP16 65504; the released MS-AMP
``LBAdamW``: in-time amax, ``compute_scaling_factor`` with margin 0), so the largest entry lands
within a factor 2 of the format's largest value and the small ones keep the format's relative
precision down to its underflow (E4M3: ~2^-17 of the amax). Casts round to nearest even. 8 bytes
of moments per parameter become 3 (plus two scalars per tensor). ``moments="float32"`` keeps
optax's own ``adamw`` (``optim.py``). Deviation: MS-AMP's ``exp_avg`` is E4M3 stored as uint8
bits and its kernel fuses the update; here XLA fuses the jnp ops.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

MOMENT_FORMATS = {"fp8": (jnp.float8_e4m3fn, jnp.float16)}
FMT_MAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.float16): 65504.0}


class ScaledTensor(NamedTuple):
    """``values · scale`` in float32: low-precision values and one float32 scale."""

    values: jax.Array
    scale: jax.Array  # float32 scalar


def scale_for(x: jax.Array, dtype) -> jax.Array:
    """The per-tensor dequant scale ``2^-floor(log2(FMT_MAX / amax))`` (1 for zeros): a power of two,
    so ``x / scale`` is exact and only the cast rounds; ``amax / scale <= FMT_MAX``."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32) if x.size else jnp.float32(0)
    exp = jnp.floor(jnp.log2(FMT_MAX[jnp.dtype(dtype)] / jnp.where(amax > 0, amax, 1.0)))
    # ldexp, not exp2: XLA:CPU's exp2 of an integer is not always the exact power of two
    return jnp.where(amax > 0, jnp.ldexp(jnp.float32(1.0), (-exp).astype(jnp.int32)), 1.0).astype(jnp.float32)


def store(x: jax.Array, dtype) -> ScaledTensor:
    """``x`` in ``dtype`` with its per-tensor scale."""
    scale = scale_for(x, dtype)
    return ScaledTensor((x / scale).astype(dtype), scale)


def load(t: ScaledTensor) -> jax.Array:
    return t.values.astype(jnp.float32) * t.scale


class ScaleByLowPrecisionAdamState(NamedTuple):
    """Values and scales in separate trees shaped like the parameters (each leaf one array, so
    the sharding rules and checkpoints treat them as they treat optax's own moments)."""

    count: jax.Array
    mu: optax.Updates  # mu_dtype values
    mu_scale: optax.Updates  # float32 scalars
    nu: optax.Updates
    nu_scale: optax.Updates


def scale_by_adam_low_precision(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                                moments: str = "fp8") -> optax.GradientTransformation:
    """``optax.scale_by_adam`` with the moments stored as ``MOMENT_FORMATS[moments]``."""
    if moments not in MOMENT_FORMATS:
        raise ValueError(f"moments={moments!r}; expected float32 or one of {sorted(MOMENT_FORMATS)}")
    mu_dtype, nu_dtype = MOMENT_FORMATS[moments]
    f32 = jnp.float32

    def init_fn(params):
        return ScaleByLowPrecisionAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params),
            mu_scale=jax.tree.map(lambda p: jnp.ones([], f32), params),
            nu=jax.tree.map(lambda p: jnp.zeros(p.shape, nu_dtype), params),
            nu_scale=jax.tree.map(lambda p: jnp.ones([], f32), params),
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_int32_increment(state.count)
        c = count.astype(f32)
        mu = jax.tree.map(lambda g, v, s: b1 * (v.astype(f32) * s) + (1.0 - b1) * g.astype(f32),
                          updates, state.mu, state.mu_scale)
        nu = jax.tree.map(lambda g, v, s: b2 * (v.astype(f32) * s) + (1.0 - b2) * jnp.square(g.astype(f32)),
                          updates, state.nu, state.nu_scale)
        direction = jax.tree.map(
            lambda m, n, g: ((m / (1.0 - b1**c)) / (jnp.sqrt(n / (1.0 - b2**c)) + eps)).astype(g.dtype),
            mu, nu, updates)
        mu_scale = jax.tree.map(lambda m: scale_for(m, mu_dtype), mu)
        nu_scale = jax.tree.map(lambda n: scale_for(n, nu_dtype), nu)
        return direction, ScaleByLowPrecisionAdamState(
            count=count,
            mu=jax.tree.map(lambda m, s: (m / s).astype(mu_dtype), mu, mu_scale),
            mu_scale=mu_scale,
            nu=jax.tree.map(lambda n, s: (n / s).astype(nu_dtype), nu, nu_scale),
            nu_scale=nu_scale,
        )

    return optax.GradientTransformation(init_fn, update_fn)


def adamw_low_precision(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                        weight_decay: float = 1e-4, mask=None, moments: str = "fp8"):
    """``optax.adamw`` (same chain: Adam direction, decoupled decay, -lr) with low-precision moments."""
    return optax.chain(
        scale_by_adam_low_precision(b1, b2, eps, moments),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )


__all__ = ["MOMENT_FORMATS", "ScaledTensor", "scale_for", "store", "load", "scale_by_adam_low_precision",
           "adamw_low_precision"]
