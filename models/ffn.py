"""Feed-forward seam: ``make_ffn(cfg)`` builds the FFN kind named by ``cfg.ffn``.

Every FFN has the call signature ``ffn(x_BTD, *, token_ids_BT, embed_BTD) -> (y_BTD, aux)``
where ``aux`` is a dict of scalar auxiliary losses (empty for dense). ``token_ids_BT`` and
``embed_BTD`` (the embedding-layer output) are what Mixture of Lookup Experts reads; dense and
MoE FFNs ignore them. Kinds other than dense are registered by their own modules
(``models/moe.py``, ``models/mole.py``), imported lazily here.
"""

from __future__ import annotations

import importlib
from typing import Callable

import jax
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.layers import activation, make_linear, prepare_shared_input


class DenseFFN(nnx.Module):
    """SwiGLU MLP (Llama): down(act(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, d_ff: int | None = None):
        d_ff = cfg.d_ff if d_ff is None else d_ff
        self.act = activation(cfg.hidden_act)
        self.gate_proj = make_linear(cfg.d_model, d_ff, cfg=cfg, axes=("embed", "mlp"), use_bias=cfg.mlp_bias, rngs=rngs)
        self.up_proj = make_linear(cfg.d_model, d_ff, cfg=cfg, axes=("embed", "mlp"), use_bias=cfg.mlp_bias, rngs=rngs)
        self.down_proj = make_linear(d_ff, cfg.d_model, cfg=cfg, axes=("mlp", "embed"), use_bias=cfg.mlp_bias, rngs=rngs)

    def __call__(self, x_BTD: jax.Array, *, token_ids_BT=None, embed_BTD=None):
        x_in = prepare_shared_input(self.gate_proj, x_BTD)  # gate and up read one input
        return self.down_proj(self.act(self.gate_proj(x_in)) * self.up_proj(x_in)), {}


FFN_REGISTRY: dict[str, Callable[..., nnx.Module]] = {"dense": DenseFFN}
_FFN_MODULES = {"moe": "pallasite.models.moe", "mole": "pallasite.models.mole"}


def register_ffn(kind: str, cls: Callable[..., nnx.Module]) -> None:
    FFN_REGISTRY[kind] = cls


def make_ffn(cfg: ModelConfig, *, rngs: nnx.Rngs) -> nnx.Module:
    if cfg.ffn not in FFN_REGISTRY and cfg.ffn in _FFN_MODULES:
        importlib.import_module(_FFN_MODULES[cfg.ffn])
    if cfg.ffn not in FFN_REGISTRY:
        raise ValueError(f"ffn={cfg.ffn!r} is not available; registered kinds: {sorted(FFN_REGISTRY)}")
    return FFN_REGISTRY[cfg.ffn](cfg, rngs=rngs)
