"""TPU (Mosaic) fused Kronecker transform + per-token int4 quantize + pack (FlatQuant §3.2).

A grid step takes ``block_t`` tokens as one ``[block_t·n1p, n2p]`` tile (the wrapper's row-major
reshape of ``x [T, n1·n2]``, n1 padded to a multiple of 8). The right factor is one 2-D MXU matmul
per parity (``P2`` split into even / odd columns outside the kernel, so packing needs no lane
shuffle); the left factor ``P1ᵀ`` is a batched matmul over the tokens of the block. The per-token
absmax, clip, round-half-even, clamp and nibble packing are vector ops on the ``[block_t, n1p,
n2p/2]`` results; codes are written as ``uint8``, scales as lane-replicated ``[block_t, 128]``.
``block_t`` is a multiple of 32 (the uint8 tile).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallasite.ops.common import dot, round_up
from pallasite.ops.quant.quantizers import qrange_sym, round_half_even

DEFAULT_BLOCK_T = 32
LANES = 128


def _kernel(c_ref, x_ref, p1t_ref, p2e_ref, p2o_ref, q_ref, s_ref, *, bt, n1p, bits):
    qmin, qmax = qrange_sym(bits)
    cmax, cmin = c_ref[0], c_ref[1]
    x = x_ref[...]  # [bt * n1p, n2p]
    p1t = jnp.broadcast_to(p1t_ref[...], (bt, n1p, n1p))
    batched = (((2,), (1,)), ((0,), (0,)))  # [t, a, i] x [t, i, b] -> [t, a, b]

    def left(z):  # P1ᵀ · Z per token
        z = z.reshape(bt, n1p, z.shape[-1])
        return jax.lax.dot_general(
            p1t, z, batched, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST
        )

    ye, yo = left(dot(x, p2e_ref[...])), left(dot(x, p2o_ref[...]))  # [bt, n1p, n2p / 2] each
    row_max = lambda y: jnp.max(jnp.max(y, axis=2), axis=1, keepdims=True)  # noqa: E731  [bt, 1]
    row_min = lambda y: jnp.min(jnp.min(y, axis=2), axis=1, keepdims=True)  # noqa: E731
    xmax = jnp.maximum(jnp.maximum(row_max(ye), row_max(yo)), 0.0) * cmax
    xmin = jnp.minimum(jnp.minimum(row_min(ye), row_min(yo)), 0.0) * cmin
    amax = jnp.maximum(-xmin, xmax)
    scale = jnp.where(amax == 0, 1.0, amax / qmax)  # [bt, 1]
    scale_t = scale[:, :, None]  # [bt, 1, 1]

    def code(y):
        return jnp.clip(round_half_even(y / scale_t), qmin, qmax).astype(jnp.int32) & 0xF

    q_ref[...] = (code(ye) | (code(yo) << 4)).astype(jnp.uint8)
    s_ref[...] = jnp.broadcast_to(scale, s_ref.shape)


@functools.partial(jax.jit, static_argnames=("bits", "block_t", "interpret"))
def kron_quantize(x_TN, p1, p2, clip_factors, *, bits, block_t, interpret):
    """x [T, n1·n2] -> (uint8 [T, n/2], float32 [T]); ``clip_factors``: sigmoid(clip logits)."""
    T, N = x_TN.shape
    n1, n2 = p1.shape[0], p2.shape[0]
    n1p, n2p = round_up(n1, 8), n2  # n2 is even (checked by the caller); a full-width lane block
    bt = round_up(min(block_t, round_up(T, 32)), 32)
    Tp = round_up(T, bt)
    X = x_TN.astype(jnp.float32).reshape(T, n1, n2)
    X = jnp.pad(X, ((0, Tp - T), (0, n1p - n1), (0, 0))).reshape(Tp * n1p, n2p)
    p1t = jnp.pad(p1.astype(jnp.float32), ((0, n1p - n1), (0, n1p - n1))).T
    p2f = p2.astype(jnp.float32)
    q, s = pl.pallas_call(
        functools.partial(_kernel, bt=bt, n1p=n1p, bits=bits),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(Tp // bt,),
            in_specs=[
                pl.BlockSpec((bt * n1p, n2p), lambda i, c: (i, 0)),
                pl.BlockSpec((n1p, n1p), lambda i, c: (0, 0)),
                pl.BlockSpec((n2p, n2p // 2), lambda i, c: (0, 0)),
                pl.BlockSpec((n2p, n2p // 2), lambda i, c: (0, 0)),
            ],
            out_specs=[
                pl.BlockSpec((bt, n1p, n2p // 2), lambda i, c: (i, 0, 0)),
                pl.BlockSpec((bt, LANES), lambda i, c: (i, 0)),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((Tp, n1p, n2p // 2), jnp.uint8),
            jax.ShapeDtypeStruct((Tp, LANES), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name="pallasite_kron_quant_tpu",
    )(clip_factors.astype(jnp.float32), X, p1t, p2f[:, 0::2], p2f[:, 1::2])
    return q[:T, :n1].reshape(T, N // 2), s[:T, 0]


__all__ = ["kron_quantize", "DEFAULT_BLOCK_T"]
