"""The dense (full) KV cache and the cache interface every cache kind implements.

A cache is a pytree whose array leaves carry a leading layer axis ``[L, ...]``; the model
slices layer ``i`` with ``jax.tree.map(lambda a: a[i], cache)`` (or scans over axis 0) and
calls ``layer_cache.update_and_attend(...)``. Cache kinds (dense, CateKV hybrid, 4-bit) differ
only in what they store and how they attend; the model never looks inside.

Slot convention: a token at position ``p`` is written to slot ``p``. Prompts are
right-padded; pad tokens write junk into slots past their row's length, but the next decode
step of that row writes slot ``length`` before attending to slots ``<= length``, so junk is
always overwritten before it becomes visible (causal mask by position).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import struct

from pallasite.ops.attention import attention


@struct.dataclass
class DenseKVCache:
    k: jax.Array  # [L, B, S, K, D] (or [B, S, K, D] for one layer)
    v: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[-3]

    @property
    def batch_size(self) -> int:
        return self.k.shape[-4]

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
        B = q_BTHD.shape[0]
        rows = jnp.arange(B)[:, None]
        k = self.k.at[rows, positions_BT].set(k_BTKD.astype(self.k.dtype), mode="drop")
        v = self.v.at[rows, positions_BT].set(v_BTKD.astype(self.v.dtype), mode="drop")
        if impl == "pallas" and q_BTHD.shape[1] == 1:
            from pallasite.ops.attention import _PALLAS_IMPLS

            if "decode" not in _PALLAS_IMPLS:
                try:
                    from pallasite.ops.attention import decode  # noqa: F401  (registers itself)
                except ImportError:
                    pass
            if "decode" in _PALLAS_IMPLS:
                out = _PALLAS_IMPLS["decode"](q_BTHD, k, v, q_positions_BT=positions_BT,
                                              sliding_window=sliding_window, interpret=interpret)
                return out, DenseKVCache(k=k, v=v)
        out = attention(
            q_BTHD, k.astype(q_BTHD.dtype), v.astype(q_BTHD.dtype), q_positions_BT=positions_BT,
            causal=True, sliding_window=sliding_window, impl=impl, interpret=interpret,
        )
        return out, DenseKVCache(k=k, v=v)


def init_dense_cache(cfg, batch_size: int, max_len: int, dtype=None) -> DenseKVCache:
    """Zeroed cache [L, B, max_len, K, Dh] in ``dtype`` (default: the model's compute dtype)."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    shape = (cfg.n_layers, batch_size, max_len, cfg.n_kv_heads, cfg.dh)
    return DenseKVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
