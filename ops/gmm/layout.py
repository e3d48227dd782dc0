"""The padded grouped layout every grouped-matmul kernel (and ``gmm_tiles``) works in.

Rows of group ``g`` (``[s_g, s_g + group_sizes[g])``, ``s_g`` the exclusive cumsum) are scattered
so that every group starts on a multiple of ``bm``: each ``bm``-row tile then belongs to one group
(at most one partial tile per group, so ``ceil(M / bm) + G`` tiles always suffice — a static
bound). ``tile_group`` names each tile's group, ``tile_start`` / ``tile_count`` each group's
tiles, ``used_tiles`` how many tiles hold rows. With ``min_tiles=1`` an empty group still owns one
(zero) tile, so a kernel that walks the tiles in order writes every group's output block.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallasite.ops.common import round_up


def check(lhs_MK, rhs_GKN, group_sizes_G):
    if lhs_MK.ndim != 2 or rhs_GKN.ndim != 3 or group_sizes_G.ndim != 1:
        raise ValueError(
            f"gmm: expected lhs [M,K], rhs [G,K,N], group_sizes [G]; got {lhs_MK.shape}, "
            f"{rhs_GKN.shape}, {group_sizes_G.shape}"
        )
    if lhs_MK.shape[1] != rhs_GKN.shape[1]:
        raise ValueError(
            f"gmm: contraction sizes differ: lhs K={lhs_MK.shape[1]} vs rhs K={rhs_GKN.shape[1]}"
        )
    if rhs_GKN.shape[0] != group_sizes_G.shape[0]:
        raise ValueError(
            f"gmm: rhs has {rhs_GKN.shape[0]} groups but group_sizes has {group_sizes_G.shape[0]}"
        )


@dataclasses.dataclass(frozen=True)
class PaddedGroups:
    bm: int
    num_tiles: int  # static bound
    dest_M: jax.Array  # [M] padded row of each row (num_tiles * bm for rows past the groups)
    valid_M: jax.Array  # [M] row belongs to a group
    tile_group: jax.Array  # [num_tiles] int32
    tile_start: jax.Array  # [G] int32 first tile of each group
    tile_count: jax.Array  # [G] int32
    used_tiles: jax.Array  # [] int32

    @property
    def rows(self) -> int:
        return self.num_tiles * self.bm

    def scatter(self, x_MX: jax.Array, width: int) -> jax.Array:
        """Rows of ``x`` into the padded layout ``[num_tiles * bm, width]`` (zeros elsewhere)."""
        return (
            jnp.zeros((self.rows, width), x_MX.dtype)
            .at[self.dest_M, : x_MX.shape[1]]
            .set(x_MX, mode="drop")
        )

    def gather(self, y_PX: jax.Array, width: int) -> jax.Array:
        """Rows back from the padded layout, ``width`` columns; rows past the groups are zero."""
        out = jnp.take(y_PX, jnp.minimum(self.dest_M, self.rows - 1), axis=0)[:, :width]
        return jnp.where(self.valid_M[:, None], out, 0).astype(out.dtype)


def padded_groups(group_sizes_G: jax.Array, M: int, bm: int, *, min_tiles: int = 0) -> PaddedGroups:
    G = group_sizes_G.shape[0]
    gs = group_sizes_G.astype(jnp.int32)
    num_tiles = (
        -(-M // bm) + G
    )  # each group adds at most one partial (or, with min_tiles, empty) tile
    tiles_G = jnp.maximum((gs + bm - 1) // bm, min_tiles)
    ends = jnp.cumsum(gs)
    starts = ends - gs
    tile_ends = jnp.cumsum(tiles_G)
    tile_start = tile_ends - tiles_G
    rows = jnp.arange(M, dtype=jnp.int32)
    row_group = jnp.minimum(jnp.searchsorted(ends, rows, side="right"), G - 1)
    valid = rows < ends[-1]
    dest = jnp.where(valid, tile_start[row_group] * bm + rows - starts[row_group], num_tiles * bm)
    tile_group = jnp.searchsorted(tile_ends, jnp.arange(num_tiles, dtype=jnp.int32), side="right")
    tile_group = jnp.minimum(tile_group, G - 1).astype(
        jnp.int32
    )  # trailing unused tiles: the last group
    return PaddedGroups(
        bm=bm,
        num_tiles=num_tiles,
        dest_M=dest.astype(jnp.int32),
        valid_M=valid,
        tile_group=tile_group,
        tile_start=tile_start.astype(jnp.int32),
        tile_count=tiles_G.astype(jnp.int32),
        used_tiles=tile_ends[-1].astype(jnp.int32),
    )


def pow2_block(size: int, cap: int) -> int:
    """Power-of-two block >= 16 covering ``size`` up to ``cap`` (GPU block rule)."""
    b = 16
    while b < size and b < cap:
        b *= 2
    return b


def tpu_block(size: int, cap: int, multiple: int) -> int:
    """Multiple of ``multiple`` covering ``size`` up to ``cap`` (TPU (8, 128) tiling)."""
    return min(round_up(cap, multiple), round_up(size, multiple))


__all__ = ["check", "PaddedGroups", "padded_groups", "pow2_block", "tpu_block"]
