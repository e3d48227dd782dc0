"""W4A4 quantized Linear and FlatQuant transform placement / folding (Sun et al., "FlatQuant:
Flatness Matters for LLM Quantization", ICML 2025; official code ruikangliu/FlatQuant).

Placement per Llama-style layer (official ``model_tools/llama_utils.py``), with ``kron(L, R)``
acting on a row-major reshaped token (``x ↦ Lᵀ · reshape(x, n1×n2) · R``):

==========  ========================  ==========================================  ===================================
transform   size                      where                                       kept as
==========  ========================  ==========================================  ===================================
``ln``      kron on d_model, + c      shared input of q/k/v                       online; c → input-norm γ
``ug``      kron on d_model, + c      shared input of gate/up                     online; c → post-attn-norm γ
``down``    kron on d_ff, + c         input of down_proj                          online; c → up_proj output columns
``v``       head_dim × head_dim       v_proj output (the V cache is transformed)  folded into v_proj
``o``       n_heads × n_heads         head mixing of the attention output         online; o_proj gets kron(o, v)^{-T}
``k``       head_dim × head_dim       q (inverse-transpose) and k after RoPE      online, in the KV4 cache
==========  ========================  ==========================================  ===================================

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
from pallasite.models.context import Taps
from pallasite.models.layers import LinearBase
from pallasite.models.transformer import abstract_model
from pallasite.ops.quant.int_gemm import int_gemm, pack_weight_int4, unpack_weight_int4
from pallasite.ops.quant.kron_quant import kron_quantize, kron_transform_ref, quantize_rows_packed
from pallasite.ops.quant.quantizers import (
    LAC_INIT,
    NO_CLIP_LOGIT,
    act_scale_sym,
    fake_quant_act_sym,
    fake_quant_kv_asym,
    fake_quant_weight_sym,
    pack_int4,
    qrange_sym,
    quantize_act_sym,
    quantize_weight_sym,
    round_ste,
    weight_scale_sym,
)
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
    # calibration mode: float kernels quantized on the fly with straight-through rounding
    # (differentiable; ops/quant/quantizers.py), no integer kernels
    fake_quant: bool = False

    def __post_init__(self):
        if self.method not in QUANT_METHODS:
            raise ValueError(f"QuantConfig.method={self.method!r}; expected one of {QUANT_METHODS}")
        for name in ("w_bits", "a_bits", "kv_bits"):
            if getattr(self, name) not in (4, 16):
                raise ValueError(f"QuantConfig.{name}={getattr(self, name)}; expected 4 or 16 (off)")
        if self.impl not in ("ref", "pallas"):
            raise ValueError(f"QuantConfig.impl={self.impl!r}; expected 'ref' or 'pallas'")
        if self.fake_quant and self.share_inputs:
            raise ValueError("QuantConfig: fake_quant (calibration) does not share inputs; set share_inputs=False")


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
    """W4A4 linear: online Kronecker transform + per-token int4 activations × int4 weights.

    Deployed (default): packed int4 kernel + ``w_scale``, integer GEMM. ``fake_quant``
    (calibration): a float kernel, fake-quantized on the fly with straight-through rounding, so
    the output is differentiable in the kernel, the factors and the clip logits."""

    def __init__(self, in_features: int, out_features: int, *, cfg: ModelConfig, axes, use_bias: bool = False,
                 init_std: float = 0.02, rngs: nnx.Rngs):
        q = kind_config(cfg, "linear", "w4a4", QuantConfig)
        self.qcfg = q
        self.in_features, self.out_features = in_features, out_features
        self.dtype = jnp.dtype(cfg.dtype)
        axes = tuple(axes)
        if q.w_bits < 16 and not q.fake_quant:
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
        return (q.share_inputs and not q.fake_quant and self.in_left is not None and q.a_bits < 16
                and q.w_bits < 16)

    def prepare_shared_input(self, x: jax.Array):
        """Transform (and, with one clip per group, quantize) an input read by the whole group."""
        if not self._shares_input():
            return x
        q, L, R = self.qcfg, self.in_left[...], self.in_right[...]
        x32, dims = x.astype(jnp.float32), (L.shape[0], R.shape[0])
        if q.shared_act_clip:
            return SharedQuantInput(dims=dims, codes=kron_quantize(x32, L, R, self.act_clip[...], impl=q.impl))
        return SharedQuantInput(dims=dims, x_t=kron_transform_ref(x32, L, R))

    def _transformed_input(self, x: jax.Array) -> jax.Array:
        """The online transform in float32, on rows ``[N, in]`` as the fused kernel computes it."""
        x = x.astype(jnp.float32)
        if self.in_left is None:
            return x
        rows = kron_transform_ref(x.reshape(-1, x.shape[-1]), self.in_left[...].astype(jnp.float32),
                                  self.in_right[...].astype(jnp.float32))
        return rows.reshape(x.shape)

    def _input_codes(self, x: jax.Array):
        """(integer-valued codes, per-token scale [..., 1]) of the transformed input, straight-through."""
        x = self._transformed_input(x)
        qmin, qmax = qrange_sym(self.qcfg.a_bits)
        scale = act_scale_sym(x, self.act_clip[...], self.qcfg.a_bits)
        return jnp.clip(round_ste(x / scale), qmin, qmax), scale

    def quantized_input(self, x: jax.Array) -> jax.Array:
        """The activation the (folded) weight multiplies, in float32: the online transform, then the
        per-token quantizer (quantize-dequantize, straight-through). The deployed integer path
        multiplies exactly these values (its codes × scales); GPTQ's Hessian is built from them."""
        if self.qcfg.a_bits >= 16:
            return self._transformed_input(x)
        codes, scale = self._input_codes(x)
        return codes * scale

    def _fake_quant_forward(self, x: jax.Array) -> jax.Array:
        """Calibration mode. With both quantizers on, the GEMM runs on the codes and the scales are
        applied after it, in the order of ``ops.quant.int_gemm``'s epilogue: the products of small
        integers are exact in float32, so this equals the deployed integer path bit for bit (same
        codes, same float operations) while staying differentiable (straight-through rounding)."""
        q = self.qcfg
        w = self.kernel[...].astype(jnp.float32)
        if q.a_bits < 16 and q.w_bits < 16:
            qmin, qmax = qrange_sym(q.w_bits)
            w_scale = weight_scale_sym(w, q.w_bits)
            w_codes = jnp.clip(round_ste(w / w_scale), qmin, qmax)
            x_codes, x_scale = self._input_codes(x)
            acc = jnp.dot(x_codes, w_codes, precision=jax.lax.Precision.HIGHEST)
            return acc * x_scale * w_scale
        return jnp.dot(self.quantized_input(x), fake_quant_weight_sym(w, q.w_bits))

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
        if q.fake_quant:
            y = self._fake_quant_forward(x)
            if bias is not None:
                y = y + bias
        elif q.a_bits < 16 and q.w_bits < 16:
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


# ====================================================================== folding
def _namespace(*trees):
    """jnp when any leaf is a jax array (calibration: differentiable, in the arrays' dtype), else
    numpy in float64 (deployment: fold exactly, then quantize)."""
    return jnp if any(isinstance(a, jax.Array) for t in trees for a in jax.tree.leaves(t)) else np


def _kron_apply(x, left, right, xp=np):
    """``x @ kron(left, right)`` over the last axis via the row-major reshape."""
    n1, n2 = left.shape[0], right.shape[0]
    X = x.reshape(*x.shape[:-1], n1, n2)
    # numpy's einsum runs a three-operand contraction as one nested loop unless told to go pairwise
    # (two BLAS products): 0.75 s against milliseconds per SmolLM2 kernel at deployment
    kw = {"optimize": True} if xp is np else {}
    return xp.einsum("ai,...ak,kb->...ib", left, X, right, **kw).reshape(x.shape)


def transform_weight_in(w_IO, c, kron_inv_t, xp=np):
    """``W̃ = P^{-1} diag(1/c) W`` for kernel ``[in, out]``: each output column (a vector over the
    input) is divided by c and multiplied by ``kron(L^{-T}, R^{-T})`` like an activation row."""
    w = w_IO
    if c is not None:
        w = w / c[:, None]
    if kron_inv_t is not None:
        w = _kron_apply(w.T, *kron_inv_t, xp=xp).T
    return w


def apply_lwc(w_IO, logits_O2, xp=np):
    """Learnable weight clipping: column o clamped to ``[min_o·σ(θmin_o), max_o·σ(θmax_o)]``."""
    if logits_O2 is None:
        return w_IO
    f = 1.0 / (1.0 + xp.exp(-logits_O2))
    return xp.clip(w_IO, w_IO.min(axis=0) * f[:, 1], w_IO.max(axis=0) * f[:, 0])


def fold_layer(w: dict, t: dict, cfg: ModelConfig, *, weight_clipping: bool = True) -> dict:
    """Fold one layer's transforms ``t`` (see training/flatquant.py ``resolve``) into its float
    weights ``w`` → the deployed layer: ``input_norm, post_norm, {q,k,v,o,gate,up,down}`` kernels
    (+ biases), the online factors ``online[name] = (L, R)`` and clip logits ``lac``. LWC is applied
    here (after the transform). numpy inputs fold in float64; jax inputs fold in their dtype,
    differentiably (the calibration builds its quantized block through this function)."""
    xp = _namespace(w, t)
    H, K, Dh = cfg.n_heads, cfg.n_kv_heads, cfg.dh
    cast = (lambda a: None if a is None else np.asarray(a, np.float64)) if xp is np else (  # noqa: E731
        lambda a: None if a is None else jnp.asarray(a))
    w = {k: cast(v) for k, v in w.items()}
    t = {k: (jax.tree.map(cast, v) if k not in ("lwc", "lac") else v) for k, v in t.items()}
    lwc = {n: cast(v) for n, v in (t.get("lwc") or {}).items()} if weight_clipping else {}  # weight quantizer
    out = {"input_norm": w["input_norm"], "post_norm": w["post_norm"], "online": {}}
    # attention input: c folds into the RMSNorm gain (norm(x)·γ·c)
    if t.get("c_ln") is not None:
        out["input_norm"] = out["input_norm"] * t["c_ln"]
    for name in ("q", "k", "v"):
        kern = apply_lwc(transform_weight_in(w[name], t.get("c_ln"), t.get("ln_inv_t"), xp), lwc.get(name), xp)
        bias = w.get(name + "_bias")
        if name == "v" and t.get("v") is not None:  # out-transform: each head's values · Mv
            Mv = t["v"]
            kern = xp.einsum("ikd,de->ike", kern.reshape(-1, K, Dh), Mv).reshape(kern.shape)
            if bias is not None:
                bias = (bias.reshape(K, Dh) @ Mv).reshape(-1)
        out[name], out[name + "_bias"] = kern, bias
        out["online"][name] = t.get("ln")
    # o_proj: input (attention output, heads × Dh) carries kron(Mo, Mv); inverse goes into the weight
    o_inv = None
    if t.get("o") is not None or t.get("v") is not None:
        o_inv = (t["o_inv_t"] if t.get("o") is not None else xp.eye(H, dtype=w["o"].dtype),
                 t["v_inv_t"] if t.get("v") is not None else xp.eye(Dh, dtype=w["o"].dtype))
    out["o"] = apply_lwc(transform_weight_in(w["o"], None, o_inv, xp), lwc.get("o"), xp)
    out["o_bias"] = w.get("o_bias")
    out["online"]["o"] = None if t.get("o") is None else (t["o"], xp.eye(Dh, dtype=w["o"].dtype))
    # MLP
    if t.get("c_ug") is not None:
        out["post_norm"] = out["post_norm"] * t["c_ug"]
    for name in ("gate", "up"):
        out[name] = apply_lwc(transform_weight_in(w[name], t.get("c_ug"), t.get("ug_inv_t"), xp), lwc.get(name), xp)
        out[name + "_bias"] = w.get(name + "_bias")
        out["online"][name] = t.get("ug")
    out["down"] = apply_lwc(transform_weight_in(w["down"], t.get("c_down"), t.get("down_inv_t"), xp),
                            lwc.get("down"), xp)
    out["down_bias"] = w.get("down_bias")
    out["online"]["down"] = t.get("down")
    if t.get("c_down") is not None:  # per-output-channel scaling commutes with per-channel quantization
        out["up"] = out["up"] * t["c_down"][None, :]
        if out["up_bias"] is not None:
            out["up_bias"] = out["up_bias"] * t["c_down"]
    out["lac"] = dict(t.get("lac") or {})
    return out


# ====================================================================== deployed state
_LINEAR_PATHS = {"q": ("attn", "q_proj"), "k": ("attn", "k_proj"), "v": ("attn", "v_proj"), "o": ("attn", "o_proj"),
                 "gate": ("ffn", "gate_proj"), "up": ("ffn", "up_proj"), "down": ("ffn", "down_proj")}


def layer_params(pure: dict, cfg: ModelConfig, i: int) -> dict:
    """Layer i's parameters as one ``Block``'s pure dict (list or scanned layout)."""
    if cfg.scan_layers:
        return jax.tree.map(lambda a: a[i], pure["layers"])
    return pure["layers"][i]


def layer_weights(pure: dict, cfg: ModelConfig, i: int) -> dict:
    """Float weights of layer i from a pure state dict (list or scanned layout) as numpy arrays."""
    lay = layer_params(pure, cfg, i)
    w = {"input_norm": np.asarray(lay["input_norm"]["scale"]), "post_norm": np.asarray(lay["post_attn_norm"]["scale"])}
    for name, (mod, sub) in _LINEAR_PATHS.items():
        try:
            p = lay[mod][sub]
        except KeyError:
            raise ValueError(f"layer {i}: missing {mod}.{sub}; FlatQuant placement needs q/k/v/o and "
                             f"gate/up/down") from None
        w[name] = np.asarray(p["kernel"])
        w[name + "_bias"] = None if p.get("bias") is None else np.asarray(p["bias"])
    return w


def quantized_config(cfg: ModelConfig, qcfg: QuantConfig, kv_cache_config=None) -> ModelConfig:
    """The quantized model's config: ``linear="w4a4"`` and, with 4-bit KV, ``kv_cache="kv4"``."""
    check_quantizable(cfg)
    kv = dict(kv_cache="kv4", kv_cache_config=kv_cache_config) if qcfg.kv_bits < 16 else dict(kv_cache="dense")
    return cfg.replace(linear="w4a4", linear_config=qcfg, scan_layers=False, **kv)


def quantized_block_params(folded: dict, template: dict, qcfg: QuantConfig, weight_quantizer=None,
                           layer: int = 0) -> dict:
    """One quantized ``Block``'s pure dict (shaped like ``template``, the block's abstract pure
    dict) from a folded layer. Deployed: packed int4 kernels + scales (numpy, RTN or
    ``weight_quantizer(layer, name, w_IO) -> (q, scale)``); ``qcfg.fake_quant`` or ``w_bits=16``:
    the float kernels as given (jax arrays stay jax arrays: differentiable)."""
    xp = _namespace(folded)
    f32 = (lambda a: np.asarray(a, np.float32)) if xp is np else (lambda a: a.astype(jnp.float32))  # noqa: E731
    out = {"input_norm": {"scale": f32(folded["input_norm"])}, "post_attn_norm": {"scale": f32(folded["post_norm"])}}
    for name, (mod, sub) in _LINEAR_PATHS.items():
        tp = template[mod][sub]
        p = {}
        w = folded[name]
        if qcfg.w_bits < 16 and not qcfg.fake_quant:
            qw, sw = (quantize_weight_sym(jnp.asarray(w, jnp.float32)) if weight_quantizer is None
                      else weight_quantizer(layer, name, w))
            p["kernel"] = np.asarray(pack_weight_int4(jnp.asarray(qw)))
            p["w_scale"] = np.asarray(sw, np.float32)
        else:
            p["kernel"] = f32(w)
        if "bias" in tp:
            b = folded.get(name + "_bias")
            p["bias"] = xp.zeros(tp["bias"].shape, xp.float32) if b is None else f32(b)
        if "in_left" in tp:
            lr = folded["online"].get(name)
            n1, n2 = tp["in_left"].shape[0], tp["in_right"].shape[0]
            p["in_left"] = xp.eye(n1, dtype=xp.float32) if lr is None else f32(lr[0])
            p["in_right"] = xp.eye(n2, dtype=xp.float32) if lr is None else f32(lr[1])
        clip = folded["lac"].get(name)
        p["act_clip"] = xp.full((2,), NO_CLIP_LOGIT, xp.float32) if clip is None else f32(clip)
        out.setdefault(mod, {})[sub] = p
    return out


def build_quantized_state(cfg: ModelConfig, pure_fp: dict, folded_layers: list[dict], qcfg: QuantConfig,
                          weight_quantizer=None, kv_cache_config=None):
    """Assemble the deployed model: (cfg_q, pure state dict). ``weight_quantizer(i, name, w_IO) ->
    (q int8 [in, out], scale [out])`` defaults to RTN; GPTQ plugs in here."""
    if qcfg.share_inputs:
        qcfg = dataclasses.replace(qcfg, share_inputs=_groups_share_factors(folded_layers),
                                   shared_act_clip=_groups_share_clips(folded_layers))
    cfg_q = quantized_config(cfg, qcfg, kv_cache_config)
    _, abstract_state = nnx.split(abstract_model(cfg_q))
    pure = abstract_state.to_pure_dict()
    pure["embed"] = jax.tree.map(np.asarray, pure_fp["embed"])
    pure["final_norm"] = jax.tree.map(np.asarray, pure_fp["final_norm"])
    if "lm_head" in pure_fp and pure_fp["lm_head"] is not None and "lm_head" in pure:
        pure["lm_head"] = jax.tree.map(np.asarray, pure_fp["lm_head"])
    for i, f in enumerate(folded_layers):
        pure["layers"][i] = quantized_block_params(f, pure["layers"][i], qcfg, weight_quantizer, i)
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
    """Per-layer K-cache transform / inverse-transpose and K/V clip logits (``[L, ...]`` float32)
    for ``init_kv4_cache`` and ``kv_quant_taps`` (traceable: calibration builds one per layer)."""
    eye = jnp.eye(cfg.dh, dtype=jnp.float32)
    no_clip = jnp.full((2,), NO_CLIP_LOGIT, jnp.float32)

    def stack(key, default, present="k"):
        present = key if present is None else present
        return jnp.stack([default if t.get(present) is None else jnp.asarray(t[key], jnp.float32)
                          for t in resolved_layers])

    return {"k_trans": stack("k", eye), "q_trans": stack("k_inv_t", eye),
            "k_clip": stack("k_clip", no_clip, None), "v_clip": stack("v_clip", no_clip, None)}


def kv_quant_taps(kv: dict, kv_bits: int, group: int = 128, capture=()) -> Taps:
    """Taps that give the real blocks the KV4 cache's numerics without a cache, differentiably:
    after RoPE queries · ``q_trans`` (``attn.q``) and keys · ``k_trans`` (``attn.k``), then keys and
    values quantize-dequantized with their clip logits by the cache's quantizer (straight-through
    rounding). ``kv`` is ``kv_transforms``' dict (``[L, ...]``, indexed by the block's layer)."""
    f32 = jnp.float32

    def replace(name, x, layer):
        if name == "attn.q":
            return jnp.einsum("bthd,de->bthe", x.astype(f32), kv["q_trans"][layer].astype(f32)).astype(x.dtype)
        if name == "attn.k":
            k = jnp.einsum("btkd,de->btke", x.astype(f32), kv["k_trans"][layer].astype(f32))
            return fake_quant_kv_asym(k, kv["k_clip"][layer], kv_bits, group).astype(x.dtype)
        if name == "attn.v":
            return fake_quant_kv_asym(x.astype(f32), kv["v_clip"][layer], kv_bits, group).astype(x.dtype)
        return x

    return Taps(capture=capture, replace=replace)


def state_from_pure(cfg_q: ModelConfig, pure: dict):
    """(graphdef, nnx.State) of the deployed model from its pure dict."""
    graphdef, abstract_state = nnx.split(abstract_model(cfg_q))
    leaves = jax.tree.map(jnp.asarray, pure)
    nnx.replace_by_pure_dict(abstract_state, leaves)
    return graphdef, abstract_state
