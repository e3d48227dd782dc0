"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 families) in Flax NNX, and
the pure functional forward used by every loop.

    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    logits_BTV, cache, aux = forward(graphdef, state, tokens_BT, positions_BT, cache=cache)
    logits_BTV, inter = capture(graphdef, state, tokens_BT, Taps(capture=("ffn.in",)))  # inter["ffn.in"]: [L, ...]

Layers are an ``nnx.List`` of blocks, or — with ``cfg.scan_layers`` — one block whose parameters
carry a leading layer axis, applied with ``jax.lax.scan``. Every block gets one ``ForwardContext``
(``models/context.py``); caches follow the ``KVCache`` protocol (``inference/cache/base.py``: a
leading layer axis, plus state shared by all layers that rides along the layers). ``cfg.remat``
wraps each block in ``jax.checkpoint`` (``full``: save nothing; ``dots``: save matmul outputs).
Gemma 3 (``cfg.sandwich_norm``): x += norm(attn(norm(x))); x += norm(ffn(norm(x))) (the extra
norms are ``attn_out_norm`` / ``ffn_out_norm``).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite import sharding
from pallasite.models.attention import Attention
from pallasite.models.config import ModelConfig
from pallasite.models.context import NO_TAPS, ForwardContext, Taps
from pallasite.models.ffn import make_ffn
from pallasite.models.layers import Linear, RMSNorm, embed_class
from pallasite.models.rope import inv_frequencies, rope_cos_sin

# Residual-stream activations keep the batch sharding through every layer (sharding.constrain).
RESIDUAL_AXES = ("batch", "seq", "act_embed")


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.d_model, cfg=cfg, axis_name="embed")
        self.attn = Attention(cfg, rngs=rngs)
        # post_attn_norm is the FFN's input norm (HF Llama: post_attention_layernorm)
        self.post_attn_norm = RMSNorm(cfg.d_model, cfg=cfg, axis_name="embed")
        self.ffn = make_ffn(cfg, rngs=rngs)
        if cfg.sandwich_norm:
            self.attn_out_norm = RMSNorm(cfg.d_model, cfg=cfg, axis_name="embed")
            self.ffn_out_norm = RMSNorm(cfg.d_model, cfg=cfg, axis_name="embed")
        else:
            self.attn_out_norm = self.ffn_out_norm = None

    def __call__(self, x_BTD, ctx: ForwardContext, *, cache=None):
        """(x, cache, aux losses) for one layer; ``ctx.captured`` receives the tapped values."""
        x_BTD = ctx.tap("block.in", x_BTD)
        h, cache = self.attn(ctx.tap("attn.in", self.input_norm(x_BTD)), ctx, cache=cache)
        if self.attn_out_norm is not None:
            h = self.attn_out_norm(h)
        x_BTD = sharding.constrain(x_BTD + h, RESIDUAL_AXES)
        y, aux = self.ffn(ctx.tap("ffn.in", self.post_attn_norm(x_BTD)), ctx)
        if self.ffn_out_norm is not None:
            y = self.ffn_out_norm(y)
        x_BTD = ctx.tap("block.out", sharding.constrain(x_BTD + ctx.tap("ffn.out", y), RESIDUAL_AXES))
        return x_BTD, cache, aux


def _remat_policy(kind: str):
    if kind == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    return jax.checkpoint_policies.nothing_saveable


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = embed_class(cfg)(cfg.vocab_size, cfg.d_model, cfg=cfg, rngs=rngs)
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
            def make_stacked(r):
                return Block(cfg, rngs=r)

            self.layers = make_stacked(rngs)
        else:
            self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg=cfg, axis_name="embed")
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else Linear(cfg.d_model, cfg.vocab_size, cfg=cfg, axes=("embed", "vocab"), rngs=rngs)
        )

    def context(self, tokens_BT, positions_BT=None, *, segment_ids_BT=None, taps: Taps = NO_TAPS) -> ForwardContext:
        """The per-call context of a forward over ``tokens_BT`` (embedding included)."""
        cfg = self.cfg
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        rope = rope_cos_sin(positions_BT, inv_frequencies(cfg.dh, cfg.rope_theta, cfg.rope_scaling_dict))
        rope_local = None  # Gemma 3: local layers rotate with their own base, unscaled
        if cfg.rope_local_theta is not None and "sliding" in (cfg.layer_types or ()):
            rope_local = rope_cos_sin(positions_BT, inv_frequencies(cfg.dh, cfg.rope_local_theta))
        return ForwardContext(
            positions_BT=positions_BT,
            rope=rope,
            token_ids_BT=tokens_BT,
            embed_BTD=sharding.constrain(self.embed(tokens_BT), RESIDUAL_AXES),
            segment_ids_BT=segment_ids_BT,
            taps=taps,
            rope_local=rope_local,
        )

    def run(self, tokens_BT, positions_BT=None, *, cache: Any = None, segment_ids_BT=None, taps: Taps = NO_TAPS):
        """(final-normed hidden [B, T, D], cache, aux losses, intermediates {tap: [L, ...]})."""
        cfg = self.cfg
        ctx = self.context(tokens_BT, positions_BT, segment_ids_BT=segment_ids_BT, taps=taps)

        def run_block(graphdef, state, x, layer_cache, layer):
            layer_ctx = ctx.for_layer(layer)
            x, layer_cache, aux = nnx.merge(graphdef, state)(x, layer_ctx, cache=layer_cache)
            return x, layer_cache, aux, layer_ctx.captured

        def checkpointed(fn):
            if cfg.remat == "none":
                return fn
            return jax.checkpoint(fn, policy=_remat_policy(cfg.remat), static_argnums=(0,))

        x = ctx.embed_BTD
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)
            per_layer, shared = (None, None) if cache is None else cache.split_shared()
            step = checkpointed(run_block)

            def body(carry, xs):
                x, shared = carry
                layer_state, layer_cache, layer = xs
                if layer_cache is not None:
                    layer_cache = layer_cache.join_shared(shared)
                x, layer_cache, aux, captured = step(graphdef, layer_state, x, layer_cache, layer)
                if layer_cache is not None:
                    layer_cache, shared = layer_cache.split_shared()
                return (x, shared), (layer_cache, aux, captured)

            layers = jnp.arange(cfg.n_layers, dtype=jnp.int32)
            (x, shared), (per_layer, aux_L, inter) = jax.lax.scan(body, (x, shared), (state, per_layer, layers))
            cache = None if cache is None else per_layer.join_shared(shared)
            aux = jax.tree.map(jnp.sum, aux_L)
        else:
            aux, captured_L = {}, []
            for i, block in enumerate(self.layers):
                graphdef, state = nnx.split(block)
                step = checkpointed(lambda g, s, x, c, i=i: run_block(g, s, x, c, i))
                layer_cache = None if cache is None else cache.layer(i)
                x, layer_cache, block_aux, captured = step(graphdef, state, x, layer_cache)
                if cache is not None:
                    cache = cache.with_layer(i, layer_cache)
                for k, v in block_aux.items():
                    aux[k] = aux.get(k, 0.0) + v
                captured_L.append(captured)
            inter = {k: jnp.stack([c[k] for c in captured_L]) for k in (captured_L[0] if captured_L else {})}
        return self.final_norm(x), cache, aux, inter

    def __call__(
        self,
        tokens_BT: jax.Array,
        positions_BT: Optional[jax.Array] = None,
        *,
        cache: Any = None,
        segment_ids_BT: Optional[jax.Array] = None,
        return_hidden: bool = False,
    ):
        """(logits float32 [B, T, V] — or the final-normed hidden states —, cache, aux losses)."""
        h, cache, aux, _ = self.run(tokens_BT, positions_BT, cache=cache, segment_ids_BT=segment_ids_BT)
        return (h if return_hidden else self.head(h)), cache, aux

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


def capture(graphdef, state, tokens_BT, taps: Taps, positions_BT=None, *, segment_ids_BT=None):
    """Pure forward that also returns the tapped activations: (logits [B,T,V], {tap: [L, ...]})."""
    model = nnx.merge(graphdef, state)
    h, _, _, inter = model.run(tokens_BT, positions_BT, segment_ids_BT=segment_ids_BT, taps=taps)
    return model.head(h), inter
