"""TPU (Mosaic) int4 x int4 GEMM with an int32 accumulator and a dequantization epilogue.

Grid ``(T / block_m, N / block_n, K/2 / block_k)``, the packed-K axis "arbitrary" into an int32
VMEM accumulator. Each step unpacks its ``uint8`` activation and weight blocks into signed nibbles
(int8 containers: the MXU's integer path) and adds the even- and odd-channel products, ``Σ_k =
Σ_j xe·We + Σ_j xo·Wo`` (no interleave). The last step converts to float32 and applies
``x_scale[t]·w_scale[o] (+ bias[o])``; the per-token scales arrive lane-replicated ``[T, 128]``
(a column without a relayout), the per-channel ones as a ``[1, N]`` row. Blocks: ``block_m`` a
multiple of 32 (the 8-bit tile), ``block_n`` / ``block_k`` (packed bytes) of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallasite.ops.common import pad_axis, round_up

DEFAULT_BLOCKS = (128, 256, 512)  # (block_m, block_n, block_k in packed bytes)
LANES = 128


def nibbles_i8(p):
    """Signed low / high nibbles of packed bytes, as int8."""
    p32 = p.astype(jnp.int32) & 0xFF
    lo = ((p32 & 0xF) ^ 8) - 8
    hi = (((p32 >> 4) & 0xF) ^ 8) - 8
    return lo.astype(jnp.int8), hi.astype(jnp.int8)


def _kernel(x_ref, w_ref, xs_ref, ws_ref, b_ref, o_ref, acc_ref):
    kk = pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.int32)

    xe, xo = nibbles_i8(x_ref[...])
    we, wo = nibbles_i8(w_ref[...])
    acc_ref[...] += jnp.dot(xe, we, preferred_element_type=jnp.int32) + jnp.dot(
        xo, wo, preferred_element_type=jnp.int32
    )

    @pl.when(kk == pl.num_programs(2) - 1)
    def _finish():
        y = acc_ref[...].astype(jnp.float32) * xs_ref[...][:, :1] * ws_ref[...]
        o_ref[...] = y + b_ref[...]


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def int_gemm(xq_packed, x_scale, wq_packed, w_scale, bias, *, block_m, block_n, block_k, interpret):
    """xq uint8 [T, K/2], x_scale [T], wq uint8 [K/2, N], w_scale, bias [N] -> float32 [T, N]."""
    T, K2 = xq_packed.shape
    N = wq_packed.shape[1]
    bm = min(round_up(block_m, 32), round_up(T, 32))
    bn = min(round_up(block_n, LANES), round_up(N, LANES))
    bk = min(round_up(block_k, LANES), round_up(K2, LANES))
    Tp, Np, K2p = round_up(T, bm), round_up(N, bn), round_up(K2, bk)
    x = pad_axis(pad_axis(xq_packed, 0, Tp), 1, K2p)  # a zero byte is two zero nibbles: exact
    w = pad_axis(pad_axis(wq_packed, 0, K2p), 1, Np)
    xs = jnp.broadcast_to(pad_axis(x_scale.astype(jnp.float32), 0, Tp)[:, None], (Tp, LANES))
    row = lambda a: pad_axis(a.astype(jnp.float32), 0, Np)[None, :]  # noqa: E731  [1, Np]
    y = pl.pallas_call(
        _kernel,
        grid=(Tp // bm, Np // bn, K2p // bk),
        in_specs=[
            pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
            pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j)),
            pl.BlockSpec((bm, LANES), lambda i, j, kk: (i, 0)),
            pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)),
            pl.BlockSpec((1, bn), lambda i, j, kk: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Tp, Np), jnp.float32),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.int32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="pallasite_int_gemm_tpu",
    )(x, w, xs, row(w_scale), row(bias))
    return y[:T, :N]


__all__ = ["int_gemm", "nibbles_i8", "DEFAULT_BLOCKS"]
