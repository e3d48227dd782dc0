"""The per-call context every block, attention and FFN receives, and the taps channel.

``ForwardContext`` carries what a layer may need besides its input: positions, the RoPE tables,
segment ids, the token ids and the embedding-layer output (MoLE's experts read it), the layer
index and the ``Taps``. Modules never take method-specific keyword arguments: they read the
context.

``Taps`` observe and (for calibration) replace named activations inside the real blocks:
``x = ctx.tap("attn.k", x)`` returns ``taps.replace(name, x, layer)`` (identity by default) and
records it when ``name`` is in ``taps.capture``. The recorded values leave each block as part of
its outputs, so they survive the per-block ``nnx.merge``, ``jax.checkpoint`` and ``lax.scan``
(stacked ``[L, ...]``). Tap names are listed in ``TAP_NAMES``; a kind may add its own (prefix it
with the kind, e.g. ``"moe.experts"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax

# name -> what it is (shapes for one layer)
TAP_NAMES = {
    "block.in": "block input, the residual stream [B, T, D]",
    "attn.in": "attention input after the input norm [B, T, D]",
    "attn.q": "queries after RoPE (and q norm) [B, T, H, Dh]",
    "attn.k": "keys after RoPE (and k norm) [B, T, K, Dh]",
    "attn.v": "values [B, T, K, Dh]",
    "attn.out": "attention output before o_proj [B, T, H*Dh]",
    "ffn.in": "FFN input after the post-attention norm [B, T, D]",
    "ffn.hidden": "dense FFN hidden act(gate) * up, down_proj's input [B, T, F]",
    "ffn.out": "FFN output before the residual add [B, T, D]",
    "block.out": "block output, the residual stream [B, T, D]",
    "moe.router_probs": "router softmax over all experts [B*T, E] (MoE FFNs)",
    "moe.experts": "selected experts [B*T, k] (MoE FFNs)",
}


@dataclasses.dataclass(frozen=True)
class Taps:
    """Which activations to record (``capture``: names, or ``"*"`` for all) and an optional
    ``replace(name, value, layer) -> value`` applied at every tap point (``layer`` is a Python int
    in the unrolled layout and a traced int32 under ``scan_layers``)."""

    capture: Any = ()
    replace: Optional[Callable[[str, jax.Array, Any], jax.Array]] = None

    def wants(self, name: str) -> bool:
        return self.capture == "*" or name in self.capture


NO_TAPS = Taps()


@dataclasses.dataclass
class ForwardContext:
    """Per-call inputs shared by every layer (built by ``Transformer``; never stored)."""

    positions_BT: jax.Array
    rope: tuple  # (cos, sin) [B, T, Dh]
    token_ids_BT: Optional[jax.Array] = None
    embed_BTD: Optional[jax.Array] = None
    segment_ids_BT: Optional[jax.Array] = None
    layer: Any = None
    taps: Taps = NO_TAPS
    captured: dict = dataclasses.field(default_factory=dict)

    def for_layer(self, layer) -> "ForwardContext":
        """This context for one block, with a fresh record of captured values."""
        return dataclasses.replace(self, layer=layer, captured={})

    def tap(self, name: str, value: jax.Array) -> jax.Array:
        if self.taps.replace is not None:
            value = self.taps.replace(name, value, self.layer)
        if self.taps.wants(name):
            self.captured[name] = value
        return value
