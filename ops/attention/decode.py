"""Pallas decode attention (one new token per row) over a KV cache, split-K ("flash decoding").

Grid ``(B, K, n_splits)``: one program per (batch row, KV head, split of the cache). A program
holds the ``G = H // K`` query heads of its KV group as one ``[G_pad, D]`` tile (G padded to 16
so the GPU dot has a legal shape), streams its split of the cache in ``block_k`` blocks, and keeps
an online softmax (float32 max ``m``, normaliser ``l``, accumulator ``o``). The splits are merged
outside the kernel with the usual log-sum-exp correction. The loop runs only over blocks that
intersect the visible slot range ``[kv_start_B, kv_len_B)`` of its row, so a cache allocated for
32k tokens but filled to 4k costs 4k of reads, and a CateKV sparse part costs only its kept
entries.

The cache interface (what a quantized cache implements)
-------------------------------------------------------
The kernel never indexes K/V arrays itself; a ``KVSource`` does::

    KVSource(arrays=(a0, a1, ...), load=fn, head_dim=D)

* every array has layout ``[B, K, S, ...]`` (``kv_layout="BKSD"``, head-major: KV-head axis 1,
  slot axis 2) or ``[B, S, K, ...]`` (``"BSKD"``, slot-major, the default for compatibility), any
  trailing dims; the kernel hands ``load`` one ref per array, already restricted to (row b,
  head h): ref shapes ``[S, ...]``; each split program loads only its own contiguous run of blocks.
  Head-major is what the dense cache (``inference/cache/dense.py``) stores: a (row, head)
  program then streams one contiguous ``[S, D]`` slab, where slot-major reads every ``K``-th
  ``D``-run; on CPU the XLA reference path likewise contracts a head-major cache without first
  transposing all of it each step;
* ``load(refs, sl) -> (k_blk, v_blk)`` returns the ``[block_k, D]`` key and value block for the
  slot slice ``sl`` (a ``pl.ds`` of length ``block_k``) in any float dtype; the kernel casts to the
  query dtype and accumulates in float32.

``dense_source(k, v, kv_layout=...)`` is the plain cache (``load = (k_ref[sl], v_ref[sl])``);
``scaled_int8_source`` is a worked example of a quantized cache: int8 codes plus one float scale
per (token, head), dequantised inside the kernel. A 4-bit cache (FlatQuant KV4) slots in the same
way: pass packed nibbles ``[B,S,K,D//2]`` uint8 plus per-group scales / zeros ``[B,S,K,D//g]`` and a
``load`` that unpacks (``(x >> 4) & 15``, ``x & 15``), interleaves and applies ``(code - zero) *
scale`` per group. Keep trailing dims powers of two (Triton block rule). Nothing else changes:
slot ranges, splits, GQA grouping and the merge are the kernel's business.

``decode_attention(q_BKGD, source, kv_len_B, kv_start_B)`` is the kernel entry; it returns the
float32 output and the per-row log-sum-exp pieces are merged internally.
``decode_attention_reference`` is its jnp twin (same signature), used by tests and as the XLA
path. ``dense_decode`` is what ``inference/cache/dense.py`` calls (registered as
``_PALLAS_IMPLS["decode"]``): the visible range of a token at position ``p`` is ``[0, p]`` (or
``[p - window + 1, p]`` with a sliding window); the dense cache calls it with
``kv_layout="BKSD"``.

GPU notes: Triton lowering; ``block_k`` and the padded G, D are powers of two >= 16; a cache
whose capacity is not a multiple of ``block_k`` is padded (a copy) — allocate capacities as
multiples of 128 to avoid it. TPU (Mosaic) would need the K/V split DMA'd through VMEM
(``pltpu`` scratch) instead of the full-split block used here; not written yet.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallasite.ops.attention import default_interpret, register_pallas
from pallasite.ops.attention.reference import KV_LAYOUTS
from pallasite.ops.attention.flash import _compiler_params, _dot, _next_pow2, _pad_axis


@functools.partial(jax.tree_util.register_dataclass, data_fields=["arrays"], meta_fields=["load", "head_dim", "kv_layout"])
@dataclasses.dataclass(frozen=True)
class KVSource:
    """K/V storage as seen by the decode kernel: arrays ``[B, K, S, ...]`` (``kv_layout="BKSD"``)
    or ``[B, S, K, ...]`` (``"BSKD"``; only the first three axes are meant) + an in-kernel loader."""

    arrays: tuple
    load: Callable  # (refs tuple, pl.ds slice) -> (k_blk [bk, D], v_blk [bk, D])
    head_dim: int
    kv_layout: str = "BSKD"

    def __post_init__(self):
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"KVSource: kv_layout={self.kv_layout!r}; expected one of {KV_LAYOUTS}")

    @property
    def slot_axis(self) -> int:
        return 2 if self.kv_layout == "BKSD" else 1

    @property
    def head_axis(self) -> int:
        return 1 if self.kv_layout == "BKSD" else 2

    @property
    def capacity(self) -> int:
        return self.arrays[0].shape[self.slot_axis]

    @property
    def n_kv_heads(self) -> int:
        return self.arrays[0].shape[self.head_axis]

    def dequantize(self, kv_layout: str = "BSKD") -> tuple[jax.Array, jax.Array]:
        """Full K, V in jnp (reference path), by calling ``load`` on whole arrays; returned as
        ``[B, S, K, D]`` (``kv_layout="BSKD"``) or ``[B, K, S, D]`` (``"BKSD"``)."""
        def one(*arrs):  # arrs: [S, ...] for one (b, h)
            return self.load(tuple(_ArrayRef(a) for a in arrs), slice(None))

        out = 0 if kv_layout == "BKSD" else 1
        per_head = jax.vmap(one, in_axes=self.head_axis - 1, out_axes=(out, out))  # per row -> [K,S,D] / [S,K,D]
        return jax.vmap(per_head)(*self.arrays)


class _ArrayRef:
    """Lets a ``load`` written for refs (``ref[sl]``, ``ref[sl, :]``) run on plain arrays."""

    def __init__(self, a):
        self.a = a

    def __getitem__(self, idx):
        return self.a[idx]

    @property
    def shape(self):
        return self.a.shape

    @property
    def dtype(self):
        return self.a.dtype


def _dense_load(refs, sl):
    k_ref, v_ref = refs
    return k_ref[sl, :], v_ref[sl, :]


def dense_source(k: jax.Array, v: jax.Array, kv_layout: str = "BSKD") -> KVSource:
    """A float cache: k, v ``[B, S, K, D]`` (``"BSKD"``) or ``[B, K, S, D]`` (``"BKSD"``)."""
    return KVSource(arrays=(k, v), load=_dense_load, head_dim=k.shape[-1], kv_layout=kv_layout)


def _int8_load(refs, sl):
    kq, ks, vq, vs = refs
    k = kq[sl, :].astype(jnp.float32) * ks[sl][:, None].astype(jnp.float32)
    v = vq[sl, :].astype(jnp.float32) * vs[sl][:, None].astype(jnp.float32)
    return k, v


def scaled_int8_source(kq, kscale, vq, vscale, kv_layout: str = "BSKD") -> KVSource:
    """Example quantized cache: symmetric int8 codes ``[B, S, K, D]`` with one scale per (token, KV
    head) ``[B, S, K]`` (or ``[B, K, S, D]`` / ``[B, K, S]`` with ``kv_layout="BKSD"``)."""
    return KVSource(arrays=(kq, kscale, vq, vscale), load=_int8_load, head_dim=kq.shape[-1], kv_layout=kv_layout)


def quantize_int8(x):
    """Symmetric int8 quantisation with one scale per vector of the last axis (per (token, head)
    in either layout), for the example source and its tests."""
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)
    q = jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale.astype(jnp.float32)


def _decode_kernel(lens_ref, starts_ref, q_ref, *refs, load, n_arrays, scale, block_k, blocks_per_split, n_blocks):
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
        s = _dot(q, k, trans_b=True) * scale  # [Gp, bk]
        slot = i * block_k + offs
        visible = (slot >= kv_start) & (slot < kv_len)
        s = jnp.where(visible[None, :], s, -jnp.inf)
        v = jnp.where(visible[:, None], v, 0)  # unused slots may hold anything (NaN): 0 * NaN = NaN
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe[:, None])
        corr = jnp.exp(m_prev - m_safe)
        l_new = corr * l_prev + jnp.sum(p, axis=1)
        acc = corr[:, None] * acc + _dot(p.astype(v.dtype), v)
        return acc, m_new, l_new

    init = (jnp.zeros((Gp, Dp), jnp.float32), jnp.full((Gp,), -jnp.inf, jnp.float32), jnp.zeros((Gp,), jnp.float32))
    acc, m, l = lax.fori_loop(lo, hi, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _merge_splits(o_BKNGD, m_BKNG, l_BKNG):
    m_max = jnp.max(m_BKNG, axis=2, keepdims=True)
    m_max = jnp.where(m_max == -jnp.inf, 0.0, m_max)
    w = jnp.exp(m_BKNG - m_max)  # splits with no visible key have m = -inf -> weight 0
    num = jnp.sum(w[..., None] * o_BKNGD, axis=2)
    den = jnp.sum(w * l_BKNG, axis=2)
    return num / jnp.where(den == 0.0, 1.0, den)[..., None]


@functools.partial(jax.jit, static_argnames=("load", "head_dim", "scale", "block_k", "k_splits", "interpret",
                                             "kv_layout"))
def _decode_call(q_BKGD, arrays, kv_len_B, kv_start_B, *, load, head_dim, scale, block_k, k_splits, interpret,
                 kv_layout):
    B, K, G, D = q_BKGD.shape
    slot_axis = 2 if kv_layout == "BKSD" else 1
    S = arrays[0].shape[slot_axis]
    bk = min(block_k, _next_pow2(S))
    Sp = pl.cdiv(S, bk) * bk
    if Sp != S:  # padded slots are never visible (slot >= kv_len)
        arrays = tuple(_pad_axis(a, slot_axis, Sp) for a in arrays)
    n_blocks = Sp // bk
    # Splits are contiguous runs of blocks over the whole slot axis (no divisibility needed, so a
    # 32k+128-slot cache still gets k_splits programs per (row, head)).
    n_splits = max(1, min(k_splits, n_blocks))
    blocks_per_split = pl.cdiv(n_blocks, n_splits)
    n_splits = pl.cdiv(n_blocks, blocks_per_split)
    Gp, Dp = _next_pow2(G), _next_pow2(D)
    q = _pad_axis(_pad_axis(q_BKGD, 2, Gp), 3, Dp)

    def kv_spec(a):
        # The whole slot axis of one (row, head); the kernel body sees [Sp, ...] in either layout.
        rest = a.shape[3:]
        zeros = (0,) * len(rest)
        if kv_layout == "BKSD":  # head-major: one contiguous [Sp, ...] slab per (row, head)
            return pl.BlockSpec((None, None, Sp, *rest), lambda b, h, j: (b, h, 0, *zeros))
        return pl.BlockSpec((None, Sp, None, *rest), lambda b, h, j: (b, 0, h, *zeros))

    row = pl.BlockSpec((None,), lambda b, h, j: (b,))
    kernel = functools.partial(_decode_kernel, load=load, n_arrays=len(arrays), scale=scale, block_k=bk,
                               blocks_per_split=blocks_per_split, n_blocks=n_blocks)
    o, m, l = pl.pallas_call(
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
        compiler_params=_compiler_params(interpret),
        name="pallasite_decode_attention",
    )(kv_len_B.astype(jnp.int32), kv_start_B.astype(jnp.int32), q, *arrays)
    return _merge_splits(o, m, l)[:, :, :G, :head_dim]


def decode_attention(
    q_BKGD: jax.Array,
    source: KVSource,
    kv_len_B: jax.Array,
    kv_start_B: Optional[jax.Array] = None,
    *,
    scale: Optional[float] = None,
    block_k: int = 128,
    k_splits: int = 16,
    interpret: Optional[bool] = None,
) -> jax.Array:
    """Attention of one query per (row, query head) over cache slots ``[kv_start_B, kv_len_B)``.

    q_BKGD: [B, K, G, D] (query heads grouped by KV head); returns float32 [B, K, G, D].
    Rows with an empty visible range return 0.
    """
    B, K, G, D = q_BKGD.shape
    axes = "[B, K, S, ...]" if source.kv_layout == "BKSD" else "[B, S, K, ...]"
    if source.arrays[0].shape[0] != B or source.n_kv_heads != K or source.head_dim != D:
        raise ValueError(
            f"decode_attention: query [B={B}, K={K}, G={G}, D={D}] does not match the cache "
            f"{axes} = {tuple(source.arrays[0].shape)} (kv_layout={source.kv_layout}) with head_dim {source.head_dim}")
    for a in source.arrays:
        if a.shape[:3] != source.arrays[0].shape[:3]:
            raise ValueError(f"decode_attention: cache arrays disagree on {axes[:8]}]: {[x.shape for x in source.arrays]}")
    interpret = default_interpret() if interpret is None else interpret
    kv_len_B = jnp.broadcast_to(jnp.asarray(kv_len_B, jnp.int32), (B,))
    kv_start_B = jnp.zeros((B,), jnp.int32) if kv_start_B is None else jnp.broadcast_to(
        jnp.asarray(kv_start_B, jnp.int32), (B,))
    scale = float(D ** -0.5 if scale is None else scale)
    return _decode_call(q_BKGD, tuple(source.arrays), kv_len_B, kv_start_B, load=source.load, head_dim=source.head_dim,
                        scale=scale, block_k=_next_pow2(block_k), k_splits=int(k_splits), interpret=bool(interpret),
                        kv_layout=source.kv_layout)


def decode_attention_reference(q_BKGD, source: KVSource, kv_len_B, kv_start_B=None, *, scale=None, **_):
    """jnp twin of ``decode_attention`` (float32, same slot-range semantics, 0 for empty rows)."""
    B, K, G, D = q_BKGD.shape
    k, v = source.dequantize(kv_layout="BKSD")  # [B, K, S, D]: contracted below without a transpose
    S = k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    kv_len_B = jnp.broadcast_to(jnp.asarray(kv_len_B, jnp.int32), (B,))
    kv_start_B = jnp.zeros((B,), jnp.int32) if kv_start_B is None else jnp.broadcast_to(jnp.asarray(kv_start_B), (B,))
    s = jnp.einsum("bkgd,bksd->bkgs", q_BKGD.astype(jnp.float32), k.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * scale
    slot = jnp.arange(S)
    visible = (slot[None] >= kv_start_B[:, None]) & (slot[None] < kv_len_B[:, None])  # [B, S]
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
    den = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bkgs,bksd->bkgd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return out / jnp.where(den == 0.0, 1.0, den)


def dense_decode(q_BTHD, k, v, *, q_positions_BT, sliding_window=None, interpret=None,
                 block_k: int = 128, k_splits: int = 16, kv_layout: str = "BSKD"):
    """Decode step over a dense cache (slot = position): what ``DenseKVCache`` calls for T == 1,
    with its head-major k, v ``[B, K, S, D]`` (``kv_layout="BKSD"``); ``"BSKD"``: ``[B, S, K, D]``."""
    B, T, H, D = q_BTHD.shape
    if T != 1:
        raise ValueError(f"dense_decode: expected one query token per row, got T={T}")
    src = dense_source(k, v, kv_layout)
    K = src.n_kv_heads
    pos = q_positions_BT[:, 0].astype(jnp.int32)
    start = None if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
    q = q_BTHD.reshape(B, K, H // K, D)
    out = decode_attention(q, src, pos + 1, start, block_k=block_k, k_splits=k_splits,
                           interpret=interpret)
    return out.reshape(B, 1, H, D).astype(q_BTHD.dtype)


register_pallas("decode", dense_decode)

__all__ = ["KVSource", "dense_source", "scaled_int8_source", "quantize_int8", "decode_attention",
           "decode_attention_reference", "dense_decode"]
