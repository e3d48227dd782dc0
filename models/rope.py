"""Rotary position embeddings (Su et al. 2021) in the Hugging Face "rotate_half" layout.

Supported ``rope_scaling`` types: ``default`` (none), ``linear`` (position interpolation) and
``llama3`` (Llama 3.1 frequency-dependent scaling, transformers' ``_compute_llama3_parameters``).
Any other type fails loudly rather than silently computing unscaled frequencies.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


def inv_frequencies(head_dim: int, theta: float, scaling: Optional[dict] = None) -> np.ndarray:
    """[head_dim // 2] float64 inverse frequencies, with optional scaling applied."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported; expected default | linear | llama3")


def rope_cos_sin(positions_BT: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, head_dim] (frequencies repeated over the two halves)."""
    freqs = positions_BT.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x_BTHD: jax.Array, cos_BTD: jax.Array, sin_BTD: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin, computed in float32, returned in x's dtype."""
    x = x_BTHD.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x * cos_BTD[:, :, None, :] + rotated * sin_BTD[:, :, None, :]
    return out.astype(x_BTHD.dtype)
