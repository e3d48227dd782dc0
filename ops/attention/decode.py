"""Decode attention (one new token per row) over a KV cache, split-K ("flash decoding").

``decode_attention(q_BKGD, source, kv_len_B, kv_start_B)`` attends each row's query heads (grouped
by KV head) over the cache slots ``[kv_start, kv_len)`` of a ``KVSource`` (dense, int8, 4-bit or a
pool window: ``ops.attention.kv_source``) and picks its kernel with ``ops.dispatch``: the TPU
variant (``decode_tpu``: full-K blocks, scalar-prefetched lengths / pool base) or the GPU variant
(``decode_gpu``: per-(row, head) programs, Triton; the generic interpreter on CPU). Splits are
merged with the log-sum-exp correction; rows with an empty range return 0. A source without a TPU
codec runs the jnp twin ``decode_attention_reference`` on TPU, with one logged warning.
``decode_attention_dense`` is the dense cache's entry (slot = position; a sliding window moves
``kv_start``).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

import pallasite.ops.attention.decode_gpu as decode_gpu
import pallasite.ops.attention.decode_tpu as decode_tpu
from pallasite.ops.attention.kv_source import (  # noqa: F401  (re-exported: the decode API)
    KVSource,
    TPUCodec,
    dense_source,
    pooled_source,
    quantize_int8,
    scaled_int8_source,
)
from pallasite.ops.common import next_pow2
from pallasite.ops.dispatch import pick_variant, warn_fallback, warn_once


def _check(q_BKGD, source: KVSource):
    B, K, G, D = q_BKGD.shape
    axes = "[B, K, S, ...]" if source.kv_layout == "BKSD" else "[B, S, K, ...]"
    if source.arrays[0].shape[0] != B or source.n_kv_heads != K or source.head_dim != D:
        raise ValueError(
            f"decode_attention: query [B={B}, K={K}, G={G}, D={D}] does not match the cache "
            f"{axes} = {tuple(source.arrays[0].shape)} (kv_layout={source.kv_layout}, "
            f"{source.n_kv_heads} heads) with "
            f"head_dim {source.head_dim}"
        )
    for a in source.arrays:
        if a.shape[:3] != source.arrays[0].shape[:3]:
            raise ValueError(
                f"decode_attention: cache arrays disagree on {axes[:8]}]: "
                f"{[x.shape for x in source.arrays]}"
            )


def decode_attention(
    q_BKGD: jax.Array,
    source: KVSource,
    kv_len_B: jax.Array,
    kv_start_B: Optional[jax.Array] = None,
    *,
    scale: Optional[float] = None,
    block_k: Optional[int] = None,
    k_splits: Optional[int] = None,
    interpret: Optional[Any] = None,
) -> jax.Array:
    """Attention of one query per (row, query head) over cache slots ``[kv_start_B, kv_len_B)``.

    q_BKGD: [B, K, G, D] (query heads grouped by KV head); returns float32 [B, K, G, D]. ``block_k``
    / ``k_splits``: None takes the variant's defaults (GPU 128 / 16, TPU 512 / 2).
    """
    _check(q_BKGD, source)
    B, _, _, D = q_BKGD.shape
    variant = pick_variant(interpret)
    kv_len_B = jnp.broadcast_to(jnp.asarray(kv_len_B, jnp.int32), (B,))
    kv_start_B = (
        jnp.zeros((B,), jnp.int32)
        if kv_start_B is None
        else jnp.broadcast_to(jnp.asarray(kv_start_B, jnp.int32), (B,))
    )
    scale = float(D**-0.5 if scale is None else scale)
    if variant.kind == "tpu":
        if source.tpu is None:
            warn_fallback(
                "decode_attention (TPU)",
                "the KVSource has no TPU codec",
                arrays=[tuple(a.shape) for a in source.arrays],
            )
            return decode_attention_reference(q_BKGD, source, kv_len_B, kv_start_B, scale=scale)
        if (
            source.kv_layout == "BSKD"
        ):  # the TPU kernel reads [K, block_k, ...] blocks of head-major arrays
            warn_once(
                "decode_attention (TPU)",
                "a slot-major (BSKD) cache is read through a head-major copy "
                "on every call; store it head-major",
                arrays=[tuple(a.shape) for a in source.arrays],
            )
            source = source.window().head_major()
        return decode_tpu.decode(
            q_BKGD,
            source,
            kv_len_B,
            kv_start_B,
            scale=scale,
            block_k=int(block_k or decode_tpu.DEFAULT_BLOCK_K),
            k_splits=int(k_splits or decode_tpu.DEFAULT_K_SPLITS),
            interpret=variant.interpret,
        )
    source = source.window()
    return decode_gpu.decode(
        q_BKGD,
        tuple(source.arrays),
        kv_len_B,
        kv_start_B,
        load=source.load,
        head_dim=source.head_dim,
        scale=scale,
        block_k=next_pow2(block_k or decode_gpu.DEFAULT_BLOCK_K),
        k_splits=int(k_splits or decode_gpu.DEFAULT_K_SPLITS),
        interpret=variant.interpret,
        kv_layout=source.kv_layout,
    )


def decode_attention_reference(
    q_BKGD, source: KVSource, kv_len_B, kv_start_B=None, *, scale=None, **_
):
    """jnp twin of ``decode_attention`` (float32, same slot-range semantics, 0 for empty rows)."""
    B, K, G, D = q_BKGD.shape
    k, v = source.dequantize(kv_layout="BKSD")  # [B, K, S, D]: contracted below without a transpose
    S = k.shape[2]
    scale = D**-0.5 if scale is None else scale
    kv_len_B = jnp.broadcast_to(jnp.asarray(kv_len_B, jnp.int32), (B,))
    kv_start_B = (
        jnp.zeros((B,), jnp.int32)
        if kv_start_B is None
        else jnp.broadcast_to(jnp.asarray(kv_start_B), (B,))
    )
    s = (
        jnp.einsum(
            "bkgd,bksd->bkgs",
            q_BKGD.astype(jnp.float32),
            k.astype(jnp.float32),
            precision=lax.Precision.HIGHEST,
        )
        * scale
    )
    slot = jnp.arange(S)
    visible = (slot[None] >= kv_start_B[:, None]) & (slot[None] < kv_len_B[:, None])  # [B, S]
    s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(m == -jnp.inf, 0.0, m))
    den = jnp.sum(p, axis=-1, keepdims=True)
    v = jnp.where(
        visible[:, None, :, None], v.astype(jnp.float32), 0.0
    )  # unused slots may hold NaN
    out = jnp.einsum("bkgs,bksd->bkgd", p, v, precision=lax.Precision.HIGHEST)
    return out / jnp.where(den == 0.0, 1.0, den)


def decode_attention_dense(
    q_BTHD,
    k,
    v,
    *,
    q_positions_BT,
    sliding_window=None,
    interpret=None,
    block_k: Optional[int] = None,
    k_splits: Optional[int] = None,
    kv_layout: str = "BSKD",
):
    """Decode step over a dense cache (slot = position): what ``DenseKVCache`` calls for T == 1,
    with its head-major k, v ``[B, K, S, D]`` (``kv_layout="BKSD"``); ``"BSKD"``: ``[B, S, K, D]``.
    The visible range of a token at position ``p`` is ``[0, p]`` (``[p - window + 1, p]``)."""
    B, T, H, D = q_BTHD.shape
    if T != 1:
        raise ValueError(f"decode_attention_dense: expected one query token per row, got T={T}")
    src = dense_source(k, v, kv_layout)
    K = src.n_kv_heads
    pos = q_positions_BT[:, 0].astype(jnp.int32)
    start = None if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
    q = q_BTHD.reshape(B, K, H // K, D)
    out = decode_attention(
        q, src, pos + 1, start, block_k=block_k, k_splits=k_splits, interpret=interpret
    )
    return out.reshape(B, 1, H, D).astype(q_BTHD.dtype)


dense_decode = decode_attention_dense  # the name benchmarks and tests used before the public entry

__all__ = [
    "decode_attention",
    "decode_attention_reference",
    "decode_attention_dense",
    "dense_decode",
    "KVSource",
    "TPUCodec",
    "dense_source",
    "pooled_source",
    "scaled_int8_source",
    "quantize_int8",
]
