"""TPU (Mosaic) flash attention, forward and backward (FlashAttention-2 on TPU's memory model).

Head-major operands (q ``[B, H, T, D]``, k / v ``[B, K, S, D]``) so every block's last two dims are
(rows, D): blocks ``(block_q, D)`` / ``(block_k, D)``, ``block_q`` a multiple of 16 and ``block_k``
of 128. Grid ``(B, H, q blocks, k blocks)``, the last axis "arbitrary": the online-softmax state
lives in VMEM scratch (lane-replicated ``[block_q, 128]`` max / normaliser, ``[block_q, D]``
float32 accumulator). Block skipping is data-dependent: the ``[lo, hi)`` key-block range of each
query block (``blocks.block_range``) is scalar-prefetched, the K/V index map walks that range and
repeats its last block afterwards (no DMA), and the body runs under ``pl.when``. Backward: dK/dV
over grid ``(B, K, k blocks, G, q blocks)`` (the G query heads of a KV group accumulate into one
scratch, no per-head copies), dQ over the forward's grid. Masks come from per-row position /
segment lanes (``[B, T, 128]``, lane 0 position, lane 1 segment) and per-key sublanes
(``[B, 8, S]``: position, valid, segment).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallasite.ops.attention.blocks import block_bounds, block_range, query_block_range, visible
from pallasite.ops.common import dot, pad_axis, round_up

LANES = 128
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 128


def sublanes(dtype) -> int:
    """Rows of one native TPU tile for ``dtype``: 8 (32-bit), 16 (bf16), 32 (8-bit)."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def geometry(T: int, S: int, dtype, block_q: int, block_k: int):
    sub = sublanes(dtype)
    bq = min(round_up(block_q, sub), round_up(T, sub))
    bk = min(round_up(block_k, LANES), round_up(S, LANES))
    return bq, bk, round_up(T, bq), round_up(S, bk)


def lanes(x_R128: jax.Array, n: int) -> jax.Array:
    """A lane-replicated ``[rows, 128]`` statistic widened (or narrowed) to ``[rows, n]``."""
    if n == LANES:
        return x_R128
    if n < LANES:
        return x_R128[:, :n]
    if n % LANES == 0:
        return jnp.tile(x_R128, (1, n // LANES))
    return jnp.broadcast_to(x_R128[:, :1], (x_R128.shape[0], n))


def q_info(qpos_BT, qseg_BT, Tp):
    """``[B, Tp, 128]`` int32: lane 0 the position, lane 1 the segment of each query row."""
    info = jnp.stack([pad_axis(qpos_BT, 1, Tp), pad_axis(qseg_BT, 1, Tp)], axis=-1)
    return pad_axis(info.astype(jnp.int32), 2, LANES)


def k_info(kpos_BS, kvalid_BS, kseg_BS, Sp):
    """``[B, 8, Sp]`` int32: row 0 position, row 1 validity (padding: invalid), row 2 segment."""
    info = jnp.stack(
        [pad_axis(kpos_BS, 1, Sp), pad_axis(kvalid_BS, 1, Sp), pad_axis(kseg_BS, 1, Sp)], axis=1
    )
    return pad_axis(info.astype(jnp.int32), 1, 8)


def _mask(qi_ref, ki_ref, *, causal, window, use_segments):
    qi, ki = qi_ref[...], ki_ref[...]
    return visible(
        qi[:, 0:1],
        ki[0:1, :],
        ki[1:2, :],
        qi[:, 1:2],
        ki[2:3, :],
        causal=causal,
        window=window,
        use_segments=use_segments,
    )


def _clamped(lo, hi, step, n):
    """Block visited at ``step`` of a ``[lo, hi)`` walk: past the end it repeats the last block
    (an unchanged block index issues no DMA)."""
    return jnp.clip(jnp.minimum(lo + step, jnp.maximum(hi - 1, lo)), 0, n - 1)


def _ranges(qpos, kpos, kvalid, T, bq, bk, Tp, Sp, *, causal, window):
    """Per query block its key-block range and per key block its query-block range, flattened."""
    B = qpos.shape[0]
    q_real = pad_axis(jnp.ones((B, T), jnp.int32), 1, Tp)
    qmin, qmax = block_bounds(pad_axis(qpos, 1, Tp), q_real, bq)  # [B, nq]
    kmin, kmax = block_bounds(pad_axis(kpos, 1, Sp), pad_axis(kvalid, 1, Sp), bk)  # [B, nk]
    k_lo, k_hi = block_range(
        kmin[:, None, :], kmax[:, None, :], qmin, qmax, causal=causal, window=window
    )
    q_lo, q_hi = query_block_range(
        qmin[:, None, :], qmax[:, None, :], kmin, kmax, causal=causal, window=window
    )
    return k_lo.reshape(-1), k_hi.reshape(-1), q_lo.reshape(-1), q_hi.reshape(-1)


def _params(*semantics):
    return pltpu.CompilerParams(dimension_semantics=semantics)


# ----------------------------------------------------------------------------- forward
def _fwd_kernel(
    lo_ref,
    hi_ref,
    q_ref,
    k_ref,
    v_ref,
    qi_ref,
    ki_ref,
    o_ref,
    lse_ref,
    m_sc,
    l_sc,
    acc_sc,
    *,
    scale,
    causal,
    window,
    use_segments,
    nq,
):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, hi = lo_ref[b * nq + i], hi_ref[b * nq + i]
    D = acc_sc.shape[1]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when(lo + j < hi)
    def _step():
        s = dot(q_ref[...], k_ref[...], trans_b=True) * scale  # [bq, bk] float32
        s = jnp.where(
            _mask(qi_ref, ki_ref, causal=causal, window=window, use_segments=use_segments),
            s,
            -jnp.inf,
        )
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [bq, 128]
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # all masked so far: keep exp() finite
        p = jnp.exp(s - m_safe[:, :1])
        corr = jnp.exp(m_prev - m_safe)
        l_sc[...] = corr * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        v = v_ref[...]
        acc_sc[...] = lanes(corr, D) * acc_sc[...] + dot(p.astype(v.dtype), v)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        denom = l_sc[...]
        empty = denom == 0.0  # no visible key: output 0, lse +inf (no gradient)
        o_ref[...] = (acc_sc[...] / lanes(jnp.where(empty, 1.0, denom), D)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, jnp.inf, m_sc[...] + jnp.log(jnp.where(empty, 1.0, denom)))


def forward(
    q_BHTD,
    k_BKSD,
    v_BKSD,
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
    """-> (out [B, H, T, D] in q's dtype, lse [B, H, Tp] float32)."""
    B, H, T, D = q_BHTD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G = H // K
    bq, bk, Tp, Sp = geometry(T, S, q_BHTD.dtype, block_q, block_k)
    nq, nk = Tp // bq, Sp // bk
    lo, hi, _, _ = _ranges(qpos, kpos, kvalid, T, bq, bk, Tp, Sp, causal=causal, window=window)
    q = pad_axis(q_BHTD, 2, Tp)
    k, v = pad_axis(k_BKSD, 2, Sp), pad_axis(v_BKSD, 2, Sp)

    def kv_map(b, h, i, j, lo_ref, hi_ref):
        return b, h // G, _clamped(lo_ref[b * nq + i], hi_ref[b * nq + i], j, nk), 0

    def ki_map(b, h, i, j, lo_ref, hi_ref):
        return b, 0, _clamped(lo_ref[b * nq + i], hi_ref[b * nq + i], j, nk)

    q_map = lambda b, h, i, j, *_: (b, h, i, 0)  # noqa: E731
    kernel = functools.partial(
        _fwd_kernel, scale=scale, causal=causal, window=window, use_segments=use_segments, nq=nq
    )
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, H, nq, nk),
            in_specs=[
                pl.BlockSpec((None, None, bq, D), q_map),
                pl.BlockSpec((None, None, bk, D), kv_map),
                pl.BlockSpec((None, None, bk, D), kv_map),
                pl.BlockSpec((None, bq, LANES), lambda b, h, i, j, *_: (b, i, 0)),
                pl.BlockSpec((None, 8, bk), ki_map),
            ],
            out_specs=[
                pl.BlockSpec((None, None, bq, D), q_map),
                pl.BlockSpec((None, None, bq, LANES), q_map),
            ],
            scratch_shapes=[
                pltpu.VMEM((bq, LANES), jnp.float32),
                pltpu.VMEM((bq, LANES), jnp.float32),
                pltpu.VMEM((bq, D), jnp.float32),
            ],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((B, H, Tp, D), q_BHTD.dtype),
            jax.ShapeDtypeStruct((B, H, Tp, LANES), jnp.float32),
        ],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="pallasite_flash_fwd_tpu",
    )(lo, hi, q, k, v, q_info(qpos, qseg, Tp), k_info(kpos, kvalid, kseg, Sp))
    return out[:, :, :T], lse[..., 0]


# ----------------------------------------------------------------------------- backward
def _dkv_kernel(
    lo_ref,
    hi_ref,
    q_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qi_ref,
    k_ref,
    v_ref,
    ki_ref,
    dk_ref,
    dv_ref,
    dk_sc,
    dv_sc,
    *,
    scale,
    causal,
    window,
    use_segments,
    nk,
):
    b, jk, g, i = pl.program_id(0), pl.program_id(2), pl.program_id(3), pl.program_id(4)
    lo, hi = lo_ref[b * nk + jk], hi_ref[b * nk + jk]

    @pl.when((g == 0) & (i == 0))
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    @pl.when(lo + i < hi)
    def _step():
        q, do, k, v = q_ref[...], do_ref[...], k_ref[...], v_ref[...]
        s = dot(q, k, trans_b=True) * scale  # [bq, bk]
        mask = _mask(qi_ref, ki_ref, causal=causal, window=window, use_segments=use_segments)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...][:, :1]), 0.0)
        dv_sc[...] += dot(p.astype(do.dtype), do, trans_a=True)  # [bk, D]
        ds = p * (dot(do, v, trans_b=True) - delta_ref[...][:, :1])
        dk_sc[...] += dot(ds.astype(q.dtype), q, trans_a=True) * scale

    @pl.when((g == pl.num_programs(3) - 1) & (i == pl.num_programs(4) - 1))
    def _finish():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(
    lo_ref,
    hi_ref,
    q_ref,
    do_ref,
    lse_ref,
    delta_ref,
    qi_ref,
    k_ref,
    v_ref,
    ki_ref,
    dq_ref,
    dq_sc,
    *,
    scale,
    causal,
    window,
    use_segments,
    nq,
):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    lo, hi = lo_ref[b * nq + i], hi_ref[b * nq + i]

    @pl.when(j == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    @pl.when(lo + j < hi)
    def _step():
        q, do, k, v = q_ref[...], do_ref[...], k_ref[...], v_ref[...]
        s = dot(q, k, trans_b=True) * scale
        mask = _mask(qi_ref, ki_ref, causal=causal, window=window, use_segments=use_segments)
        p = jnp.where(mask, jnp.exp(s - lse_ref[...][:, :1]), 0.0)
        ds = p * (dot(do, v, trans_b=True) - delta_ref[...][:, :1])
        dq_sc[...] += dot(ds.astype(k.dtype), k) * scale

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def backward(
    q_BHTD,
    k_BKSD,
    v_BKSD,
    qpos,
    kpos,
    qseg,
    kseg,
    kvalid,
    out_BHTD,
    lse_BHT,
    g_BHTD,
    *,
    causal,
    window,
    use_segments,
    scale,
    block_q,
    block_k,
    interpret,
):
    """FlashAttention-2 backward: dK/dV per key block (all G heads of its group), dQ per q block."""
    B, H, T, D = q_BHTD.shape
    K, S = k_BKSD.shape[1], k_BKSD.shape[2]
    G = H // K
    bq, bk, Tp, Sp = geometry(T, S, q_BHTD.dtype, block_q, block_k)
    nq, nk = Tp // bq, Sp // bk
    k_lo, k_hi, q_lo, q_hi = _ranges(
        qpos, kpos, kvalid, T, bq, bk, Tp, Sp, causal=causal, window=window
    )
    delta = jnp.sum(g_BHTD.astype(jnp.float32) * out_BHTD.astype(jnp.float32), axis=-1)  # [B, H, T]
    rows = lambda x: jnp.broadcast_to(pad_axis(x, 2, Tp)[..., None], (B, H, Tp, LANES))  # noqa: E731
    lse, delta = rows(lse_BHT[:, :, :T]), rows(delta)
    q, do = (
        pad_axis(q_BHTD, 2, Tp),
        pad_axis(g_BHTD.astype(q_BHTD.dtype), 2, Tp),
    )  # padded rows: no gradient
    k, v = pad_axis(k_BKSD, 2, Sp), pad_axis(v_BKSD, 2, Sp)
    qi, ki = q_info(qpos, qseg, Tp), k_info(kpos, kvalid, kseg, Sp)
    kw = dict(scale=scale, causal=causal, window=window, use_segments=use_segments)

    # dK, dV: grid (B, K, nk, G, nq); the query blocks walk the range that can see this key block
    def qd_map(b, h, jk, g, i, lo_ref, hi_ref):
        return b, h * G + g, _clamped(lo_ref[b * nk + jk], hi_ref[b * nk + jk], i, nq), 0

    def qi_map(b, h, jk, g, i, lo_ref, hi_ref):
        return b, _clamped(lo_ref[b * nk + jk], hi_ref[b * nk + jk], i, nq), 0

    kv_map = lambda b, h, jk, g, i, *_: (b, h, jk, 0)  # noqa: E731
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, nk=nk, **kw),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, K, nk, G, nq),
            in_specs=[
                pl.BlockSpec((None, None, bq, D), qd_map),
                pl.BlockSpec((None, None, bq, D), qd_map),
                pl.BlockSpec((None, None, bq, LANES), qd_map),
                pl.BlockSpec((None, None, bq, LANES), qd_map),
                pl.BlockSpec((None, bq, LANES), qi_map),
                pl.BlockSpec((None, None, bk, D), kv_map),
                pl.BlockSpec((None, None, bk, D), kv_map),
                pl.BlockSpec((None, 8, bk), lambda b, h, jk, g, i, *_: (b, 0, jk)),
            ],
            out_specs=[pl.BlockSpec((None, None, bk, D), kv_map)] * 2,
            scratch_shapes=[pltpu.VMEM((bk, D), jnp.float32)] * 2,
        ),
        out_shape=[
            jax.ShapeDtypeStruct((B, K, Sp, D), k_BKSD.dtype),
            jax.ShapeDtypeStruct((B, K, Sp, D), v_BKSD.dtype),
        ],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
        name="pallasite_flash_dkv_tpu",
    )(q_lo, q_hi, q, do, lse, delta, qi, k, v, ki)

    # dQ: the forward's grid and key-block walk
    def kv_walk(b, h, i, j, lo_ref, hi_ref):
        return b, h // G, _clamped(lo_ref[b * nq + i], hi_ref[b * nq + i], j, nk), 0

    def ki_walk(b, h, i, j, lo_ref, hi_ref):
        return b, 0, _clamped(lo_ref[b * nq + i], hi_ref[b * nq + i], j, nk)

    q_map = lambda b, h, i, j, *_: (b, h, i, 0)  # noqa: E731
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, nq=nq, **kw),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, H, nq, nk),
            in_specs=[
                pl.BlockSpec((None, None, bq, D), q_map),
                pl.BlockSpec((None, None, bq, D), q_map),
                pl.BlockSpec((None, None, bq, LANES), q_map),
                pl.BlockSpec((None, None, bq, LANES), q_map),
                pl.BlockSpec((None, bq, LANES), lambda b, h, i, j, *_: (b, i, 0)),
                pl.BlockSpec((None, None, bk, D), kv_walk),
                pl.BlockSpec((None, None, bk, D), kv_walk),
                pl.BlockSpec((None, 8, bk), ki_walk),
            ],
            out_specs=pl.BlockSpec((None, None, bq, D), q_map),
            scratch_shapes=[pltpu.VMEM((bq, D), jnp.float32)],
        ),
        out_shape=jax.ShapeDtypeStruct((B, H, Tp, D), q_BHTD.dtype),
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
        name="pallasite_flash_dq_tpu",
    )(k_lo, k_hi, q, do, lse, delta, qi, k, v, ki)
    return dq[:, :, :T], dk[:, :, :S], dv[:, :, :S]


__all__ = [
    "forward",
    "backward",
    "geometry",
    "sublanes",
    "lanes",
    "DEFAULT_BLOCK_Q",
    "DEFAULT_BLOCK_K",
]
