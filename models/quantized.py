"""W4A4 quantized Linear and FlatQuant transform placement / folding (Sun et al., "FlatQuant:
Flatness Matters for LLM Quantization", ICML 2025; official code ruikangliu/FlatQuant).

Placement per Llama-style layer (official ``model_tools/llama_utils.py``), with ``kron(L, R)``
acting on a row-major reshaped token (``x ↦ Lᵀ · reshape(x, n1×n2) · R``):

================  =======================  ==============================================  =========
transform         size                     where                                            kept as
================  =======================  ==============================================  =========
``ln``            kron on d_model, + c      shared input of q/k/v                             online; c → input-norm γ
``ug``            kron on d_model, + c      shared input of gate/up                           online; c → post-attn-norm γ
``down``          kron on d_ff, + c         input of down_proj                                online; c → up_proj output columns
``v``             head_dim × head_dim       v_proj output (so the V cache is transformed)     folded into v_proj
``o``             n_heads × n_heads         head mixing of the attention output               online; o_proj gets kron(o, v)^{-T}
``k``             head_dim × head_dim       q (inverse-transpose) and k **after RoPE**        online, in the KV4 cache
================  =======================  ==============================================  =========

Weights transform with the inverse-transpose on their input dimension: ``W̃ = (W ⊘ c) · P^{-T}``
(kernel layout ``[in, out]``: ``W̃ = P^{-1} · diag(1/c) · W``), so ``x̃ W̃ = x W`` exactly before
quantization. After calibration everything foldable is folded here in float64
(``fold_layer``), learnable weight clipping (LWC) is applied to the transformed weights, then the
weights are quantized (RTN or GPTQ) to packed int4 with per-output-channel scales.

``QuantLinear`` (registered as ``linear="w4a4"``) keeps the parameter names ``kernel`` (packed
``uint8 [in/2, out]``, or float ``[in, out]`` when ``w_bits=16``) and ``bias``, plus ``w_scale``
``[out]``, the online factors ``in_left``/``in_right`` and the activation clip logits
``act_clip [2]``. Its forward is the deployed path: fused Kronecker transform + per-token int4
quantize (``ops.quant.kron_quantize``) then the int GEMM with dequant epilogue
(``ops.quant.int_gemm``); ``impl`` picks the jnp reference or the Pallas kernels. The factor
shape of each linear follows from its logical axes: inputs on ``embed``/``mlp`` use
``decompose_dim(in)`` (the paper's rule: the factor pair closest to √n), ``o_proj``
(``q_heads``) uses ``(n_heads, head_dim)`` with a head-mixing left factor.

Shared inputs (``QuantConfig.share_inputs``): q/k/v (and gate/up) read the same array and carry
the same online transform, so the transform runs once per shared input: the attention and FFN
modules pass their input through ``layers.prepare_shared_input`` (``QuantLinear.
prepare_shared_input`` returns a ``SharedQuantInput`` pytree) and every linear of the group
consumes that. ``build_quantized_state`` enables it only after checking that the group members'
factors are identical (each linear also checks the factor shape it is handed). What is shared
depends on the clips: when every group member has the same activation clip (``shared_act_clip``:
RTN, SmoothQuant, Hadamard) the int4 codes and per-token scales of the fused kernel are reused by
all three GEMMs; FlatQuant's calibrated model has one learned clip per linear (the official
recipe), so there the transformed activations are shared and each linear quantizes them with its
own clip (cheap, elementwise; the fused Pallas kernel is then not used for those inputs).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from pallasite.models.config import ModelConfig, kind_config
from pallasite.models.layers import LinearBase
from pallasite.models.transformer import abstract_model
from pallasite.ops.quant.int_gemm import int_gemm, pack_weight_int4, unpack_weight_int4
from pallasite.ops.quant.kron_quant import kron_quantize, kron_transform_ref, quantize_rows_packed
from pallasite.ops.quant.quantizers import (LAC_INIT, NO_CLIP_LOGIT, fake_quant_act_sym, pack_int4, quantize_act_sym,
                                            quantize_weight_sym)
from pallasite.registry import LINEAR

QUANT_METHODS = ("rtn", "smoothquant", "hadamard", "flatquant")
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")


def decompose_dim(n: int) -> tuple[int, int]:
    """FlatQuant's ``get_decompose_dim``: n = (a−b)(a+b) with the smallest a ≥ √n (factors closest to √n).

    Examples: 4096 → (64, 64), 11008 → (86, 128), 14336 → (112, 128), 576 → (24, 24), 1536 → (32, 48)."""
    if n < 1:
        raise ValueError(f"decompose_dim: n must be positive, got {n}")
    a = math.isqrt(n)
    if a * a < n:
        a += 1
    while True:
        b = math.isqrt(a * a - n)
        if b * b == a * a - n:
            return a - b, a + b
        a += 1


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """Sub-config of a quantized model (``linear="w4a4"``, ``linear_config=QuantConfig(...)``)."""

    method: str = "flatquant"  # rtn | smoothquant | hadamard | flatquant
    w_bits: int = 4
    a_bits: int = 4
    kv_bits: int = 4
    online_transform: bool = True  # Kronecker input transforms in q/k/v, gate/up, down, o
    impl: str = "ref"  # ref | pallas (fused transform+quantize and int GEMM kernels)
    kv_group: int = 128
    share_inputs: bool = False  # transform (and quantize) a shared q/k/v or gate/up input once
    shared_act_clip: bool = False  # every linear of a shared input has the same clip: reuse the int4 codes

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise ValueError(f"QuantConfig.method={self.method!r}; expected one of {QUANT_METHODS}")
        for name in ("w_bits", "a_bits", "kv_bits"):
            if getattr(self, name) not in (4, 16):
                raise ValueError(f"QuantConfig.{name}={getattr(self, name)}; expected 4 or 16 (off)")
        if self.impl not in ("ref", "pallas"):
            raise ValueError(f"QuantConfig.impl={self.impl!r}; expected 'ref' or 'pallas'")


def check_quantizable(cfg: ModelConfig) -> None:
    """The placement above knows the dense Llama/Mistral/Qwen2 layer; anything else fails clearly."""
    problems = []
    if cfg.family not in SUPPORTED_FAMILIES:
        problems.append(f"family={cfg.family!r} (known layouts: {SUPPORTED_FAMILIES})")
    if cfg.ffn != "dense":
        problems.append(f"ffn={cfg.ffn!r} (only the dense SwiGLU FFN has a known transform placement)")
    if cfg.qk_norm:
        problems.append("qk_norm=True (per-head q/k norms sit between q/k_proj and RoPE; placement unknown)")
    if cfg.hidden_act != "silu":
        problems.append(f"hidden_act={cfg.hidden_act!r} (expected the SwiGLU 'silu' MLP)")
    if problems:
        raise ValueError("FlatQuant transform placement does not know this layer layout: " + "; ".join(problems))


def linear_factor_dims(in_features: int, axes, cfg: ModelConfig) -> tuple[int, int]:
    """(n1, n2) of the online input transform of a linear, from its logical input axis."""
    if axes and axes[0] == "q_heads":
        return cfg.n_heads, cfg.dh
    return decompose_dim(in_features)


@struct.dataclass
class SharedQuantInput:
    """What the linears of one shared-input group (q/k/v, gate/up) consume, computed once.

    ``codes`` (packed int4, per-token scales) when the group shares one activation clip, else the
    transformed float activations ``x_t`` that each linear quantizes with its own clip.
    """
    dims: tuple = struct.field(pytree_node=False)  # (n1, n2) of the Kronecker transform applied
    x_t: Optional[jax.Array] = None
    codes: Optional[tuple] = None


class QuantLinear(LinearBase):
    """Deployed W4A4 linear: online Kronecker transform + per-token int4 activations × int4 weights."""

    def __init__(self, in_features: int, out_features: int, *, cfg: ModelConfig, axes, use_bias: bool = False,
                 init_std: float = 0.02, rngs: nnx.Rngs):
        q = kind_config(cfg, "linear", "w4a4", QuantConfig)
        self.qcfg = q
        self.in_features, self.out_features = in_features, out_features
        self.dtype = jnp.dtype(cfg.dtype)
        axes = tuple(axes)
        if q.w_bits < 16:
            if in_features % 2:
                raise ValueError(f"QuantLinear: in_features={in_features} must be even to pack int4 pairs")
            self.kernel = nnx.Param(jnp.zeros((in_features // 2, out_features), jnp.uint8), logical_axes=axes)
            self.w_scale = nnx.Param(jnp.ones((out_features,), jnp.float32), logical_axes=(axes[-1],))
        else:
            self.kernel = nnx.Param(jax.nn.initializers.normal(init_std)(rngs.params(), (in_features, out_features)),
                                    logical_axes=axes)
            self.w_scale = None
        self.bias = nnx.Param(jnp.zeros((out_features,), jnp.float32), logical_axes=(axes[-1],)) if use_bias else None
        if q.online_transform:
            n1, n2 = linear_factor_dims(in_features, axes, cfg)
            self.in_left = nnx.Param(jnp.eye(n1, dtype=jnp.float32), logical_axes=(None, None))
            self.in_right = nnx.Param(jnp.eye(n2, dtype=jnp.float32), logical_axes=(None, None))
        else:
            self.in_left = self.in_right = None
        self.act_clip = nnx.Param(jnp.full((2,), LAC_INIT, jnp.float32), logical_axes=(None,))

    def _shares_input(self) -> bool:
        q = self.qcfg
        return q.share_inputs and self.in_left is not None and q.a_bits < 16 and q.w_bits < 16

    def prepare_shared_input(self, x: jax.Array):
        """Transform (and, with one clip per group, quantize) an input read by the whole group."""
        if not self._shares_input():
            return x
        q, L, R = self.qcfg, self.in_left[...], self.in_right[...]
        x32, dims = x.astype(jnp.float32), (L.shape[0], R.shape[0])
        if q.shared_act_clip:
            return SharedQuantInput(dims=dims, codes=kron_quantize(x32, L, R, self.act_clip[...], impl=q.impl))
        return SharedQuantInput(dims=dims, x_t=kron_transform_ref(x32, L, R))

    def __call__(self, x) -> jax.Array:
        """``x``: the float input, or a ``SharedQuantInput`` from the group's ``prepare_shared_input``."""
        q = self.qcfg
        bias = None if self.bias is None else self.bias[...].astype(jnp.float32)
        if isinstance(x, SharedQuantInput):
            dims = None if self.in_left is None else (self.in_left[...].shape[0], self.in_right[...].shape[0])
            if not self._shares_input() or x.dims != dims:
                raise ValueError(f"QuantLinear: handed a shared input transformed with factors {x.dims}, but this "
                                 f"linear's transform is {dims} (share_inputs={q.share_inputs})")
            xq, xs = x.codes if x.codes is not None else quantize_rows_packed(x.x_t, self.act_clip[...])
            return int_gemm(xq, xs, self.kernel[...], self.w_scale[...], bias, impl=q.impl).astype(self.dtype)
        x = x.astype(jnp.float32)
        has_t = self.in_left is not None
        if q.a_bits < 16 and q.w_bits < 16:
            if has_t:
                xq, xs = kron_quantize(x, self.in_left[...], self.in_right[...], self.act_clip[...], impl=q.impl)
            else:
                qx, sx = quantize_act_sym(x, self.act_clip[...])
                xq, xs = pack_int4(qx), sx[..., 0]
            y = int_gemm(xq, xs, self.kernel[...], self.w_scale[...], bias, impl=q.impl)
        else:
            if has_t:
                x = kron_transform_ref(x, self.in_left[...], self.in_right[...])
            if q.a_bits < 16:
                x = fake_quant_act_sym(x, self.act_clip[...])
            w = self.kernel[...]
            if q.w_bits < 16:
                w = unpack_weight_int4(w).astype(jnp.float32) * self.w_scale[...][None, :]
            y = jnp.dot(x, w.astype(jnp.float32))
            if bias is not None:
                y = y + bias
        return y.astype(self.dtype)


LINEAR.register("w4a4", QuantLinear, config=QuantConfig)


# ====================================================================== folding (float64, numpy)
def _kron_apply(x, left, right):
    """numpy float64 ``x @ kron(left, right)`` over the last axis via the row-major reshape."""
    n1, n2 = left.shape[0], right.shape[0]
    X = x.reshape(*x.shape[:-1], n1, n2)
    Y = np.einsum("ai,...ak,kb->...ib", left, X, right)
    return Y.reshape(x.shape)


def transform_weight_in(w_IO: np.ndarray, c: Optional[np.ndarray], kron_inv_t) -> np.ndarray:
    """``W̃ = P^{-1} diag(1/c) W`` for kernel ``[in, out]``: each output column (a vector over the
    input) is divided by c and multiplied by ``kron(L^{-T}, R^{-T})`` like an activation row."""
    w = np.asarray(w_IO, np.float64)
    if c is not None:
        w = w / np.asarray(c, np.float64)[:, None]
    if kron_inv_t is not None:
        w = _kron_apply(w.T, *kron_inv_t).T
    return w


def apply_lwc(w_IO: np.ndarray, logits_O2: Optional[np.ndarray]) -> np.ndarray:
    if logits_O2 is None:
        return w_IO
    f = 1.0 / (1.0 + np.exp(-np.asarray(logits_O2, np.float64)))
    wmax = w_IO.max(axis=0) * f[:, 0]
    wmin = w_IO.min(axis=0) * f[:, 1]
    return np.clip(w_IO, wmin, wmax)


def fold_layer(w: dict, t: dict, cfg: ModelConfig, *, weight_clipping: bool = True) -> dict:
    """Fold one layer's transforms (``t``, float64 matrices, see training/flatquant.py ``resolve``)
    into its float weights ``w`` → dict of float64 arrays for the deployed layer:
    ``input_norm, post_norm, {q,k,v,o,gate,up,down}`` kernels (+ biases), the online factors
    ``online[name] = (L, R)`` and clip logits. LWC is applied here (after the transform)."""
    H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.dh
    f64 = lambda a: None if a is None else np.asarray(a, np.float64)  # noqa: E731
    out = {"input_norm": f64(w["input_norm"]).copy(), "post_norm": f64(w["post_norm"]).copy(), "online": {}}
    lwc = (t.get("lwc") or {}) if weight_clipping else {}  # LWC belongs to the weight quantizer
    # attention input: c folds into the RMSNorm gain (norm(x)·γ·c)
    if t.get("c_ln") is not None:
        out["input_norm"] = out["input_norm"] * f64(t["c_ln"])
    for name in ("q", "k", "v"):
        kern = transform_weight_in(w[name], t.get("c_ln"), t.get("ln_inv_t"))
        kern = apply_lwc(kern, lwc.get(name))
        bias = f64(w.get(name + "_bias"))
        if name == "v" and t.get("v") is not None:  # out-transform: each head's values · Mv
            Mv = f64(t["v"])
            kern = np.einsum("ikd,de->ike", kern.reshape(-1, K, Dh), Mv).reshape(kern.shape)
            if bias is not None:
                bias = (bias.reshape(K, Dh) @ Mv).reshape(-1)
        out[name], out[name + "_bias"] = kern, bias
        out["online"][name] = t.get("ln")
    # o_proj: input (attention output, heads × Dh) carries kron(Mo, Mv); inverse goes into the weight
    o_inv = None
    if t.get("o") is not None or t.get("v") is not None:
        o_inv = (f64(t["o_inv_t"]) if t.get("o") is not None else np.eye(H),
                 f64(t["v_inv_t"]) if t.get("v") is not None else np.eye(Dh))
    out["o"] = apply_lwc(transform_weight_in(w["o"], None, o_inv), lwc.get("o"))
    out["o_bias"] = f64(w.get("o_bias"))
    out["online"]["o"] = None if t.get("o") is None else (f64(t["o"]), np.eye(Dh))
    # MLP
    if t.get("c_ug") is not None:
        out["post_norm"] = out["post_norm"] * f64(t["c_ug"])
    for name in ("gate", "up"):
        out[name] = apply_lwc(transform_weight_in(w[name], t.get("c_ug"), t.get("ug_inv_t")), lwc.get(name))
        out[name + "_bias"] = f64(w.get(name + "_bias"))
        out["online"][name] = t.get("ug")
    out["down"] = apply_lwc(transform_weight_in(w["down"], t.get("c_down"), t.get("down_inv_t")), lwc.get("down"))
    out["down_bias"] = f64(w.get("down_bias"))
    out["online"]["down"] = t.get("down")
    if t.get("c_down") is not None:  # per-output-channel scaling commutes with per-channel quantization
        out["up"] = out["up"] * f64(t["c_down"])[None, :]
        if out["up_bias"] is not None:
            out["up_bias"] = out["up_bias"] * f64(t["c_down"])
    out["lac"] = dict(t.get("lac") or {})
    return out


# ====================================================================== deployed state
_LINEAR_PATHS = {"q": ("attn", "q_proj"), "k": ("attn", "k_proj"), "v": ("attn", "v_proj"), "o": ("attn", "o_proj"),
                 "gate": ("ffn", "gate_proj"), "up": ("ffn", "up_proj"), "down": ("ffn", "down_proj")}


def layer_weights(pure: dict, cfg: ModelConfig, i: int) -> dict:
    """Float weights of layer i from a pure state dict (list or scanned layout) as numpy arrays."""
    layers = pure["layers"]
    if cfg.scan_layers:
        take = lambda a: np.asarray(a)[i]  # noqa: E731
        lay = jax.tree.map(take, layers)
    else:
        lay = layers[i]
    w = {"input_norm": np.asarray(lay["input_norm"]["scale"]), "post_norm": np.asarray(lay["post_attn_norm"]["scale"])}
    for name, (mod, sub) in _LINEAR_PATHS.items():
        try:
            p = lay[mod][sub]
        except KeyError:
            raise ValueError(f"layer {i}: missing {mod}.{sub}; FlatQuant placement needs q/k/v/o and gate/up/down") from None
        w[name] = np.asarray(p["kernel"])
        w[name + "_bias"] = None if p.get("bias") is None else np.asarray(p["bias"])
    return w


def quantized_config(cfg: ModelConfig, qcfg: QuantConfig) -> ModelConfig:
    check_quantizable(cfg)
    return cfg.replace(linear="w4a4", linear_config=qcfg, scan_layers=False)


def build_quantized_state(cfg: ModelConfig, pure_fp: dict, folded_layers: list[dict], qcfg: QuantConfig,
                          weight_quantizer=None):
    """Assemble the deployed model: (cfg_q, pure state dict). ``weight_quantizer(i, name, w_IO) ->
    (q int8 [in, out], scale [out])`` defaults to RTN; GPTQ plugs in here."""
    if qcfg.share_inputs:
        qcfg = dataclasses.replace(qcfg, share_inputs=_groups_share_factors(folded_layers),
                                   shared_act_clip=_groups_share_clips(folded_layers))
    cfg_q = quantized_config(cfg, qcfg)
    _, abstract_state = nnx.split(abstract_model(cfg_q))
    pure = abstract_state.to_pure_dict()
    pure["embed"] = jax.tree.map(np.asarray, pure_fp["embed"])
    pure["final_norm"] = jax.tree.map(np.asarray, pure_fp["final_norm"])
    if "lm_head" in pure_fp and pure_fp["lm_head"] is not None and "lm_head" in pure:
        pure["lm_head"] = jax.tree.map(np.asarray, pure_fp["lm_head"])
    for i, f in enumerate(folded_layers):
        lay = pure["layers"][i]
        lay["input_norm"]["scale"] = f["input_norm"].astype(np.float32)
        lay["post_attn_norm"]["scale"] = f["post_norm"].astype(np.float32)
        for name, (mod, sub) in _LINEAR_PATHS.items():
            p = lay[mod][sub]
            w = f[name]
            if qcfg.w_bits < 16:
                if weight_quantizer is None:
                    qw, sw = quantize_weight_sym(jnp.asarray(w, jnp.float32))
                else:
                    qw, sw = weight_quantizer(i, name, w)
                p["kernel"] = np.asarray(pack_weight_int4(jnp.asarray(qw)))
                p["w_scale"] = np.asarray(sw, np.float32)
            else:
                p["kernel"] = w.astype(np.float32)
            if "bias" in p:
                b = f.get(name + "_bias")
                p["bias"] = np.zeros(p["bias"].shape, np.float32) if b is None else b.astype(np.float32)
            if qcfg.online_transform:
                lr = f["online"].get(name)
                n1, n2 = p["in_left"].shape[0], p["in_right"].shape[0]
                p["in_left"] = np.eye(n1, dtype=np.float32) if lr is None else np.asarray(lr[0], np.float32)
                p["in_right"] = np.eye(n2, dtype=np.float32) if lr is None else np.asarray(lr[1], np.float32)
            clip = f["lac"].get(name)
            p["act_clip"] = np.full((2,), NO_CLIP_LOGIT, np.float32) if clip is None else np.asarray(clip, np.float32)
    return cfg_q, pure


SHARED_GROUPS = (("q", "k", "v"), ("gate", "up"))


def _groups_share_factors(folded_layers: list[dict]) -> bool:
    def same(a, b):
        if a is None or b is None:
            return a is None and b is None
        return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    return all(same(f["online"].get(g[0]), f["online"].get(n)) for f in folded_layers for g in SHARED_GROUPS for n in g)


def _groups_share_clips(folded_layers: list[dict]) -> bool:
    def clip(f, n):
        c = f["lac"].get(n)
        return None if c is None else np.asarray(c)
    return all((clip(f, g[0]) is None and clip(f, n) is None) or
               (clip(f, g[0]) is not None and clip(f, n) is not None and np.array_equal(clip(f, g[0]), clip(f, n)))
               for f in folded_layers for g in SHARED_GROUPS for n in g)


def kv_transforms(cfg: ModelConfig, resolved_layers: list[dict]) -> dict:
    """Per-layer K-cache transform / inverse-transpose and K/V clip logits for ``init_kv4_cache``."""
    Dh = cfg.dh
    eye = np.eye(Dh)
    kt = np.stack([np.asarray(t["k"]) if t.get("k") is not None else eye for t in resolved_layers])
    qt = np.stack([np.asarray(t["k_inv_t"]) if t.get("k") is not None else eye for t in resolved_layers])
    clip = lambda key: np.stack([np.asarray(t[key]) if t.get(key) is not None else np.full(2, NO_CLIP_LOGIT)  # noqa: E731
                                 for t in resolved_layers])
    return {"k_trans": jnp.asarray(kt, jnp.float32), "q_trans": jnp.asarray(qt, jnp.float32),
            "k_clip": jnp.asarray(clip("k_clip"), jnp.float32), "v_clip": jnp.asarray(clip("v_clip"), jnp.float32)}


def state_from_pure(cfg_q: ModelConfig, pure: dict):
    """(graphdef, nnx.State) of the deployed model from its pure dict."""
    graphdef, abstract_state = nnx.split(abstract_model(cfg_q))
    leaves = jax.tree.map(jnp.asarray, pure)
    nnx.replace_by_pure_dict(abstract_state, leaves)
    return graphdef, abstract_state
