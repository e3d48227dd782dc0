"""GPU (Triton) flash attention, forward and backward; also what runs in the generic interpreter.

One program per (batch row, query head, query block) keeps a ``[block_q, D]`` float32 accumulator
and the running max / normaliser and loops (``fori_loop``) over the key blocks of its KV head
(``h // G``: grouped-query attention reads the shared K/V, no repetition) — only over the range
that ``blocks.block_range`` finds, computed inside the kernel from per-block min / max positions
(GPU has no scalar prefetch). Slot-major operands (q ``[B, T, H, D]``, k / v ``[B, S, K, D]``);
block shapes are powers of two >= 16 (Triton), T and S are padded to block multiples and D to a
power of two. Backward (FlashAttention-2): ``delta = rowsum(dO·O)`` in jnp, one kernel per (row,
query head, key block) for dK / dV (summed over the G heads of a group afterwards), one per (row,
head, query block) for dQ.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallasite.ops.attention.blocks import (
    BIG,
    block_bounds,
    block_range,
    query_block_range,
    visible,
)
from pallasite.ops.common import dot, next_pow2, pad_axis
from pallasite.ops.dispatch import triton_params

DEFAULT_BLOCK_Q = 64
DEFAULT_BLOCK_K = 64


def _mask(qpos, kpos, kvalid, qseg, kseg, *, causal, window, use_segments):
    """[bq, bk] visibility from per-row vectors ``[bq]`` / ``[bk]``."""
    return visible(
        qpos[:, None],
        kpos[None, :],
        kvalid[None, :],
        None if qseg is None else qseg[:, None],
        None if kseg is None else kseg[None, :],
        causal=causal,
        window=window,
        use_segments=use_segments,
    )


def _padded_bounds(pos_BS, valid_BS, block, n_blocks_pad):
    """``blocks.block_bounds`` padded with sentinel blocks to a power-of-two count (Triton)."""
    bmin, bmax = block_bounds(pos_BS, valid_BS, block)
    return pad_axis(bmin, 1, n_blocks_pad, BIG), pad_axis(bmax, 1, n_blocks_pad, -BIG)


def _flash_kernel(
    q_ref,
    k_ref,
    v_ref,
    qpos_ref,
    kpos_ref,
    qseg_ref,
    kseg_ref,
    kvalid_ref,
    bmin_ref,
    bmax_ref,
    o_ref,
    lse_ref,
    *,
    scale,
    block_k,
    causal,
    window,
    use_segments,
):
    bq, D = q_ref.shape
    q = q_ref[...]  # [bq, D]
    qpos = qpos_ref[...]  # [bq]
    qseg = qseg_ref[...] if use_segments else None
    lo, hi = block_range(
        bmin_ref[...], bmax_ref[...], jnp.min(qpos), jnp.max(qpos), causal=causal, window=window
    )

    def body(j, carry):
        acc, m_prev, l_prev = carry
        sl = pl.ds(j * block_k, block_k)
        k = k_ref[sl, :]
        s = dot(q, k, trans_b=True) * scale  # [bq, bk] float32
        mask = _mask(
            qpos,
            kpos_ref[sl],
            kvalid_ref[sl],
            qseg,
            kseg_ref[sl] if use_segments else None,
            causal=causal,
            window=window,
            use_segments=use_segments,
        )
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all-masked so far: keep exp() finite
        p = jnp.exp(s - m_safe[:, None])
        corr = jnp.exp(m_prev - m_safe)
        l_new = corr * l_prev + jnp.sum(p, axis=1)
        v = v_ref[sl, :]
        acc = corr[:, None] * acc + dot(p.astype(v.dtype), v)
        return acc, m_new, l_new

    init = (
        jnp.zeros((bq, D), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    acc, m, denom = lax.fori_loop(lo, hi, body, init)
    empty = denom == 0.0  # rows with no visible key -> output 0, lse +inf (no gradient)
    o_ref[...] = (acc / jnp.where(empty, 1.0, denom)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, denom)))


def _geometry(T, S, D, block_q, block_k):
    bq = min(block_q, next_pow2(T))
    bk = min(block_k, next_pow2(S))
    return bq, bk, pl.cdiv(T, bq) * bq, pl.cdiv(S, bk) * bk, next_pow2(D)


def _pad_inputs(q, k, v, qpos, kpos, qseg, kseg, kvalid, Tp, Sp, Dp):
    # Padding: extra queries are computed and dropped; extra keys are marked invalid; extra
    # feature columns are zeros (they add 0 to q·k and produce 0 output columns).
    return (
        pad_axis(pad_axis(q, 1, Tp), 3, Dp),
        pad_axis(pad_axis(k, 1, Sp), 3, Dp),
        pad_axis(pad_axis(v, 1, Sp), 3, Dp),
        pad_axis(qpos, 1, Tp),
        pad_axis(kpos, 1, Sp),
        pad_axis(qseg, 1, Tp),
        pad_axis(kseg, 1, Sp),
        pad_axis(kvalid, 1, Sp, 0),
    )


def forward(
    q,
    k,
    v,
    qpos,
    kpos,
    qseg,
    kseg,
    kvalid,
    *,
    causal,
    window,
    use_segments,
    scale,
    block_q,
    block_k,
    interpret,
):
    """Padded forward: (out [B, T, H, D], lse [B, H, Tp] float32)."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    bq, bk, Tp, Sp, Dp = _geometry(T, S, D, block_q, block_k)
    q, k, v, qpos, kpos, qseg, kseg, kvalid = _pad_inputs(
        q, k, v, qpos, kpos, qseg, kseg, kvalid, Tp, Sp, Dp
    )
    n_blocks_pad = next_pow2(Sp // bk, minimum=1)
    bmin, bmax = _padded_bounds(kpos, kvalid, bk, n_blocks_pad)

    kernel = functools.partial(
        _flash_kernel,
        scale=scale,
        block_k=bk,
        causal=causal,
        window=window,
        use_segments=use_segments,
    )
    row_q = pl.BlockSpec((None, bq), lambda b, h, i: (b, i))
    row_k = pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0))
    row_blocks = pl.BlockSpec((None, n_blocks_pad), lambda b, h, i: (b, 0))
    out, lse = pl.pallas_call(
        kernel,
        grid=(B, H, Tp // bq),
        in_specs=[
            pl.BlockSpec((None, bq, None, Dp), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, Sp, None, Dp), lambda b, h, i: (b, 0, h // G, 0)),
            pl.BlockSpec((None, Sp, None, Dp), lambda b, h, i: (b, 0, h // G, 0)),
            row_q,
            row_k,
            row_q,
            row_k,
            row_k,
            row_blocks,
            row_blocks,
        ],
        out_specs=[
            pl.BlockSpec((None, bq, None, Dp), lambda b, h, i: (b, i, h, 0)),
            pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, Tp, H, Dp), q.dtype),
            jax.ShapeDtypeStruct((B, H, Tp), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=triton_params(interpret),
        name="pallasite_flash_attention",
    )(q, k, v, qpos, kpos, qseg, kseg, kvalid, bmin, bmax)
    return out[:, :T, :, :D], lse


def _dkdv_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qpos_ref,
    kpos_ref,
    qseg_ref,
    kseg_ref,
    kvalid_ref,
    qmin_ref,
    qmax_ref,
    dk_ref,
    dv_ref,
    *,
    scale,
    block_q,
    causal,
    window,
    use_segments,
):
    """One key block of one query head: loop over the query blocks that can see it."""
    bk, D = k_ref.shape
    k, v = k_ref[...], v_ref[...]
    kpos, kvalid = kpos_ref[...], kvalid_ref[...]
    kseg = kseg_ref[...] if use_segments else None
    kmin = jnp.min(jnp.where(kvalid != 0, kpos, BIG))
    kmax = jnp.max(jnp.where(kvalid != 0, kpos, -BIG))
    # query blocks (min / max position per block, sentinel-padded) that can see this key block
    lo, hi = query_block_range(
        qmin_ref[...], qmax_ref[...], kmin, kmax, causal=causal, window=window
    )

    def body(i, carry):
        dk, dv = carry
        sl = pl.ds(i * block_q, block_q)
        q, do = q_ref[sl, :], do_ref[sl, :]
        s = dot(q, k, trans_b=True) * scale  # [bq, bk]
        mask = _mask(
            qpos_ref[sl],
            kpos,
            kvalid,
            qseg_ref[sl] if use_segments else None,
            kseg,
            causal=causal,
            window=window,
            use_segments=use_segments,
        )
        p = jnp.where(mask, jnp.exp(s - lse_ref[sl][:, None]), 0.0)
        dv = dv + dot(p.astype(do.dtype), do, trans_a=True)  # [bk, D]
        dp = dot(do, v, trans_b=True)  # [bq, bk]
        ds = p * (dp - delta_ref[sl][:, None])
        dk = dk + dot(ds.astype(q.dtype), q, trans_a=True) * scale
        return dk, dv

    zeros = jnp.zeros((bk, D), jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qpos_ref,
    kpos_ref,
    qseg_ref,
    kseg_ref,
    kvalid_ref,
    bmin_ref,
    bmax_ref,
    dq_ref,
    *,
    scale,
    block_k,
    causal,
    window,
    use_segments,
):
    """One query block of one head: loop over the key blocks it can see."""
    bq, D = q_ref.shape
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qpos = qpos_ref[...]
    qseg = qseg_ref[...] if use_segments else None
    lo, hi = block_range(
        bmin_ref[...], bmax_ref[...], jnp.min(qpos), jnp.max(qpos), causal=causal, window=window
    )

    def body(j, dq):
        sl = pl.ds(j * block_k, block_k)
        k, v = k_ref[sl, :], v_ref[sl, :]
        s = dot(q, k, trans_b=True) * scale
        mask = _mask(
            qpos,
            kpos_ref[sl],
            kvalid_ref[sl],
            qseg,
            kseg_ref[sl] if use_segments else None,
            causal=causal,
            window=window,
            use_segments=use_segments,
        )
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        ds = p * (dot(do, v, trans_b=True) - delta[:, None])
        return dq + dot(ds.astype(k.dtype), k) * scale

    dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, D), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def backward(
    q,
    k,
    v,
    qpos,
    kpos,
    qseg,
    kseg,
    kvalid,
    out,
    lse,
    g,
    *,
    causal,
    window,
    use_segments,
    scale,
    block_q,
    block_k,
    interpret,
):
    """FlashAttention-2 backward in two Pallas kernels (dK/dV per key block, dQ per query block)."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    bq, bk, Tp, Sp, Dp = _geometry(T, S, D, block_q, block_k)
    # delta_i = Σ_d dO_i·O_i (float32), [B, H, Tp]
    delta = jnp.einsum("bthd,bthd->bht", g.astype(jnp.float32), out.astype(jnp.float32))
    delta = pad_axis(delta, 2, Tp)
    qp, kp, vp, qpos_p, kpos_p, qseg_p, kseg_p, kvalid_p = _pad_inputs(
        q, k, v, qpos, kpos, qseg, kseg, kvalid, Tp, Sp, Dp
    )
    do = pad_axis(pad_axis(g.astype(q.dtype), 1, Tp), 3, Dp)  # padded query rows carry no gradient
    nq_pad = next_pow2(Tp // bq, minimum=1)
    # query blocks: min / max position (padded query rows are excluded via a validity row)
    q_real = pad_axis(jnp.ones((B, T), jnp.int32), 1, Tp, 0)
    qmin, qmax = _padded_bounds(qpos_p, q_real, bq, nq_pad)
    nk_pad = next_pow2(Sp // bk, minimum=1)
    bmin, bmax = _padded_bounds(kpos_p, kvalid_p, bk, nk_pad)
    params = triton_params(interpret)

    kw = dict(scale=scale, causal=causal, window=window, use_segments=use_segments)
    full_q = pl.BlockSpec((None, Tp, None, Dp), lambda b, h, j: (b, 0, h, 0))
    blk_k = pl.BlockSpec((None, bk, None, Dp), lambda b, h, j: (b, j, h // G, 0))
    row_full_q = pl.BlockSpec((None, None, Tp), lambda b, h, j: (b, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, block_q=bq, **kw),
        grid=(B, H, Sp // bk),
        in_specs=[
            full_q,
            blk_k,
            blk_k,
            full_q,
            row_full_q,
            row_full_q,
            pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
            pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
            pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
            pl.BlockSpec((None, nq_pad), lambda b, h, j: (b, 0)),
            pl.BlockSpec((None, nq_pad), lambda b, h, j: (b, 0)),
        ],
        out_specs=[pl.BlockSpec((None, bk, None, Dp), lambda b, h, j: (b, j, h, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, Sp, H, Dp), jnp.float32)] * 2,
        interpret=interpret,
        compiler_params=params,
        name="pallasite_flash_dkdv",
    )(qp, kp, vp, do, lse, delta, qpos_p, kpos_p, qseg_p, kseg_p, kvalid_p, qmin, qmax)
    # per query head -> per KV head: sum over the G heads of each group
    dk = dk.reshape(B, Sp, K, G, Dp).sum(3)[:, :S, :, :D].astype(k.dtype)
    dv = dv.reshape(B, Sp, K, G, Dp).sum(3)[:, :S, :, :D].astype(v.dtype)

    blk_q = pl.BlockSpec((None, bq, None, Dp), lambda b, h, i: (b, i, h, 0))
    full_k = pl.BlockSpec((None, Sp, None, Dp), lambda b, h, i: (b, 0, h // G, 0))
    row_q = pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, block_k=bk, **kw),
        grid=(B, H, Tp // bq),
        in_specs=[
            blk_q,
            full_k,
            full_k,
            blk_q,
            row_q,
            row_q,
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
            pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
            pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
            pl.BlockSpec((None, nk_pad), lambda b, h, i: (b, 0)),
            pl.BlockSpec((None, nk_pad), lambda b, h, i: (b, 0)),
        ],
        out_specs=blk_q,
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, Dp), jnp.float32),
        interpret=interpret,
        compiler_params=params,
        name="pallasite_flash_dq",
    )(qp, kp, vp, do, lse, delta, qpos_p, kpos_p, qseg_p, kseg_p, kvalid_p, bmin, bmax)
    return dq[:, :T, :, :D].astype(q.dtype), dk, dv


__all__ = ["forward", "backward", "DEFAULT_BLOCK_Q", "DEFAULT_BLOCK_K"]
