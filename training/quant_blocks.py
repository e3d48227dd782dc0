"""Post-training quantization passes through the model's own ``Block``, one layer at a time.

FlatQuant's calibration, SmoothQuant's statistics and GPTQ's Hessians (``training/flatquant.py``,
``training/quant_baselines.py``) all walk the decoder layer by layer: layer i's inputs are the
outputs of layer i−1 (full precision, or the already fake-quantized layers for GPTQ), and each
layer is the real ``models.transformer.Block`` — the full-precision one on layer i's float
weights, or the ``linear="w4a4"`` block in calibration mode (``QuantConfig(fake_quant=True)``:
float kernels, straight-through quantizers) built from a folded layer. Activations are read with
taps (``attn.in``, ``attn.out``, ``ffn.in``, ``ffn.hidden``) and the KV4 cache's numerics (key
transform after RoPE, K/V fake quantization) are applied with ``models.quantized.kv_quant_taps``.
"""

from __future__ import annotations

from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.context import NO_TAPS, ForwardContext, Taps
from pallasite.models.quantized import QuantConfig, layer_params, quantized_config
from pallasite.models.rope import inv_frequencies, rope_cos_sin
from pallasite.models.transformer import Block

# absmax statistics of the three quantized inputs of a layer: name -> tap
STAT_TAPS = {"ln": "attn.in", "ug": "ffn.in", "down": "ffn.hidden"}


class BlockFn:
    """One decoder ``Block`` of ``cfg`` as a pure function of its parameters (a pure dict)."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg.replace(scan_layers=False)
        self.graphdef, self.abstract = nnx.split(nnx.eval_shape(lambda: Block(self.cfg, rngs=nnx.Rngs(0))))
        self.template = self.abstract.to_pure_dict()
        self.inv_freq = inv_frequencies(self.cfg.dh, self.cfg.rope_theta, self.cfg.rope_scaling_dict)

    def block(self, params: dict) -> Block:
        state = jax.tree.map(lambda a: a, self.abstract)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(self.graphdef, state)

    def context(self, B: int, T: int, taps: Taps = NO_TAPS, layer: int = 0) -> ForwardContext:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return ForwardContext(positions_BT=positions, rope=rope_cos_sin(positions, self.inv_freq), taps=taps,
                              layer=layer)

    def __call__(self, params: dict, x_BTD, taps: Taps = NO_TAPS, layer: int = 0):
        """(block output [B, T, D], {tap: value} captured)."""
        ctx = self.context(x_BTD.shape[0], x_BTD.shape[1], taps, layer)
        y, _, _ = self.block(params)(x_BTD, ctx)
        return y, ctx.captured


def calibration_config(cfg: ModelConfig, w_bits: int, a_bits: int, kv_bits: int) -> ModelConfig:
    """The ``w4a4`` config of the calibration-mode block (float kernels, fake quantization)."""
    q = QuantConfig(method="flatquant", w_bits=w_bits, a_bits=a_bits, kv_bits=kv_bits, fake_quant=True)
    return quantized_config(cfg, q)


def embed_tokens(pure: dict, tokens_NT) -> jax.Array:
    return jnp.take(jnp.asarray(pure["embed"]["embedding"], jnp.float32), jnp.asarray(tokens_NT), axis=0)


def _absmax(v):
    return jnp.max(jnp.abs(v), axis=(0, 1))


def fp_layers(cfg: ModelConfig, pure: dict, tokens_NT, batch: int = 4,
              n_layers: Optional[int] = None) -> Iterator[tuple]:
    """Walk the full-precision model layer by layer: yields ``(i, x_in [N, T, D], x_out, stats)``
    where ``stats[name]`` is the per-channel absmax over all tokens of the input of the ``ln`` (q/k/v),
    ``ug`` (gate/up) and ``down`` linears (SmoothQuant's and FlatQuant's statistics)."""
    fp = BlockFn(cfg)
    taps = Taps(capture=tuple(STAT_TAPS.values()))

    @jax.jit
    def run(params, x):
        y, cap = fp(params, x, taps)
        return y, {name: _absmax(cap[tap]) for name, tap in STAT_TAPS.items()}

    x = embed_tokens(pure, tokens_NT)
    for i in range(cfg.n_layers if n_layers is None else min(n_layers, cfg.n_layers)):
        params = jax.tree.map(
            lambda a: jnp.asarray(a, jnp.float32) if jnp.issubdtype(jnp.asarray(a).dtype, jnp.floating)
            else jnp.asarray(a), layer_params(pure, cfg, i))
        outs, stats = [], None
        for b in range(0, x.shape[0], batch):
            y, s = run(params, x[b:b + batch])
            outs.append(y)
            stats = s if stats is None else jax.tree.map(jnp.maximum, stats, s)
        x_out = jnp.concatenate(outs, axis=0)
        yield i, x, x_out, stats
        x = x_out


# linear group -> (module path of the linear that owns the input's transform and clip, tap of its input)
HESSIAN_INPUTS = {"qkv": (("attn", "q_proj"), "attn.in"), "o": (("attn", "o_proj"), "attn.out"),
                  "ug": (("ffn", "gate_proj"), "ffn.in"), "down": (("ffn", "down_proj"), "ffn.hidden")}


def quantized_layer_inputs(block_fn: BlockFn, params: dict, x_BTD, taps: Taps):
    """(block output, {group: Σ_tokens x̂ᵀx̂}) of a calibration-mode block: x̂ is what each linear
    group's (folded) weight multiplies — its tapped input through ``QuantLinear.quantized_input``
    (online transform + activation quantizer). Shared inputs (q/k/v, gate/up) appear once."""
    ctx = block_fn.context(x_BTD.shape[0], x_BTD.shape[1],
                           Taps(capture=tuple(tap for _, tap in HESSIAN_INPUTS.values()), replace=taps.replace))
    block = block_fn.block(params)
    y, _, _ = block(x_BTD, ctx)
    sums = {}
    for group, ((mod, sub), tap) in HESSIAN_INPUTS.items():
        xq = getattr(getattr(block, mod), sub).quantized_input(ctx.captured[tap])
        x2 = xq.reshape(-1, xq.shape[-1])
        sums[group] = x2.T @ x2
    return y, sums


def as_numpy(tree) -> dict:
    return jax.tree.map(lambda a: np.asarray(a, np.float64), tree)
