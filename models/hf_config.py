"""Hugging Face ``config.json`` ⇄ ``ModelConfig``: one registered ``ModelTypeSpec`` per model type.

``HF_MODEL_TYPE.register(model_type, ModelTypeSpec(model_type, from_hf, to_hf, architecture))``:
``from_hf(hf: dict) -> ModelConfig`` (``family`` = ``model_type``; ``config_to_hf`` dispatches on
``cfg.family``) and ``to_hf(cfg) -> dict``, its inverse (``model_type``, ``architectures`` and
``dtype`` are filled in here). ``dense_config_kwargs`` / ``dense_config_to_hf`` hold the fields every
Llama-style config shares. Built in: llama, mistral, qwen2, qwen3, gemma3_text (here) and the MoE
families (``models/hf_moe.py``), found through ``pallasite.registry``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import numpy as np

from pallasite.models.config import GEMMA3_FLAGS, ModelConfig, gemma3_layer_types
from pallasite.registry import HF_MODEL_TYPE

_HF_ACT = {"silu": "silu", "swish": "silu", "gelu": "gelu_exact", "gelu_pytorch_tanh": "gelu", "gelu_new": "gelu"}
_ACT_HF = {"silu": "silu", "gelu": "gelu_pytorch_tanh", "gelu_exact": "gelu"}
_ROPE_KINDS = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class ModelTypeSpec:
    model_type: str
    from_hf: Callable[[dict], ModelConfig]
    to_hf: Callable[[ModelConfig], dict]
    architecture: str


def register_model_type(model_type: str, *, from_hf: Callable[[dict], ModelConfig],
                        to_hf: Callable[[ModelConfig], dict], architecture: str) -> None:
    HF_MODEL_TYPE.register(model_type, ModelTypeSpec(model_type, from_hf, to_hf, architecture))


def _spec(model_type: str) -> ModelTypeSpec:
    return HF_MODEL_TYPE.get(model_type, field="Hugging Face model_type")


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


# ---------------------------------------------------------------- Gemma 3 (text)
_GEMMA3_LAYER_TYPES = {"sliding_attention": "sliding", "full_attention": "full"}
_GEMMA3_UNSUPPORTED = ("final_logit_softcapping", "attn_logit_softcapping")
_G3 = "HF config (gemma3_text)"


def _gemma3_rope(hf: Mapping) -> tuple[dict, dict]:
    """(global, local) RoPE parameters from v5's per-layer-type ``rope_parameters`` or the older
    ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` (defaults: 1M global, 10k local)."""
    params = hf.get("rope_parameters")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        glob = dict(params.get("full_attention") or {})
        loc = dict(params.get("sliding_attention") or {})
    else:
        glob = {**(hf.get("rope_scaling") or {}), **(params or {})}
        loc = {"rope_type": "default"}
        if hf.get("rope_local_base_freq") is not None:
            loc["rope_theta"] = hf["rope_local_base_freq"]
    glob.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    loc.setdefault("rope_theta", 10_000.0)
    return glob, loc


def _gemma3_layer_types(hf: Mapping, n: int) -> tuple:
    hf_types = hf.get("layer_types")
    if hf_types is None:  # older configs: every sliding_window_pattern-th layer is global
        pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
        return gemma3_layer_types(n, pattern)
    if set(hf_types) - set(_GEMMA3_LAYER_TYPES) or len(hf_types) != n:
        raise ValueError(f"{_G3}: layer_types must be {n} of {sorted(_GEMMA3_LAYER_TYPES)}; "
                         f"got {hf_types}")
    return tuple(_GEMMA3_LAYER_TYPES[t] for t in hf_types)


def _gemma3_from_hf(hf):
    for key in _GEMMA3_UNSUPPORTED:
        if hf.get(key) is not None:
            raise ValueError(f"{_G3}: {key}={hf[key]} is not supported (pallasite implements no "
                             "logit soft-capping; Gemma 3 checkpoints carry none)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{_G3}: use_bidirectional_attention=True is not supported (causal only)")
    types = _gemma3_layer_types(hf, int(_need(hf, "num_hidden_layers")))
    window = hf.get("sliding_window")
    if "sliding" in types and window is None:
        raise ValueError(f"{_G3}: sliding_attention layers need sliding_window")
    glob, loc = _gemma3_rope(hf)
    theta_local, local_scaling = rope_from_hf({"rope_parameters": loc})
    if local_scaling is not None:
        raise ValueError(f"{_G3}: RoPE scaling of the sliding layers ({loc}) is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    flat = {k: v for k, v in hf.items() if k not in ("rope_scaling", "sliding_window")}
    flat.update(rope_parameters=glob, hidden_act=act,
                tie_word_embeddings=hf.get("tie_word_embeddings", True))
    bias = bool(hf.get("attention_bias", False))
    kwargs = {**dense_config_kwargs(flat), **GEMMA3_FLAGS}
    kwargs.update(layer_types=types, sliding_window=None if "sliding" not in types else int(window),
                  rope_local_theta=theta_local, qkv_bias=bias, o_bias=bias,
                  query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)))
    return ModelConfig(**kwargs)


def _gemma3_to_hf(cfg):
    _reject(cfg, "gemma3_text", mlp_bias=False, o_bias=cfg.qkv_bias,
            **{k: v for k, v in GEMMA3_FLAGS.items() if k != "family"})
    out = dense_config_to_hf(cfg)
    out["hidden_activation"] = out.pop("hidden_act")  # (already the HF spelling)
    glob = out["rope_parameters"]
    loc = dict(glob) if cfg.rope_local_theta is None else {"rope_type": "default",
                                                          "rope_theta": cfg.rope_local_theta}
    out["rope_parameters"] = {"full_attention": glob, "sliding_attention": loc}
    types = cfg.layer_types or (("sliding" if cfg.sliding_window else "full"),) * cfg.n_layers
    names = {v: k for k, v in _GEMMA3_LAYER_TYPES.items()}
    qpas = cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.dh
    out.update(layer_types=[names[t] for t in types], sliding_window=cfg.sliding_window,
               query_pre_attn_scalar=int(qpas) if float(qpas).is_integer() else qpas,
               attention_bias=cfg.qkv_bias, final_logit_softcapping=None,
               attn_logit_softcapping=None, use_bidirectional_attention=False)
    return out


register_model_type("gemma3_text", from_hf=_gemma3_from_hf, to_hf=_gemma3_to_hf,
                    architecture="Gemma3ForCausalLM")


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a config.json dict (any registered model_type)."""
    if "model_type" not in hf:
        raise ValueError(f"HF config has no 'model_type'; supported model types: {', '.join(HF_MODEL_TYPE.names())}")
    return _spec(hf["model_type"]).from_hf(dict(hf))


def config_to_hf(cfg: ModelConfig, *, dtype: Optional[str] = None) -> dict:
    """config.json dict (transformers v5 layout) for ``cfg``; readable by ``AutoConfig``."""
    spec = _spec(cfg.family)
    out = spec.to_hf(cfg)
    out.update(model_type=spec.model_type, architectures=[spec.architecture],
               dtype=dtype or str(np.dtype(cfg.param_dtype)))
    return dict(sorted(out.items()))
