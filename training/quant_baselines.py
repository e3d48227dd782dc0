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

from pallasite.models.config import ModelConfig
from pallasite.models.quantized import (QuantConfig, build_quantized_state, check_quantizable, decompose_dim,
                                        fold_layer, kv_transforms, layer_weights, state_from_pure)
from pallasite.ops.quant.hadamard import has_hadamard, random_hadamard
from pallasite.training.flatquant import (FP_BITS, CalibConfig, calibrate, embed_tokens, layer_forward,
                                          rope_tables)


def rtn_transforms(cfg: ModelConfig) -> list[dict]:
    return [{} for _ in range(cfg.n_layers)]


def fp_statistics(cfg: ModelConfig, pure: dict, tokens_NT, batch: int = 4) -> list[dict]:
    """Per-layer per-channel absmax of the three quantized inputs along the FP model."""
    tokens_NT = np.asarray(tokens_NT)
    rope = rope_tables(cfg, tokens_NT.shape[1], jnp.float32)
    fp_fn = jax.jit(lambda w, x: layer_forward(w, None, x, cfg, FP_BITS, rope=rope, collect=True))
    x = embed_tokens(pure, tokens_NT)
    out = []
    for i in range(cfg.n_layers):
        w = {k: (None if v is None else jnp.asarray(v, jnp.float32)) for k, v in layer_weights(pure, cfg, i).items()}
        ys, stats = [], None
        for b in range(0, x.shape[0], batch):
            y, s = fp_fn(w, x[b:b + batch])
            ys.append(y)
            stats = s if stats is None else jax.tree.map(jnp.maximum, stats, s)
        out.append({k: np.asarray(v, np.float64) for k, v in stats.items()})
        x = jnp.concatenate(ys, axis=0)
    return out


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


@dataclasses.dataclass
class QuantizedModel:
    cfg: ModelConfig  # quantized config (linear="w4a4", quant=QuantConfig)
    graphdef: object
    state: object
    kv: dict  # per-layer K transforms and K/V clip logits for init_kv4_cache
    resolved: list  # per-layer float64 transforms (what was folded)
    history: Optional[list] = None  # FlatQuant per-layer per-epoch calibration MSE

    def init_cache(self, batch_size: int, max_len: int):
        from pallasite.inference.cache.dense import init_dense_cache
        from pallasite.inference.cache.kv4 import init_kv4_cache

        if self.cfg.quant.kv_bits >= 16:
            return init_dense_cache(self.cfg, batch_size, max_len, dtype=jnp.float32)
        return init_kv4_cache(self.cfg, batch_size, max_len, self.kv, group=self.cfg.quant.kv_group)


def quantize_model(cfg: ModelConfig, pure: dict, method: str, *, calib_tokens=None,
                   ccfg: CalibConfig = CalibConfig(), w_bits: int = 4, a_bits: int = 4, kv_bits: int = 4,
                   impl: str = "ref", resolved: Optional[list] = None, seed: int = 0,
                   log: Callable[[str], None] = print) -> QuantizedModel:
    """FP pure state dict → deployed W4A4KV4 model for ``method`` (rtn | smoothquant | hadamard | flatquant)."""
    check_quantizable(cfg)
    history = None
    if resolved is None:
        if method == "rtn":
            resolved = rtn_transforms(cfg)
        elif method == "smoothquant":
            if calib_tokens is None:
                raise ValueError("quantize_model(method='smoothquant') needs calib_tokens for activation statistics")
            resolved = smoothquant_transforms(cfg, pure, calib_tokens)
        elif method == "hadamard":
            resolved = hadamard_transforms(cfg, seed)
        elif method == "flatquant":
            if calib_tokens is None:
                raise ValueError("quantize_model(method='flatquant') needs calib_tokens for calibration")
            from pallasite.training.flatquant import Bits

            resolved, history = calibrate(cfg, pure, calib_tokens, ccfg, bits=Bits(w_bits, a_bits, kv_bits), log=log)
        else:
            raise ValueError(f"quantize_model: unknown method {method!r}; expected rtn | smoothquant | hadamard | flatquant")
    online = method in ("hadamard", "flatquant")
    qcfg = QuantConfig(method=method, w_bits=w_bits, a_bits=a_bits, kv_bits=kv_bits, online_transform=online, impl=impl)
    folded = [fold_layer(layer_weights(pure, cfg, i), t, cfg, weight_clipping=w_bits < 16) for i, t in enumerate(resolved)]
    cfg_q, pure_q = build_quantized_state(cfg, pure, folded, qcfg)
    graphdef, state = state_from_pure(cfg_q, pure_q)
    return QuantizedModel(cfg_q, graphdef, state, kv_transforms(cfg, resolved), resolved, history)
