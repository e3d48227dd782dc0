"""The KV-cache contract: what the transformer and the generation engine may ask of any cache.

A cache is a pytree (``flax.struct.dataclass`` subclassing ``KVCache``) whose array leaves carry a
leading layer axis ``[L, ...]``, except state shared by all layers (e.g. CateKV's packed head pools),
which ``split_shared`` takes out so it can ride along the layers. Slot convention: the token at
position ``p`` is visible to queries at positions ``>= p`` only (causal by position), so rolling a
row back is resetting its length — entries past it are never read before being overwritten.

Per layer (a ``layer(i)`` view, no layer axis): ``update_and_attend(q, k, v, positions, ...)``.
Engine: ``create`` (registered kinds are built from ``ModelConfig.kv_cache`` + its sub-config),
``with_prompt_lengths`` before the prefill, ``for_appending`` / ``rollback`` for speculative decoding.
"""

from __future__ import annotations

from typing import Any, Optional

import jax


class KVCache:
    """Base of every cache kind; the defaults fit caches with no shared state."""

    # ---------------------------------------------------------------- construction (engine)
    @classmethod
    def create(cls, model_cfg, batch_size: int, max_len: int, *, config=None, model=None) -> "KVCache":
        """An empty cache for ``batch_size`` rows of ``max_len`` positions. ``config`` is the kind's
        sub-config; ``model`` (a ``pallasite.Model``, optional) gives access to artifacts saved
        with the model (``model.path``)."""
        raise NotImplementedError(f"{cls.__name__}.create")

    # ---------------------------------------------------------------- layers (transformer)
    def split_shared(self) -> tuple["KVCache", Any]:
        """(the part whose leaves all have the leading layer axis, state shared by all layers)."""
        return self, None

    def join_shared(self, shared: Any) -> "KVCache":
        """Inverse of ``split_shared`` (for a whole cache or one layer's view)."""
        return self

    def layer(self, i) -> "KVCache":
        """Layer ``i``'s view: per-layer leaves indexed, shared state attached."""
        per_layer, shared = self.split_shared()
        return jax.tree.map(lambda a: a[i], per_layer).join_shared(shared)

    def with_layer(self, i, layer_cache: "KVCache") -> "KVCache":
        """Write back a layer view returned by ``update_and_attend``."""
        per_layer, _ = self.split_shared()
        layer_part, shared = layer_cache.split_shared()
        return jax.tree.map(lambda a, n: a.at[i].set(n), per_layer, layer_part).join_shared(shared)

    def update_and_attend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, *, sliding_window: Optional[int] = None,
                          impl: str = "ref", interpret: Optional[bool] = None):
        """One layer: write this call's keys/values at their positions, then attend. -> (out, cache)."""
        raise NotImplementedError(f"{type(self).__name__}.update_and_attend")

    # ---------------------------------------------------------------- engine
    def with_prompt_lengths(self, lengths_B) -> "KVCache":
        """The cache told each row's prompt length (right-padded prompts) before the prefill."""
        return self

    def for_appending(self) -> "KVCache":
        """The cache after its prefill, for calls that append T >= 1 tokens at once (speculative
        verification). A kind that reads a call of T > 1 tokens as its prefill (CateKV) marks here
        that later calls are not; the default needs nothing."""
        return self

    def rollback(self, lengths_B) -> "KVCache":
        """Forget every entry at positions >= ``lengths_B`` per row. Under the slot convention a
        cache needs nothing: the engine feeds the next token at the row's length."""
        return self

    # ---------------------------------------------------------------- accounting
    @property
    def capacity(self) -> int:
        raise NotImplementedError(f"{type(self).__name__}.capacity")

    @property
    def batch_size(self) -> int:
        raise NotImplementedError(f"{type(self).__name__}.batch_size")

    def nbytes(self) -> int:
        """Bytes of every array the cache holds."""
        return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self)))


class HeadMajorCache(KVCache):
    """Caches whose ``slots_leaf`` is laid out ``[L, B, K, S, ...]`` (head-major: dense, 4-bit)."""

    @property
    def slots_leaf(self):
        raise NotImplementedError(f"{type(self).__name__}.slots_leaf")

    @property
    def capacity(self) -> int:
        return self.slots_leaf.shape[-2]

    @property
    def batch_size(self) -> int:
        return self.slots_leaf.shape[-4]

    @property
    def n_kv_heads(self) -> int:
        return self.slots_leaf.shape[-3]
