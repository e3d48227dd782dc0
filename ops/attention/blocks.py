"""The visibility rule of ``reference.attention`` and the block skipping built on it, shared by the
GPU (Triton) and TPU (Mosaic) flash kernels.

Key ``j`` is visible to query ``i`` iff ``k_pos[j] <= q_pos[i]`` (causal), ``q_pos[i] - k_pos[j] <
window``, ``q_seg[i] == k_seg[j]`` and ``k_valid[j]``. A key block is skipped when no key in it can
be visible to any query of the query block, judged from the min / max position over its valid
keys (``block_bounds``) — exact for any position layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BIG = 2**30  # "no key" sentinel for block min / max positions (int32-safe)


def visible(qpos, kpos, kvalid, qseg, kseg, *, causal, window, use_segments):
    """Boolean visibility; q-side operands ``[bq, 1]``, k-side ``[1, bk]`` (they broadcast)."""
    mask = kvalid != 0
    if causal:
        mask = mask & (kpos <= qpos)
    if window is not None:
        mask = mask & ((qpos - kpos) < window)
    if use_segments:
        mask = mask & (qseg == kseg)
    return mask


def block_bounds(pos_BS: jax.Array, valid_BS: jax.Array, block: int):
    """Per block of ``block`` entries: min / max position over valid entries, sentinels (BIG, -BIG)
    when the block has none. ``S`` must be a multiple of ``block``. -> two int32
    ``[B, S // block]``."""
    B, S = pos_BS.shape
    pos = pos_BS.reshape(B, S // block, block)
    ok = valid_BS.reshape(B, S // block, block) != 0
    return (
        jnp.min(jnp.where(ok, pos, BIG), axis=-1).astype(jnp.int32),
        jnp.max(jnp.where(ok, pos, -BIG), axis=-1).astype(jnp.int32),
    )


def block_range(bmin, bmax, qmin, qmax, *, causal, window):
    """Smallest ``[lo, hi)`` range of blocks (last axis of ``bmin`` / ``bmax``) holding every block
    that a query range ``[qmin, qmax]`` (broadcast over the leading axes) can see. Empty query
    ranges (``qmin = BIG``) give ``hi <= lo``."""
    n = bmin.shape[-1]
    qmin, qmax = jnp.asarray(qmin)[..., None], jnp.asarray(qmax)[..., None]
    vis = (bmin < BIG) & (qmin < BIG)  # the block has a valid key, the query range a valid row
    if causal:
        vis &= bmin <= qmax
    if window is not None:
        vis &= bmax > qmin - window
    ids = jnp.arange(n, dtype=jnp.int32)
    return (
        jnp.min(jnp.where(vis, ids, n), axis=-1).astype(jnp.int32),
        jnp.max(jnp.where(vis, ids + 1, 0), axis=-1).astype(jnp.int32),
    )


def query_block_range(qmin, qmax, kmin, kmax, *, causal, window):
    """The transpose of ``block_range``: smallest ``[lo, hi)`` range of query blocks (last axis of
    ``qmin`` / ``qmax``) that can see some key of a key range ``[kmin, kmax]`` (broadcast)."""
    n = qmin.shape[-1]
    kmin, kmax = jnp.asarray(kmin)[..., None], jnp.asarray(kmax)[..., None]
    vis = (qmin < BIG) & (kmin < BIG)
    if causal:
        vis &= qmax >= kmin
    if window is not None:
        vis &= qmin - kmax < window
    ids = jnp.arange(n, dtype=jnp.int32)
    return (
        jnp.min(jnp.where(vis, ids, n), axis=-1).astype(jnp.int32),
        jnp.max(jnp.where(vis, ids + 1, 0), axis=-1).astype(jnp.int32),
    )


__all__ = ["BIG", "visible", "block_bounds", "block_range", "query_block_range"]
