"""Grouped-query self-attention with RoPE, optional q/k/v biases (Qwen2), per-head q/k
RMSNorm (Qwen3) and sliding window (Mistral).

Without a cache the block attends within the (possibly packed) sequence; with a cache the
cache object does the write and the attention (``KVCache.update_and_attend``), so sparse and
quantized caches plug in without touching this module. Taps: ``attn.q`` / ``attn.k`` (after RoPE),
``attn.v``, ``attn.out`` (see ``models/context.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.context import ForwardContext
from pallasite.models.layers import RMSNorm, make_linear
from pallasite.models.rope import apply_rope
from pallasite.ops.attention import attention


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
        cos, sin = ctx.rope
        q = ctx.tap("attn.q", apply_rope(q, cos, sin))
        k = ctx.tap("attn.k", apply_rope(k, cos, sin))
        v = ctx.tap("attn.v", v)
        if cache is None:
            out = attention(
                q, k, v, q_positions_BT=positions_BT, k_positions_BS=positions_BT, causal=True,
                sliding_window=cfg.sliding_window, q_segment_ids_BT=ctx.segment_ids_BT,
                k_segment_ids_BS=ctx.segment_ids_BT, impl=cfg.attention_impl,
            )
        else:
            out, cache = cache.update_and_attend(
                q, k, v, positions_BT, sliding_window=cfg.sliding_window, impl=cfg.attention_impl
            )
        out = ctx.tap("attn.out", out.reshape(B, T, cfg.n_heads * cfg.dh))
        return self.o_proj(out), cache
