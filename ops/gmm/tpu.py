"""TPU (Mosaic) grouped matmul kernels over the padded grouped layout (``layout.py``).

gmm: grid ``(row tiles, N / block_n, K / block_k)``, K "arbitrary" into a float32 VMEM
accumulator. Each tile's group and the number of used tiles are scalar-prefetched: the weight
index map reads ``rhs[tile_group[i]]`` (data-dependent blocks, no weight gather), tiles past the
used ones repeat the last used blocks (no DMA) and write zeros. ``transpose_rhs`` multiplies by
``rhs[g]ᵀ`` from ``[G, N, K]`` weights (the backward's ``dout · rhsᵀ`` without a weight
transpose). tgmm: grid ``(K / block_k, N / block_n, row tiles)``; the output block is
``tile_group[t]``: consecutive tiles of one group accumulate into one VMEM block, written when the
group changes (every group owns >= 1 tile, so empty groups are written as zeros). Blocks:
``block_m`` a multiple of 16, ``block_k`` / ``block_n`` of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallasite.ops.common import dot, pad_axis, round_up
from pallasite.ops.gmm.layout import padded_groups, tpu_block

DEFAULT_BLOCKS = (128, 512, 512)  # (block_m, block_k, block_n)


def _gmm_kernel(tile_group_ref, used_ref, x_ref, w_ref, o_ref, acc_ref, *, transpose_rhs):
    i, kk = pl.program_id(0), pl.program_id(2)
    used = i < used_ref[0]

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(used)
    def _step():
        acc_ref[...] += dot(x_ref[...], w_ref[...], trans_b=transpose_rhs)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def gmm(
    lhs_MK,
    rhs,
    group_sizes_G,
    *,
    block_m,
    block_k,
    block_n,
    interpret,
    out_dtype,
    transpose_rhs=False,
):
    """``lhs [M, K]`` x ``rhs [G, K, N]`` (``[G, N, K]`` with ``transpose_rhs``) -> ``[M, N]``."""
    M, K = lhs_MK.shape
    N = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    bm = tpu_block(M, block_m, 8 * (4 // jnp.dtype(lhs_MK.dtype).itemsize))
    bk, bn = tpu_block(K, block_k, 128), tpu_block(N, block_n, 128)
    Kp, Np = round_up(K, bk), round_up(N, bn)
    lay = padded_groups(group_sizes_G, M, bm)
    rhs_p = pad_axis(pad_axis(rhs, 1, Np if transpose_rhs else Kp), 2, Kp if transpose_rhs else Np)

    def tile(i, tg, used):  # unused trailing tiles revisit the last used one (no DMA)
        return jnp.minimum(i, jnp.maximum(used[0] - 1, 0))

    def w_map(i, j, kk, tg, used):
        g = tg[tile(i, tg, used)]
        return (g, j, kk) if transpose_rhs else (g, kk, j)

    w_block = (None, bn, bk) if transpose_rhs else (None, bk, bn)
    out_p = pl.pallas_call(
        functools.partial(_gmm_kernel, transpose_rhs=transpose_rhs),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(lay.num_tiles, Np // bn, Kp // bk),
            in_specs=[
                pl.BlockSpec((bm, bk), lambda i, j, kk, tg, used: (tile(i, tg, used), kk)),
                pl.BlockSpec(w_block, w_map),
            ],
            out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk, *_: (i, j)),
            scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((lay.rows, Np), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="pallasite_gmm_tpu",
    )(lay.tile_group, lay.used_tiles.reshape(1), lay.scatter(lhs_MK, Kp), rhs_p)
    return lay.gather(out_p, N)


def _tgmm_kernel(tile_group_ref, x_ref, dy_ref, o_ref, acc_ref):
    t, n = pl.program_id(2), pl.num_programs(2)
    g = tile_group_ref[t]
    first = (t == 0) | (tile_group_ref[jnp.maximum(t - 1, 0)] != g)
    last = (t == n - 1) | (tile_group_ref[jnp.minimum(t + 1, n - 1)] != g)

    @pl.when(first)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    acc_ref[...] += dot(x_ref[...], dy_ref[...], trans_a=True)  # [bk, bn]

    @pl.when(last)
    def _finish():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, block_m, block_k, block_n, interpret, out_dtype):
    """drhs[g] = lhs_gᵀ · dout_g -> ``[G, K, N]``."""
    M, K = lhs_MK.shape
    N, G = dout_MN.shape[1], group_sizes_G.shape[0]
    bm = tpu_block(M, block_m, 8 * (4 // jnp.dtype(lhs_MK.dtype).itemsize))
    bk, bn = tpu_block(K, block_k, 128), tpu_block(N, block_n, 128)
    Kp, Np = round_up(K, bk), round_up(N, bn)
    lay = padded_groups(group_sizes_G, M, bm, min_tiles=1)
    out = pl.pallas_call(
        _tgmm_kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(Kp // bk, Np // bn, lay.num_tiles),
            in_specs=[
                pl.BlockSpec((bm, bk), lambda i, j, t, tg: (t, i)),
                pl.BlockSpec((bm, bn), lambda i, j, t, tg: (t, j)),
            ],
            out_specs=pl.BlockSpec((None, bk, bn), lambda i, j, t, tg: (tg[t], i, j)),
            scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((G, Kp, Np), out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="pallasite_tgmm_tpu",
    )(lay.tile_group, lay.scatter(lhs_MK, Kp), lay.scatter(dout_MN, Np))
    return out[:, :K, :N]


__all__ = ["gmm", "tgmm", "DEFAULT_BLOCKS"]
