"""Grouped-query self-attention with RoPE, optional q/k/v biases (Qwen2), q/k RMSNorm (Qwen3 per
head, OLMoE over all heads), sliding window (Mistral: every layer) and Gemma 3's interleaved
local/global layers.

Per-layer attention (``cfg.layer_types``): a "sliding" layer attends within ``cfg.sliding_window``
and rotates with ``ctx.rope_local`` when the context has one (Gemma 3: base 10k locally, 1M
globally); a "full" layer attends causally with ``ctx.rope``. In the unrolled layout the layer
index is a Python int and the choice is static; under ``scan_layers`` it is data: the RoPE tables
are selected with ``jnp.where`` and the attention (with its cache write) runs under ``lax.cond``
between two branches whose windows are static, so the Pallas kernels keep their static masks.
The attention scale is ``cfg.query_scale`` (Gemma: ``query_pre_attn_scalar ** -0.5``); when it
differs from head_dim ** -0.5 the queries are pre-scaled by the ratio after the ``attn.q`` tap, as
Gemma's JAX code scales the query before the logits (caches take no scale argument).

Without a cache the block attends within the (possibly packed) sequence; with a cache the
cache object does the write and the attention (``KVCache.update_and_attend``), so sparse and
quantized caches plug in without touching this module. Taps: ``attn.q`` / ``attn.k`` (after RoPE),
``attn.v``, ``attn.out`` (see ``models/context.py``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.context import ForwardContext
from pallasite.models.layers import RMSNorm, make_linear
from pallasite.models.rope import apply_rope
from pallasite.ops.attention import attention


def static_layer(layer):
    """``layer`` as a Python int when it is one (unrolled layers), else None (traced under scan)."""
    if isinstance(layer, (int, np.integer)):
        return int(layer)
    return None


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        D, H, K, Dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.dh
        self.q_proj = make_linear(D, H * Dh, cfg=cfg, axes=("embed", "q_heads"), use_bias=cfg.qkv_bias, rngs=rngs)
        self.k_proj = make_linear(D, K * Dh, cfg=cfg, axes=("embed", "kv_heads"), use_bias=cfg.qkv_bias, rngs=rngs)
        self.v_proj = make_linear(D, K * Dh, cfg=cfg, axes=("embed", "kv_heads"), use_bias=cfg.qkv_bias, rngs=rngs)
        self.o_proj = make_linear(H * Dh, D, cfg=cfg, axes=("q_heads", "embed"), use_bias=cfg.o_bias, rngs=rngs)
        if cfg.qk_norm and cfg.qk_norm_scope == "full":  # OLMoE: one RMSNorm over all heads
            self.q_norm = RMSNorm(H * Dh, cfg=cfg, axis_name="q_heads")
            self.k_norm = RMSNorm(K * Dh, cfg=cfg, axis_name="kv_heads")
        elif cfg.qk_norm:
            self.q_norm = RMSNorm(Dh, cfg=cfg, axis_name="head_dim")
            self.k_norm = RMSNorm(Dh, cfg=cfg, axis_name="head_dim")
        else:
            self.q_norm = self.k_norm = None

    def _layer_choice(self, ctx: ForwardContext):
        """(is_local: None when static, else a traced bool; window; rope (cos, sin))."""
        cfg = self.cfg
        local_rope = ctx.rope if ctx.rope_local is None else ctx.rope_local
        if not cfg.mixed_layers:
            window = cfg.layer_windows[0]
            sliding = cfg.layer_types is not None and cfg.layer_types[0] == "sliding"
            return None, window, (local_rope if sliding else ctx.rope)
        layer = static_layer(ctx.layer)
        if layer is not None:
            sliding = cfg.layer_types[layer] == "sliding"
            return None, cfg.layer_windows[layer], (local_rope if sliding else ctx.rope)
        if ctx.layer is None:
            raise ValueError("Attention: a model with mixed layer_types needs ctx.layer "
                             "(the layer index)")
        is_local = jnp.asarray(np.array([t == "sliding" for t in cfg.layer_types]))[ctx.layer]
        rope = tuple(jnp.where(is_local, lo, gl) for lo, gl in zip(local_rope, ctx.rope))
        return is_local, cfg.sliding_window, rope

    def __call__(self, x_BTD: jax.Array, ctx: ForwardContext, *, cache=None):
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        positions_BT = ctx.positions_BT
        x_in = self.q_proj.prepare_shared_input(x_BTD)  # q, k and v read one input
        q, k = self.q_proj(x_in), self.k_proj(x_in)
        if self.q_norm is not None and cfg.qk_norm_scope == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, T, cfg.n_heads, cfg.dh)
        k = k.reshape(B, T, cfg.n_kv_heads, cfg.dh)
        v = self.v_proj(x_in).reshape(B, T, cfg.n_kv_heads, cfg.dh)
        if self.q_norm is not None and cfg.qk_norm_scope == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        is_local, window, (cos, sin) = self._layer_choice(ctx)
        q = ctx.tap("attn.q", apply_rope(q, cos, sin))
        k = ctx.tap("attn.k", apply_rope(k, cos, sin))
        v = ctx.tap("attn.v", v)
        ratio = cfg.query_scale * math.sqrt(cfg.dh)  # the attention op scales by head_dim ** -0.5
        if ratio != 1.0:
            q = (q.astype(jnp.float32) * ratio).astype(q.dtype)

        def attend(window):
            def run(q, k, v, cache):
                if cache is None:
                    out = attention(
                        q, k, v, q_positions_BT=positions_BT, k_positions_BS=positions_BT,
                        causal=True, sliding_window=window, q_segment_ids_BT=ctx.segment_ids_BT,
                        k_segment_ids_BS=ctx.segment_ids_BT, impl=cfg.attention_impl,
                    )
                    return out, None
                return cache.update_and_attend(q, k, v, positions_BT, sliding_window=window,
                                               impl=cfg.attention_impl)
            return run

        if is_local is None:
            out, cache = attend(window)(q, k, v, cache)
        else:
            out, cache = jax.lax.cond(is_local, attend(window), attend(None), q, k, v, cache)
        out = ctx.tap("attn.out", out.reshape(B, T, cfg.n_heads * cfg.dh))
        return self.o_proj(out), cache
