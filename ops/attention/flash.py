"""Pallas flash attention for prefill and training (FlashAttention-2 style online softmax).

One program per (batch row, query head, query block): it keeps a ``[block_q, D]`` float32
accumulator plus the running max ``m`` and normaliser ``l`` of the softmax, and loops over key
blocks of its KV head (``h // G`` — grouped-query attention reads the shared K/V directly, no
repetition). Masks follow ``reference.attention`` exactly (positions, not indices): key ``j`` is
visible to query ``i`` iff ``k_pos[j] <= q_pos[i]`` (causal), ``q_pos[i] - k_pos[j] < window``,
``q_seg[i] == k_seg[j]`` and ``k_valid[j]``.

Block skipping. Before the loop a program works out which key blocks can contain a visible key:
the wrapper hands it, per key block, the min / max key position over *valid* keys (a few bytes
per block), and the program loops only over ``[lo, hi)``, the smallest block range that holds
every block that is not fully masked. This is exact for any position layout (a skipped block is
fully masked by construction) and gives the usual ~2x causal saving when positions increase
along the sequence (training, packed sequences, prefill into a cache).

Numerics: logits, softmax statistics and the accumulator are float32 whatever the input dtype;
``p`` is cast to V's dtype for the PV product (as in FlashAttention-2). Float32 matmuls ask for
full precision (``allow_tf32=False``) so fp32 results match the reference to ~1e-6 on GPU too.

Deviation from the reference, by design: a query row with *no* visible key returns 0 here,
whereas the reference's finite ``NEG_INF`` gives a uniform average over all keys. Such rows do
not occur for causal self-attention (a query always sees itself); tests compare rows that see
at least one key.

Backward: ``flash_attention`` carries a ``jax.custom_vjp``. The forward also writes the row
log-sum-exp; the default backward (``backward="pallas"``) is FlashAttention-2's: ``delta =
rowsum(dO·O)`` in jnp, then one kernel per (row, query head, key block) that loops over the query
blocks able to see that key block and accumulates dK, dV (summed over the G heads of a KV group
afterwards), and one per (row, head, query block) for dQ — O(T + S) memory, the same block
skipping. ``backward="reference"`` uses the VJP of the jnp reference instead. Both are tested to
equal the reference's gradients.

Lowering: the same kernel body runs in interpret mode on CPU and lowers through Triton on
NVIDIA GPUs (``plgpu.CompilerParams``); block shapes are powers of two >= 16, T and S are padded
to block multiples and D to a power of two >= 16 in the wrapper. A TPU (Mosaic) variant would
tile K/V through VMEM with a third grid axis instead of the in-kernel loop over a full-S block;
it is not written yet (the CPU interpret path does not need it).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallasite.ops.attention import default_interpret, register_pallas
from pallasite.ops.attention.reference import attention as reference_attention

_BIG = 2 ** 30  # "no key" sentinel for block min/max positions (int32-safe)


def _next_pow2(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def _pad_axis(x, axis, size, value=0):
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _compiler_params(interpret, num_warps=4, num_stages=2):
    if interpret:
        return None
    if jax.default_backend() == "gpu":
        from jax.experimental.pallas import triton as plgpu

        return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    return None


def _dot(a, b, trans_a=False, trans_b=False):
    """[M,K] x [K,N] (a: [K,M] with trans_a; b: [N,K] with trans_b) -> float32, exact for f32."""
    exact = a.dtype == jnp.float32 and b.dtype == jnp.float32
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32,
                           precision=lax.Precision.HIGHEST if exact else None)


def _mask(qpos, kpos, kvalid, qseg, kseg, *, causal, window, use_segments):
    """[bq, bk] visibility, the same rule as ``reference.attention_mask``."""
    mask = kvalid[None, :] != 0
    if causal:
        mask &= kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= (qpos[:, None] - kpos[None, :]) < window
    if use_segments:
        mask &= qseg[:, None] == kseg[None, :]
    return mask


def _block_range(bmin, bmax, qmin, qmax, *, causal, window):
    """Smallest [lo, hi) range of key blocks holding every block that is not fully masked."""
    n = bmin.shape[0]
    visible = bmin < _BIG  # block has at least one valid key
    if causal:
        visible &= bmin <= qmax
    if window is not None:
        visible &= bmax > qmin - window
    ids = jnp.arange(n, dtype=jnp.int32)
    return jnp.min(jnp.where(visible, ids, n)), jnp.max(jnp.where(visible, ids + 1, 0))


def _flash_kernel(q_ref, k_ref, v_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref, kvalid_ref,
                  bmin_ref, bmax_ref, o_ref, lse_ref, *, scale, block_k, causal, window, use_segments):
    bq, D = q_ref.shape
    q = q_ref[...]  # [bq, D]
    qpos = qpos_ref[...]  # [bq]
    qseg = qseg_ref[...] if use_segments else None
    lo, hi = _block_range(bmin_ref[...], bmax_ref[...], jnp.min(qpos), jnp.max(qpos), causal=causal, window=window)

    def body(j, carry):
        acc, m_prev, l_prev = carry
        sl = pl.ds(j * block_k, block_k)
        k = k_ref[sl, :]
        s = _dot(q, k, trans_b=True) * scale  # [bq, bk] float32
        mask = _mask(qpos, kpos_ref[sl], kvalid_ref[sl], qseg, kseg_ref[sl] if use_segments else None,
                     causal=causal, window=window, use_segments=use_segments)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all-masked so far: keep exp() finite
        p = jnp.exp(s - m_safe[:, None])
        corr = jnp.exp(m_prev - m_safe)
        l_new = corr * l_prev + jnp.sum(p, axis=1)
        v = v_ref[sl, :]
        acc = corr[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_new, l_new

    init = (jnp.zeros((bq, D), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
            jnp.zeros((bq,), jnp.float32))
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    empty = l == 0.0  # rows with no visible key -> output 0, lse +inf (no gradient)
    o_ref[...] = (acc / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l)))


def _block_bounds(pos_BS, valid_BS, block, n_blocks_pad):
    """Per block: min / max position over valid entries (sentinels when none) [B, n_pad]."""
    B, S = pos_BS.shape
    kp = pos_BS.reshape(B, S // block, block)
    kv = valid_BS.reshape(B, S // block, block) != 0
    bmin = jnp.min(jnp.where(kv, kp, _BIG), axis=-1)
    bmax = jnp.max(jnp.where(kv, kp, -_BIG), axis=-1)
    return (_pad_axis(bmin, 1, n_blocks_pad, _BIG).astype(jnp.int32),
            _pad_axis(bmax, 1, n_blocks_pad, -_BIG).astype(jnp.int32))


def _geometry(T, S, D, block_q, block_k):
    bq = min(block_q, _next_pow2(T))
    bk = min(block_k, _next_pow2(S))
    return bq, bk, pl.cdiv(T, bq) * bq, pl.cdiv(S, bk) * bk, _next_pow2(D)


def _pad_inputs(q, k, v, qpos, kpos, qseg, kseg, kvalid, Tp, Sp, Dp):
    # Padding: extra queries are computed and dropped; extra keys are marked invalid; extra
    # feature columns are zeros (they add 0 to q·k and produce 0 output columns).
    return (_pad_axis(_pad_axis(q, 1, Tp), 3, Dp), _pad_axis(_pad_axis(k, 1, Sp), 3, Dp),
            _pad_axis(_pad_axis(v, 1, Sp), 3, Dp), _pad_axis(qpos, 1, Tp), _pad_axis(kpos, 1, Sp),
            _pad_axis(qseg, 1, Tp), _pad_axis(kseg, 1, Sp), _pad_axis(kvalid, 1, Sp, 0))


def _flash_forward(q, k, v, qpos, kpos, qseg, kseg, kvalid, *, causal, window, use_segments, scale,
                   block_q, block_k, interpret):
    """Padded forward: (out [B, T, H, D], lse [B, H, Tp] float32)."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    bq, bk, Tp, Sp, Dp = _geometry(T, S, D, block_q, block_k)
    q, k, v, qpos, kpos, qseg, kseg, kvalid = _pad_inputs(q, k, v, qpos, kpos, qseg, kseg, kvalid, Tp, Sp, Dp)
    n_blocks_pad = _next_pow2(Sp // bk, minimum=1)
    bmin, bmax = _block_bounds(kpos, kvalid, bk, n_blocks_pad)

    kernel = functools.partial(_flash_kernel, scale=scale, block_k=bk, causal=causal, window=window,
                               use_segments=use_segments)
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
            row_q, row_k, row_q, row_k, row_k, row_blocks, row_blocks,
        ],
        out_specs=[pl.BlockSpec((None, bq, None, Dp), lambda b, h, i: (b, i, h, 0)),
                   pl.BlockSpec((None, None, bq), lambda b, h, i: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dp), q.dtype), jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        interpret=interpret,
        compiler_params=_compiler_params(interpret),
        name="pallasite_flash_attention",
    )(q, k, v, qpos, kpos, qseg, kseg, kvalid, bmin, bmax)
    return out[:, :T, :, :D], lse


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
                 kvalid_ref, qmin_ref, qmax_ref, dk_ref, dv_ref, *, scale, block_q, causal, window, use_segments):
    """One key block of one query head: loop over the query blocks that can see it."""
    bk, D = k_ref.shape
    k, v = k_ref[...], v_ref[...]
    kpos, kvalid = kpos_ref[...], kvalid_ref[...]
    kseg = kseg_ref[...] if use_segments else None
    valid_pos = jnp.where(kvalid != 0, kpos, _BIG)
    kmin = jnp.min(valid_pos)
    kmax = jnp.max(jnp.where(kvalid != 0, kpos, -_BIG))
    qmin, qmax = qmin_ref[...], qmax_ref[...]  # per query block, sentinel-padded
    n = qmin.shape[0]
    vis = (qmin < _BIG) & (kmin < _BIG)
    if causal:
        vis &= qmax >= kmin
    if window is not None:
        vis &= qmin - kmax < window
    ids = jnp.arange(n, dtype=jnp.int32)
    lo, hi = jnp.min(jnp.where(vis, ids, n)), jnp.max(jnp.where(vis, ids + 1, 0))

    def body(i, carry):
        dk, dv = carry
        sl = pl.ds(i * block_q, block_q)
        q, do = q_ref[sl, :], do_ref[sl, :]
        s = _dot(q, k, trans_b=True) * scale  # [bq, bk]
        mask = _mask(qpos_ref[sl], kpos, kvalid, qseg_ref[sl] if use_segments else None, kseg,
                     causal=causal, window=window, use_segments=use_segments)
        p = jnp.where(mask, jnp.exp(s - lse_ref[sl][:, None]), 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)  # [bk, D]
        dp = _dot(do, v, trans_b=True)  # [bq, bk]
        ds = p * (dp - delta_ref[sl][:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True) * scale
        return dk, dv

    zeros = jnp.zeros((bk, D), jnp.float32)
    dk, dv = lax.fori_loop(lo, hi, body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, kpos_ref, qseg_ref, kseg_ref,
               kvalid_ref, bmin_ref, bmax_ref, dq_ref, *, scale, block_k, causal, window, use_segments):
    """One query block of one head: loop over the key blocks it can see."""
    bq, D = q_ref.shape
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qpos = qpos_ref[...]
    qseg = qseg_ref[...] if use_segments else None
    lo, hi = _block_range(bmin_ref[...], bmax_ref[...], jnp.min(qpos), jnp.max(qpos), causal=causal, window=window)

    def body(j, dq):
        sl = pl.ds(j * block_k, block_k)
        k, v = k_ref[sl, :], v_ref[sl, :]
        s = _dot(q, k, trans_b=True) * scale
        mask = _mask(qpos, kpos_ref[sl], kvalid_ref[sl], qseg, kseg_ref[sl] if use_segments else None,
                     causal=causal, window=window, use_segments=use_segments)
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k) * scale

    dq = lax.fori_loop(lo, hi, body, jnp.zeros((bq, D), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _flash_backward(q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse, g, *, causal, window, use_segments, scale,
                    block_q, block_k, interpret):
    """FlashAttention-2 backward in two Pallas kernels (dK/dV per key block, dQ per query block)."""
    B, T, H, D = q.shape
    S, K = k.shape[1], k.shape[2]
    G = H // K
    bq, bk, Tp, Sp, Dp = _geometry(T, S, D, block_q, block_k)
    # delta_i = Σ_d dO_i·O_i (float32), [B, H, Tp]
    delta = jnp.einsum("bthd,bthd->bht", g.astype(jnp.float32), out.astype(jnp.float32))
    delta = _pad_axis(delta, 2, Tp)
    qp, kp, vp, qpos_p, kpos_p, qseg_p, kseg_p, kvalid_p = _pad_inputs(q, k, v, qpos, kpos, qseg, kseg, kvalid, Tp, Sp, Dp)
    do = _pad_axis(_pad_axis(g.astype(q.dtype), 1, Tp), 3, Dp)  # padded query rows carry no gradient
    nq_pad = _next_pow2(Tp // bq, minimum=1)
    # query blocks: min / max position (padded query rows are excluded via a validity row)
    q_real = _pad_axis(jnp.ones((B, T), jnp.int32), 1, Tp, 0)
    qmin, qmax = _block_bounds(qpos_p, q_real, bq, nq_pad)
    nk_pad = _next_pow2(Sp // bk, minimum=1)
    bmin, bmax = _block_bounds(kpos_p, kvalid_p, bk, nk_pad)
    params = _compiler_params(interpret)

    kw = dict(scale=scale, causal=causal, window=window, use_segments=use_segments)
    full_q = pl.BlockSpec((None, Tp, None, Dp), lambda b, h, j: (b, 0, h, 0))
    blk_k = pl.BlockSpec((None, bk, None, Dp), lambda b, h, j: (b, j, h // G, 0))
    row_full_q = pl.BlockSpec((None, None, Tp), lambda b, h, j: (b, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, block_q=bq, **kw),
        grid=(B, H, Sp // bk),
        in_specs=[full_q, blk_k, blk_k, full_q, row_full_q, row_full_q,
                  pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)), pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
                  pl.BlockSpec((None, Tp), lambda b, h, j: (b, 0)), pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
                  pl.BlockSpec((None, bk), lambda b, h, j: (b, j)),
                  pl.BlockSpec((None, nq_pad), lambda b, h, j: (b, 0)),
                  pl.BlockSpec((None, nq_pad), lambda b, h, j: (b, 0))],
        out_specs=[pl.BlockSpec((None, bk, None, Dp), lambda b, h, j: (b, j, h, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((B, Sp, H, Dp), jnp.float32)] * 2,
        interpret=interpret, compiler_params=params, name="pallasite_flash_dkdv",
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
        in_specs=[blk_q, full_k, full_k, blk_q, row_q, row_q,
                  pl.BlockSpec((None, bq), lambda b, h, i: (b, i)), pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
                  pl.BlockSpec((None, bq), lambda b, h, i: (b, i)), pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
                  pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
                  pl.BlockSpec((None, nk_pad), lambda b, h, i: (b, 0)),
                  pl.BlockSpec((None, nk_pad), lambda b, h, i: (b, 0))],
        out_specs=blk_q,
        out_shape=jax.ShapeDtypeStruct((B, Tp, H, Dp), jnp.float32),
        interpret=interpret, compiler_params=params, name="pallasite_flash_dq",
    )(qp, kp, vp, do, lse, delta, qpos_p, kpos_p, qseg_p, kseg_p, kvalid_p, bmin, bmax)
    return dq[:, :T, :, :D].astype(q.dtype), dk, dv


_STATIC = (8, 9, 10, 11, 12, 13, 14, 15)


@functools.partial(jax.custom_vjp, nondiff_argnums=_STATIC)
def _flash(q, k, v, qpos, kpos, qseg, kseg, kvalid, causal, window, use_segments, scale, block_q, block_k,
           interpret, backward):
    return _flash_forward(q, k, v, qpos, kpos, qseg, kseg, kvalid, causal=causal, window=window,
                          use_segments=use_segments, scale=scale, block_q=block_q, block_k=block_k,
                          interpret=interpret)[0]


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, kvalid, causal, window, use_segments, scale, block_q, block_k,
               interpret, backward):
    out, lse = _flash_forward(q, k, v, qpos, kpos, qseg, kseg, kvalid, causal=causal, window=window,
                              use_segments=use_segments, scale=scale, block_q=block_q, block_k=block_k,
                              interpret=interpret)
    return out, (q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse)


def _reference_for_vjp(q, k, v, qpos, kpos, qseg, kseg, kvalid, causal, window, use_segments, scale):
    return reference_attention(
        q, k, v, q_positions_BT=qpos, k_positions_BS=kpos, causal=causal, sliding_window=window,
        q_segment_ids_BT=qseg if use_segments else None, k_segment_ids_BS=kseg if use_segments else None,
        k_valid_BS=kvalid != 0, scale=scale,
    )


def _flash_bwd(causal, window, use_segments, scale, block_q, block_k, interpret, backward, res, g):
    q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse = res
    if backward == "pallas":
        dq, dk, dv = _flash_backward(q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse, g, causal=causal,
                                     window=window, use_segments=use_segments, scale=scale, block_q=block_q,
                                     block_k=block_k, interpret=interpret)
    else:
        _, vjp = jax.vjp(lambda q_, k_, v_: _reference_for_vjp(q_, k_, v_, qpos, kpos, qseg, kseg, kvalid, causal,
                                                               window, use_segments, scale), q, k, v)
        dq, dk, dv = vjp(g)
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    *,
    q_positions_BT: Optional[jax.Array] = None,
    k_positions_BS: Optional[jax.Array] = None,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    q_segment_ids_BT: Optional[jax.Array] = None,
    k_segment_ids_BS: Optional[jax.Array] = None,
    k_valid_BS: Optional[jax.Array] = None,
    scale: Optional[float] = None,
    block_q: int = 64,
    block_k: int = 64,
    interpret: Optional[bool] = None,
    backward: str = "pallas",
) -> jax.Array:
    """Flash attention with the same signature and masks as ``reference.attention``.

    q: [B,T,H,D]; k, v: [B,S,K,D] with H % K == 0 -> [B,T,H,D] in q's dtype. Differentiable
    (custom VJP: ``backward="pallas"`` runs the FlashAttention-2 backward kernels, ``"reference"``
    the VJP of the jnp reference). ``block_q`` / ``block_k`` are rounded into powers of two >= 16.
    """
    if backward not in ("pallas", "reference"):
        raise ValueError(f"flash_attention: backward={backward!r}; expected 'pallas' or 'reference'")
    B, T, H, D = q_BTHD.shape
    if k_BSKD.ndim != 4 or v_BSKD.shape != k_BSKD.shape or k_BSKD.shape[0] != B or k_BSKD.shape[3] != D:
        raise ValueError(f"flash_attention: expected k, v [B={B}, S, K, D={D}], got k {k_BSKD.shape}, v {v_BSKD.shape}")
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    if H % K:
        raise ValueError(f"flash_attention: {H} query heads are not a multiple of {K} key/value heads")
    if (q_segment_ids_BT is None) != (k_segment_ids_BS is None):
        raise ValueError("flash_attention: pass both q_segment_ids_BT and k_segment_ids_BS, or neither")
    interpret = default_interpret() if interpret is None else interpret
    if q_positions_BT is None:
        q_positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + (S - T), (B, T))
    if k_positions_BS is None:
        k_positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    use_segments = q_segment_ids_BT is not None
    qseg = (q_segment_ids_BT if use_segments else jnp.zeros((B, T))).astype(jnp.int32)
    kseg = (k_segment_ids_BS if use_segments else jnp.zeros((B, S))).astype(jnp.int32)
    kvalid = (jnp.ones((B, S), jnp.int32) if k_valid_BS is None else k_valid_BS.astype(jnp.int32))
    scale = float(D ** -0.5 if scale is None else scale)
    bq, bk = _next_pow2(block_q), _next_pow2(block_k)
    qpos = jnp.broadcast_to(q_positions_BT, (B, T)).astype(jnp.int32)
    kpos = jnp.broadcast_to(k_positions_BS, (B, S)).astype(jnp.int32)
    return _flash(q_BTHD, k_BSKD, v_BSKD, qpos, kpos, qseg, kseg, kvalid, bool(causal),
                  None if sliding_window is None else int(sliding_window), use_segments, scale, bq, bk,
                  bool(interpret), backward)


def _registered(q_BTHD, k_BSKD, v_BSKD, *, interpret=None, **kwargs):
    return flash_attention(q_BTHD, k_BSKD, v_BSKD, interpret=interpret, **kwargs)


register_pallas("flash", _registered)

__all__ = ["flash_attention"]
