"""W4A4KV4 baselines next to FlatQuant, and the one pipeline that quantizes a checkpoint with any
of them (``quantize_model``).

* **RTN** — no transform: per-token symmetric int4 activations, per-channel symmetric int4
  weights (round-to-nearest), asymmetric per-head int4 KV cache.
* **SmoothQuant** (Xiao et al., ICML 2023) — per-channel smoothing ``x/s``, ``W·s`` with
  ``s_j = max|X_j|^α / max|W_j|^{1−α}``, α = 0.5 (the paper's default), folded into the input
  RMSNorm (q/k/v), the post-attention RMSNorm (gate/up) and — as FlatQuant folds its ``down``
  scale — into up_proj's output columns (down_proj); statistics from the full-precision pass
  over the calibration windows. Then RTN. (In FlatQuant's convention ``c = 1/s``.)
* **Hadamard + RTN** (QuaRot-style, Ashkboos et al. 2024) — randomised Hadamard rotations at
  FlatQuant's placement: Kronecker Hadamards ``H_{n1} ⊗ H_{n2}`` (a Kronecker product of Hadamard
  matrices is Hadamard) online before q/k/v, gate/up and down_proj, a head_dim Hadamard folded
  into v_proj and applied to q/k after RoPE; the head-mixing factor only when ``n_heads`` admits a
  Hadamard matrix (SmolLM2 has 9 heads: none exists, so that factor is the identity).
  Deviation from QuaRot: the rotation is online at each linear's input instead of being fused
  into the residual stream (identical quantization statistics up to the RMSNorm gain), and RTN
  instead of GPTQ weights (the "Hadamard+RTN" row).
* **FlatQuant** — ``training/flatquant.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.inference.cache.kv4 import KV4Config, init_kv4_cache, save_kv_transforms
from pallasite.models.config import ModelConfig
from pallasite.models.quantized import (
    QUANT_METHODS,
    QuantConfig,
    build_quantized_state,
    check_quantizable,
    decompose_dim,
    fold_layer,
    kv_quant_taps,
    kv_transforms,
    layer_weights,
    quantized_block_params,
    state_from_pure,
)
from pallasite.ops.quant.hadamard import has_hadamard, random_hadamard
from pallasite.training.flatquant import Bits, CalibConfig, calibrate, random_orthogonal
from pallasite.training.quant_blocks import (
    BlockFn,
    as_numpy,
    calibration_config,
    embed_tokens,
    fp_layers,
    quantized_layer_inputs,
)

KV4_TRANSFORMS_FILE = "kv4_transforms.npz"  # written next to a quantized model (KV4Config.transforms)


def rtn_transforms(cfg: ModelConfig) -> list[dict]:
    return [{} for _ in range(cfg.n_layers)]


def fp_statistics(cfg: ModelConfig, pure: dict, tokens_NT, batch: int = 4) -> list[dict]:
    """Per-layer per-channel absmax of the three quantized inputs along the FP model (taps of the
    model's own blocks: ``attn.in``, ``ffn.in``, ``ffn.hidden``)."""
    return [as_numpy(stats) for _, _, _, stats in fp_layers(cfg, pure, np.asarray(tokens_NT), batch)]


def smoothquant_transforms(cfg: ModelConfig, pure: dict, tokens_NT, alpha: float = 0.5) -> list[dict]:
    stats = fp_statistics(cfg, pure, tokens_NT)
    res = []
    for i, st in enumerate(stats):
        w = layer_weights(pure, cfg, i)
        wmax = lambda *ks: np.max(np.stack([np.abs(np.asarray(w[k], np.float64)).max(axis=1) for k in ks]), axis=0)  # noqa: E731

        def c(wm, xm):
            return np.maximum(np.power(np.maximum(wm, 1e-5), 1 - alpha) / np.power(np.maximum(xm, 1e-5), alpha), 1e-5)

        res.append({"c_ln": c(wmax("q", "k", "v"), st["ln"]), "c_ug": c(wmax("gate", "up"), st["ug"]),
                    "c_down": c(wmax("down"), st["down"])})
    return res


def hadamard_transforms(cfg: ModelConfig, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    res = []
    for _ in range(cfg.n_layers):
        t = {}

        def rh(n):
            return random_hadamard(n, int(rng.integers(2**31)))

        for name, n in (("ln", cfg.d_model), ("ug", cfg.d_model), ("down", cfg.d_ff)):
            n1, n2 = decompose_dim(n)
            if not (has_hadamard(n1) and has_hadamard(n2)):
                raise ValueError(f"Hadamard baseline: no Hadamard factors for {name} ({n} = {n1}×{n2})")
            pair = (rh(n1), rh(n2))
            t[name], t[name + "_inv_t"] = pair, pair  # orthogonal: the inverse-transpose is itself
        Hv, Hk = rh(cfg.dh), rh(cfg.dh)
        t["v"], t["v_inv_t"], t["k"], t["k_inv_t"] = Hv, Hv, Hk, Hk
        if has_hadamard(cfg.n_heads):
            Ho = rh(cfg.n_heads)
            t["o"], t["o_inv_t"] = Ho, Ho
        res.append(t)
    return res


def random_orthogonal_transforms(cfg: ModelConfig, seed: int = 0) -> list[dict]:
    """Random orthogonal transforms at FlatQuant's placement (its initialisation without the
    channel scales and clipping): Kronecker pairs for ln/ug/down, single factors for v, k, o."""
    rng = np.random.default_rng(seed)
    res = []
    for _ in range(cfg.n_layers):
        t = {}
        for name, n in (("ln", cfg.d_model), ("ug", cfg.d_model), ("down", cfg.d_ff)):
            pair = tuple(random_orthogonal(m, rng) for m in decompose_dim(n))
            t[name], t[name + "_inv_t"] = pair, pair  # orthogonal: the inverse-transpose is itself
        for name, n in (("v", cfg.dh), ("k", cfg.dh), ("o", cfg.n_heads)):
            m = random_orthogonal(n, rng)
            t[name], t[name + "_inv_t"] = m, m
        res.append(t)
    return res


HESSIAN_OF = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "ug", "up": "ug", "down": "down"}


def gptq_hessians(cfg: ModelConfig, pure: dict, resolved: list, tokens_NT, bits: Bits, batch: int = 4) -> list[dict]:
    """Per layer, GPTQ's ``H = 2 X̂ᵀX̂ / n`` of each linear group's input as the folded weight sees
    it (``QuantLinear.quantized_input``: transformed by ``resolved[i]``, activation-quantized), one
    Hessian per shared input (``qkv``, ``o``, ``ug``, ``down``; see ``HESSIAN_OF``), from the
    calibration-mode blocks (fake-quantized RTN weights, KV through ``kv_quant_taps``).

    As GPTQ's sequential pass, layer i's inputs are the outputs of the already-quantized layers
    0..i-1 (fake-quantized; deviation: those layers use RTN weights, not their GPTQ weights, and
    within a layer o/down see RTN-quantized q/k/v/gate/up instead of GPTQ'd ones — one pass per
    layer instead of four)."""
    tokens_NT = np.asarray(tokens_NT)
    block_fn = BlockFn(calibration_config(cfg, bits.w, bits.a, bits.kv))
    qcfg = block_fn.cfg.linear_config

    @jax.jit
    def fwd(params, kv, x):
        return quantized_layer_inputs(block_fn, params, x, kv_quant_taps(kv, bits.kv, qcfg.kv_group))

    x = embed_tokens(pure, tokens_NT)
    n_tok = tokens_NT.shape[0] * tokens_NT.shape[1]
    out = []
    for i in range(cfg.n_layers):
        folded = fold_layer(layer_weights(pure, cfg, i), resolved[i], cfg, weight_clipping=bits.w < 16)
        params = jax.tree.map(jnp.asarray, quantized_block_params(folded, block_fn.template, qcfg))
        kv = kv_transforms(cfg, [resolved[i]])
        ys, acc = [], None
        for b in range(0, x.shape[0], batch):
            y, h = fwd(params, kv, x[b:b + batch])
            ys.append(y)
            h = as_numpy(h)
            acc = h if acc is None else {k: acc[k] + h[k] for k in acc}
        out.append({k: 2.0 * v / n_tok for k, v in acc.items()})
        x = jnp.concatenate(ys, axis=0)
    return out


def gptq_weight_quantizer(hessians: list[dict], bits: int = 4):
    """``build_quantized_state``'s ``weight_quantizer`` running GPTQ with the layer's Hessians."""
    from pallasite.ops.quant.gptq import gptq_quantize

    def quantize(i, name, w_IO):
        return gptq_quantize(w_IO, hessians[i][HESSIAN_OF[name]], bits=bits)
    return quantize


@dataclasses.dataclass
class QuantizedModel:
    """What ``quantize_model`` produced: the deployed model (``cfg``: ``linear="w4a4"`` and, with
    4-bit KV, ``kv_cache="kv4"`` reading ``KV4_TRANSFORMS_FILE`` next to the model), its KV
    transforms and what was folded. ``save`` writes a folder ``pallasite.load`` serves."""

    cfg: ModelConfig
    graphdef: object
    state: object
    kv: dict  # per-layer K transforms and K/V clip logits (inference/cache/kv4.py TRANSFORM_KEYS)
    resolved: list  # per-layer float64 transforms (what was folded)
    history: Optional[list] = None  # FlatQuant per-layer per-epoch calibration MSE

    def init_cache(self, batch_size: int, max_len: int):
        """The model's KV cache with the in-memory transforms (the saved model reads them from its folder)."""
        from pallasite.inference.cache.dense import init_dense_cache

        if self.cfg.kv_cache != "kv4":
            return init_dense_cache(self.cfg, batch_size, max_len, dtype=jnp.float32)
        return init_kv4_cache(self.cfg, batch_size, max_len, self.kv, group=self.cfg.kv_cache_config.group)

    def save(self, out_dir: str, tokenizer=None):
        """Write a pallasite model folder (orbax parameters + config, ``KV4_TRANSFORMS_FILE``, the
        tokenizer) and return it loaded: a ``pallasite.Model`` whose KV4 cache reads the file."""
        import os

        from pallasite.api import Model, load

        Model(self.cfg, self.state, tokenizer, self.graphdef).save(out_dir, format="orbax")
        if self.cfg.kv_cache == "kv4":
            save_kv_transforms(os.path.join(out_dir, KV4_TRANSFORMS_FILE), self.kv)
        return load(out_dir)


def quantize_model(cfg: ModelConfig, pure: dict, method: str, *, calib_tokens=None,
                   ccfg: CalibConfig = CalibConfig(), w_bits: int = 4, a_bits: int = 4, kv_bits: int = 4,
                   impl: str = "ref", resolved: Optional[list] = None, seed: int = 0,
                   log: Callable[[str], None] = print, checkpoint: Optional[str] = None,
                   weight_quantizer: str = "rtn", share_inputs: bool = True) -> QuantizedModel:
    """FP pure state dict → deployed W4A4KV4 model for ``method`` (rtn | smoothquant | hadamard | flatquant).

    ``weight_quantizer``: ``"rtn"`` (round-to-nearest) or ``"gptq"`` (GPTQ on the transformed,
    clipped weights with Hessians of their transformed inputs over ``calib_tokens``; the paper's
    "-GPTQ" rows). ``checkpoint``: FlatQuant's per-layer calibration directory (resumable).
    ``share_inputs``: transform the shared q/k/v and gate/up inputs once (``QuantConfig.share_inputs``)."""
    check_quantizable(cfg)
    if method not in QUANT_METHODS:
        raise ValueError(f"quantize_model: unknown method {method!r}; expected one of {' | '.join(QUANT_METHODS)}")
    if weight_quantizer not in ("rtn", "gptq"):
        raise ValueError(f"quantize_model: weight_quantizer={weight_quantizer!r}; expected 'rtn' or 'gptq'")
    if calib_tokens is None and resolved is None and (method in ("smoothquant", "flatquant")):
        raise ValueError(f"quantize_model(method={method!r}) needs calib_tokens "
                         f"({'activation statistics' if method == 'smoothquant' else 'calibration'})")
    if weight_quantizer == "gptq" and calib_tokens is None:
        raise ValueError("quantize_model(weight_quantizer='gptq') needs calib_tokens for the GPTQ Hessians")
    bits = Bits(w_bits, a_bits, kv_bits)
    history = None
    if resolved is None:
        if method == "rtn":
            resolved = rtn_transforms(cfg)
        elif method == "smoothquant":
            resolved = smoothquant_transforms(cfg, pure, calib_tokens)
        elif method == "hadamard":
            resolved = hadamard_transforms(cfg, seed)
        else:
            resolved, history = calibrate(cfg, pure, calib_tokens, ccfg, bits=bits, log=log,
                                          checkpoint=checkpoint, log_epochs=checkpoint is not None)
    online = method in ("hadamard", "flatquant")
    qcfg = QuantConfig(method=method, w_bits=w_bits, a_bits=a_bits, kv_bits=kv_bits, online_transform=online, impl=impl,
                       share_inputs=share_inputs and online)
    folded = [fold_layer(layer_weights(pure, cfg, i), t, cfg, weight_clipping=w_bits < 16)
              for i, t in enumerate(resolved)]
    wq = None
    if weight_quantizer == "gptq" and w_bits < 16:
        hess = gptq_hessians(cfg, pure, resolved, calib_tokens, bits, batch=ccfg.batch)
        wq = gptq_weight_quantizer(hess, w_bits)
    kv_config = KV4Config(group=qcfg.kv_group, transforms=KV4_TRANSFORMS_FILE)
    cfg_q, pure_q = build_quantized_state(cfg, pure, folded, qcfg, weight_quantizer=wq, kv_cache_config=kv_config)
    graphdef, state = state_from_pure(cfg_q, pure_q)
    return QuantizedModel(cfg_q, graphdef, state, kv_transforms(cfg, resolved), resolved, history)
