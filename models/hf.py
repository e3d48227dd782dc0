"""Hugging Face checkpoints ⇄ pallasite: config mapping, safetensors import/export, no torch.

    cfg = config_from_hf(json.load(open("config.json")))          # -> ModelConfig
    cfg, state = import_hf("path/to/hf_folder", scan_layers=True)   # state ≅ nnx.split(abstract_model(cfg))[1]
    export_hf(cfg, state, "out_folder")                             # config.json, generation_config.json, safetensors

Weights are read with ``safetensors``' numpy backend (``safe_open(..., framework="numpy")``)
from ``model.safetensors`` or the shards listed in ``model.safetensors.index.json``; torch is
never imported. Layout differences handled here:

* HF ``nn.Linear`` weights are ``[out, in]``; our ``Linear.kernel`` is ``[in, out]`` (transpose).
* HF keeps one tensor per layer (``model.layers.{i}.…``); with ``cfg.scan_layers`` our layer
  parameters are stacked on a leading ``[L]`` axis (``np.stack`` on import, index on export).
* Tied embeddings: HF drops ``lm_head.weight`` from the file; so do we (a file that carries it
  anyway is accepted when it equals the embedding, and rejected otherwise).
* RoPE: both HF layouts use rotate_half, as ``models/rope.py`` does, so q/k need no permutation
  (GGUF does: see ``models/gguf.py``).

Strictness: every pallasite parameter must be produced from exactly one shape-checked read,
and every tensor in the file must be consumed. A missing, extra or misshaped tensor raises
``CheckpointMismatchError`` naming the HF tensor, the expected and the actual shape. Only the
non-persistent rotary buffers some old exports carry (``*.rotary_emb.inv_freq``) are ignored.

HF → pallasite → HF round-trips bit-exactly (same names, same dtype, same bytes) as long as
``dtype=None`` (parameters keep the checkpoint's storage dtype; ``cfg.param_dtype`` records it,
while the compute ``cfg.dtype`` stays float32 — change it with ``cfg.replace(dtype=...)``).

Extension hooks (so MoE / MoLE / new families plug in from their own modules, without editing
this file — e.g. ``models/hf_moe.py``):

``register_model_type(model_type, *, from_hf, to_hf, architecture)``
    ``from_hf(hf: dict) -> ModelConfig`` turns a config.json dict into a ModelConfig whose
    ``family`` equals ``model_type`` (``config_to_hf`` dispatches on ``cfg.family``);
    ``to_hf(cfg) -> dict`` is its inverse (``model_type``, ``architectures`` and ``dtype`` are
    filled in by ``config_to_hf``). Reuse ``dense_config_kwargs(hf)`` / ``dense_config_to_hf(cfg)``
    for the shared Llama-style fields. Unknown types listed in ``_LAZY_MODEL_TYPE_MODULES`` are
    imported on first use, so ``import_hf`` on a Mixtral folder works without an explicit import.

``register_ffn_mapping(kind, to_hf_fn, from_hf_fn)`` for ``cfg.ffn == kind``:
    ``to_hf_fn(cfg, ffn_params, prefix, layer) -> {hf_name: np.ndarray}`` where ``ffn_params``
    maps paths *relative to the block's ``ffn`` module* (e.g. ``("gate_proj", "kernel")``) to
    this layer's numpy arrays (the layer axis already removed), ``prefix`` is
    ``"model.layers.{layer}."`` and returned names are full HF names.
    ``from_hf_fn(cfg, read, prefix, layer, expected) -> {rel_path: np.ndarray}`` where
    ``expected`` maps the same relative paths to the shapes pallasite wants for this layer and
    ``read(hf_name, shape=None)`` returns one tensor (marking it consumed) and raises the
    named error when it is absent or — given ``shape``, in HF's own layout — misshaped. The
    result must cover ``expected`` exactly (checked here). Both functions must be pure and
    exact inverses of each other, so the round-trip stays bit-exact.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any, Callable, Mapping, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.transformer import abstract_model

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers' default "5GB"

# Buffers some exporters persist that carry no weights (RoPE tables are recomputed).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class CheckpointMismatchError(ValueError):
    """The checkpoint does not match the model the config describes (missing/extra/misshaped)."""


# --------------------------------------------------------------------------- config mapping

_HF_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu_exact", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
_ACT_HF = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "gelu_exact": "gelu"}
_ROPE_KINDS = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelTypeSpec:
    model_type: str
    from_hf: Callable[[dict], ModelConfig]
    to_hf: Callable[[ModelConfig], dict]
    architecture: str


MODEL_TYPES: dict[str, ModelTypeSpec] = {}
# Families registered by other modules, imported the first time they are asked for.
_LAZY_MODEL_TYPE_MODULES = {
    "mixtral": "pallasite.models.hf_moe",
    "qwen2_moe": "pallasite.models.hf_moe",
    "qwen3_moe": "pallasite.models.hf_moe",
    "olmoe": "pallasite.models.hf_moe",
}


def register_model_type(model_type: str, *, from_hf: Callable[[dict], ModelConfig],
                        to_hf: Callable[[ModelConfig], dict], architecture: str) -> None:
    MODEL_TYPES[model_type] = ModelTypeSpec(model_type, from_hf, to_hf, architecture)


def _spec(model_type: str) -> ModelTypeSpec:
    if model_type not in MODEL_TYPES and model_type in _LAZY_MODEL_TYPE_MODULES:
        try:
            importlib.import_module(_LAZY_MODEL_TYPE_MODULES[model_type])
        except ImportError:
            pass
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"Hugging Face model_type {model_type!r} is not supported; supported model types: "
            f"{sorted(MODEL_TYPES)} (register more with pallasite.models.hf.register_model_type)"
        )
    return MODEL_TYPES[model_type]


def _need(hf: Mapping, key: str):
    if key not in hf or hf[key] is None:
        raise ValueError(f"HF config ({hf.get('model_type')}): required key {key!r} is missing")
    return hf[key]


def rope_from_hf(hf: Mapping) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling dict or None) from v5 ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling``. Unsupported scaling types fail here rather
    than at the first forward."""
    params = hf.get("rope_parameters")
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    else:
        params = dict(params)
        if params and all(isinstance(v, Mapping) for v in params.values()):
            raise ValueError(f"HF config: per-layer-type rope_parameters {sorted(params)} are not supported")
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in _ROPE_KINDS:
        raise ValueError(f"HF config: rope type {kind!r} is not supported; expected one of {_ROPE_KINDS}")
    prf = params.get("partial_rotary_factor", 1.0)
    if prf not in (None, 1.0):
        raise ValueError(f"HF config: partial_rotary_factor={prf} is not supported (only full rotary)")
    if kind == "default":
        return float(theta), None
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type", "partial_rotary_factor")}
    scaling["rope_type"] = kind
    return float(theta), scaling


def _sliding_window_from_hf(hf: Mapping) -> Optional[int]:
    mt = hf.get("model_type")
    if mt == "mistral":
        return hf.get("sliding_window")
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
        return None
    n = int(hf["num_hidden_layers"])
    # Qwen2/3: layer i slides iff i >= max_window_layers (transformers' Qwen2Config.__post_init__).
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= int(hf.get("max_window_layers", 0)) else "full_attention" for i in range(n)
    ]
    if all(t == "sliding_attention" for t in types):
        return int(hf["sliding_window"])
    if all(t == "full_attention" for t in types):
        return None
    raise ValueError(f"HF config ({mt}): mixed sliding/full attention layers {types} are not supported "
                     "(pallasite applies one sliding_window to every layer)")


def _eos(v):
    if v is None:
        return None
    return (int(v),) if isinstance(v, int) else tuple(int(i) for i in v)


def dense_config_kwargs(hf: Mapping) -> dict:
    """ModelConfig kwargs for the fields every Llama-style config.json shares."""
    act = hf.get("hidden_act", "silu")
    if act not in _HF_ACT:
        raise ValueError(f"HF config: hidden_act={act!r} is not supported; expected one of {sorted(_HF_ACT)}")
    theta, scaling = rope_from_hf(hf)
    n_heads = int(_need(hf, "num_attention_heads"))
    d = int(_need(hf, "hidden_size"))
    return dict(
        vocab_size=int(_need(hf, "vocab_size")),
        d_model=d,
        n_layers=int(_need(hf, "num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
        head_dim=int(hf.get("head_dim") or d // n_heads),
        d_ff=int(_need(hf, "intermediate_size")),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_seq_len=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        hidden_act=_HF_ACT[act],
        sliding_window=_sliding_window_from_hf(hf),
        family=str(hf["model_type"]),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=_eos(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"),
    )


def dense_config_to_hf(cfg: ModelConfig) -> dict:
    """The shared Llama-style config.json fields (inverse of ``dense_config_kwargs``)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_scaling_dict, "rope_theta": cfg.rope_theta}
    eos = cfg.eos_token_id
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.dh,
        intermediate_size=cfg.d_ff,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope,
        max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act=_ACT_HF[cfg.hidden_act],
        bos_token_id=cfg.bos_token_id,
        eos_token_id=None if eos is None else (eos[0] if len(eos) == 1 else list(eos)),
        pad_token_id=cfg.pad_token_id,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
    )


def _reject(cfg: ModelConfig, family: str, **must):
    bad = {k: getattr(cfg, k) for k, v in must.items() if getattr(cfg, k) != v}
    if bad:
        raise ValueError(f"config_to_hf: a {family} checkpoint cannot express {bad}; it requires {must}")


def _llama_from_hf(hf):
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(**dense_config_kwargs(hf), qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


def _llama_to_hf(cfg):
    _reject(cfg, "llama", qk_norm=False, sliding_window=None, o_bias=cfg.qkv_bias)
    return {**dense_config_to_hf(cfg), "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias, "pretraining_tp": 1}


def _mistral_from_hf(hf):
    return ModelConfig(**dense_config_kwargs(hf))


def _mistral_to_hf(cfg):
    _reject(cfg, "mistral", qk_norm=False, qkv_bias=False, o_bias=False, mlp_bias=False)
    return {**dense_config_to_hf(cfg), "sliding_window": cfg.sliding_window}


def _qwen_sliding(cfg):
    if cfg.sliding_window is None:
        return dict(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers,
                    layer_types=["full_attention"] * cfg.n_layers)
    return dict(use_sliding_window=True, sliding_window=cfg.sliding_window, max_window_layers=0,
                layer_types=["sliding_attention"] * cfg.n_layers)


def _qwen2_from_hf(hf):
    # Qwen2Attention hard-codes bias=True on q/k/v and none on o_proj or the MLP.
    return ModelConfig(**dense_config_kwargs(hf), qkv_bias=True)


def _qwen2_to_hf(cfg):
    _reject(cfg, "qwen2", qkv_bias=True, o_bias=False, mlp_bias=False, qk_norm=False)
    return {**dense_config_to_hf(cfg), **_qwen_sliding(cfg)}


def _qwen3_from_hf(hf):
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(**dense_config_kwargs(hf), qkv_bias=bias, o_bias=bias, qk_norm=True)


def _qwen3_to_hf(cfg):
    _reject(cfg, "qwen3", qk_norm=True, mlp_bias=False, o_bias=cfg.qkv_bias)
    return {**dense_config_to_hf(cfg), "attention_bias": cfg.qkv_bias, **_qwen_sliding(cfg)}


register_model_type("llama", from_hf=_llama_from_hf, to_hf=_llama_to_hf, architecture="LlamaForCausalLM")
register_model_type("mistral", from_hf=_mistral_from_hf, to_hf=_mistral_to_hf, architecture="MistralForCausalLM")
register_model_type("qwen2", from_hf=_qwen2_from_hf, to_hf=_qwen2_to_hf, architecture="Qwen2ForCausalLM")
register_model_type("qwen3", from_hf=_qwen3_from_hf, to_hf=_qwen3_to_hf, architecture="Qwen3ForCausalLM")


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json dict (any registered model_type)."""
    if "model_type" not in hf:
        raise ValueError(f"HF config has no 'model_type'; supported model types: {sorted(MODEL_TYPES)}")
    return _spec(hf["model_type"]).from_hf(dict(hf))


def config_to_hf(cfg: ModelConfig, *, dtype: Optional[str] = None) -> dict:
    """config.json dict (transformers v5 layout) for ``cfg``; readable by ``AutoConfig``."""
    spec = _spec(cfg.family)
    out = spec.to_hf(cfg)
    out.update(model_type=spec.model_type, architectures=[spec.architecture],
               dtype=dtype or str(np.dtype(cfg.param_dtype)))
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- tensor mapping

Read = Callable[..., np.ndarray]
FFN_MAPPINGS: dict[str, tuple[Callable, Callable]] = {}
_LAZY_FFN_MODULES = {"moe": "pallasite.models.hf_moe", "mole": "pallasite.models.hf_moe"}


def register_ffn_mapping(kind: str, to_hf_fn: Callable, from_hf_fn: Callable) -> None:
    """Tensor mapping for ``cfg.ffn == kind`` (contract in the module docstring)."""
    FFN_MAPPINGS[kind] = (to_hf_fn, from_hf_fn)


def _ffn_mapping(kind: str):
    if kind not in FFN_MAPPINGS and kind in _LAZY_FFN_MODULES:
        try:
            importlib.import_module(_LAZY_FFN_MODULES[kind])
        except ImportError:
            pass
    if kind not in FFN_MAPPINGS:
        raise ValueError(f"no HF tensor mapping for ffn={kind!r}; registered: {sorted(FFN_MAPPINGS)}")
    return FFN_MAPPINGS[kind]


def linear_to_hf(kernel_in_out: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(kernel_in_out, -1, -2))


def linear_from_hf(read: Read, name: str, in_out_shape) -> np.ndarray:
    """Read an HF ``[out, in]`` Linear weight, checking it against our ``[in, out]`` shape."""
    return np.ascontiguousarray(np.swapaxes(read(name, shape=tuple(in_out_shape)[::-1]), -1, -2))


# (relative pallasite path under the block's ffn module, HF suffix after prefix, is a linear kernel)
_DENSE_FFN = [(("gate_proj", "kernel"), "mlp.gate_proj.weight", True),
              (("up_proj", "kernel"), "mlp.up_proj.weight", True),
              (("down_proj", "kernel"), "mlp.down_proj.weight", True),
              (("gate_proj", "bias"), "mlp.gate_proj.bias", False),
              (("up_proj", "bias"), "mlp.up_proj.bias", False),
              (("down_proj", "bias"), "mlp.down_proj.bias", False)]


def _dense_to_hf(cfg, ffn_params, prefix, layer):
    return {prefix + hf: (linear_to_hf(ffn_params[p]) if lin else ffn_params[p])
            for p, hf, lin in _DENSE_FFN if p in ffn_params}


def _dense_from_hf(cfg, read, prefix, layer, expected):
    return {p: (linear_from_hf(read, prefix + hf, expected[p]) if lin else read(prefix + hf, shape=expected[p]))
            for p, hf, lin in _DENSE_FFN if p in expected}


register_ffn_mapping("dense", _dense_to_hf, _dense_from_hf)

# Attention and norms are the same for every family (a linear kind keeps kernel/bias names).
_BLOCK = [(("attn", n, "kernel"), f"self_attn.{n}.weight", True) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
_BLOCK += [(("attn", n, "bias"), f"self_attn.{n}.bias", False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
_BLOCK += [(("attn", "q_norm", "scale"), "self_attn.q_norm.weight", False),
           (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", False),
           (("input_norm", "scale"), "input_layernorm.weight", False),
           (("post_attn_norm", "scale"), "post_attention_layernorm.weight", False)]
_TOP = [(("embed", "embedding"), "model.embed_tokens.weight", False),
        (("final_norm", "scale"), "model.norm.weight", False),
        (("lm_head", "kernel"), "lm_head.weight", True)]


def _split_block(rel_params: Mapping[tuple, Any]):
    """Split a block's params into (attention + norms, ffn relative to the ffn module, unknown)."""
    block_keys = {p for p, _, _ in _BLOCK}
    base, ffn, unknown = {}, {}, []
    for p, v in rel_params.items():
        if p in block_keys:
            base[p] = v
        elif p[0] == "ffn":
            ffn[p[1:]] = v
        else:
            unknown.append(p)
    return base, ffn, unknown


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def _flat_values(state) -> dict[tuple, Any]:
    out = {}
    for path, v in nnx.to_flat_state(state):
        out[tuple(path)] = v.get_value() if isinstance(v, nnx.Variable) else v
    return out


# --------------------------------------------------------------------------- reading

class _Reader:
    """Tensor access over one or several safetensors files, tracking what was consumed."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        index = os.path.join(path, SAFETENSORS_INDEX)
        single = os.path.join(path, SAFETENSORS_SINGLE)
        if os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.exists(single):
            files, weight_map = [SAFETENSORS_SINGLE], None
        else:
            raise FileNotFoundError(f"{path}: neither {SAFETENSORS_SINGLE} nor {SAFETENSORS_INDEX} found")
        self.handles = {fn: safe_open(os.path.join(path, fn), framework="numpy") for fn in files}
        self.where: dict[str, str] = {}
        for fn, h in self.handles.items():
            for k in h.keys():
                if k in self.where:
                    raise CheckpointMismatchError(f"tensor {k!r} appears in both {self.where[k]} and {fn}")
                self.where[k] = fn
        if weight_map is not None:
            for k, fn in weight_map.items():
                if self.where.get(k) != fn:
                    raise CheckpointMismatchError(
                        f"{SAFETENSORS_INDEX} maps tensor {k!r} to {fn}, but it is in {self.where.get(k, 'no shard')}")
        self.consumed: set[str] = set()

    def shape(self, name: str) -> tuple:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def has(self, name: str) -> bool:
        return name in self.where

    def __call__(self, name: str, shape=None) -> np.ndarray:
        if name not in self.where:
            exp = "" if shape is None else f" (expected shape {tuple(shape)})"
            raise CheckpointMismatchError(f"{self.path}: missing tensor {name!r}{exp}")
        if shape is not None and self.shape(name) != tuple(shape):
            raise CheckpointMismatchError(
                f"{self.path}: tensor {name!r} has shape {self.shape(name)}, expected {tuple(shape)}")
        self.consumed.add(name)
        return self.handles[self.where[name]].get_tensor(name)

    def unused(self) -> list[str]:
        return sorted(k for k in self.where if k not in self.consumed and not k.endswith(_IGNORED_SUFFIXES))


def _check_cover(got: Mapping, expected: Mapping, where: str):
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise CheckpointMismatchError(f"{where}: mapping produced no value for {missing} and unexpected {extra}")
    for p, shp in expected.items():
        if tuple(got[p].shape) != tuple(shp):
            raise CheckpointMismatchError(f"{where}: parameter {p} has shape {tuple(got[p].shape)}, expected {tuple(shp)}")


def read_hf_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def import_hf(path: str, *, dtype=None, scan_layers: Optional[bool] = None, cfg: Optional[ModelConfig] = None):
    """(ModelConfig, nnx.State) from an HF folder; the state matches
    ``nnx.split(abstract_model(cfg))[1]`` in either layer layout.

    ``dtype``: storage dtype to cast parameters to (``cfg.param_dtype``); None keeps the
    checkpoint's. ``scan_layers``: stacked layout (default: the config's default, False).
    ``cfg``: skip config.json and use this config (e.g. one with method sub-configs).
    """
    path = os.fspath(path)
    if cfg is None:
        cfg = config_from_hf(read_hf_config(path))
    read = _Reader(path)
    embed_name = "model.embed_tokens.weight"
    if not read.has(embed_name):
        read(embed_name, shape=(cfg.vocab_size, cfg.d_model))  # raises the named error
    if dtype is None:  # keep the checkpoint's storage dtype (bit-exact round trip)
        st_dtype = read.handles[read.where[embed_name]].get_slice(embed_name).get_dtype()
        if st_dtype not in _ST_DTYPES:
            raise CheckpointMismatchError(f"{path}: {embed_name} has unsupported dtype {st_dtype}")
        param_dtype = _ST_DTYPES[st_dtype]
    else:
        param_dtype = jnp.dtype(dtype).name
    changes = {"param_dtype": param_dtype}
    if scan_layers is not None:
        changes["scan_layers"] = bool(scan_layers)
    cfg = cfg.replace(**changes)

    abs_state = nnx.split(abstract_model(cfg))[1]
    abs_flat = {tuple(p): v for p, v in nnx.to_flat_state(abs_state)}
    top_shapes = {p: v.shape for p, v in abs_flat.items() if p[0] != "layers"}
    layer_shapes = {}
    for p, v in abs_flat.items():
        if p[0] == "layers":
            if cfg.scan_layers:
                layer_shapes[p[1:]] = v.shape[1:]
            elif p[1] == 0:
                layer_shapes[p[2:]] = v.shape
    base_shapes, ffn_shapes, unknown = _split_block(layer_shapes)
    if unknown:
        raise CheckpointMismatchError(f"no HF mapping for pallasite block parameters {unknown}")
    _, ffn_from_hf = _ffn_mapping(cfg.ffn)

    values: dict[tuple, np.ndarray] = {}
    for p, hf_name, lin in _TOP:
        if p in top_shapes:
            values[p] = linear_from_hf(read, hf_name, top_shapes[p]) if lin else read(hf_name, shape=top_shapes[p])
    if cfg.tie_embeddings and read.has("lm_head.weight"):
        # Some exporters save the tied head anyway; accept it only if it really is the embedding.
        head = read("lm_head.weight", shape=(cfg.vocab_size, cfg.d_model))
        if not np.array_equal(head, values[("embed", "embedding")]):
            raise CheckpointMismatchError(f"{path}: tie_word_embeddings=True but lm_head.weight differs from "
                                          "model.embed_tokens.weight")
    per_layer = []
    for i in range(cfg.n_layers):
        prefix = _layer_prefix(i)
        layer = {p: (linear_from_hf(read, prefix + hf, base_shapes[p]) if lin else read(prefix + hf, shape=base_shapes[p]))
                 for p, hf, lin in _BLOCK if p in base_shapes}
        ffn = ffn_from_hf(cfg, read, prefix, i, ffn_shapes)
        _check_cover(ffn, ffn_shapes, f"layer {i} ffn ({cfg.ffn})")
        layer.update({("ffn",) + p: v for p, v in ffn.items()})
        per_layer.append(layer)
    extra = read.unused()
    if extra:
        shown = ", ".join(f"{k} {read.shape(k)}" for k in extra[:20])
        raise CheckpointMismatchError(
            f"{path}: {len(extra)} unexpected tensor(s) not used by the {cfg.family} model (ffn={cfg.ffn}, "
            f"tie_embeddings={cfg.tie_embeddings}): {shown}{' …' if len(extra) > 20 else ''}")

    if cfg.scan_layers:
        for rel in layer_shapes:
            values[("layers",) + rel] = np.stack([per_layer[i][rel] for i in range(cfg.n_layers)])
    else:
        for i, layer in enumerate(per_layer):
            for rel, v in layer.items():
                values[("layers", i) + rel] = v

    flat = []
    for p, var in abs_flat.items():
        arr = values[p]
        if tuple(arr.shape) != tuple(var.shape):  # guards the mapping code itself
            raise CheckpointMismatchError(f"parameter {'/'.join(map(str, p))}: got {arr.shape}, expected {var.shape}")
        flat.append((p, var.replace(jnp.asarray(arr, dtype=param_dtype))))
    return cfg, nnx.from_flat_state(flat)


# --------------------------------------------------------------------------- writing

def state_to_hf_tensors(cfg: ModelConfig, state) -> dict[str, np.ndarray]:
    """{HF name: numpy array} for a pallasite state (either layout), in HF's layout."""
    flat = {p: np.asarray(v) for p, v in _flat_values(state).items()}
    out: dict[str, np.ndarray] = {}
    top, layers = {}, [dict() for _ in range(cfg.n_layers)]
    for p, v in flat.items():
        if p[0] != "layers":
            top[p] = v
        elif cfg.scan_layers:
            for i in range(cfg.n_layers):
                layers[i][p[1:]] = v[i]
        else:
            layers[int(p[1])][p[2:]] = v
    for p, hf_name, lin in _TOP:
        if p in top:
            out[hf_name] = linear_to_hf(top.pop(p)) if lin else top.pop(p)
    if top:
        raise ValueError(f"export_hf: no HF mapping for top-level parameters {sorted(top)}")
    ffn_to_hf, _ = _ffn_mapping(cfg.ffn)
    for i, layer in enumerate(layers):
        prefix = _layer_prefix(i)
        base, ffn, unknown = _split_block(layer)
        if unknown:
            raise ValueError(f"export_hf: no HF mapping for layer {i} parameters {unknown}")
        for p, hf, lin in _BLOCK:
            if p in base:
                out[prefix + hf] = linear_to_hf(base[p]) if lin else base[p]
        out.update(ffn_to_hf(cfg, ffn, prefix, i))
    return out


def export_hf(cfg: ModelConfig, state, path: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write an HF folder: config.json, generation_config.json and safetensors (sharded with
    ``model.safetensors.index.json`` when the tensors exceed ``max_shard_bytes``)."""
    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = state_to_hf_tensors(cfg, state)
    dtype = tensors["model.embed_tokens.weight"].dtype.name
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg, dtype=dtype), f, indent=2)
    gen = {"_from_model_config": True, "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id}
    if cfg.eos_token_id is not None:
        gen["eos_token_id"] = cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else list(cfg.eos_token_id)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)

    # Greedy packing in name order; a tensor larger than the limit gets a shard of its own.
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(tensors[name])
        size += nbytes
    for stale in (SAFETENSORS_SINGLE, SAFETENSORS_INDEX):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    meta = {"format": "pt"}  # transformers refuses safetensors files without a known format tag
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, SAFETENSORS_SINGLE), metadata=meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fn), metadata=meta)
        weight_map.update({k: fn for k in shard})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
