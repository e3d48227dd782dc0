"""GPU (Triton) split-K decode attention ("flash decoding"); also what the generic interpreter runs.

Grid ``(B, K, splits)``: one program per (row, KV head, split of the cache) holds the ``G = H // K``
query heads of its group as one ``[G_pad, D]`` tile (padded to powers of two >= 16 for the dot),
loops over its split's blocks that intersect the row's visible range ``[kv_start, kv_len)`` (so a
32k-slot cache filled to 4k costs 4k of reads) and calls the source's ``load`` to dequantize each
``[block_k, D]`` block. Splits are merged outside (``decode_tpu.merge_splits``). The slot axis of
one (row, head) is the BlockSpec in either layout; a capacity that is not a multiple of
``block_k`` is padded (a copy): allocate capacities as multiples of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallasite.ops.attention.decode_tpu import merge_splits
from pallasite.ops.common import dot, next_pow2, pad_axis
from pallasite.ops.dispatch import triton_params

DEFAULT_BLOCK_K = 128
DEFAULT_K_SPLITS = 16


def _decode_kernel(
    lens_ref, starts_ref, q_ref, *refs, load, n_arrays, scale, block_k, blocks_per_split, n_blocks
):
    kv_refs = refs[:n_arrays]  # whole slot axis of this (row, head); the split picks its blocks
    o_ref, m_ref, l_ref = refs[n_arrays:]
    j = pl.program_id(2)
    q = q_ref[...]  # [Gp, Dp]
    Gp, Dp = q.shape
    first = j * blocks_per_split
    last = jnp.minimum(first + blocks_per_split, n_blocks)
    kv_len = lens_ref[...]  # row's visible slots are [start, len)
    kv_start = starts_ref[...]
    lo = jnp.clip(kv_start // block_k, first, last)
    hi = jnp.clip(pl.cdiv(kv_len, block_k), first, last)
    offs = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry):
        acc, m_prev, l_prev = carry
        sl = pl.ds(i * block_k, block_k)
        k, v = load(kv_refs, sl)
        k, v = k.astype(q.dtype), v.astype(q.dtype)
        if k.shape[-1] != Dp:  # source head_dim below the padded query width
            k = jnp.pad(k, ((0, 0), (0, Dp - k.shape[-1])))
            v = jnp.pad(v, ((0, 0), (0, Dp - v.shape[-1])))
        s = dot(q, k, trans_b=True) * scale  # [Gp, bk]
        slot = i * block_k + offs
        visible = (slot >= kv_start) & (slot < kv_len)
        s = jnp.where(visible[None, :], s, -jnp.inf)
        v = jnp.where(visible[:, None], v, 0)  # unused slots may hold anything (NaN): 0 * NaN = NaN
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        corr = jnp.exp(m_prev - m_safe)
        l_new = corr * l_prev + jnp.sum(p, axis=1)
        acc = corr[:, None] * acc + dot(p.astype(v.dtype), v)
        return acc, m_new, l_new

    init = (
        jnp.zeros((Gp, Dp), jnp.float32),
        jnp.full((Gp,), -jnp.inf, jnp.float32),
        jnp.zeros((Gp,), jnp.float32),
    )
    acc, m, denom = lax.fori_loop(lo, hi, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = denom


@functools.partial(
    jax.jit,
    static_argnames=("load", "head_dim", "scale", "block_k", "k_splits", "interpret", "kv_layout"),
)
def decode(
    q_BKGD,
    arrays,
    kv_len_B,
    kv_start_B,
    *,
    load,
    head_dim,
    scale,
    block_k,
    k_splits,
    interpret,
    kv_layout,
):
    B, K, G, D = q_BKGD.shape
    slot_axis = 2 if kv_layout == "BKSD" else 1
    S = arrays[0].shape[slot_axis]
    bk = min(block_k, next_pow2(S))
    Sp = pl.cdiv(S, bk) * bk
    if Sp != S:  # padded slots are never visible (slot >= kv_len)
        arrays = tuple(pad_axis(a, slot_axis, Sp) for a in arrays)
    n_blocks = Sp // bk
    # Splits are contiguous runs of blocks over the whole slot axis (no divisibility needed, so a
    # 32k+128-slot cache still gets k_splits programs per (row, head)).
    n_splits = max(1, min(k_splits, n_blocks))
    blocks_per_split = pl.cdiv(n_blocks, n_splits)
    n_splits = pl.cdiv(n_blocks, blocks_per_split)
    Gp, Dp = next_pow2(G), next_pow2(D)
    q = pad_axis(pad_axis(q_BKGD, 2, Gp), 3, Dp)

    def kv_spec(a):
        # The whole slot axis of one (row, head); the kernel body sees [Sp, ...] in either layout.
        rest = a.shape[3:]
        zeros = (0,) * len(rest)
        if kv_layout == "BKSD":  # head-major: one contiguous [Sp, ...] slab per (row, head)
            return pl.BlockSpec((None, None, Sp, *rest), lambda b, h, j: (b, h, 0, *zeros))
        return pl.BlockSpec((None, Sp, None, *rest), lambda b, h, j: (b, 0, h, *zeros))

    row = pl.BlockSpec((None,), lambda b, h, j: (b,))
    kernel = functools.partial(
        _decode_kernel,
        load=load,
        n_arrays=len(arrays),
        scale=scale,
        block_k=bk,
        blocks_per_split=blocks_per_split,
        n_blocks=n_blocks,
    )
    o, m, denom = pl.pallas_call(
        kernel,
        grid=(B, K, n_splits),
        in_specs=[row, row, pl.BlockSpec((None, None, Gp, Dp), lambda b, h, j: (b, h, 0, 0))]
        + [kv_spec(a) for a in arrays],
        out_specs=[
            pl.BlockSpec((None, None, None, Gp, Dp), lambda b, h, j: (b, h, j, 0, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, h, j: (b, h, j, 0)),
            pl.BlockSpec((None, None, None, Gp), lambda b, h, j: (b, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, K, n_splits, Gp, Dp), jnp.float32),
            jax.ShapeDtypeStruct((B, K, n_splits, Gp), jnp.float32),
            jax.ShapeDtypeStruct((B, K, n_splits, Gp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=triton_params(interpret),
        name="pallasite_decode_attention",
    )(kv_len_B.astype(jnp.int32), kv_start_B.astype(jnp.int32), q, *arrays)
    return merge_splits((o,), m, denom, axis=2)[0][:, :, :G, :head_dim]


__all__ = ["decode", "DEFAULT_BLOCK_K", "DEFAULT_K_SPLITS"]
