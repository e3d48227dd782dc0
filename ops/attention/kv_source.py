"""``KVSource``: how the decode kernels read a KV cache they do not own (dense, int8, 4-bit, pool).

A source is a pytree: ``arrays`` (layout ``[B, K, S, ...]`` head-major, ``kv_layout="BKSD"``, or
``[B, S, K, ...]`` slot-major, ``"BSKD"``; only the first three axes are meant) plus static
readers. ``load(refs, sl) -> (k [bk, D], v [bk, D])`` dequantizes one slot block for the GPU
kernel and the jnp reference (refs already restricted to one (row, head)). ``tpu`` (a
``TPUCodec``) is the TPU kernel's reader: per-token factors stay lane vectors ``[1, bk]`` and are
folded into the two products (``s = (q·codesᵀ)·scale``, ``o = (p·scale)·codes``), so nothing is
transposed in VMEM. ``head_base`` (optional int32 scalar) makes a source a window of
``n_heads`` heads starting at that head of a larger pool (CateKV's pools shared by all layers);
the TPU kernel scalar-prefetches it and reads the pool in place.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax import lax

from pallasite.ops.attention.reference import KV_LAYOUTS
from pallasite.ops.common import dot


@dataclasses.dataclass(frozen=True)
class TPUCodec:
    """The TPU decode kernel's view of a source, for one KV head ``h`` of a block.

    ``scores(q [G, D'], refs, h) -> [G, bk]`` float32 logits before the softmax scale;
    ``values(p [G, bk], refs, h, mask) -> tuple of [G, w]`` float32 partial outputs (one accumulator
    each, widths ``widths``); ``mask.row`` ``[1, bk]`` / ``mask.col`` ``[bk, 1]`` mark the visible
    slots (unused slots may hold anything, NaN included: 0·NaN is NaN). refs: 4-D arrays arrive
    as ``[K, bk, X]`` (index ``h`` first), 3-D per-token arrays as ``[K, bk]`` (take
    ``[h:h + 1]``: a ``[1, bk]`` lane vector).
    ``q_in(q_BKGD)`` / ``out(parts)`` rearrange the query and the outputs outside the kernel
    (4-bit codes: deinterleave and re-interleave channels)."""

    scores: Callable
    values: Callable
    widths: tuple
    q_in: Optional[Callable] = None
    out: Optional[Callable] = None


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["arrays", "head_base"],
    meta_fields=["load", "head_dim", "kv_layout", "tpu", "n_heads"],
)
@dataclasses.dataclass(frozen=True)
class KVSource:
    """K/V storage as seen by the decode kernels (see the module docstring)."""

    arrays: tuple
    load: Callable  # (refs tuple, slice) -> (k_blk [bk, D], v_blk [bk, D])
    head_dim: int
    kv_layout: str = "BSKD"
    tpu: Optional[TPUCodec] = None
    head_base: Optional[jax.Array] = None  # int32 scalar: first pool head of this window
    n_heads: Optional[int] = None  # window size (required with head_base)

    def __post_init__(self):
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"KVSource: kv_layout={self.kv_layout!r}; expected one of {KV_LAYOUTS}"
            )
        if (self.head_base is None) != (self.n_heads is None):
            raise ValueError("KVSource: head_base and n_heads come together (a window of a pool)")

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
        return self.n_heads if self.n_heads is not None else self.arrays[0].shape[self.head_axis]

    def window(self) -> "KVSource":
        """The same source with a pool window cut out (an XLA copy of the window; no head_base)."""
        if self.head_base is None:
            return self
        arrays = tuple(
            lax.dynamic_slice_in_dim(a, self.head_base, self.n_heads, axis=self.head_axis)
            for a in self.arrays
        )
        return dataclasses.replace(self, arrays=arrays, head_base=None, n_heads=None)

    def head_major(self) -> "KVSource":
        """The same source with every array head-major (a transpose when it was slot-major)."""
        if self.kv_layout == "BKSD":
            return self
        return dataclasses.replace(
            self, arrays=tuple(jnp.swapaxes(a, 1, 2) for a in self.arrays), kv_layout="BKSD"
        )

    def dequantize(self, kv_layout: str = "BSKD") -> tuple[jax.Array, jax.Array]:
        """Full K, V in jnp (reference path), by calling ``load`` on whole arrays; returned as
        ``[B, S, K, D]`` (``kv_layout="BSKD"``) or ``[B, K, S, D]`` (``"BKSD"``)."""
        src = self.window()

        def one(*arrs):  # arrs: [S, ...] for one (b, h)
            return src.load(tuple(_ArrayRef(a) for a in arrs), slice(None))

        out = 0 if kv_layout == "BKSD" else 1
        per_head = jax.vmap(one, in_axes=src.head_axis - 1, out_axes=(out, out))  # per row
        return jax.vmap(per_head)(*src.arrays)


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


# ----------------------------------------------------------------------------- dense
def _dense_load(refs, sl):
    k_ref, v_ref = refs
    return k_ref[sl, :], v_ref[sl, :]


def _dense_scores(q, refs, h):
    return dot(q, refs[0][h].astype(q.dtype), trans_b=True)


def _dense_values(p, refs, h, mask):
    v = jnp.where(mask.col, refs[1][h], 0)
    return (dot(p.astype(v.dtype), v),)


def dense_source(k: jax.Array, v: jax.Array, kv_layout: str = "BSKD") -> KVSource:
    """A float cache: k, v ``[B, S, K, D]`` (``"BSKD"``) or ``[B, K, S, D]`` (``"BKSD"``)."""
    D = k.shape[-1]
    return KVSource(
        arrays=(k, v),
        load=_dense_load,
        head_dim=D,
        kv_layout=kv_layout,
        tpu=TPUCodec(_dense_scores, _dense_values, (D,)),
    )


def pooled_source(
    k_pool: jax.Array, v_pool: jax.Array, head_base, n_heads: int, kv_layout: str = "BKSD"
) -> KVSource:
    """A window of ``n_heads`` heads from ``head_base`` of a float pool (CateKV's pools): the TPU
    kernel reads the pool in place (``head_base`` scalar-prefetched); other paths cut the window."""
    src = dense_source(k_pool, v_pool, kv_layout)
    if not 0 < n_heads <= src.n_kv_heads:
        raise ValueError(
            f"pooled_source: n_heads={n_heads} outside a pool of {src.n_kv_heads} heads"
        )
    return dataclasses.replace(
        src, head_base=jnp.asarray(head_base, jnp.int32), n_heads=int(n_heads)
    )


# ----------------------------------------------------------------------------- int8
def _int8_load(refs, sl):
    kq, ks, vq, vs = refs
    k = kq[sl, :].astype(jnp.float32) * ks[sl][:, None].astype(jnp.float32)
    v = vq[sl, :].astype(jnp.float32) * vs[sl][:, None].astype(jnp.float32)
    return k, v


def _int8_scores(q, refs, h):
    kq, ks = refs[0], refs[1]
    return dot(q, kq[h].astype(jnp.float32).astype(q.dtype), trans_b=True) * ks[
        h : h + 1, :
    ].astype(jnp.float32)


def _int8_values(p, refs, h, mask):
    vq, vs = refs[2], refs[3]
    ps = jnp.where(mask.row, p * vs[h : h + 1, :].astype(jnp.float32), 0.0)
    return (dot(ps, vq[h].astype(jnp.float32)),)


def scaled_int8_source(kq, kscale, vq, vscale, kv_layout: str = "BSKD") -> KVSource:
    """Example quantized cache: symmetric int8 codes ``[B, S, K, D]`` with one scale per (token, KV
    head) ``[B, S, K]`` (or ``[B, K, S, D]`` / ``[B, K, S]`` with ``kv_layout="BKSD"``)."""
    D = kq.shape[-1]
    return KVSource(
        arrays=(kq, kscale, vq, vscale),
        load=_int8_load,
        head_dim=D,
        kv_layout=kv_layout,
        tpu=TPUCodec(_int8_scores, _int8_values, (D,)),
    )


def quantize_int8(x):
    """Symmetric int8 quantisation with one scale per vector of the last axis (per (token, head)
    in either layout), for the example source and its tests."""
    scale = jnp.max(jnp.abs(x), axis=-1) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)
    q = jnp.clip(jnp.round(x / scale[..., None]), -127, 127).astype(jnp.int8)
    return q, scale.astype(jnp.float32)


__all__ = [
    "KVSource",
    "TPUCodec",
    "dense_source",
    "pooled_source",
    "scaled_int8_source",
    "quantize_int8",
]
