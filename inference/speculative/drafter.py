"""The drafter: a second model (any ``Transformer`` config, its own tokenizer and KV cache kind)
that the speculative strategy runs inside the engine's compiled loop.

``Drafter`` holds the drafter's config, split state and tokenizer, and the target's tokenizer
(``bind_target`` fills it in for ``pallasite.generate``). Its cache is any registered
``KVCache`` kind, created inside the loop's trace and kept in ``DecodeState.extra``; rolling it
back is resetting the per-row length (``KVCache.rollback``, the slot convention).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
from flax import nnx

from pallasite.registry import KV_CACHE


@dataclasses.dataclass(frozen=True, eq=False)
class Drafter:
    """A drafter model for speculative decoding (compared by identity)."""

    config: Any  # ModelConfig
    graphdef: Any
    state: Any
    tokenizer: Any = None
    target_tokenizer: Any = None
    path: Optional[str] = None  # where cache artifacts of the drafter (a CateKV head mask) live

    @classmethod
    def of(cls, model, *, target=None) -> "Drafter":
        """From a ``pallasite.Model`` (or a ``Drafter``); ``target`` (a Model or a tokenizer) binds
        the target's tokenizer."""
        if isinstance(model, Drafter):
            d = model
        else:
            missing = [a for a in ("config", "graphdef", "state") if not hasattr(model, a)]
            if missing:
                raise TypeError(f"drafter must be a pallasite.Model or a speculative.Drafter; got "
                                f"{type(model).__name__} (no {', '.join(missing)})")
            d = cls(model.config, model.graphdef, model.state, getattr(model, "tokenizer", None),
                    path=getattr(model, "path", None))
        if target is not None:
            tok = getattr(target, "tokenizer", target) if hasattr(target, "config") else target
            d = dataclasses.replace(d, target_tokenizer=tok)
        return d

    def cache_kind(self, kind: Optional[str], kind_config: Any):
        """(kind, validated sub-config) of the drafter's cache: ``kind`` or the drafter's default."""
        field = "SpeculativeConfig.drafter_kv_cache_config"
        if kind is None or kind == self.config.kv_cache:
            k = self.config.kv_cache
            return k, KV_CACHE.merge_config(k, self.config.kv_cache_config, kind_config, field=field)
        KV_CACHE.check(kind, field="SpeculativeConfig.drafter_kv_cache")
        return kind, KV_CACHE.make_config(kind, kind_config, field=field)


class _ModelRef:
    """What a cache kind's ``create`` may ask of a model (its folder for saved artifacts)."""

    def __init__(self, path):
        self.path = path


def create_cache(cfg, kind: str, kind_config, batch: int, length: int, path: Optional[str] = None):
    return KV_CACHE.get(kind).create(cfg, batch, length, config=kind_config, model=_ModelRef(path))


def call(graphdef, state, cache, tokens_BT, positions_BT):
    """Drafter forward over its cache: (float32 logits [B, T, V_D], cache)."""
    logits, cache, _ = nnx.merge(graphdef, state)(tokens_BT, positions_BT, cache=cache)
    return logits, cache


def call_at(graphdef, state, cache, tokens_BT, positions_BT, idx_B):
    """Drafter forward over its cache with the LM head at ONE position per row (``idx_B``): (float32
    logits [B, V_D], cache). The catch-up feeds up to ``1 + max_spelling`` tokens a round and only
    the last one's distribution is drafted from, so the head (a V_D x D matmul per position, the
    largest one of a small drafter) runs once per row instead of T times."""
    model = nnx.merge(graphdef, state)
    h_BTD, cache, _ = model(tokens_BT, positions_BT, cache=cache, return_hidden=True)
    return model.head(take_positions(h_BTD, idx_B)[:, None])[:, 0], cache


def prefill(graphdef, state, cache, tokens_BT, lengths_B):
    """Fill the drafter's cache with its right-padded prompts (no LM head: the first draft
    distribution comes from the next catch-up call)."""
    B, T = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    cache = cache.with_prompt_lengths(lengths_B)
    _, cache, _ = nnx.merge(graphdef, state)(tokens_BT, positions, cache=cache, return_hidden=True)
    return cache.for_appending()


def take_positions(x_BT, idx_B):
    """x[b, idx[b]] for a [B, T, ...] array."""
    return jnp.take_along_axis(x_BT, idx_B.reshape((-1,) + (1,) * (x_BT.ndim - 1)), axis=1)[:, 0]


__all__ = ["Drafter", "create_cache", "call", "call_at", "prefill", "take_positions"]
