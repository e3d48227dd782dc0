"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 families) in Flax NNX, and the
pure functional forward used by every loop.

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    logits_BTV, cache, aux = forward(graphdef, state, tokens_BT, positions_BT, cache=cache)

Layers are an ``nnx.List`` of blocks, or — with ``cfg.scan_layers`` — one block whose
parameters carry a leading layer axis, applied with ``jax.lax.scan`` (compile time independent
of depth). KV caches always carry a leading layer axis, so both layouts share one cache (a
cache may also hold layer-independent state, e.g. CateKV's packed head pools: ``split_shared``).
``cfg.remat`` wraps each block in ``jax.checkpoint`` (``full``: save nothing; ``dots``: save
matmul outputs without batch dims).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite.models.attention import Attention
from pallasite.models.config import ModelConfig
from pallasite.models.ffn import make_ffn
from pallasite.models.layers import Embed, Linear, RMSNorm
from pallasite.models.rope import inv_frequencies, rope_cos_sin


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.d_model, cfg=cfg, axis_name="embed")
        self.attn = Attention(cfg, rngs=rngs)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg=cfg, axis_name="embed")
        self.ffn = make_ffn(cfg, rngs=rngs)

    def __call__(self, x_BTD, positions_BT, rope, *, cache=None, segment_ids_BT=None, token_ids_BT=None, embed_BTD=None):
        h, cache = self.attn(self.input_norm(x_BTD), positions_BT, rope, cache=cache, segment_ids_BT=segment_ids_BT)
        x_BTD = x_BTD + h
        y, aux = self.ffn(self.post_attn_norm(x_BTD), token_ids_BT=token_ids_BT, embed_BTD=embed_BTD)
        return x_BTD + y, cache, aux


def _remat_policy(kind: str):
    if kind == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint_policies.nothing_saveable


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg.vocab_size, cfg.d_model, cfg=cfg, rngs=rngs)
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def make_stacked(r):
                return Block(cfg, rngs=r)

            self.layers = make_stacked(rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg=cfg, axis_name="embed")
        self.lm_head = None if cfg.tie_embeddings else Linear(cfg.d_model, cfg.vocab_size, cfg=cfg, axes=("embed", "vocab"), rngs=rngs)

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: Optional[jax.Array] = None,
        *,
        cache: Any = None,
        segment_ids_BT: Optional[jax.Array] = None,
        return_hidden: bool = False,
    ):
        cfg = self.cfg
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        rope = rope_cos_sin(positions_BT, inv_frequencies(cfg.dh, cfg.rope_theta, cfg.rope_scaling_dict))
        embed_BTD = self.embed(tokens_BT)
        kwargs = dict(segment_ids_BT=segment_ids_BT, token_ids_BT=tokens_BT, embed_BTD=embed_BTD)

        def run_block(graphdef, state, x, layer_cache):
            block = nnx.merge(graphdef, state)
            return block(x, positions_BT, rope, cache=layer_cache, **kwargs)

        if cfg.remat != "none":
            run_block = jax.checkpoint(run_block, policy=_remat_policy(cfg.remat), static_argnums=(0,))

        x = embed_BTD
        # A cache may hold state shared by all layers (no layer axis; CateKV's packed head pools):
        # ``split_shared() -> (per-layer part, shared)``, ``join_shared(shared)``. It rides along
        # with the activations through the layers; every other cache is sliced per layer as before.
        shared = None
        if cache is not None and hasattr(cache, "split_shared"):
            cache, shared = cache.split_shared()
        join = (lambda c, sh: c) if shared is None else (lambda c, sh: c.join_shared(sh))
        split = (lambda c: (c, None)) if shared is None else (lambda c: c.split_shared())
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(carry, xs):
                x, shared = carry
                layer_state, layer_cache = xs
                x, layer_cache, aux = run_block(graphdef, layer_state, x, join(layer_cache, shared))
                layer_cache, shared = split(layer_cache)
                return (x, shared), (layer_cache, aux)

            (x, shared), (cache, aux_L) = jax.lax.scan(body, (x, shared), (state, cache))
            aux = jax.tree.map(jnp.sum, aux_L)
        else:
            aux = {}
            for i, block in enumerate(self.layers):
                layer_cache = None if cache is None else join(jax.tree.map(lambda a: a[i], cache), shared)
                graphdef, state = nnx.split(block)
                x, layer_cache, block_aux = run_block(graphdef, state, x, layer_cache)
                if cache is not None:
                    layer_cache, shared = split(layer_cache)
                    cache = jax.tree.map(lambda a, n: a.at[i].set(n), cache, layer_cache)
                for k, v in block_aux.items():
                    aux[k] = aux.get(k, 0.0) + v
        if shared is not None:
            cache = cache.join_shared(shared)
        x = self.final_norm(x)
        if return_hidden:
            return x, cache, aux
        return self.head(x), cache, aux

    def head(self, h_BTD: jax.Array) -> jax.Array:
        """float32 logits from final-normed hidden states (tied: embedding transpose)."""
        logits = self.embed.attend(h_BTD) if self.lm_head is None else self.lm_head(h_BTD)
        return logits.astype(jnp.float32)


def init_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """Shapes and dtypes only (no allocation); used to restore checkpoints and import weights."""
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))


def forward(graphdef, state, tokens_BT, positions_BT=None, *, cache=None, segment_ids_BT=None):
    """Pure forward over split state: (logits float32 [B,T,V], cache, aux losses)."""
    model = nnx.merge(graphdef, state)
    return model(tokens_BT, positions_BT, cache=cache, segment_ids_BT=segment_ids_BT)
