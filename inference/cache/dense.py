"""The dense (full) KV cache and the cache interface every cache kind implements.

A cache is a pytree whose array leaves carry a leading layer axis ``[L, ...]``; the model
slices layer ``i`` with ``jax.tree.map(lambda a: a[i], cache)`` (or scans over axis 0) and
calls ``layer_cache.update_and_attend(...)``. Cache kinds (dense, CateKV hybrid, 4-bit) differ
only in what they store and how they attend; the model never looks inside.

Slot convention: a token at position ``p`` is written to slot ``p``. Prompts are
right-padded; pad tokens write junk into slots past their row's length, but the next decode
step of that row writes slot ``length`` before attending to slots ``<= length``, so junk is
always overwritten before it becomes visible (causal mask by position).

Layout: ``k, v`` are head-major, ``[L, B, K, S, D]`` (KV head before slot). Attention contracts
each (row, KV head) over its slots, so it wants ``[B, K, S, D]`` operands: the XLA reference path
(``attention(..., kv_layout="BKSD")``, einsums ``btkgd,bksd->bkgts``) and the Pallas decode kernel
(``ops/attention/decode.py``, a BlockSpec per (row, head) over one contiguous ``[S, D]`` slab) read
this layout as it is. A slot-major ``[L, B, S, K, D]`` cache (this module's layout before
2026-11-30) made XLA:CPU transpose the whole cache to head-major on every decode step — at B=8,
4096 slots, 4 layers that transpose was 2.5-8x slower than reading the head-major cache directly —
so a step now costs the scatter of one token's K/V (a ``[B, K, T, D]`` write) plus one read of the
cache. Only the Pallas flash kernel (prefill, ``impl="pallas"``, T > 1) still reads slot-major;
it gets a swapped copy (once per prefill call, not per decoded token).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from pallasite.ops.attention import attention, decode_attention_dense


def _write(cache_BKSD: jax.Array, new_BTKD: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """Scatter T new tokens per row into the head-major cache at slot = position (out-of-range
    positions are dropped, as before)."""
    B, T, K, _ = new_BTKD.shape
    rows = jnp.arange(B)[:, None, None]
    heads = jnp.arange(K)[None, :, None]
    slots = positions_BT[:, None, :]  # index arrays broadcast to [B, K, T]
    return cache_BKSD.at[rows, heads, slots].set(jnp.swapaxes(new_BTKD, 1, 2).astype(cache_BKSD.dtype), mode="drop")


@struct.dataclass
class DenseKVCache:
    k: jax.Array  # [L, B, K, S, D] (or [B, K, S, D] for one layer): head-major, see the module doc
    v: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[-2]

    @property
    def batch_size(self) -> int:
        return self.k.shape[-4]

    @property
    def n_kv_heads(self) -> int:
        return self.k.shape[-3]

    def nbytes(self) -> int:
        return int(self.k.size * self.k.dtype.itemsize + self.v.size * self.v.dtype.itemsize)

    def update_and_attend(
        self,
        q_BTHD: jax.Array,
        k_BTKD: jax.Array,
        v_BTKD: jax.Array,
        positions_BT: jax.Array,
        *,
        sliding_window: Optional[int] = None,
        impl: str = "ref",
        interpret: Optional[bool] = None,
    ):
        """Write this step's keys/values at their positions, then attend. Returns (out, cache)."""
        if self.k.ndim != 4 or k_BTKD.shape[2] != self.k.shape[1] or k_BTKD.shape[3] != self.k.shape[3]:
            raise ValueError(f"DenseKVCache.update_and_attend: one layer's cache [B, K, S, D] = {self.k.shape} does not "
                             f"match the new keys [B, T, K, D] = {k_BTKD.shape}")
        k = _write(self.k, k_BTKD, positions_BT)
        v = _write(self.v, v_BTKD, positions_BT)
        if impl == "pallas" and q_BTHD.shape[1] == 1:
            out = decode_attention_dense(q_BTHD, k, v, q_positions_BT=positions_BT, sliding_window=sliding_window,
                                         interpret=interpret, kv_layout="BKSD")
            return out, DenseKVCache(k=k, v=v)
        out = attention(
            q_BTHD, k.astype(q_BTHD.dtype), v.astype(q_BTHD.dtype), q_positions_BT=positions_BT,
            causal=True, sliding_window=sliding_window, impl=impl, interpret=interpret, kv_layout="BKSD",
        )
        return out, DenseKVCache(k=k, v=v)


def init_dense_cache(cfg, batch_size: int, max_len: int, dtype=None) -> DenseKVCache:
    """Zeroed head-major cache [L, B, K, max_len, Dh] in ``dtype`` (default: the model's compute dtype)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.n_layers, batch_size, cfg.n_kv_heads, max_len, cfg.dh)
    return DenseKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
