"""The dense (full) KV cache: every key and value of every position, head-major.

``k, v`` are ``[L, B, K, S, D]`` (KV head before slot): attention contracts each (row, KV head)
over its slots, so both the XLA reference path (``kv_layout="BKSD"``) and the Pallas decode kernel
(one contiguous ``[S, D]`` slab per program) read it as stored, and a decode step costs the
scatter of one token's K/V plus one read of the cache (docs/inference.md has the measurements).
The token at position ``p`` is written to slot ``p`` (``base.KVCache``'s slot convention).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from pallasite.inference.cache.base import HeadMajorCache
from pallasite.ops.attention import attention, decode_attention_dense
from pallasite.registry import KV_CACHE


def write_head_major(cache_BKSD: jax.Array, new_BTKD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """Scatter T new tokens per row into a head-major cache at slot = position (positions past the
    capacity are dropped)."""
    B, T, K, _ = new_BTKD.shape
    rows = jnp.arange(B)[:, None, None]
    heads = jnp.arange(K)[None, :, None]
    slots = positions_BT[:, None, :]  # index arrays broadcast to [B, K, T]
    return cache_BKSD.at[rows, heads, slots].set(jnp.swapaxes(new_BTKD, 1, 2).astype(cache_BKSD.dtype), mode="drop")


@KV_CACHE.register("dense")
@struct.dataclass
class DenseKVCache(HeadMajorCache):
    k: jax.Array  # [L, B, K, S, D] (or [B, K, S, D] for one layer)
    v: jax.Array

    @property
    def slots_leaf(self):
        return self.k

    @classmethod
    def create(cls, model_cfg, batch_size: int, max_len: int, *, config=None, model=None) -> "DenseKVCache":
        return init_dense_cache(model_cfg, batch_size, max_len)

    def update_and_attend(
        self,
        q_BTHD,
        k_BTKD,
        v_BTKD,
        positions_BT,
        *,
        sliding_window: Optional[int] = None,
        impl: str = "ref",
        interpret: Optional[bool] = None,
    ):
        """Write this step's keys/values at their positions, then attend. Returns (out, cache)."""
        if self.k.ndim != 4 or k_BTKD.shape[2] != self.k.shape[1] or k_BTKD.shape[3] != self.k.shape[3]:
            raise ValueError(
                f"DenseKVCache.update_and_attend: one layer's cache [B, K, S, D] = {self.k.shape} does not "
                f"match the new keys [B, T, K, D] = {k_BTKD.shape}"
            )
        k = write_head_major(self.k, k_BTKD, positions_BT)
        v = write_head_major(self.v, v_BTKD, positions_BT)
        if impl == "pallas" and q_BTHD.shape[1] == 1:
            out = decode_attention_dense(
                q_BTHD,
                k,
                v,
                q_positions_BT=positions_BT,
                sliding_window=sliding_window,
                interpret=interpret,
                kv_layout="BKSD",
            )
            return out, DenseKVCache(k=k, v=v)
        out = attention(
            q_BTHD,
            k.astype(q_BTHD.dtype),
            v.astype(q_BTHD.dtype),
            q_positions_BT=positions_BT,
            causal=True,
            sliding_window=sliding_window,
            impl=impl,
            interpret=interpret,
            kv_layout="BKSD",
        )
        return out, DenseKVCache(k=k, v=v)


def init_dense_cache(cfg, batch_size: int, max_len: int, dtype=None) -> DenseKVCache:
    """Zeroed head-major cache [L, B, K, max_len, Dh] in ``dtype`` (default: the model's compute dtype)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.dh)
    return DenseKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
