"""Hugging Face MoE checkpoints ⇄ pallasite: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Registers the four ``model_type``s (``HF_MODEL_TYPE``) and the ``moe`` FFN tensor mapping
(``HF_FFN``), so ``import_hf`` / ``export_hf`` work as for dense models. Gating: Mixtral softmax →
top-k → renormalise; Qwen2/3-MoE renormalise iff ``norm_topk_prob`` (Qwen2-MoE adds a
sigmoid-gated shared expert); OLMoE does not renormalise and norms q/k over the whole projection.
Reads transformers' fused ``experts.gate_up_proj`` / ``down_proj`` or the per-expert names and
writes the per-expert names (what ``save_pretrained`` writes). Our stacked ``w_gate``/``w_up``
[E, D, F], ``w_down`` [E, F, D] and router [D, E] are transposes of HF's ``[out, in]`` weights.
Refused, naming the key: layers without experts, Mixtral router jitter, OLMoE ``clip_qkv``.
The per-family tensor table is in docs/checkpoints.md.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from pallasite.models.config import ModelConfig
from pallasite.models.hf import linear_from_hf, linear_to_hf
from pallasite.models.hf_config import dense_config_kwargs, dense_config_to_hf, register_model_type
from pallasite.models.moe import MoEConfig, moe_config_of
from pallasite.registry import HF_FFN

_MIXTRAL_NAMES = {
    "gate": "block_sparse_moe.gate.weight",
    "experts": "block_sparse_moe.experts.{e}.",
    "w_gate": "w1.weight",
    "w_up": "w3.weight",
    "w_down": "w2.weight",
    "fused": "block_sparse_moe.experts.",
}
_QWEN_NAMES = {
    "gate": "mlp.gate.weight",
    "experts": "mlp.experts.{e}.",
    "w_gate": "gate_proj.weight",
    "w_up": "up_proj.weight",
    "w_down": "down_proj.weight",
    "fused": "mlp.experts.",
}


def _names(cfg: ModelConfig) -> dict:
    return _MIXTRAL_NAMES if cfg.family == "mixtral" else _QWEN_NAMES


def _bad(hf: Mapping, msg: str):
    raise ValueError(f"HF config ({hf.get('model_type')}): {msg}")


def _all_layers_sparse(hf: Mapping):
    if int(hf.get("decoder_sparse_step") or 1) != 1 or list(hf.get("mlp_only_layers") or []):
        _bad(
            hf,
            f"decoder_sparse_step={hf.get('decoder_sparse_step')} / mlp_only_layers={hf.get('mlp_only_layers')}: "
            "only checkpoints whose every layer is an MoE layer are supported",
        )


def _moe_kwargs(hf: Mapping, **extra) -> dict:
    return dict(lb_loss_coef=float(hf.get("router_aux_loss_coef", 0.01) or 0.0), **extra)


# ----------------------------------------------------------------------------- config mapping
def _mixtral_from_hf(hf):
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        _bad(hf, f"router_jitter_noise={hf['router_jitter_noise']} is not implemented (expected 0.0)")
    moe = MoEConfig(
        num_experts=int(hf["num_local_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        norm_topk_prob=True,
        **_moe_kwargs(hf),
    )
    return ModelConfig(**dense_config_kwargs(hf), ffn="moe", ffn_config=moe)


def _mixtral_to_hf(cfg):
    m = moe_config_of(cfg)
    if not m.norm_topk_prob or m.shared_expert_d_ff or m.router_bias or cfg.qkv_bias or cfg.qk_norm:
        raise ValueError(
            "config_to_hf: a mixtral checkpoint needs norm_topk_prob=True, no shared expert, no router "
            "bias, no q/k/v bias and no qk_norm"
        )
    if (m.d_expert or cfg.d_ff) != cfg.d_ff:
        raise ValueError(f"config_to_hf: mixtral's expert width is intermediate_size={cfg.d_ff}; d_expert={m.d_expert}")
    return {
        **dense_config_to_hf(cfg),
        "num_local_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "router_aux_loss_coef": m.lb_loss_coef,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": cfg.sliding_window,
    }


def _qwen2_moe_from_hf(hf):
    _all_layers_sparse(hf)
    moe = MoEConfig(
        num_experts=int(hf["num_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        d_expert=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_d_ff=int(hf.get("shared_expert_intermediate_size") or 0),
        shared_expert_gate=True,
        **_moe_kwargs(hf),
    )
    return ModelConfig(**dense_config_kwargs(hf), qkv_bias=bool(hf.get("qkv_bias", True)), ffn="moe", ffn_config=moe)


def _qwen_moe_common_to_hf(cfg):
    m = moe_config_of(cfg)
    return {
        **dense_config_to_hf(cfg),
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.d_expert or cfg.d_ff,
        "norm_topk_prob": m.norm_topk_prob,
        "router_aux_loss_coef": m.lb_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "output_router_logits": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
    }


def _qwen2_moe_to_hf(cfg):
    m = moe_config_of(cfg)
    if not m.shared_expert_d_ff or not m.shared_expert_gate or cfg.qk_norm or m.router_bias:
        raise ValueError("config_to_hf: a qwen2_moe checkpoint needs a gated shared expert, no qk_norm, no router bias")
    return {
        **_qwen_moe_common_to_hf(cfg),
        "shared_expert_intermediate_size": m.shared_expert_d_ff,
        "qkv_bias": cfg.qkv_bias,
    }


def _qwen3_moe_from_hf(hf):
    _all_layers_sparse(hf)
    # transformers v5 writes Qwen3-MoE's expert count as num_local_experts (older files: num_experts)
    n_exp = hf.get("num_local_experts") or hf.get("num_experts") or _bad(hf, "num_local_experts is missing")
    moe = MoEConfig(
        num_experts=int(n_exp),
        top_k=int(hf["num_experts_per_tok"]),
        d_expert=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        **_moe_kwargs(hf),
    )
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(**dense_config_kwargs(hf), qkv_bias=bias, o_bias=bias, qk_norm=True, ffn="moe", ffn_config=moe)


def _qwen3_moe_to_hf(cfg):
    m = moe_config_of(cfg)
    if m.shared_expert_d_ff or not cfg.qk_norm or m.router_bias or cfg.o_bias != cfg.qkv_bias:
        raise ValueError(
            "config_to_hf: a qwen3_moe checkpoint needs per-head qk_norm, no shared expert, no router bias"
        )
    out = {**_qwen_moe_common_to_hf(cfg), "attention_bias": cfg.qkv_bias}
    out["num_local_experts"] = out.pop("num_experts")
    return out


def _olmoe_from_hf(hf):
    if hf.get("clip_qkv") is not None:
        _bad(hf, f"clip_qkv={hf['clip_qkv']} is not implemented (expected null)")
    moe = MoEConfig(
        num_experts=int(hf["num_experts"]),
        top_k=int(hf["num_experts_per_tok"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        **_moe_kwargs(hf),
    )
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        **dense_config_kwargs(hf),
        qkv_bias=bias,
        o_bias=bias,
        qk_norm=True,
        qk_norm_scope="full",
        ffn="moe",
        ffn_config=moe,
    )


def _olmoe_to_hf(cfg):
    m = moe_config_of(cfg)
    if m.shared_expert_d_ff or not cfg.qk_norm or cfg.qk_norm_scope != "full" or m.router_bias:
        raise ValueError("config_to_hf: an olmoe checkpoint needs full-width qk_norm, no shared expert, no router bias")
    if (m.d_expert or cfg.d_ff) != cfg.d_ff:
        raise ValueError(f"config_to_hf: olmoe's expert width is intermediate_size={cfg.d_ff}; d_expert={m.d_expert}")
    return {
        **dense_config_to_hf(cfg),
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.top_k,
        "norm_topk_prob": m.norm_topk_prob,
        "router_aux_loss_coef": m.lb_loss_coef,
        "clip_qkv": None,
        "attention_bias": cfg.qkv_bias,
        "output_router_logits": False,
    }


register_model_type("mixtral", from_hf=_mixtral_from_hf, to_hf=_mixtral_to_hf, architecture="MixtralForCausalLM")
register_model_type("qwen2_moe", from_hf=_qwen2_moe_from_hf, to_hf=_qwen2_moe_to_hf, architecture="Qwen2MoeForCausalLM")
register_model_type("qwen3_moe", from_hf=_qwen3_moe_from_hf, to_hf=_qwen3_moe_to_hf, architecture="Qwen3MoeForCausalLM")
register_model_type("olmoe", from_hf=_olmoe_from_hf, to_hf=_olmoe_to_hf, architecture="OlmoeForCausalLM")


# ----------------------------------------------------------------------------- tensor mapping
_SHARED = [
    (("shared_expert", "gate_proj", "kernel"), "mlp.shared_expert.gate_proj.weight"),
    (("shared_expert", "up_proj", "kernel"), "mlp.shared_expert.up_proj.weight"),
    (("shared_expert", "down_proj", "kernel"), "mlp.shared_expert.down_proj.weight"),
    (("shared_gate",), "mlp.shared_expert_gate.weight"),
]


def _moe_to_hf(cfg, ffn_params, prefix, layer):
    n = _names(cfg)
    if ("w_gate",) not in ffn_params:
        raise ValueError(
            f"export_hf: layer {layer} has non-gated MoE experts (MoEConfig.gated=False); {cfg.family} "
            "checkpoints hold SwiGLU experts (gate/up/down), so this model has no HF layout"
        )
    out = {prefix + n["gate"]: linear_to_hf(ffn_params[("router",)])}
    for key in ("w_gate", "w_up", "w_down"):
        stacked = ffn_params[(key,)]
        for e in range(stacked.shape[0]):
            out[prefix + n["experts"].format(e=e) + n[key]] = linear_to_hf(stacked[e])
    for p, hf in _SHARED:
        if p in ffn_params:
            out[prefix + hf] = linear_to_hf(ffn_params[p])
    unknown = sorted(set(ffn_params) - {("router",), ("w_gate",), ("w_up",), ("w_down",)} - {p for p, _ in _SHARED})
    if unknown:
        raise ValueError(
            f"export_hf: layer {layer} MoE parameters {unknown} have no {cfg.family} HF name "
            "(router bias / similarity tables are not part of HF checkpoints)"
        )
    return out


def _moe_from_hf(cfg, read, prefix, layer, expected):
    n = _names(cfg)
    out = {("router",): linear_from_hf(read, prefix + n["gate"], expected[("router",)])}
    E, D, F = expected[("w_gate",)]
    fused_gu = prefix + n["fused"] + "gate_up_proj"
    if read.has(fused_gu):  # transformers v5 in-memory layout, if a writer saved it as is
        gu = read(fused_gu, shape=(E, 2 * F, D))
        out[("w_gate",)] = np.ascontiguousarray(np.swapaxes(gu[:, :F], 1, 2))
        out[("w_up",)] = np.ascontiguousarray(np.swapaxes(gu[:, F:], 1, 2))
        out[("w_down",)] = np.ascontiguousarray(
            np.swapaxes(read(prefix + n["fused"] + "down_proj", shape=(E, D, F)), 1, 2)
        )
    else:
        for key in ("w_gate", "w_up", "w_down"):
            shape = expected[(key,)][1:]
            out[(key,)] = np.stack(
                [linear_from_hf(read, prefix + n["experts"].format(e=e) + n[key], shape) for e in range(E)]
            )
    for p, hf in _SHARED:
        if p in expected:
            out[p] = linear_from_hf(read, prefix + hf, expected[p])
    if ("similarity",) in expected:  # Occult similarity tables are not in HF checkpoints: identity
        out[("similarity",)] = np.eye(E, dtype=np.float32)
    return out


HF_FFN.register("moe", (_moe_to_hf, _moe_from_hf))
