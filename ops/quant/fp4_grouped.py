"""The FP4 training GEMM over expert groups: ``fp4_gmm(x [M, K], w [G, K, N], group_sizes [G])``
is ``ops.gmm.gmm`` with the operands and the backward of ``ops.quant.fp4_gemm.fp4_dot`` — rows of
group g use expert g's weights, each expert's weights are quantized per output channel, each
row (token) per row, OCC on the rows, E5M2 output gradients, DGE on the weight gradient.

Rows past ``sum(group_sizes)`` give zeros (as ``gmm``). The grouped GEMMs run through
``ops.gmm.gmm`` (``gmm_impl``) on the grid values cast to float32 (exact; ``gmm`` has no FP8 or
f32-accumulating bf16 path yet, so this is a simulation on every backend); the per-(expert,
channel) weight scale is gathered per row in the epilogue (dgrad folds it into the gradient
operand, as ``fp4_dot``); the weight gradient is the transpose of ``gmm`` in its rhs
(``jax.vjp``), i.e. ``tgmm`` of the impl.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallasite.ops.gmm import gmm
from pallasite.ops.quant import fp4
from pallasite.ops.quant.fp4_gemm import FP4GemmSpec
from pallasite.ops.quant.fp4_kernel import quantize_rows


def _row_groups(group_sizes_G, M):
    """Group of each row [M] and whether the row is inside some group."""
    ends = jnp.cumsum(group_sizes_G)
    g = jnp.searchsorted(ends, jnp.arange(M), side="right")
    return jnp.minimum(g, group_sizes_G.shape[0] - 1), jnp.arange(M) < ends[-1]


def _cast(a, dtype):
    return a if dtype is None else a.astype(dtype)


def _forward(x_MK, w_GKN, group_sizes_G, spec, gmm_impl):
    G, K, N = w_GKN.shape
    ax = quantize_rows(
        x_MK,
        fmt=spec.a_fmt,
        scale=spec.scale,
        occ_alpha=spec.occ_alpha,
        select=spec.select,
        impl=spec.impl,
    )
    aw = quantize_rows(
        jnp.swapaxes(w_GKN, 1, 2), fmt=spec.w_fmt, scale=spec.scale, impl=spec.impl
    )  # [G, N, K]
    qw_GKN = jnp.swapaxes(aw.q, 1, 2)
    sw_GN = aw.dequant[..., 0]
    row_g, valid = _row_groups(group_sizes_G, x_MK.shape[0])
    cast = (
        jnp.float32
    )  # grid values are exact in f32; ops.gmm has no FP8 / f32-accumulating bf16 path
    y = gmm(_cast(ax.q, cast), _cast(qw_GKN, cast), group_sizes_G, impl=gmm_impl).astype(
        jnp.float32
    )
    y = y * ax.dequant * sw_GN[row_g]
    if ax.residual is not None:
        y = y + gmm(
            ax.residual, w_GKN.astype(ax.residual.dtype), group_sizes_G, impl=gmm_impl
        ).astype(jnp.float32)
    y = jnp.where(valid[:, None], y, 0.0)
    return y.astype(x_MK.dtype), (ax, qw_GKN, sw_GN, row_g)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def fp4_gmm(x_MK, w_GKN, group_sizes_G, spec: FP4GemmSpec, gmm_impl: str = "ref"):
    """Grouped ``x @ w[g]`` with FP4 operands and the FP4-training backward (see module doc)."""
    return _forward(x_MK, w_GKN, group_sizes_G, spec, gmm_impl)[0]


def _fwd(x_MK, w_GKN, group_sizes_G, spec, gmm_impl):
    y, (ax, qw_GKN, sw_GN, row_g) = _forward(x_MK, w_GKN, group_sizes_G, spec, gmm_impl)
    return y, (
        ax.q,
        ax.dequant,
        ax.residual,
        qw_GKN,
        sw_GN,
        row_g,
        w_GKN,
        group_sizes_G,
        jnp.zeros((), x_MK.dtype),
    )


def _grad_operand(g32, spec):
    return fp4.quantize_e5m2(g32) if spec.grad_e5m2 else (g32, jnp.float32(1.0))


def _bwd(spec, gmm_impl, res, g_MN):
    qx, sx, residual, qw_GKN, sw_GN, row_g, w_GKN, group_sizes_G, x_like = res
    cast = jnp.float32
    g32 = g_MN.astype(jnp.float32)
    gd, sd = _grad_operand(g32 * sw_GN[row_g], spec)
    grad_x = (
        gmm(
            _cast(gd, cast), _cast(jnp.swapaxes(qw_GKN, 1, 2), cast), group_sizes_G, impl=gmm_impl
        ).astype(jnp.float32)
        * sd
    )

    def wgrad(lhs, dout):  # Σ over the rows of each group: lhsᵀ · dout, the rhs-transpose of gmm
        zeros = jnp.zeros(w_GKN.shape, lhs.dtype)
        return jax.vjp(lambda r: gmm(lhs, r, group_sizes_G, impl=gmm_impl), zeros)[1](
            dout.astype(lhs.dtype)
        )[0]

    gw, sw = _grad_operand(g32 * sx, spec)
    grad_w = wgrad(_cast(qx, cast), _cast(gw, cast)).astype(jnp.float32) * sw
    if spec.w_grad == "dge" and spec.w_fmt == "e2m1":
        sf = fp4.weight_scale(w_GKN, axis=1, fmt="e2m1", scale=spec.scale)
        grad_w = grad_w * fp4.dge_derivative(
            w_GKN.astype(jnp.float32) * sf, spec.dge_k, spec.dge_clamp
        )
    if residual is not None:
        grad_w = grad_w + wgrad(residual, g_MN).astype(jnp.float32)
    return grad_x.astype(x_like.dtype), grad_w.astype(w_GKN.dtype), None


fp4_gmm.defvjp(_fwd, _bwd)

__all__ = ["fp4_gmm"]
