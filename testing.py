"""Test helpers: tiny random ``transformers`` models as PyTorch references.

    torch_model, path = make_tiny_hf_model("qwen3", tmp_path)   # saved with save_pretrained
    cfg, state = pallasite.models.hf.import_hf(path)
    np.testing.assert_allclose(forward(graphdef, state, ids)[0], pt_logits(torch_model, ids), atol=1e-4)

Families live in ``TINY_FAMILIES`` (name -> builder returning a ``transformers`` config), MoE
families (Mixtral & co.) included; tests add theirs with ``register_tiny_family``.
Every model is float32, eager attention, and — unlike transformers' own init — has its
norm weights and biases randomised and a larger weight scale (``initializer_range=0.1``), so a
mapping mistake (swapped norms, a dropped bias, a wrong RoPE layout) moves the logits far
beyond a 1e-4 tolerance instead of hiding in near-uniform attention.

torch and transformers' PyTorch models are imported lazily: importing this module is cheap and
torch-free; tests that call these helpers should ``pytest.importorskip("torch")`` first.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

# Common tiny shape: D=64, 2 layers, 4 query heads / 2 KV heads (GQA), F=128, V=256.
TINY_BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _llama(**kw):
    import transformers

    return transformers.LlamaConfig(**{**TINY_BASE, "tie_word_embeddings": False, **kw})


def _llama_tied(**kw):
    return _llama(**{"tie_word_embeddings": True, **kw})


def _llama3_rope(**kw):
    # original_max_position_embeddings is small so that all three llama3 frequency bands
    # (kept, smoothly interpolated, divided by factor) occur at head_dim 16.
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return _llama(**{"rope_parameters": rope, "attention_bias": True, "mlp_bias": True, **kw})


def _mistral(**kw):
    import transformers

    # A window shorter than the test sequences, so the sliding-window mask is exercised.
    return transformers.MistralConfig(**{**TINY_BASE, "sliding_window": 5, **kw})


def _qwen2(**kw):
    import transformers

    return transformers.Qwen2Config(**{**TINY_BASE, "tie_word_embeddings": True, **kw})


def _qwen3(**kw):
    import transformers

    # head_dim 32 != hidden/heads = 16: exercises the explicit head_dim path.
    return transformers.Qwen3Config(**{**TINY_BASE, "head_dim": 32, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1000000.0}, **kw})


def _gemma3(**kw):
    import transformers

    # 6 layers = Gemma 3's 5 local : 1 global; a window (5) shorter than the test sequences so the
    # local layers matter; head_dim 32 != hidden/heads and query_pre_attn_scalar 24 != head_dim so
    # the explicit head_dim and the query scale are exercised; RoPE bases as Gemma 3 (10k / 1M).
    return transformers.Gemma3TextConfig(**{**TINY_BASE, "num_hidden_layers": 6, "head_dim": 32,
                                            "query_pre_attn_scalar": 24, "sliding_window": 5,
                                            "bos_token_id": 2, "eos_token_id": 1, **kw})


def _tiny_moe(kind: str):
    """Tiny MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) with 8 experts."""
    def build(**kw):
        import transformers

        base = {**TINY_BASE, "tie_word_embeddings": False}
        if kind == "mixtral":
            return transformers.MixtralConfig(**{**base, "intermediate_size": 48, "num_local_experts": 8,
                                                 "num_experts_per_tok": 2, "router_jitter_noise": 0.0, **kw})
        if kind == "qwen2_moe":
            return transformers.Qwen2MoeConfig(**{**base, "num_experts": 8, "num_experts_per_tok": 4,
                                                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                                  "norm_topk_prob": False, **kw})
        if kind == "qwen3_moe":
            return transformers.Qwen3MoeConfig(**{**base, "num_experts": 8, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 32, "norm_topk_prob": True, "head_dim": 32,
                                                  **kw})
        return transformers.OlmoeConfig(**{**base, "intermediate_size": 32, "num_experts": 8,
                                           "num_experts_per_tok": 3, "norm_topk_prob": False, **kw})

    return build


TINY_FAMILIES: dict[str, Callable[..., Any]] = {
    "llama": _llama,
    "llama_tied": _llama_tied,
    "llama3_rope": _llama3_rope,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    **{kind: _tiny_moe(kind) for kind in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")},
}


def register_tiny_family(name: str, builder: Callable[..., Any]) -> None:
    """Add a family: ``builder(**config_overrides) -> transformers.PretrainedConfig``."""
    TINY_FAMILIES[name] = builder


def tiny_hf_config(family: str, **config_overrides):
    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; known: {sorted(TINY_FAMILIES)}")
    return TINY_FAMILIES[family](**config_overrides)


def make_tiny_hf_model(family: str, out_dir, *, seed: int = 0, **config_overrides):
    """Build a tiny random float32 ``transformers`` causal LM and ``save_pretrained`` it.

    Returns ``(torch_model, path)`` with the model in eval mode. ``config_overrides`` go to
    the transformers config (e.g. ``num_hidden_layers=3``, ``tie_word_embeddings=True``).
    """
    import torch
    import transformers

    hf_cfg = tiny_hf_config(family, **config_overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager", dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # transformers initialises norms to 1 and biases to 0, which would hide a swapped
            # norm or a dropped bias: randomise them around those values.
            if name.endswith("norm.weight") or "layernorm" in name:
                # Gemma's (1 + w) norms are stored around 0, the others around 1.
                center = 0.0 if model.config.model_type.startswith("gemma") else 1.0
                p.copy_(center + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    model.eval()
    path = os.fspath(out_dir)
    model.save_pretrained(path)
    return model, path


def pt_logits(torch_model, ids) -> np.ndarray:
    """float32 logits [B, T, V] of a PyTorch causal LM for int token ids [B, T] (no padding)."""
    import torch

    with torch.no_grad():
        out = torch_model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long), use_cache=False)
    return out.logits.float().numpy()


def pt_greedy(torch_model, ids, n: int) -> np.ndarray:
    """transformers' own greedy ``generate``: the ``n`` new token ids [B, n] after prompts [B, T].

    EOS is disabled so that exactly ``n`` tokens come back (a random model may emit EOS at any
    step; greedy parity is about the argmax sequence, not about stopping).
    """
    import torch
    import transformers

    prompt = torch.as_tensor(np.asarray(ids), dtype=torch.long)
    gen_cfg = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=n, min_new_tokens=0, eos_token_id=None,
        pad_token_id=torch_model.config.pad_token_id if torch_model.config.pad_token_id is not None else 0,
        bos_token_id=None,
    )
    with torch.no_grad():
        out = torch_model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=gen_cfg)
    return out[:, prompt.shape[1]:].numpy()
