"""FP4 (E2M1) quantizers for FP4 training: Wang et al., "Optimizing Large Language Model Training
Using FP4 Quantization" (ICML 2025; official code Azure/MS-AMP ``msamp/operators/fp4_quantize``).

* E2M1 grid {0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6}: nearest value by a comparison chain with strict
  ``<`` at the midpoints (the official CUDA LUT), so ties go toward +inf (0.25 -> 0.5,
  -0.25 -> 0) and |x| > 6 saturates. ``jnp.float4_e2m1fn`` casts round ties to even: not used.
* Vector-wise absmax scale per row of the last axis (activations: per token; weights: rows of
  ``kernel.T``, i.e. per output channel of ``y = x @ kernel``): ``x_q = Q(x·sf)/sf``.
  ``scale="exact"`` (default): the paper's ``sf = 6/amax``; ``"pow2"``: the released code's
  ``sf = 2^floor(log2(6/amax))`` (its unit-test golden values need it). The default uses the full
  grid (lower error, measured in docs/fp4.md); the GEMM applies 1/sf in f32 either way.
* OCC (paper §3.2): each row is clamped at ±t with t the (n+1)-th largest |x|, n = round(2(1−α)K)
  — the paper's two-sided α/1−α quantile clamp, symmetric (≈2% clamped at α = 0.99) — found by
  ``lax.top_k`` or by an exact bisection on the float bits (same value; 10x faster on XLA:CPU,
  where top_k is a sort); the residual ``ΔY = Y − Y_c`` is returned densely masked.
* DGE (paper §3.1, App. C): backward ``∂L/∂W = ∂L/∂W_q ⊙ f'(W·sf)``,
  ``f'(x) = (1/k)|2x'/δ − 1|^(1/k − 1)`` on 14 left-anchored intervals (δ 0.5/1/2), clamped at 3.
* 8-bit mode (``fmt="e4m3"``, for W8A4/W4A8): the same scales with 448 as the maximum, FP8 cast
  (round to nearest even). Gradients: E5M2 with a per-tensor power-of-two scale (MS-AMP).
Deviations: scales and f' are computed in f32 (official: bf16 inputs).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

E2M1_GRID = (-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_GRID[:-1], E2M1_GRID[1:]))
FMT_MAX = {"e2m1": 6.0, "e4m3": 448.0}
E5M2_MAX = 57344.0
SCALE_KINDS = ("exact", "pow2")
SELECTS = ("auto", "top_k", "bisect")
# DGE intervals [a, a + δ): left edges and widths over the E2M1 range
DGE_LEFT = (-6.0, -4.0, -3.0, -2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0)
DGE_DELTA = (2.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0)


def check_format(fmt: str, scale: str) -> None:
    if fmt not in FMT_MAX:
        raise ValueError(f"fp4 quantizer: fmt={fmt!r}; expected one of {tuple(FMT_MAX)}")
    if scale not in SCALE_KINDS:
        raise ValueError(f"fp4 quantizer: scale={scale!r}; expected one of {SCALE_KINDS}")


# ----------------------------------------------------------------------------- element rounding
def round_e2m1(v: jax.Array) -> jax.Array:
    """Nearest E2M1 value of already-scaled ``v`` (float32), ties toward +inf, saturating at ±6."""
    v = v.astype(jnp.float32)
    q = jnp.full(v.shape, E2M1_GRID[0], jnp.float32)
    for lo, hi, mid in zip(E2M1_GRID[:-1], E2M1_GRID[1:], E2M1_MIDPOINTS):
        q = q + jnp.where(v >= mid, jnp.float32(hi - lo), jnp.float32(0.0))
    return q


def round_e4m3(v: jax.Array) -> jax.Array:
    """Saturating FP8 E4M3 cast (round to nearest even) of already-scaled ``v``, back in float32."""
    v = jnp.clip(v.astype(jnp.float32), -FMT_MAX["e4m3"], FMT_MAX["e4m3"])
    return v.astype(jnp.float8_e4m3fn).astype(jnp.float32)


def round_to(fmt: str, v: jax.Array) -> jax.Array:
    """Nearest value of the format (float32 result); shared by the reference and the kernels."""
    return round_e2m1(v) if fmt == "e2m1" else round_e4m3(v)


# ----------------------------------------------------------------------------- scales
def pow2_floor(r: jax.Array) -> jax.Array:
    """2^floor(log2 r) for positive float32 r, from the exponent bits (exact; kernel-friendly)."""
    bits = jax.lax.bitcast_convert_type(r.astype(jnp.float32), jnp.int32)
    expo = jnp.clip(
        (bits >> 23) & 0xFF, 1, 254
    )  # normal range: subnormal r -> 2^-126, inf -> 2^127
    return jax.lax.bitcast_convert_type(expo << 23, jnp.float32)


def scale_from_amax(amax: jax.Array, fmax: float, kind: str) -> tuple[jax.Array, jax.Array]:
    """(sf, 1/sf) mapping ``amax`` onto ``fmax``; rows with amax 0 or non-finite get sf = 1."""
    amax = amax.astype(jnp.float32)
    ok = (amax > 0) & (amax <= jnp.finfo(jnp.float32).max)  # False for 0, inf, NaN
    safe = jnp.where(ok, amax, 1.0)
    r = jnp.float32(fmax) / safe
    sf = pow2_floor(r) if kind == "pow2" else r
    sf = jnp.where(ok, sf, 1.0)
    return sf, 1.0 / sf


def dequant_scale_e5m2(amax: jax.Array) -> tuple[jax.Array, jax.Array]:
    return scale_from_amax(amax, E5M2_MAX, "pow2")


# ----------------------------------------------------------------------------- OCC threshold
def n_clamped(alpha: float, k: int) -> int:
    """Entries clamped per row of length ``k`` at quantile level ``alpha``: round(2(1−α)k) < k."""
    if not 0.5 < float(alpha) < 1.0:
        raise ValueError(f"OCC alpha={alpha!r}; expected 0.5 < alpha < 1")
    return min(int(math.floor(2.0 * (1.0 - float(alpha)) * k + 0.5)), k - 1)


def default_select() -> str:
    return "bisect" if jax.default_backend() == "cpu" else "top_k"


def kth_largest_bisect(a: jax.Array, kth: int) -> jax.Array:
    """The ``kth`` largest (1-based) of non-negative ``a`` per row, [..., 1]: bisection on the
    int32 bit pattern (monotone for non-negative floats), 31 count passes; equals lax.top_k."""
    bits = jax.lax.bitcast_convert_type(a.astype(jnp.float32), jnp.int32)
    # the carry derives from ``bits`` so it has its sharding/varying type (inside shard_map too)
    lo = jnp.zeros_like(bits[..., :1])  # count(bits >= lo) >= kth always
    hi = jnp.full_like(bits[..., :1], 0x7F800001)  # count(bits >= hi) < kth (no NaN)

    def body(_, c):
        lo, hi = c
        mid = lo + (hi - lo) // 2
        ok = jnp.sum((bits >= mid).astype(jnp.int32), axis=-1, keepdims=True) >= kth
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    lo, _ = jax.lax.fori_loop(0, 31, body, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def occ_threshold(x: jax.Array, alpha: float, select: str = "auto") -> jax.Array:
    """Per-row clamp threshold t [..., 1]: the (n+1)-th largest |x|, n = n_clamped(alpha, K)."""
    if select not in SELECTS:
        raise ValueError(f"OCC select={select!r}; expected one of {SELECTS}")
    select = default_select() if select == "auto" else select
    a = jnp.abs(x.astype(jnp.float32))
    kth = n_clamped(alpha, x.shape[-1]) + 1
    if select == "top_k":
        return jax.lax.top_k(a, kth)[0][..., kth - 1 : kth]
    return kth_largest_bisect(a, kth)


# ----------------------------------------------------------------------------- row quantizer
class RowQuant(NamedTuple):
    """Quantized rows: ``q`` grid values (``q_dtype``, E4M3 by default: exact for E2M1 values),
    ``dequant`` = 1/sf [..., 1] float32, OCC ``residual`` ΔY (x.dtype), ``threshold`` [..., 1]."""

    q: jax.Array
    dequant: jax.Array
    residual: Optional[jax.Array] = None
    threshold: Optional[jax.Array] = None

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.dequant).astype(dtype)


def quantize_block(x32: jax.Array, fmt: str, scale: str, threshold: Optional[jax.Array] = None):
    """The quantizer's arithmetic on float32 rows, shared by the reference and the Pallas kernel:
    (grid values f32, 1/sf [..., 1], OCC residual f32 or None)."""
    residual = None
    if threshold is not None:
        xc = jnp.minimum(jnp.maximum(x32, -threshold), threshold)
        residual = x32 - xc
        x32 = xc
    amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
    sf, inv = scale_from_amax(amax, FMT_MAX[fmt], scale)
    return round_to(fmt, x32 * sf), inv, residual


def quantize_rows_ref(
    x: jax.Array,
    *,
    fmt: str = "e2m1",
    scale: str = "exact",
    occ_alpha: Optional[float] = None,
    select: str = "auto",
    q_dtype=jnp.float8_e4m3fn,
) -> RowQuant:
    """jnp reference of the fused quantizer: (OCC clamp ->) row absmax -> scale -> rounding."""
    check_format(fmt, scale)
    x32 = x.astype(jnp.float32)
    threshold = None if occ_alpha is None else occ_threshold(x32, occ_alpha, select)
    q, inv, residual = quantize_block(x32, fmt, scale, threshold)
    residual = None if residual is None else residual.astype(x.dtype)
    return RowQuant(q.astype(q_dtype), inv, residual, threshold)


def fake_quant_rows(x: jax.Array, **kw) -> jax.Array:
    """Q(x) dequantized (plus the OCC residual when ``occ_alpha`` is given), in x.dtype."""
    rq = quantize_rows_ref(x, **kw)
    y = rq.dequantize()
    if rq.residual is not None:
        y = y + rq.residual.astype(jnp.float32)
    return y.astype(x.dtype)


# ----------------------------------------------------------------------------- DGE
def dge_derivative(x_scaled: jax.Array, k: float = 5.0, clamp: float = 3.0) -> jax.Array:
    """f'(x) of the differentiable E2M1 estimator at scaled values (float32): per interval
    [a, a+δ), ``(1/k)|2(x−a)/δ − 1|^(1/k − 1)`` clamped at ``clamp``; 0 above 6 (official CUDA)."""
    x = x_scaled.astype(jnp.float32)
    a = jnp.full(x.shape, DGE_LEFT[0], jnp.float32)
    d = jnp.full(x.shape, DGE_DELTA[0], jnp.float32)
    for left, delta in zip(DGE_LEFT[1:], DGE_DELTA[1:]):
        inside = x >= left
        a = jnp.where(inside, jnp.float32(left), a)
        d = jnp.where(inside, jnp.float32(delta), d)
    u = jnp.abs(2.0 * (x - a) / d - 1.0)
    # u == 0 (interval midpoint) -> inf -> clamp; pow(0, negative) is inf in XLA
    fp = jnp.minimum(jnp.power(u, 1.0 / k - 1.0) / k, clamp)
    return jnp.where(x > 6.0, 0.0, fp)


def _rows_view(w: jax.Array, axis: int):
    """``w`` with the reduction axis last (per output channel of a [in, out] kernel: axis 0)."""
    return jnp.moveaxis(w, axis, -1)


def weight_scale(
    w: jax.Array, *, axis: int = 0, fmt: str = "e2m1", scale: str = "exact"
) -> jax.Array:
    """sf per vector of ``w`` along ``axis`` (keepdims), as the quantizer computes it."""
    amax = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=axis, keepdims=True)
    return scale_from_amax(amax, FMT_MAX[fmt], scale)[0]


def weight_quant(w: jax.Array, *, axis: int = 0, fmt: str = "e2m1", scale: str = "exact"):
    """(W_q dequantized in w.dtype, W·sf float32): per-vector absmax over ``axis``."""
    rq = quantize_rows_ref(_rows_view(w, axis), fmt=fmt, scale=scale)
    w_q = jnp.moveaxis(rq.dequantize(), -1, axis).astype(w.dtype)
    return w_q, w.astype(jnp.float32) * weight_scale(w, axis=axis, fmt=fmt, scale=scale)


def dge_quantize(
    w: jax.Array, *, axis: int = 0, scale: str = "exact", k: float = 5.0, clamp: float = 3.0
) -> jax.Array:
    """E2M1 weight fake-quantizer with the DGE backward: ``dW = dW_q ⊙ f'(W·sf)`` (sf constant)."""
    return _dge_quantize(w, axis, scale, float(k), float(clamp))


def _dge_impl(w, axis, scale, k, clamp):
    w_q, w_scaled = weight_quant(w, axis=axis, fmt="e2m1", scale=scale)
    return w_q, dge_derivative(w_scaled, k, clamp)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _dge_quantize(w, axis, scale, k, clamp):
    return _dge_impl(w, axis, scale, k, clamp)[0]


def _dge_fwd(w, axis, scale, k, clamp):
    return _dge_impl(w, axis, scale, k, clamp)


def _dge_bwd(axis, scale, k, clamp, fp, g):
    return ((g.astype(jnp.float32) * fp).astype(g.dtype),)


_dge_quantize.defvjp(_dge_fwd, _dge_bwd)


def ste_quantize(x: jax.Array, **kw) -> jax.Array:
    """Fake-quantized rows with a straight-through (identity) gradient."""
    return x + jax.lax.stop_gradient(fake_quant_rows(x, **kw) - x)


# ----------------------------------------------------------------------------- E5M2 gradients
def quantize_e5m2(g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(float8_e5m2 values, dequant scalar): per-tensor power-of-two absmax scale (MS-AMP's
    ``compute_scaling_factor`` with the E5M2 maximum), saturating cast, round to nearest even."""
    g32 = g.astype(jnp.float32)
    sf, inv = dequant_scale_e5m2(jnp.max(jnp.abs(g32)))
    g8 = jnp.clip(g32 * sf, -E5M2_MAX, E5M2_MAX).astype(jnp.float8_e5m2)
    return g8, inv


__all__ = [
    "E2M1_GRID",
    "E2M1_MIDPOINTS",
    "FMT_MAX",
    "E5M2_MAX",
    "SCALE_KINDS",
    "SELECTS",
    "RowQuant",
    "round_e2m1",
    "round_e4m3",
    "round_to",
    "pow2_floor",
    "scale_from_amax",
    "n_clamped",
    "occ_threshold",
    "kth_largest_bisect",
    "default_select",
    "quantize_block",
    "quantize_rows_ref",
    "fake_quant_rows",
    "dge_derivative",
    "weight_scale",
    "weight_quant",
    "dge_quantize",
    "ste_quantize",
    "quantize_e5m2",
    "check_format",
]
