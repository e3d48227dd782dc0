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


HESSIAN_OF = {"q": "qkv", "k": "qkv", "v": "qkv", "o": "o", "gate": "ug", "up": "ug", "down": "down"}


def gptq_hessians(cfg: ModelConfig, pure: dict, resolved: list, tokens_NT, bits, batch: int = 4) -> list[dict]:
    """Per layer, GPTQ's ``H = 2 X̂ᵀX̂ / n`` of each linear group's input as the folded weight sees
    it: transformed (``resolved[i]``) and activation-quantized (``bits.a``), one Hessian per shared
    input (``qkv``, ``o``, ``ug``, ``down``; see ``HESSIAN_OF``).

    As GPTQ's sequential pass, layer i's inputs are the outputs of the already-quantized layers
    0..i-1 (fake-quantized; deviation: those layers use RTN weights, not their GPTQ weights, and
    within a layer o/down see RTN-quantized q/k/v/gate/up instead of GPTQ'd ones — one pass per
    layer instead of four)."""
    tokens_NT = np.asarray(tokens_NT)
    rope = rope_tables(cfg, tokens_NT.shape[1], jnp.float32)

    @jax.jit
    def fwd(w, t, x):
        return layer_forward(w, t, x, cfg, bits, rope=rope, hessians=True)

    x = embed_tokens(pure, tokens_NT)
    n_tok = tokens_NT.shape[0] * tokens_NT.shape[1]
    out = []
    for i in range(cfg.n_layers):
        w = {k: (None if v is None else jnp.asarray(v, jnp.float32)) for k, v in layer_weights(pure, cfg, i).items()}
        t = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), resolved[i])
        ys, acc = [], None
        for b in range(0, x.shape[0], batch):
            y, h = fwd(w, t, x[b:b + batch])
            ys.append(y)
            h = {k: np.asarray(v, np.float64) for k, v in h.items()}
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
    cfg: ModelConfig  # quantized config (linear="w4a4", quant=QuantConfig)
    graphdef: object
    state: object
    kv: dict  # per-layer K transforms and K/V clip logits for init_kv4_cache
    resolved: list  # per-layer float64 transforms (what was folded)
    history: Optional[list] = None  # FlatQuant per-layer per-epoch calibration MSE

    def init_cache(self, batch_size: int, max_len: int):
        from pallasite.inference.cache.dense import init_dense_cache
        from pallasite.inference.cache.kv4 import init_kv4_cache

        if self.cfg.linear_config.kv_bits >= 16:
            return init_dense_cache(self.cfg, batch_size, max_len, dtype=jnp.float32)
        return init_kv4_cache(self.cfg, batch_size, max_len, self.kv, group=self.cfg.linear_config.kv_group)


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
    if weight_quantizer not in ("rtn", "gptq"):
        raise ValueError(f"quantize_model: weight_quantizer={weight_quantizer!r}; expected 'rtn' or 'gptq'")
    if weight_quantizer == "gptq" and calib_tokens is None:
        raise ValueError("quantize_model(weight_quantizer='gptq') needs calib_tokens for the GPTQ Hessians")
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

            resolved, history = calibrate(cfg, pure, calib_tokens, ccfg, bits=Bits(w_bits, a_bits, kv_bits), log=log,
                                          checkpoint=checkpoint, log_epochs=checkpoint is not None)
        else:
            raise ValueError(f"quantize_model: unknown method {method!r}; expected rtn | smoothquant | hadamard | flatquant")
    online = method in ("hadamard", "flatquant")
    qcfg = QuantConfig(method=method, w_bits=w_bits, a_bits=a_bits, kv_bits=kv_bits, online_transform=online, impl=impl,
                       share_inputs=share_inputs and online)
    folded = [fold_layer(layer_weights(pure, cfg, i), t, cfg, weight_clipping=w_bits < 16) for i, t in enumerate(resolved)]
    wq = None
    if weight_quantizer == "gptq" and w_bits < 16:
        from pallasite.training.flatquant import Bits

        hess = gptq_hessians(cfg, pure, resolved, calib_tokens, Bits(w_bits, a_bits, kv_bits), batch=ccfg.batch)
        wq = gptq_weight_quantizer(hess, w_bits)
    cfg_q, pure_q = build_quantized_state(cfg, pure, folded, qcfg, weight_quantizer=wq)
    graphdef, state = state_from_pure(cfg_q, pure_q)
    return QuantizedModel(cfg_q, graphdef, state, kv_transforms(cfg, resolved), resolved, history)


# ====================================================================== save / load / CLI
def save_quantized(qm: QuantizedModel, out_dir: str) -> None:
    """``config.json`` (ModelConfig incl. the quant sub-config) + ``params.npz`` (deployed state,
    packed int4 kernels as uint8) + ``kv.npz`` (K-cache transforms and K/V clip logits)."""
    import json
    import os

    from flax import nnx

    os.makedirs(out_dir, exist_ok=True)
    flat = {}
    for path, var in nnx.to_flat_state(qm.state):
        flat["/".join(str(k) for k in path)] = np.asarray(var.get_value() if hasattr(var, "get_value") else var.value)
    np.savez(os.path.join(out_dir, "params.npz"), **flat)
    np.savez(os.path.join(out_dir, "kv.npz"), **{k: np.asarray(v) for k, v in qm.kv.items()})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(qm.cfg.to_dict(), f, indent=1)


def load_quantized(out_dir: str) -> QuantizedModel:
    import json
    import os

    from flax import nnx

    from pallasite.models.transformer import abstract_model

    with open(os.path.join(out_dir, "config.json")) as f:
        cfg_q = ModelConfig.from_dict(json.load(f))
    graphdef, abstract = nnx.split(abstract_model(cfg_q))
    params = np.load(os.path.join(out_dir, "params.npz"))
    flat = []
    for path, var in nnx.to_flat_state(abstract):
        name = "/".join(str(k) for k in path)
        if name not in params:
            raise ValueError(f"load_quantized: {out_dir}/params.npz lacks {name!r}")
        value = params[name]
        if tuple(value.shape) != tuple(var.shape):
            raise ValueError(f"load_quantized: {name!r} has shape {value.shape}, expected {tuple(var.shape)}")
        flat.append((path, var.replace(jnp.asarray(value))))
    kv = {k: jnp.asarray(v) for k, v in np.load(os.path.join(out_dir, "kv.npz")).items()}
    return QuantizedModel(cfg_q, graphdef, nnx.from_flat_state(flat), kv, resolved=[])


def main(argv=None):
    """Quantize SmolLM2-135M (GGUF) with a configs/quant file, save it, report perplexity and a sample."""
    import argparse
    import json
    import time

    from pallasite.eval.corpora import load_texts, token_streams
    from pallasite.training.config import load_config
    from pallasite.eval.perplexity import perplexity
    from pallasite.inference.engine import generate_ids
    from pallasite.models import gguf
    from pallasite.models.transformer import forward

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--config", default="configs/quant/flatquant.py:quick")
    ap.add_argument("--out", default="")
    args, rest = ap.parse_known_args(argv)
    path, _, arg = args.config.partition(":")
    c = load_config(path, arg or None, [r for r in rest if r.startswith("--config.")])
    t0 = time.time()
    cfg, state, tok = gguf.import_gguf(c.gguf or gguf.smollm2_gguf_path())
    pure = state.to_pure_dict()
    calib_stream, eval_stream = token_streams(tok, load_texts(c.text or None),
                                              max(c.calib.nsamples * c.calib.seq_len, 2_000_000))
    rng = np.random.default_rng(c.calib.seed)
    starts = rng.integers(0, len(calib_stream) - c.calib.seq_len - 1, c.calib.nsamples)
    calib = np.stack([calib_stream[s:s + c.calib.seq_len] for s in starts])
    ccfg = CalibConfig(**{k: c.calib[k] for k in ("nsamples", "seq_len", "batch", "epochs", "lr", "clip_lr_mult",
                                                   "weight_decay", "diag_alpha", "seed")})
    qm = quantize_model(cfg, pure, c.method, calib_tokens=calib, ccfg=ccfg, w_bits=c.w_bits, a_bits=c.a_bits,
                        kv_bits=c.kv_bits, impl=c.impl)
    if args.out:
        save_quantized(qm, args.out)
        qm = load_quantized(args.out)

    @jax.jit
    def logits_fn(ids):
        return forward(qm.graphdef, qm.state, ids, cache=qm.init_cache(ids.shape[0], ids.shape[1]))[0]

    r = perplexity(logits_fn, eval_stream, c.eval.seq_len, max_windows=c.eval.windows or None, batch_size=4)
    prompt = tok(c.generate.prompt, add_special_tokens=False)["input_ids"]
    new = generate_ids(qm.graphdef, qm.state, qm.cfg, [prompt], max_new_tokens=c.generate.max_new_tokens,
                       cache_factory=lambda _cfg, b, s: qm.init_cache(b, s))[0]
    print(c.generate.prompt + tok.decode(new))
    print(json.dumps({"method": c.method, "ppl": r["ppl"], "eval_tokens": r["tokens"], "saved": args.out or None,
                      "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
