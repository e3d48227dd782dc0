"""The FP4 training GEMM ``y = x @ w`` with its backward (Wang et al., ICML 2025, §3 and the
released Megatron integration of Azure/MS-AMP and the first author's fork).

Forward (``fp4_dot``): activations quantized per token, weights per output channel (rows of
``w.T``), both by the fused quantizer (``ops.quant.fp4_kernel``); the GEMM runs on the grid values
with f32 accumulation and the two dequant scales in the epilogue (exact: E2M1 × E2M1 products
are multiples of 1/4 up to 36). With OCC the sparse residual is added in high precision, as the
paper writes it: ``y = Q(Y_c)·Q(W) + ΔY·W`` (ΔY densely masked, W the master weight).

Backward, as the integration does: the saved FP4-valued operands, the output gradient in FP8
E5M2 (per-tensor power-of-two scale). Each GEMM keeps FP8 operands by folding the other operand's
per-row scale into the gradient before its E5M2 cast (for power-of-two scales this is the same
as casting the gradient once):
``dx = E5M2(g·s_w) · q_w`` (straight-through for the activation quantizer, clamp included),
``dW = q_xᵀ · E5M2(g·s_x)``, times ``f'(W·sf)`` with DGE (1 with STE), plus ``ΔYᵀ·g`` with OCC.
Operands are ``float8_e4m3fn`` / ``float8_e5m2`` on GPU (cuBLASLt FP8 GEMMs); elsewhere they are
cast to bf16 first (exact, and the fast GEMM on XLA:CPU; TPUs before v7 have no FP8 MXU path).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from pallasite.ops import dispatch
from pallasite.ops.quant import fp4
from pallasite.ops.quant.fp4_kernel import quantize_rows, resolve_impl

W_GRADS = ("dge", "ste")
GEMM_DTYPES = ("auto", "float8", "bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class FP4GemmSpec:
    """Static description of one FP4 GEMM (hashable: a ``custom_vjp`` non-differentiable arg)."""

    w_fmt: str = "e2m1"  # e2m1 (FP4) | e4m3 (FP8, for W8A4)
    a_fmt: str = "e2m1"
    scale: str = "exact"  # exact (paper) | pow2 (released code)
    w_grad: str = "dge"  # dge | ste (DGE applies to E2M1 weights only)
    dge_k: float = 5.0
    dge_clamp: float = 3.0
    occ_alpha: Optional[float] = 0.99  # None: no outlier clamping / compensation
    grad_e5m2: bool = True  # output gradient in FP8 E5M2 (False: float32, for tests/ablations)
    impl: str = "auto"  # quantizer: auto | ref | pallas
    select: str = "auto"  # OCC threshold in the reference: auto | top_k | bisect
    gemm_dtype: str = "auto"  # operands of the GEMMs: auto (float8 on GPU, else bfloat16) | ...

    def __post_init__(self):
        fp4.check_format(self.w_fmt, self.scale)
        fp4.check_format(self.a_fmt, self.scale)
        if self.w_grad not in W_GRADS:
            raise ValueError(f"FP4GemmSpec.w_grad={self.w_grad!r}; expected one of {W_GRADS}")
        if self.gemm_dtype not in GEMM_DTYPES:
            raise ValueError(
                f"FP4GemmSpec.gemm_dtype={self.gemm_dtype!r}; expected one of {GEMM_DTYPES}"
            )
        resolve_impl(self.impl)


def operand_dtype(spec: FP4GemmSpec):
    kind = spec.gemm_dtype
    if kind == "auto":
        kind = "float8" if dispatch.platform() == "gpu" else "bfloat16"
    return None if kind == "float8" else jnp.dtype(kind)


def _dot(a, b, dims, cast):
    """dot_general with f32 accumulation; ``cast`` None keeps the FP8 operands as they are."""
    if cast is not None:
        a, b = a.astype(cast), b.astype(cast)
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)


def _quantize(x_NK, w_KM, spec):
    ax = quantize_rows(
        x_NK,
        fmt=spec.a_fmt,
        scale=spec.scale,
        occ_alpha=spec.occ_alpha,
        select=spec.select,
        impl=spec.impl,
    )
    aw = quantize_rows(
        w_KM.T, fmt=spec.w_fmt, scale=spec.scale, impl=spec.impl
    )  # per output channel
    return ax, aw


def _forward(x_NK, w_KM, spec):
    ax, aw = _quantize(x_NK, w_KM, spec)
    cast = operand_dtype(spec)
    y = _dot(ax.q, aw.q, ((1,), (1,)), cast) * ax.dequant * aw.dequant[:, 0][None, :]
    if ax.residual is not None:  # the compensation term in high precision (compute dtype)
        y = y + _dot(ax.residual, w_KM.astype(ax.residual.dtype), ((1,), (0,)), None)
    return y.astype(x_NK.dtype), (ax, aw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def fp4_dot(x_NK: jax.Array, w_KM: jax.Array, spec: FP4GemmSpec) -> jax.Array:
    """``x [N, K] @ w [K, M]`` with FP4 (or FP8) operands and the FP4-training backward."""
    return _forward(x_NK, w_KM, spec)[0]


def _fwd(x_NK, w_KM, spec):
    y, (ax, aw) = _forward(x_NK, w_KM, spec)
    return y, (ax.q, ax.dequant, ax.residual, aw.q, aw.dequant, w_KM, jnp.zeros((), x_NK.dtype))


def _grad_operand(g32, spec):
    """(gradient operand, its dequant scale): E5M2 with a per-tensor scale, or float32 as is."""
    if spec.grad_e5m2:
        return fp4.quantize_e5m2(g32)
    return g32, jnp.float32(1.0)


def _bwd(spec, res, g_NM):
    qx, dx_N1, residual, qw_MK, dw_M1, w_KM, x_like = res
    cast = operand_dtype(spec)
    g32 = g_NM.astype(jnp.float32)
    # dgrad: dx[n,k] = Σ_m (g[n,m]·s_w[m]) · q_w[m,k]
    gd, sd = _grad_operand(g32 * dw_M1[:, 0][None, :], spec)
    grad_x = _dot(gd, qw_MK, ((1,), (0,)), cast if spec.grad_e5m2 else jnp.float32) * sd
    # wgrad: dW[k,m] = Σ_n q_x[n,k] · (s_x[n]·g[n,m])
    gw, sw = _grad_operand(g32 * dx_N1, spec)
    grad_w = _dot(qx, gw, ((0,), (0,)), cast if spec.grad_e5m2 else jnp.float32) * sw
    if spec.w_grad == "dge" and spec.w_fmt == "e2m1":
        sf = fp4.weight_scale(w_KM, axis=0, fmt="e2m1", scale=spec.scale)
        grad_w = grad_w * fp4.dge_derivative(
            w_KM.astype(jnp.float32) * sf, spec.dge_k, spec.dge_clamp
        )
    if residual is not None:  # d(ΔY·W)/dW in high precision
        grad_w = grad_w + _dot(residual, g_NM.astype(residual.dtype), ((0,), (0,)), None)
    return grad_x.astype(x_like.dtype), grad_w.astype(w_KM.dtype)


fp4_dot.defvjp(_fwd, _bwd)


def fp4_matmul(x: jax.Array, w_KM: jax.Array, spec: FP4GemmSpec) -> jax.Array:
    """``fp4_dot`` over any leading axes of ``x [..., K]``."""
    lead = x.shape[:-1]
    y = fp4_dot(x.reshape(-1, x.shape[-1]), w_KM, spec)
    return y.reshape(*lead, w_KM.shape[1])


__all__ = ["FP4GemmSpec", "fp4_dot", "fp4_matmul", "operand_dtype", "W_GRADS", "GEMM_DTYPES"]
