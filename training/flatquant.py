"""FlatQuant layer-wise calibration (Sun et al., "FlatQuant: Flatness Matters for LLM
Quantization", ICML 2025; official ``flatquant/train_utils.py::cali_flat_quant``).

Per decoder layer ``i`` (placement: see ``models/quantized.py``) the learnable parameters are

* Kronecker transforms ``P = P1 ⊗ P2`` (``ln``, ``ug`` on d_model; ``down`` on d_ff; factor sizes
  from ``decompose_dim``) and single transforms ``v``, ``k`` (head_dim) and ``o`` (n_heads), each
  factor parameterised as ``U diag(s) Vᵀ`` with orthogonal U, V so ``P^{-T} = U diag(1/s) Vᵀ`` is
  closed-form. U = B_U · Cayley(A_U): a fixed random orthogonal base (QR of a Gaussian with the
  sign fix, as ``get_random_orthg``) times the Cayley map of a trained skew-symmetric
  ``A = tril(X, −1) − tril(X, −1)ᵀ``, X initialised at 0 (deviation: torch's
  ``orthogonal(..., "cayley", use_trivialization=False)`` maps the stored matrix itself through
  Cayley; ours starts exactly at the random orthogonal init), ``s = 1``;
* per-channel scales ``c`` for ``ln``, ``ug``, ``down`` (``--add_diag``), initialised
  SmoothQuant-style ``c = max|W|^{1−α} / max|X|^{α}`` with α = 0.3, clamped ≥ 1e-5 (statistics
  from the full-precision pass of this layer);
* learnable weight clipping per output channel (two sigmoid logits per row, init 4) for every
  linear, learnable activation clipping (one sigmoid-logit pair per quantizer, init 4) for every
  linear's input and for the K and V cache quantizers.

Objective and optimiser, as the official recipe: the inputs of layer i are the **full-precision
outputs of the full-precision layer i−1**; loss = MSE(FP layer(x), quantized layer(x)) divided by
its own detached value; AdamW with torch's default weight decay 0.01 (set explicitly: optax's
default differs), betas (0.9, 0.999), eps 1e-8, lr 5e-3 for transforms and scales and 10× for the
clip logits, cosine decay to 1e-3× over ``epochs · nsamples / batch`` steps with no warmup,
15 epochs, batch 4, float32 throughout (half precision can make transforms singular — official
issues #16/#20). Calibration data size is configurable (paper: 128 windows × 2048 tokens).

Quantizers during calibration: W4 (symmetric per output channel, recomputed every step from
the transformed, clipped weight), A4 (symmetric per token, LAC), K4/V4 (asymmetric per head,
LAC); queries stay full precision (``q_bits = 16``), all with straight-through rounding.

Failures stop and name the layer: a non-finite loss (``FloatingPointError``) or a transform
whose singular values leave ``[1e-6, 1e6]·max`` (``np.linalg.LinAlgError``).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pallasite.models.config import ModelConfig
from pallasite.models.quantized import (
    check_quantizable,
    decompose_dim,
    fold_layer,
    kv_quant_taps,
    kv_transforms,
    layer_weights,
    quantized_block_params,
)
from pallasite.ops.quant.quantizers import LAC_INIT
from pallasite.training.quant_blocks import BlockFn, calibration_config, fp_layers

LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(frozen=True)
class Bits:
    w: int = 4
    a: int = 4
    kv: int = 4


FP_BITS = Bits(16, 16, 16)


@dataclasses.dataclass(frozen=True)
class CalibConfig:
    nsamples: int = 128  # calibration windows
    seq_len: int = 2048
    batch: int = 4
    epochs: int = 15
    lr: float = 5e-3
    clip_lr_mult: float = 10.0
    weight_decay: float = 0.01  # torch AdamW default, as the official code uses
    diag_alpha: float = 0.3
    seed: int = 0


# ====================================================================== the quantized layer
def quantized_layer_forward(block_fn: BlockFn, cfg: ModelConfig, w: dict, t: dict, x_BTD, bits: Bits):
    """Layer output of the calibration-mode ``Block`` (``block_fn``: ``calibration_config``) whose
    parameters are ``fold_layer(w, t)`` — differentiable in ``t``: online transforms and clips in
    the ``QuantLinear``s, folded weights fake-quantized, K transform after RoPE and K/V fake
    quantization through ``kv_quant_taps`` (the KV4 cache's quantizer)."""
    folded = fold_layer(w, t, cfg, weight_clipping=bits.w < 16)
    params = quantized_block_params(folded, block_fn.template, block_fn.cfg.linear_config)
    kv = kv_transforms(cfg, [t])
    y, _ = block_fn(params, x_BTD, kv_quant_taps(kv, bits.kv, block_fn.cfg.linear_config.kv_group))
    return y


# ====================================================================== transform parameters
def random_orthogonal(n: int, rng: np.random.Generator) -> np.ndarray:
    """QR of a Gaussian with the sign fix (official ``get_random_orthg``)."""
    Q, R = np.linalg.qr(rng.standard_normal((n, n)))
    return Q * np.sign(np.diag(R))[None, :]


def cayley(X):
    """Orthogonal matrix from an unconstrained X via the skew part A of its strict lower triangle."""
    Lo = jnp.tril(X, -1)
    A = Lo - Lo.T
    eye = jnp.eye(X.shape[0], dtype=X.dtype)
    return jnp.linalg.solve(eye - 0.5 * A, eye + 0.5 * A)


def _svd_factor(n, rng):
    return ({"xu": np.zeros((n, n)), "xv": np.zeros((n, n)), "s": np.ones(n)},
            {"bu": random_orthogonal(n, rng), "bv": random_orthogonal(n, rng)})


def _factor_matrices(p, b):
    U = b["bu"] @ cayley(p["xu"])
    V = b["bv"] @ cayley(p["xv"])
    M = (U * p["s"][None, :]) @ V.T
    M_it = (U / p["s"][None, :]) @ V.T
    return M, M_it


def init_flatquant_params(cfg: ModelConfig, w: dict, stats: dict, ccfg: CalibConfig, rng: np.random.Generator,
                          dtype=jnp.float32):
    """(trainable θ, frozen bases) for one layer; c from the SmoothQuant-style init. The random
    orthogonal bases are drawn in float64 and cast to ``dtype`` (float64 keeps them orthogonal to
    1e-15, which the exact-invariance test needs)."""
    D, F, H, Dh = cfg.d_model, cfg.d_ff, cfg.n_heads, cfg.dh
    theta, frozen = {}, {}
    for name, n in (("ln", D), ("ug", D), ("down", F)):
        n1, n2 = decompose_dim(n)
        (pl_, bl), (pr, br) = _svd_factor(n1, rng), _svd_factor(n2, rng)
        theta[name], frozen[name] = {"L": pl_, "R": pr}, {"L": bl, "R": br}
    for name, n in (("v", Dh), ("o", H), ("k", Dh)):
        theta[name], frozen[name] = _svd_factor(n, rng)
    alpha = ccfg.diag_alpha

    def init_c(wmax, xmax):
        return np.maximum(np.power(wmax, 1 - alpha) / np.power(np.maximum(xmax, 1e-5), alpha), 1e-5).astype(np.float32)

    absmax_in = lambda *ks: np.max(np.stack([np.abs(np.asarray(w[k])).max(axis=1) for k in ks]), axis=0)  # noqa: E731
    theta["c_ln"] = init_c(absmax_in("q", "k", "v"), np.asarray(stats["ln"]))
    theta["c_ug"] = init_c(absmax_in("gate", "up"), np.asarray(stats["ug"]))
    theta["c_down"] = init_c(absmax_in("down"), np.asarray(stats["down"]))
    theta["lwc"] = {n: np.full((w[n].shape[1], 2), LAC_INIT, np.float32) for n in LINEARS}
    theta["lac"] = {n: np.full((2,), LAC_INIT, np.float32) for n in LINEARS}
    theta["k_clip"] = np.full((2,), LAC_INIT, np.float32)
    theta["v_clip"] = np.full((2,), LAC_INIT, np.float32)
    cast = lambda a: jnp.asarray(np.asarray(a, np.float64), dtype)  # noqa: E731
    return jax.tree.map(cast, theta), jax.tree.map(cast, frozen)


def resolve(theta: dict, frozen: dict) -> dict:
    """Trainable parameters → transform matrices and inverse-transposes (differentiable)."""
    t = {}
    for name in ("ln", "ug", "down"):
        L, L_it = _factor_matrices(theta[name]["L"], frozen[name]["L"])
        R, R_it = _factor_matrices(theta[name]["R"], frozen[name]["R"])
        t[name], t[name + "_inv_t"] = (L, R), (L_it, R_it)
        t["c_" + name] = theta["c_" + name]
    for name in ("v", "o", "k"):
        t[name], t[name + "_inv_t"] = _factor_matrices(theta[name], frozen[name])
    for key in ("lwc", "lac", "k_clip", "v_clip"):
        t[key] = theta[key]
    return t


def singular_values(theta: dict) -> dict:
    """|s| of every factor (U, V orthogonal ⇒ these are the singular values of the factor)."""
    out = {}
    for name in ("ln", "ug", "down"):
        out[name + ".left"] = np.abs(np.asarray(theta[name]["L"]["s"]))
        out[name + ".right"] = np.abs(np.asarray(theta[name]["R"]["s"]))
    for name in ("v", "o", "k"):
        out[name] = np.abs(np.asarray(theta[name]["s"]))
    for name in ("c_ln", "c_ug", "c_down"):
        out[name] = np.abs(np.asarray(theta[name]))
    return out


def check_transforms(theta: dict, layer: int, rcond: float = 1e-6) -> None:
    for name, s in singular_values(theta).items():
        smax = float(np.max(s)) if s.size else 0.0
        if not np.all(np.isfinite(s)) or smax == 0.0 or float(np.min(s)) < rcond * smax:
            raise np.linalg.LinAlgError(
                f"FlatQuant calibration: layer {layer} transform {name!r} is singular or non-finite "
                f"(singular values min {np.min(s):.3g}, max {smax:.3g}; allowed ratio >= {rcond})")


def to_numpy_f64(t: dict) -> dict:
    return jax.tree.map(lambda a: np.asarray(a, np.float64), t)


# ====================================================================== calibration loop
def _labels(theta):
    def lab(path, _):
        top = path[0].key if hasattr(path[0], "key") else str(path[0])
        return "clip" if top in ("lwc", "lac", "k_clip", "v_clip") else "trans"
    return jax.tree_util.tree_map_with_path(lab, theta)


def make_optimizer(theta, ccfg: CalibConfig, total_steps: int):
    def adamw(lr):
        sched = optax.cosine_decay_schedule(lr, max(1, total_steps), alpha=1e-3)
        return optax.adamw(sched, b1=0.9, b2=0.999, eps=1e-8, weight_decay=ccfg.weight_decay)

    return optax.multi_transform({"trans": adamw(ccfg.lr), "clip": adamw(ccfg.lr * ccfg.clip_lr_mult)}, _labels(theta))


def calibrate(cfg: ModelConfig, pure: dict, tokens_NT: np.ndarray, ccfg: CalibConfig = CalibConfig(), *,
              bits: Bits = Bits(), log: Callable[[str], None] = print, max_layers: Optional[int] = None,
              checkpoint: Optional[str] = None, log_epochs: bool = False):
    """Layer-wise FlatQuant calibration. Returns (resolved transforms per layer as float64 numpy,
    history: list of per-layer lists of per-epoch mean MSE). ``max_layers``: calibrate only the
    first layers (the rest are left to the caller, e.g. identity transforms).

    ``checkpoint``: a directory; each finished layer's resolved transforms and MSE history are
    written there at once (``layer_XXX.npz``) and layers already present are loaded instead of
    re-trained (their FP outputs are recomputed, which is cheap), so a crash loses at most one
    layer. The directory also records the calibration setting and refuses to resume a different one."""
    check_quantizable(cfg)
    tokens_NT = np.asarray(tokens_NT)
    N, T = tokens_NT.shape
    bsz = min(ccfg.batch, N)
    steps_per_epoch = N // bsz
    block_fn = BlockFn(calibration_config(cfg, bits.w, bits.a, bits.kv))

    def loss_fn(theta, frozen, w, x, target):
        out = quantized_layer_forward(block_fn, cfg, w, resolve(theta, frozen), x, bits)
        return jnp.mean((out - target) ** 2)

    opt = None  # built from the first layer's θ (same structure for every layer), so one compile

    def step(theta, opt_state, frozen, w, x, target):
        mse, grads = jax.value_and_grad(loss_fn)(theta, frozen, w, x, target)
        # loss / loss.detach(): the gradient is scaled by 1 / mse (official normalisation)
        grads = jax.tree.map(lambda g: g / jax.lax.stop_gradient(mse), grads)
        updates, opt_state = opt.update(grads, opt_state, theta)
        return optax.apply_updates(theta, updates), opt_state, mse

    resolved, history = [], []
    step_jit = None
    if checkpoint is not None:
        _check_checkpoint_setting(checkpoint, ccfg, bits, tokens_NT)
    for i, x_in, x_out, stats in fp_layers(cfg, pure, tokens_NT, bsz, max_layers):
        t0 = time.time()
        w_np = {k: v for k, v in layer_weights(pure, cfg, i).items() if v is not None}
        w = {k: jnp.asarray(v, jnp.float32) for k, v in w_np.items()}
        saved = None if checkpoint is None else load_layer_checkpoint(checkpoint, i)
        if saved is not None:
            resolved.append(saved[0])
            history.append(saved[1])
            log(f"flatquant layer {i}: loaded from {checkpoint} (mse {saved[1][0]:.3e} -> {saved[1][-1]:.3e})")
            continue
        rng = np.random.default_rng([ccfg.seed, i])  # per layer: a resumed run draws the same bases
        theta, frozen = init_flatquant_params(cfg, w_np, stats, ccfg, rng)
        if opt is None:
            opt = make_optimizer(theta, ccfg, ccfg.epochs * steps_per_epoch)
            step_jit = jax.jit(step, donate_argnums=(0, 1))
        opt_state = opt.init(theta)
        epoch_mse = []
        for epoch in range(ccfg.epochs):
            tot = 0.0
            for j in range(steps_per_epoch):
                sl = slice(j * bsz, (j + 1) * bsz)
                theta, opt_state, mse = step_jit(theta, opt_state, frozen, w, x_in[sl], x_out[sl])
                tot += float(mse)
            m = tot / steps_per_epoch
            if not math.isfinite(m):
                raise FloatingPointError(f"FlatQuant calibration: non-finite loss ({m}) at layer {i}, epoch {epoch}")
            epoch_mse.append(m)
            if log_epochs:
                log(f"  layer {i} epoch {epoch + 1}/{ccfg.epochs}: mse {m:.4e} ({time.time() - t0:.0f}s)")
        check_transforms(theta, i)
        resolved.append(to_numpy_f64(resolve(theta, frozen)))
        history.append(epoch_mse)
        if checkpoint is not None:
            save_layer_checkpoint(checkpoint, i, resolved[-1], epoch_mse)
        log(f"flatquant layer {i}: mse {epoch_mse[0]:.3e} -> {epoch_mse[-1]:.3e} ({time.time() - t0:.1f}s)")
    return resolved, history


# ====================================================================== per-layer checkpoints
def _flatten(tree, prefix=""):
    """Nested dict/tuple of arrays → {"a/b/0": array}; None leaves are dropped."""
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
    elif isinstance(tree, (tuple, list)):
        for j, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{j}/"))
    elif tree is not None:
        out[prefix[:-1]] = np.asarray(tree)
    return out


def _unflatten(flat: dict) -> dict:
    root: dict = {}
    for key, v in flat.items():
        parts = key.split("/")
        node = root
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v

    def fix(node):  # dicts keyed 0..n-1 were tuples (Kronecker factor pairs)
        if not isinstance(node, dict):
            return node
        node = {k: fix(v) for k, v in node.items()}
        if node and all(k.isdigit() for k in node):
            return tuple(node[str(j)] for j in range(len(node)))
        return node
    return fix(root)


def save_layer_checkpoint(directory: str, layer: int, resolved_layer: dict, epoch_mse: list) -> None:
    import os

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"layer_{layer:03d}.npz")
    tmp = path + ".tmp.npz"
    np.savez(tmp, __history__=np.asarray(epoch_mse, np.float64), **_flatten(resolved_layer))
    os.replace(tmp, path)  # atomic: a crash mid-write never leaves a truncated layer file


def load_layer_checkpoint(directory: str, layer: int):
    """(resolved float64 transforms, epoch MSE list) of a finished layer, or None."""
    import os

    path = os.path.join(directory, f"layer_{layer:03d}.npz")
    if not os.path.exists(path):
        return None
    with np.load(path) as z:
        flat = {k: np.asarray(z[k], np.float64) for k in z.files}
    hist = [float(h) for h in flat.pop("__history__")]
    return _unflatten(flat), hist


def load_calibration(directory: str, n_layers: int) -> list:
    """All layers' resolved transforms from a finished ``checkpoint`` directory (missing layers named)."""
    out = []
    for i in range(n_layers):
        saved = load_layer_checkpoint(directory, i)
        if saved is None:
            raise FileNotFoundError(f"load_calibration: {directory} has no layer_{i:03d}.npz "
                                    f"(calibration unfinished: expected {n_layers} layers)")
        out.append(saved[0])
    return out


def _check_checkpoint_setting(directory: str, ccfg: CalibConfig, bits: Bits, tokens_NT) -> None:
    import hashlib
    import json
    import os

    setting = dict(dataclasses.asdict(ccfg), bits=dataclasses.asdict(bits), shape=list(tokens_NT.shape),
                   tokens_sha1=hashlib.sha1(np.ascontiguousarray(tokens_NT, np.int64).tobytes()).hexdigest())
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "setting.json")
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old != setting:
            raise ValueError(f"calibrate: checkpoint {directory} was made with another setting {old}; "
                             f"this run is {setting} (use a fresh directory)")
    else:
        with open(path, "w") as f:
            json.dump(setting, f, indent=1)
