"""Grouped matrix multiplication for mixture-of-experts layers.

``gmm(lhs_MK, rhs_GKN, group_sizes_G)`` multiplies consecutive row blocks of ``lhs`` by one
matrix each: rows ``[s_g, s_g + group_sizes[g])`` (``s_g`` = exclusive cumsum) use ``rhs[g]``.
Rows past ``sum(group_sizes)`` give zeros. This is what a dropless MoE runs after sorting its
(token, expert) pairs by expert (MegaBlocks' "grouped GEMM", Gale et al. 2023).

Implementations (``impl``):

* ``"ref"`` — ``jax.lax.ragged_dot`` (XLA's grouped matmul; autodiff by XLA).
* ``"tiles"`` — the kernel's padded-tile algorithm in plain XLA (gather, batched matmul,
  gather back); autodiff by XLA. The fast choice on XLA:CPU, where ``ragged_dot`` costs
  about G× the FLOPs.
* ``"pallas"`` — a Pallas kernel with a ``jax.custom_vjp``:
  forward ``out = gmm(lhs, rhs)``, backward ``dlhs = gmm(dout, rhsᵀ)`` (the same kernel) and
  ``drhs = tgmm(lhs, dout)`` (a second kernel: per group, ``lhs_gᵀ · dout_g``).

Kernel layout (why it looks like this). The rows of a group rarely start on a tile boundary,
and a Triton/Mosaic-GPU kernel cannot choose its weight block from data in an ``index_map``
(there is no scalar prefetch on GPU). So the wrapper first scatters the rows into a *padded
grouped layout* in which every group starts on a multiple of ``block_m`` (at most one partial
tile per group, so ``ceil(M / bm) + G`` tiles always suffice — a static bound), and records
the group of every tile. Each program then owns one (row tile, column tile), reads its group
id as a scalar, and loops over K in ``block_k`` slices, indexing ``rhs[g]`` dynamically inside
the kernel. Block shapes are powers of two ≥ 16 and K / N are zero-padded to them, so the same
kernel lowers with Triton on GPU; on CPU it runs in interpret mode (``interpret=None`` picks it
by platform). Accumulation is float32 with ``Precision.HIGHEST`` (no TF32 on GPU).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

__all__ = ["gmm", "gmm_reference", "gmm_tiles", "tgmm_reference", "gmm_pallas", "tgmm_pallas", "default_interpret"]


def default_interpret() -> bool:
    return jax.default_backend() == "cpu"


def _check(lhs_MK, rhs_GKN, group_sizes_G):
    if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3 or group_sizes_G.ndim != 1:
        raise ValueError(
            f"gmm: expected lhs [M,K], rhs [G,K,N], group_sizes [G]; got {lhs_MK.shape}, {rhs_GKN.shape}, {group_sizes_G.shape}"
        )
    if lhs_MK.shape[1] != rhs_GKN.shape[1]:
        raise ValueError(f"gmm: contraction sizes differ: lhs K={lhs_MK.shape[1]} vs rhs K={rhs_GKN.shape[1]}")
    if rhs_GKN.shape[0] != group_sizes_G.shape[0]:
        raise ValueError(f"gmm: rhs has {rhs_GKN.shape[0]} groups but group_sizes has {group_sizes_G.shape[0]}")


# ----------------------------------------------------------------------------- reference
def gmm_reference(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None):
    _check(lhs_MK, rhs_GKN, group_sizes_G)
    out = jax.lax.ragged_dot(
        lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32),
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=preferred_element_type,
    )
    # ragged_dot leaves rows past sum(group_sizes) as zeros on CPU; make it explicit everywhere.
    valid_M = jnp.arange(lhs_MK.shape[0]) < jnp.sum(group_sizes_G)
    return jnp.where(valid_M[:, None], out, 0).astype(out.dtype)


def tgmm_reference(lhs_MK, dout_MN, group_sizes_G):
    """drhs[g] = lhs_gᵀ · dout_g over the rows of group g → [G, K, N] (float32)."""
    G = group_sizes_G.shape[0]
    ends = jnp.cumsum(group_sizes_G)
    row_group_M = jnp.searchsorted(ends, jnp.arange(lhs_MK.shape[0]), side="right")
    onehot_MG = (row_group_M[:, None] == jnp.arange(G)[None, :]).astype(jnp.float32)
    return jnp.einsum("mg,mk,mn->gkn", onehot_MG, lhs_MK.astype(jnp.float32), dout_MN.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


# ----------------------------------------------------------------------------- padded layout
def _pow2_block(size: int, cap: int) -> int:
    b = 16
    while b < size and b < cap:
        b *= 2
    return b


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _padded_layout(group_sizes_G, M: int, bm: int):
    """Row → padded-row map and per-tile group ids for the padded grouped layout."""
    G = group_sizes_G.shape[0]
    gs = group_sizes_G.astype(jnp.int32)
    num_tiles = -(-M // bm) + G  # each group adds at most one partial tile
    padded_sizes = ((gs + bm - 1) // bm) * bm
    ends = jnp.cumsum(gs)
    starts = ends - gs
    padded_ends = jnp.cumsum(padded_sizes)
    padded_starts = padded_ends - padded_sizes
    rows = jnp.arange(M, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), G - 1)
    valid = rows < ends[-1]
    dest_M = jnp.where(valid, padded_starts[row_group] + rows - starts[row_group], num_tiles * bm)
    tile_group = jnp.searchsorted(padded_ends, jnp.arange(num_tiles, dtype=jnp.int32) * bm, side="right")
    tile_group = jnp.minimum(tile_group, G - 1).astype(jnp.int32)  # trailing empty tiles: any group (rows are 0)
    return num_tiles, dest_M, valid, tile_group, padded_starts // bm, padded_sizes // bm


def _pad_to(x, shape):
    return jnp.pad(x, [(0, s - d) for d, s in zip(x.shape, shape)])


def gmm_tiles(lhs_MK, rhs_GKN, group_sizes_G, *, block_m: int = 64):
    """Grouped matmul in plain XLA over the padded grouped layout (the Pallas kernel's
    algorithm without Pallas): rows are scattered so every ``block_m``-row tile belongs to
    one group, each tile is multiplied by its group's matrix in one batched matmul, and the
    rows are gathered back. FLOPs ≈ (M + G·block_m)·K·N, weights gathered per tile. On
    XLA:CPU this is much faster than ``ragged_dot`` (which costs about G× the FLOPs there);
    differentiable by autodiff (gathers and a batched dot)."""
    _check(lhs_MK, rhs_GKN, group_sizes_G)
    M, K = lhs_MK.shape
    bm = _pow2_block(M, block_m)
    num_tiles, dest_M, valid_M, tile_group, _, _ = _padded_layout(group_sizes_G, M, bm)
    src = jnp.full((num_tiles * bm,), M, jnp.int32).at[dest_M].set(jnp.arange(M, dtype=jnp.int32), mode="drop")
    lhs_pad = jnp.concatenate([lhs_MK, jnp.zeros((1, K), lhs_MK.dtype)], axis=0)
    x_tmk = jnp.take(lhs_pad, src, axis=0).reshape(num_tiles, bm, K)  # gather: its VJP is a scatter-add
    w_tkn = jnp.take(rhs_GKN, tile_group, axis=0)
    y = jnp.einsum("tmk,tkn->tmn", x_tmk, w_tkn, precision=jax.lax.Precision.HIGHEST)
    y = y.reshape(num_tiles * bm, -1)
    out = jnp.take(y, jnp.minimum(dest_M, num_tiles * bm - 1), axis=0)
    return jnp.where(valid_M[:, None], out, 0).astype(out.dtype)


# ----------------------------------------------------------------------------- kernels
def _gmm_kernel(tile_group_ref, x_ref, w_ref, o_ref, *, bk: int, nk: int):
    g = tile_group_ref[pl.program_id(0)]

    def body(kk, acc):
        x = x_ref[:, pl.ds(kk * bk, bk)]
        w = w_ref[g, pl.ds(kk * bk, bk), :]
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)

    acc = jax.lax.fori_loop(0, nk, body, jnp.zeros(o_ref.shape, jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def gmm_pallas(lhs_MK, rhs_GKN, group_sizes_G, *, block_m: int = 64, block_k: int = 64, block_n: int = 64,
               interpret: Optional[bool] = None, out_dtype=None):
    """Forward grouped matmul as a Pallas kernel (no autodiff; see ``gmm`` for the VJP)."""
    _check(lhs_MK, rhs_GKN, group_sizes_G)
    interpret = default_interpret() if interpret is None else interpret
    M, K = lhs_MK.shape
    G, _, N = rhs_GKN.shape
    out_dtype = out_dtype or jnp.result_type(lhs_MK.dtype, rhs_GKN.dtype)
    bm = _pow2_block(M, block_m)
    bk = _pow2_block(K, block_k)
    bn = _pow2_block(N, block_n)
    Kp, Np = _round_up(K, bk), _round_up(N, bn)
    num_tiles, dest_M, valid_M, tile_group, _, _ = _padded_layout(group_sizes_G, M, bm)
    Mp = num_tiles * bm
    lhs_p = jnp.zeros((Mp, Kp), lhs_MK.dtype).at[dest_M, :K].set(lhs_MK, mode="drop")
    rhs_p = _pad_to(rhs_GKN, (G, Kp, Np))
    tg_len = 1 << max(4, (num_tiles - 1).bit_length())  # power-of-two vector for GPU lowering
    tile_group = _pad_to(tile_group, (tg_len,))
    out_p = pl.pallas_call(
        functools.partial(_gmm_kernel, bk=bk, nk=Kp // bk),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), out_dtype),
        grid=(num_tiles, Np // bn),
        in_specs=[
            pl.BlockSpec((tg_len,), lambda i, j: (0,)),
            pl.BlockSpec((bm, Kp), lambda i, j: (i, 0)),
            pl.BlockSpec((G, Kp, bn), lambda i, j: (0, 0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        interpret=interpret,
        name="pallasite_gmm",
    )(tile_group, lhs_p, rhs_p)
    out = jnp.take(out_p, jnp.minimum(dest_M, Mp - 1), axis=0)[:, :N]
    return jnp.where(valid_M[:, None], out, 0).astype(out_dtype)


def _tgmm_kernel(tile_start_ref, tile_count_ref, x_ref, dy_ref, o_ref, *, bm: int):
    g = pl.program_id(0)
    start = tile_start_ref[g]
    count = tile_count_ref[g]

    def body(t, acc):
        rows = pl.ds((start + t) * bm, bm)
        x = x_ref[rows, :]
        dy = dy_ref[rows, :]
        return acc + jnp.dot(x.T, dy, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)

    acc = jax.lax.fori_loop(0, count, body, jnp.zeros(o_ref.shape[-2:], jnp.float32))
    o_ref[...] = acc.reshape(o_ref.shape).astype(o_ref.dtype)


def tgmm_pallas(lhs_MK, dout_MN, group_sizes_G, *, block_m: int = 64, block_k: int = 64, block_n: int = 64,
                interpret: Optional[bool] = None, out_dtype=jnp.float32):
    """Transposed grouped matmul as a Pallas kernel: drhs[g] = lhs_gᵀ · dout_g → [G, K, N]."""
    interpret = default_interpret() if interpret is None else interpret
    M, K = lhs_MK.shape
    N = dout_MN.shape[1]
    G = group_sizes_G.shape[0]
    bm = _pow2_block(M, block_m)
    bk = _pow2_block(K, block_k)
    bn = _pow2_block(N, block_n)
    Kp, Np = _round_up(K, bk), _round_up(N, bn)
    num_tiles, dest_M, _, _, tile_start, tile_count = _padded_layout(group_sizes_G, M, bm)
    Mp = num_tiles * bm
    x_p = jnp.zeros((Mp, Kp), lhs_MK.dtype).at[dest_M, :K].set(lhs_MK, mode="drop")
    dy_p = jnp.zeros((Mp, Np), dout_MN.dtype).at[dest_M, :N].set(dout_MN, mode="drop")
    gl = 1 << max(4, (G - 1).bit_length())
    out = pl.pallas_call(
        functools.partial(_tgmm_kernel, bm=bm),
        out_shape=jax.ShapeDtypeStruct((G, Kp, Np), out_dtype),
        grid=(G, Kp // bk, Np // bn),
        in_specs=[
            pl.BlockSpec((gl,), lambda g, i, j: (0,)),
            pl.BlockSpec((gl,), lambda g, i, j: (0,)),
            pl.BlockSpec((Mp, bk), lambda g, i, j: (0, i)),
            pl.BlockSpec((Mp, bn), lambda g, i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((1, bk, bn), lambda g, i, j: (g, i, j)),
        interpret=interpret,
        name="pallasite_tgmm",
    )(_pad_to(tile_start.astype(jnp.int32), (gl,)), _pad_to(tile_count.astype(jnp.int32), (gl,)), x_p, dy_p)
    return out[:, :K, :N]


# ----------------------------------------------------------------------------- custom VJP
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_pallas_vjp(lhs_MK, rhs_GKN, group_sizes_G, interpret, blocks):
    return gmm_pallas(lhs_MK, rhs_GKN, group_sizes_G, interpret=interpret, **dict(blocks))


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G, interpret, blocks):
    return _gmm_pallas_vjp(lhs_MK, rhs_GKN, group_sizes_G, interpret, blocks), (lhs_MK, rhs_GKN, group_sizes_G)


def _gmm_bwd(interpret, blocks, res, dout_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    kw = dict(blocks)
    dlhs = gmm_pallas(dout_MN, jnp.swapaxes(rhs_GKN, 1, 2), group_sizes_G, interpret=interpret,
                      out_dtype=lhs_MK.dtype, **kw)
    drhs = tgmm_pallas(lhs_MK, dout_MN, group_sizes_G, interpret=interpret, **kw).astype(rhs_GKN.dtype)
    # group_sizes is integer: its cotangent is the float0 zero.
    dgs = jnp.zeros(group_sizes_G.shape, jax.dtypes.float0)
    return dlhs, drhs, dgs


_gmm_pallas_vjp.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, impl: str = "ref", interpret: Optional[bool] = None,
        block_m: int = 64, block_k: int = 64, block_n: int = 64):
    """Grouped matmul [M,K] × [G,K,N] → [M,N]; differentiable in lhs and rhs for both impls."""
    if impl == "ref":
        return gmm_reference(lhs_MK, rhs_GKN, group_sizes_G)
    if impl == "tiles":
        return gmm_tiles(lhs_MK, rhs_GKN, group_sizes_G, block_m=block_m)
    if impl == "pallas":
        _check(lhs_MK, rhs_GKN, group_sizes_G)
        interpret = default_interpret() if interpret is None else interpret
        blocks = (("block_k", block_k), ("block_m", block_m), ("block_n", block_n))
        return _gmm_pallas_vjp(lhs_MK, rhs_GKN, group_sizes_G.astype(jnp.int32), interpret, blocks)
    raise ValueError(f"gmm impl={impl!r}; expected 'ref', 'tiles' or 'pallas'")


def _bench(argv=None):
    """``python -m pallasite.ops.gmm [--quick]``: Pallas vs ragged_dot vs tiles, forward and
    forward+backward, side by side (absolute times only mean something on an accelerator)."""
    import argparse
    import json
    import time

    import numpy as np

    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu or args.quick:
        M, K, N, G, dtype = (512, 64, 128, 8, jnp.float32) if on_cpu else (8192, 1024, 1024, 8, jnp.bfloat16)
    else:
        M, K, N, G, dtype = 32768, 2048, 1408, 16, jnp.bfloat16
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (M, K), dtype)
    w = (jax.random.normal(kw, (G, K, N), jnp.float32) / np.sqrt(K)).astype(dtype)
    cuts = jnp.sort(jax.random.randint(kg, (G - 1,), 0, M))
    gs = jnp.diff(jnp.concatenate([jnp.zeros(1, jnp.int32), cuts, jnp.full(1, M, jnp.int32)])).astype(jnp.int32)
    blocks = dict(block_m=64, block_k=64, block_n=64) if on_cpu else dict(block_m=128, block_k=64, block_n=128)
    res = {"backend": jax.default_backend(), "shape": [M, K, N, G], "dtype": jnp.dtype(dtype).name}
    ref = gmm(x, w, gs, impl="ref").astype(jnp.float32)
    for impl in ("ref", "tiles", "pallas"):
        kw_ = blocks if impl == "pallas" else {"block_m": blocks["block_m"]}
        f = jax.jit(lambda x, w, impl=impl, kw_=kw_: gmm(x, w, gs, impl=impl, **kw_))
        g = jax.jit(jax.grad(lambda x, w, impl=impl, kw_=kw_: jnp.sum(gmm(x, w, gs, impl=impl, **kw_).astype(jnp.float32) ** 2),
                             argnums=(0, 1)))
        out = jax.block_until_ready(f(x, w))
        jax.block_until_ready(g(x, w))
        times = {}
        for name, fn in (("fwd", f), ("fwd_bwd", g)):
            ts = []
            for _ in range(3 if args.quick or on_cpu else 10):
                t = time.perf_counter()
                jax.block_until_ready(fn(x, w))
                ts.append(time.perf_counter() - t)
            times[name] = float(np.median(ts))
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-9))
        res[impl] = {"fwd_ms": round(times["fwd"] * 1e3, 3), "fwd_bwd_ms": round(times["fwd_bwd"] * 1e3, 3),
                     "rel_err_vs_ref": err}
        print(f"{impl:7s} fwd {times['fwd'] * 1e3:9.3f} ms  fwd+bwd {times['fwd_bwd'] * 1e3:9.3f} ms  rel err {err:.2e}")
    res["pallas_vs_ref_fwd"] = round(res["ref"]["fwd_ms"] / res["pallas"]["fwd_ms"], 3)
    res["pallas_vs_ref_fwd_bwd"] = round(res["ref"]["fwd_bwd_ms"] / res["pallas"]["fwd_bwd_ms"], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    _bench()
