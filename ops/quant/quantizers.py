"""Integer quantizers used by FlatQuant W4A4KV4 (Sun et al., ICML 2025) and its baselines.

Conventions follow the official code (ruikangliu/FlatQuant, ``flatquant/quant_utils.py``):

* **Weights** — symmetric, per output channel, ``b`` bits: ``qmax = 2^(b-1) - 1`` (7 for 4 bits),
  range ``[-qmax-1, qmax] = [-8, 7]``, ``scale = max(|min(w)|, max(w)) / qmax`` over the input
  dimension, clamped at >= 1e-5. Our kernels are ``[in, out]`` (HF stores ``[out, in]``), so
  "per output channel" is a reduction over axis 0.
* **Activations** — symmetric, per token (last axis), with learnable activation clipping (LAC):
  ``xmax = max(max(x), 0) * sigmoid(a_max)``, ``xmin = min(min(x), 0) * sigmoid(a_min)``,
  ``scale = max(|xmin|, xmax) / qmax`` (rows that are all zero get scale 1). The clip logits are a
  single scalar pair per quantizer, initialised at 4 (sigmoid(4) = 0.982).
* **KV cache** — asymmetric, per token, per group of ``min(128, head_dim)`` channels of one head:
  ``scale = (xmax - xmin) / (2^b - 1)``, ``zero = round(-xmin / scale)``, ``q = clamp(round(x /
  scale) + zero, 0, 2^b - 1)``, dequant ``scale * (q - zero)``; LAC scalars as for activations.
* Rounding is round-half-to-even (``jnp.round``), like ``torch.round``.
* ``pack_int4`` stores two 4-bit values per byte, element ``2j`` in the low nibble and ``2j + 1``
  in the high nibble (the layout of the official ``pack_i4``); signed values are stored as their
  two's-complement nibble and sign-extended by ``unpack_int4``.

Fake quantizers (quantize-dequantize) use a straight-through estimator for ``round`` so the
calibration can differentiate through them (gradients reach transforms and clip logits).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

LAC_INIT = 4.0  # sigmoid logit initial value of every learnable clip (official code)
NO_CLIP_LOGIT = 30.0  # sigmoid(30) == 1.0 in float32: "no learned clipping"


def qrange_sym(bits: int) -> tuple[int, int]:
    qmax = 2 ** (bits - 1) - 1
    return -qmax - 1, qmax


def round_half_even(x: jax.Array) -> jax.Array:
    """Round to nearest, ties to even, from floor only (the kernels' rounding: Triton has no
    ``round`` lowering); identical to ``jnp.round``."""
    r = jnp.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * jnp.floor(r * 0.5)) != 0
    return jnp.where(tie & odd, r - 1.0, r)


def round_ste(x: jax.Array) -> jax.Array:
    """round(x) in the forward pass, identity gradient in the backward pass."""
    return x + jax.lax.stop_gradient(jnp.round(x) - x)


def _clip_factors(clip_logits: Optional[jax.Array], dtype) -> tuple[jax.Array, jax.Array]:
    if clip_logits is None:
        one = jnp.ones((), dtype)
        return one, one
    f = jax.nn.sigmoid(jnp.asarray(clip_logits).astype(dtype))
    return f[..., 0], f[..., 1]


# ---------------------------------------------------------- activations (symmetric, per token)
def act_scale_sym(
    x: jax.Array, clip_logits: Optional[jax.Array] = None, bits: int = 4
) -> jax.Array:
    """Per-token scale [..., 1] of the symmetric activation quantizer (with LAC when given).

    ``clip_logits`` is ``[2]`` = (max logit, min logit)."""
    _, qmax = qrange_sym(bits)
    cmax, cmin = _clip_factors(clip_logits, x.dtype)
    xmax = jnp.maximum(jnp.max(x, axis=-1, keepdims=True), 0) * cmax
    xmin = jnp.minimum(jnp.min(x, axis=-1, keepdims=True), 0) * cmin
    amax = jnp.maximum(jnp.abs(xmin), xmax)
    return jnp.where(amax == 0, jnp.ones_like(amax), amax / qmax)


def quantize_act_sym(x: jax.Array, clip_logits: Optional[jax.Array] = None, bits: int = 4):
    """(q int8 in [-2^(b-1), 2^(b-1)-1], scale float [..., 1]) — per-token symmetric."""
    qmin, qmax = qrange_sym(bits)
    scale = act_scale_sym(x, clip_logits, bits)
    q = jnp.clip(jnp.round(x / scale), qmin, qmax).astype(jnp.int8)
    return q, scale


def fake_quant_act_sym(
    x: jax.Array, clip_logits: Optional[jax.Array] = None, bits: int = 4
) -> jax.Array:
    """Quantize-dequantize with STE (differentiable in x and the clip logits)."""
    if bits >= 16:
        return x
    qmin, qmax = qrange_sym(bits)
    scale = act_scale_sym(x, clip_logits, bits)
    return jnp.clip(round_ste(x / scale), qmin, qmax) * scale


# ---------------------------------------------------- weights (symmetric, per output channel)
def weight_clip(w_IO: jax.Array, clip_logits_O2: Optional[jax.Array]) -> jax.Array:
    """Learnable weight clipping (LWC): clamp column o of ``w[in, out]`` to
    ``[min_o * sigmoid(θmin_o), max_o * sigmoid(θmax_o)]``; ``clip_logits_O2[o] = (θmax, θmin)``."""
    if clip_logits_O2 is None:
        return w_IO
    f = jax.nn.sigmoid(clip_logits_O2.astype(w_IO.dtype))
    wmax = jnp.max(w_IO, axis=0) * f[:, 0]
    wmin = jnp.min(w_IO, axis=0) * f[:, 1]
    return jnp.clip(w_IO, wmin, wmax)


def weight_scale_sym(w_IO: jax.Array, bits: int = 4) -> jax.Array:
    """Per-output-channel scale [out]: max(|min|, max) / qmax over the input axis, >= 1e-5/qmax."""
    _, qmax = qrange_sym(bits)
    zero = jnp.zeros((), w_IO.dtype)
    wmax = jnp.maximum(jnp.max(w_IO, axis=0), zero)
    wmin = jnp.minimum(jnp.min(w_IO, axis=0), zero)
    return jnp.maximum(jnp.maximum(jnp.abs(wmin), wmax), 1e-5) / qmax


def quantize_weight_sym(w_IO: jax.Array, bits: int = 4, scale_O: Optional[jax.Array] = None):
    """RTN: (q int8 [in, out], scale [out])."""
    qmin, qmax = qrange_sym(bits)
    scale = weight_scale_sym(w_IO, bits) if scale_O is None else scale_O
    q = jnp.clip(jnp.round(w_IO / scale), qmin, qmax).astype(jnp.int8)
    return q, scale


def fake_quant_weight_sym(w_IO: jax.Array, bits: int = 4) -> jax.Array:
    if bits >= 16:
        return w_IO
    qmin, qmax = qrange_sym(bits)
    # The scale is a function of w; the official code recomputes it every step without detaching.
    scale = weight_scale_sym(w_IO, bits)
    return jnp.clip(round_ste(w_IO / scale), qmin, qmax) * scale


# ------------------------------------------------------------ KV cache (asymmetric, per group)
def kv_group_size(head_dim: int, group: int = 128) -> int:
    g = min(group, head_dim)
    if head_dim % g:
        raise ValueError(
            f"KV quantization: head_dim={head_dim} is not a multiple of the group size {g}"
        )
    return g


def quantize_kv_asym(
    x: jax.Array, clip_logits: Optional[jax.Array] = None, bits: int = 4, group: int = 128
):
    """x [..., Dh] → (q uint8 [..., Dh] in [0, 2^b-1], scale [..., G], zero [..., G] (integer-valued
    float)), G = Dh / group. The zero point is an integer in [0, 2^b - 1] as xmin <= 0 <= xmax."""
    qmax = 2**bits - 1
    Dh = x.shape[-1]
    g = kv_group_size(Dh, group)
    xg = x.reshape(*x.shape[:-1], Dh // g, g)
    scale, zero = _kv_scale_zero(xg, clip_logits, qmax)
    q = jnp.clip(jnp.round(xg / scale) + zero, 0, qmax).astype(jnp.uint8)
    return q.reshape(x.shape), scale[..., 0], zero[..., 0]


def _kv_scale_zero(xg, clip_logits, qmax):
    cmax, cmin = _clip_factors(clip_logits, xg.dtype)
    xmax = jnp.maximum(jnp.max(xg, axis=-1, keepdims=True), 0) * cmax
    xmin = jnp.minimum(jnp.min(xg, axis=-1, keepdims=True), 0) * cmin
    both_zero = (xmax == 0) & (xmin == 0)
    xmin = jnp.where(both_zero, -1.0, xmin)
    xmax = jnp.where(both_zero, 1.0, xmax)
    scale = (xmax - xmin) / qmax
    zero = jnp.round(-xmin / scale)
    return scale, zero


def dequantize_kv_asym(
    q: jax.Array, scale: jax.Array, zero: jax.Array, group: int = 128, dtype=jnp.float32
):
    Dh = q.shape[-1]
    g = kv_group_size(Dh, group)
    qg = q.reshape(*q.shape[:-1], Dh // g, g).astype(dtype)
    out = (qg - zero[..., None].astype(dtype)) * scale[..., None].astype(dtype)
    return out.reshape(q.shape)


def fake_quant_kv_asym(
    x: jax.Array, clip_logits: Optional[jax.Array] = None, bits: int = 4, group: int = 128
):
    if bits >= 16:
        return x
    qmax = 2**bits - 1
    Dh = x.shape[-1]
    g = kv_group_size(Dh, group)
    xg = x.reshape(*x.shape[:-1], Dh // g, g)
    scale, zero = _kv_scale_zero(xg, clip_logits, qmax)
    zero = jax.lax.stop_gradient(zero)  # integer zero point; scale keeps its gradient like torch's
    q = jnp.clip(round_ste(xg / scale) + zero, 0, qmax)
    return ((q - zero) * scale).reshape(x.shape)


# ------------------------------------------------------------------ int4 packing
def pack_int4(q: jax.Array) -> jax.Array:
    """int values in [-8, 7] (or [0, 15]) [..., 2n] → uint8 [..., n]; low nibble = even element."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4: the last axis must be even, got shape {q.shape}")
    q32 = q.astype(jnp.int32) & 0xF
    lo, hi = q32[..., 0::2], q32[..., 1::2]
    return (lo | (hi << 4)).astype(jnp.uint8)


def unpack_int4(p: jax.Array, signed: bool = True) -> jax.Array:
    """Inverse of ``pack_int4``: uint8 [..., n] → int8 [..., 2n] (sign-extended when ``signed``)."""
    lo, hi = unpack_int4_halves(p, signed)
    return jnp.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], 2 * p.shape[-1]).astype(jnp.int8)


def unpack_int4_halves(p: jax.Array, signed: bool = True) -> tuple[jax.Array, jax.Array]:
    """(even elements, odd elements) as int32 — the layout the kernels consume as it is."""
    p32 = p.astype(jnp.int32) & 0xFF
    lo, hi = p32 & 0xF, (p32 >> 4) & 0xF
    if signed:  # sign-extend a 4-bit two's-complement nibble
        lo, hi = (lo ^ 8) - 8, (hi ^ 8) - 8
    return lo, hi
