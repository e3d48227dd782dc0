"""GPU (Triton) grouped matmul kernels over the padded grouped layout; also what the generic
interpreter runs. GPU has no scalar prefetch, so a program cannot pick its weight block in an
``index_map``: each program owns one (row tile, column tile), reads its tile's group id as a scalar
inside the kernel and loops over K in ``block_k`` slices indexing ``rhs[g]`` dynamically. tgmm: one
program per (group, K tile, N tile) loops over the group's row tiles. Block shapes are powers of
two >= 16 (Triton) and K / N are zero-padded to them; float32 accumulation, ``Precision.HIGHEST``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallasite.ops.common import dot, pad_axis, round_up
from pallasite.ops.dispatch import triton_params
from pallasite.ops.gmm.layout import padded_groups, pow2_block

DEFAULT_BLOCKS = (64, 64, 64)  # (block_m, block_k, block_n)


def _pow2_len(n: int) -> int:
    return 1 << max(4, (n - 1).bit_length())  # power-of-two vectors for Triton


def _gmm_kernel(tile_group_ref, x_ref, w_ref, o_ref, *, bk: int, nk: int):
    g = tile_group_ref[pl.program_id(0)]

    def body(kk, acc):
        return acc + dot(x_ref[:, pl.ds(kk * bk, bk)], w_ref[g, pl.ds(kk * bk, bk), :])

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, block_m, block_k, block_n, interpret, out_dtype):
    M, K = lhs_MK.shape
    G, _, N = rhs_GKN.shape
    bm, bk, bn = pow2_block(M, block_m), pow2_block(K, block_k), pow2_block(N, block_n)
    Kp, Np = round_up(K, bk), round_up(N, bn)
    lay = padded_groups(group_sizes_G, M, bm)
    tg_len = _pow2_len(lay.num_tiles)
    out_p = pl.pallas_call(
        functools.partial(_gmm_kernel, bk=bk, nk=Kp // bk),
        out_shape=jax.ShapeDtypeStruct((lay.rows, Np), out_dtype),
        grid=(lay.num_tiles, Np // bn),
        in_specs=[
            pl.BlockSpec((tg_len,), lambda i, j: (0,)),
            pl.BlockSpec((bm, Kp), lambda i, j: (i, 0)),
            pl.BlockSpec((G, Kp, bn), lambda i, j: (0, 0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=triton_params(interpret),
        name="pallasite_gmm",
    )(
        pad_axis(lay.tile_group, 0, tg_len),
        lay.scatter(lhs_MK, Kp),
        pad_axis(pad_axis(rhs_GKN, 1, Kp), 2, Np),
    )
    return lay.gather(out_p, N)


def _tgmm_kernel(tile_start_ref, tile_count_ref, x_ref, dy_ref, o_ref, *, bm: int):
    g = pl.program_id(0)
    start, count = tile_start_ref[g], tile_count_ref[g]

    def body(t, acc):
        rows = pl.ds((start + t) * bm, bm)
        return acc + dot(x_ref[rows, :], dy_ref[rows, :], trans_a=True)

    acc = jax.lax.fori_loop(0, count, body, jnp.zeros(o_ref.shape[-2:], jnp.float32))
    o_ref[...] = acc.reshape(o_ref.shape).astype(o_ref.dtype)


def tgmm(lhs_MK, dout_MN, group_sizes_G, *, block_m, block_k, block_n, interpret, out_dtype):
    M, K = lhs_MK.shape
    N, G = dout_MN.shape[1], group_sizes_G.shape[0]
    bm, bk, bn = pow2_block(M, block_m), pow2_block(K, block_k), pow2_block(N, block_n)
    Kp, Np = round_up(K, bk), round_up(N, bn)
    lay = padded_groups(group_sizes_G, M, bm)
    gl = _pow2_len(G)
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, bm=bm),
        out_shape=jax.ShapeDtypeStruct((G, Kp, Np), out_dtype),
        grid=(G, Kp // bk, Np // bn),
        in_specs=[
            pl.BlockSpec((gl,), lambda g, i, j: (0,)),
            pl.BlockSpec((gl,), lambda g, i, j: (0,)),
            pl.BlockSpec((lay.rows, bk), lambda g, i, j: (0, i)),
            pl.BlockSpec((lay.rows, bn), lambda g, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((1, bk, bn), lambda g, i, j: (g, i, j)),
        interpret=interpret,
        compiler_params=triton_params(interpret),
        name="pallasite_tgmm",
    )(
        pad_axis(lay.tile_start, 0, gl),
        pad_axis(lay.tile_count, 0, gl),
        lay.scatter(lhs_MK, Kp),
        lay.scatter(dout_MN, Np),
    )
    return out[:, :K, :N]


__all__ = ["gmm", "tgmm", "DEFAULT_BLOCKS"]
