"""Grouped matmul references in plain XLA: ``ragged_dot`` (``gmm_reference``), the transposed
product by one-hot einsum (``tgmm_reference``) and the kernels' padded-tile algorithm without
Pallas (``gmm_tiles``: scatter rows so each ``block_m`` tile has one group, one batched matmul
over tiles, gather back; FLOPs ≈ (M + G·block_m)·K·N — on XLA:CPU much faster than ``ragged_dot``,
which costs about G× the FLOPs there; differentiable by autodiff).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.ops.gmm.layout import check, padded_groups, pow2_block


def gmm_reference(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None):
    check(lhs_MK, rhs_GKN, group_sizes_G)
    out = jax.lax.ragged_dot(
        lhs_MK,
        rhs_GKN,
        group_sizes_G.astype(jnp.int32),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=preferred_element_type,
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
    return jnp.einsum(
        "mg,mk,mn->gkn",
        onehot_MG,
        lhs_MK.astype(jnp.float32),
        dout_MN.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )


def gmm_tiles(lhs_MK, rhs_GKN, group_sizes_G, *, block_m: int = 64):
    """Grouped matmul over the padded grouped layout in plain XLA (see the module docstring)."""
    check(lhs_MK, rhs_GKN, group_sizes_G)
    M, K = lhs_MK.shape
    lay = padded_groups(group_sizes_G, M, pow2_block(M, block_m))
    src = (
        jnp.full((lay.rows,), M, jnp.int32)
        .at[lay.dest_M]
        .set(jnp.arange(M, dtype=jnp.int32), mode="drop")
    )
    lhs_pad = jnp.concatenate([lhs_MK, jnp.zeros((1, K), lhs_MK.dtype)], axis=0)
    x_tmk = jnp.take(lhs_pad, src, axis=0).reshape(
        lay.num_tiles, lay.bm, K
    )  # gather: its VJP is a scatter-add
    w_tkn = jnp.take(rhs_GKN, lay.tile_group, axis=0)
    y = jnp.einsum("tmk,tkn->tmn", x_tmk, w_tkn, precision=jax.lax.Precision.HIGHEST)
    return lay.gather(y.reshape(lay.rows, -1), rhs_GKN.shape[2])


__all__ = ["gmm_reference", "tgmm_reference", "gmm_tiles"]
