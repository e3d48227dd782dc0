"""Feed-forward seam: ``make_ffn(cfg)`` builds the FFN kind named by ``cfg.ffn``.

Every FFN kind (registered in ``pallasite.registry.FFN``) is built as ``cls(cfg, rngs=rngs)`` and
called as ``ffn(x_BTD, ctx) -> (y_BTD, aux)``: ``x`` is the post-attention-normed residual stream,
``ctx`` the per-call ``ForwardContext`` (token ids, embedding output, positions, segment ids,
taps) and ``aux`` a dict of scalar auxiliary losses, already weighted (empty for dense).
"""

from __future__ import annotations

import jax
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.context import ForwardContext
from pallasite.models.layers import activation, make_linear
from pallasite.registry import FFN


@FFN.register("dense")
class DenseFFN(nnx.Module):
    """Gated MLP (SwiGLU for Llama): down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, d_ff: int | None = None):
        d_ff = cfg.d_ff if d_ff is None else d_ff
        self.act = activation(cfg.hidden_act)
        self.gate_proj = make_linear(
            cfg.d_model, d_ff, cfg=cfg, axes=("embed", "mlp"), use_bias=cfg.mlp_bias, rngs=rngs
        )
        self.up_proj = make_linear(cfg.d_model, d_ff, cfg=cfg, axes=("embed", "mlp"), use_bias=cfg.mlp_bias, rngs=rngs)
        self.down_proj = make_linear(
            d_ff, cfg.d_model, cfg=cfg, axes=("mlp", "embed"), use_bias=cfg.mlp_bias, rngs=rngs
        )

    def __call__(self, x_BTD: jax.Array, ctx: ForwardContext | None = None):
        x_in = self.gate_proj.prepare_shared_input(x_BTD)  # gate and up read one input
        h = self.act(self.gate_proj(x_in)) * self.up_proj(x_in)
        return self.down_proj(h if ctx is None else ctx.tap("ffn.hidden", h)), {}


def make_ffn(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    return FFN.get(cfg.ffn, field="ModelConfig.ffn")(cfg, rngs=rngs)
