"""TPU (Mosaic) split-K decode attention: one query token per (row, query head) over a KVSource.

Grid ``(B, splits, blocks per split)``, the last axis "arbitrary". A program owns one row and one
split and holds *all* K heads of each slot block (``[K, block_k, X]`` blocks of head-major arrays,
``[K, block_k]`` of per-token arrays: full-K blocks keep every block shape (8, 128)-legal and the
per-token scales lane vectors), loops over the heads statically and keeps each head's online
softmax in VMEM scratch (lane-replicated ``[K, G, 128]`` max / normaliser, float32 accumulators
whose widths the source's ``TPUCodec`` names). The row's visible range ``[kv_start, kv_len)`` and
a pool's ``head_base`` are scalar-prefetched: the K/V index map walks only the visible blocks of
the split (afterwards it repeats a block: no DMA) and the body runs under ``pl.when``. Splits are
merged outside with the log-sum-exp correction. ``block_k`` is a multiple of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallasite.ops.attention.flash_tpu import LANES, lanes
from pallasite.ops.attention.kv_source import KVSource
from pallasite.ops.common import pad_axis, round_up

DEFAULT_BLOCK_K = 512
DEFAULT_K_SPLITS = 2  # two TensorCores per chip on v4 / v5p ("parallel" grid axes are split)


class _Mask:
    """Visibility of the slots of one block: ``row`` ``[1, bk]`` and ``col`` ``[bk, 1]`` (both built
    from iotas, so no lane-to-sublane relayout is needed for either orientation)."""

    def __init__(self, first_slot, start, length, bk):
        row = first_slot + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        col = first_slot + jax.lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        self.row = (row >= start) & (row < length)
        self.col = (col >= start) & (col < length)


def _walk(b, split, len_ref, start_ref, *, bk, bps, n_blocks):
    """``[lo, hi)``: the blocks of ``split`` that intersect row ``b``'s visible slots."""
    first = split * bps
    lo = jnp.maximum(start_ref[b] // bk, first)
    hi = jnp.minimum(pl.cdiv(len_ref[b], bk), jnp.minimum(first + bps, n_blocks))
    return lo, hi


def _kernel(
    len_ref, start_ref, base_ref, q_ref, *refs, codec, n_arrays, scale, bk, bps, n_blocks, K
):
    del base_ref  # used by the index maps only
    n_parts = len(codec.widths)
    arrays = refs[:n_arrays]
    o_refs = refs[n_arrays : n_arrays + n_parts]
    m_out, l_out = refs[n_arrays + n_parts : n_arrays + n_parts + 2]
    m_sc, l_sc = refs[n_arrays + n_parts + 2 : n_arrays + n_parts + 4]
    acc_scs = refs[n_arrays + n_parts + 4 :]
    b, split, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = _walk(b, split, len_ref, start_ref, bk=bk, bps=bps, n_blocks=n_blocks)
    blk = lo + t  # the block the index maps fetched at this step (the same walk)
    length, start = len_ref[b], start_ref[b]

    @pl.when(t == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        for acc in acc_scs:
            acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(blk < hi)
    def _step():
        mask = _Mask(blk * bk, start, length, bk)
        for h in range(K):
            s = codec.scores(q_ref[h], arrays, h) * scale  # [G, bk] float32
            s = jnp.where(mask.row, s, -jnp.inf)
            m_prev = m_sc[h]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe[:, :1])
            corr = jnp.exp(m_prev - m_safe)
            l_sc[h] = corr * l_sc[h] + jnp.sum(p, axis=1, keepdims=True)
            m_sc[h] = m_new
            for acc, part in zip(acc_scs, codec.values(p, arrays, h, mask)):
                acc[h] = lanes(corr, acc.shape[-1]) * acc[h] + part

    @pl.when(t == pl.num_programs(2) - 1)
    def _finish():
        for o_ref, acc in zip(o_refs, acc_scs):
            o_ref[...] = acc[...]
        m_out[...] = m_sc[...]
        l_out[...] = l_sc[...]


def merge_splits(parts, m, denom, axis):
    """Combine per-split partial outputs (split axis ``axis``) with the log-sum-exp correction;
    splits with no visible key have m = -inf and weight 0; rows with none at all return 0."""
    m_max = jnp.max(m, axis=axis, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m - m_max)
    den = jnp.sum(w * denom, axis=axis)
    den = jnp.where(den == 0.0, 1.0, den)[..., None]
    return tuple(jnp.sum(w[..., None] * o, axis=axis) / den for o in parts)


def decode(q_BKGD, src: KVSource, kv_len_B, kv_start_B, *, scale, block_k, k_splits, interpret):
    """``src``: head-major with a ``tpu`` codec. -> float32 [B, K, G, D]."""
    codec = src.tpu
    B, K, G, D = q_BKGD.shape
    q = codec.q_in(q_BKGD) if codec.q_in is not None else q_BKGD
    Gp = round_up(G, 8)
    q = pad_axis(q, 2, Gp)
    S = src.capacity
    bk = min(round_up(block_k, LANES), round_up(S, LANES))
    Sp = round_up(S, bk)
    arrays = tuple(pad_axis(a, 2, Sp) for a in src.arrays)  # padded slots are never visible
    n_blocks = Sp // bk
    n_splits = max(1, min(k_splits, n_blocks))
    bps = pl.cdiv(n_blocks, n_splits)
    n_splits = pl.cdiv(n_blocks, bps)
    pooled = src.head_base is not None

    def block(b, split, t, len_ref, start_ref):
        """The slot block this step reads: the split's visible blocks, then the last one again."""
        lo, hi = _walk(b, split, len_ref, start_ref, bk=bk, bps=bps, n_blocks=n_blocks)
        return jnp.clip(jnp.minimum(lo + t, jnp.maximum(hi - 1, lo)), 0, n_blocks - 1)

    def spec(a):
        if (
            a.ndim == 3
        ):  # per-token [B, K, S]: the whole K axis (a pool window would break (8, 128))
            if pooled:
                raise ValueError("decode (TPU): a pooled source holds only [B, N, S, D] arrays")
            return pl.BlockSpec(
                (None, K, bk), lambda b, s, t, lr, sr, br: (b, 0, block(b, s, t, lr, sr))
            )
        rest = a.shape[3:]
        zeros = (0,) * len(rest)
        if pooled:  # element offsets (Mosaic wants every dim an Element): head_base into the pool
            return pl.BlockSpec(
                (None, pl.Element(K), pl.Element(bk), *(pl.Element(r) for r in rest)),
                lambda b, s, t, lr, sr, br: (b, br[0], block(b, s, t, lr, sr) * bk, *zeros),
            )
        return pl.BlockSpec(
            (None, K, bk, *rest), lambda b, s, t, lr, sr, br: (b, 0, block(b, s, t, lr, sr), *zeros)
        )

    out_map = lambda b, s, t, *_: (b, s, 0, 0, 0)  # noqa: E731
    widths = codec.widths
    kernel = functools.partial(
        _kernel,
        codec=codec,
        n_arrays=len(arrays),
        scale=scale,
        bk=bk,
        bps=bps,
        n_blocks=n_blocks,
        K=K,
    )
    base = (src.head_base if pooled else jnp.zeros((), jnp.int32)).reshape(1).astype(jnp.int32)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(B, n_splits, bps),
            in_specs=[pl.BlockSpec((None, K, Gp, q.shape[-1]), lambda b, s, t, *_: (b, 0, 0, 0))]
            + [spec(a) for a in arrays],
            out_specs=[pl.BlockSpec((None, None, K, Gp, w), out_map) for w in widths]
            + [pl.BlockSpec((None, None, K, Gp, LANES), out_map)] * 2,
            scratch_shapes=[pltpu.VMEM((K, Gp, LANES), jnp.float32)] * 2
            + [pltpu.VMEM((K, Gp, w), jnp.float32) for w in widths],
        ),
        out_shape=[jax.ShapeDtypeStruct((B, n_splits, K, Gp, w), jnp.float32) for w in widths]
        + [jax.ShapeDtypeStruct((B, n_splits, K, Gp, LANES), jnp.float32)] * 2,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="pallasite_decode_tpu",
    )(kv_len_B, kv_start_B, base, q, *arrays)
    n = len(widths)
    parts = merge_splits(outs[:n], outs[n][..., 0], outs[n + 1][..., 0], axis=1)
    parts = tuple(p[:, :, :G] for p in parts)
    out = codec.out(parts) if codec.out is not None else parts[0]
    return out[..., : src.head_dim]


__all__ = ["decode", "merge_splits", "DEFAULT_BLOCK_K", "DEFAULT_K_SPLITS"]
