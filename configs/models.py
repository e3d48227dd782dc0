"""Model presets: plain dicts of ``ModelConfig`` fields, validated through ``ModelConfig.from_dict``.

Published sizes follow each model's Hugging Face ``config.json`` (Llama 3 8B, Llama 3.1 8B with
llama3 RoPE scaling, Qwen2.5-0.5B, SmolLM2-135M). ``tiny`` / ``quickstart`` / ``bench20m`` are
CPU sizes for tests, the quickstart and the training benchmark. Token ids (bos/eos/pad) and
``vocab_size=0`` ("take it from the tokenizer") are filled in by the training loop.

    from pallasite.configs import models
    cfg_dict = models.get("smollm2_135m", scan_layers=True)   # dict, already validated
"""

from __future__ import annotations

from typing import Any, Callable

from pallasite.models.config import model_config_from


def llama3_8b() -> dict:
    return dict(family="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                d_ff=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False,
                bos_token_id=128000, eos_token_id=128001)


def llama3_1_8b() -> dict:
    return dict(llama3_8b(), max_seq_len=131072, eos_token_id=[128001, 128008, 128009],
                rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=8192))


def qwen2_5_0_5b() -> dict:
    return dict(family="qwen2", vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2,
                d_ff=4864, norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768, tie_embeddings=True,
                qkv_bias=True, bos_token_id=151643, eos_token_id=151643)


def smollm2_135m() -> dict:
    return dict(family="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                d_ff=1536, norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True,
                bos_token_id=0, eos_token_id=0)


def tiny() -> dict:
    """~60k params plus embeddings: unit tests and smoke runs (compiles in ~1 s on CPU)."""
    return dict(family="llama", vocab_size=0, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                max_seq_len=512, tie_embeddings=False)


def quickstart() -> dict:
    """~3.4M params at vocab 2048: the 2-core quickstart (Llama layout, tied embeddings)."""
    return dict(family="llama", vocab_size=0, d_model=192, n_layers=4, n_heads=6, n_kv_heads=2, d_ff=512,
                max_seq_len=1024, tie_embeddings=True, rope_theta=10000.0)


def bench20m() -> dict:
    """~20.2M params (vocab 8192, untied): the training benchmark against PyTorch."""
    return dict(family="llama", vocab_size=8192, d_model=384, n_layers=6, n_heads=6, n_kv_heads=2, d_ff=1664,
                max_seq_len=1024, tie_embeddings=False)


PRESETS: dict[str, Callable[[], dict]] = {
    "llama3_8b": llama3_8b,
    "llama3_1_8b": llama3_1_8b,
    "qwen2_5_0_5b": qwen2_5_0_5b,
    "smollm2_135m": smollm2_135m,
    "tiny": tiny,
    "quickstart": quickstart,
    "bench20m": bench20m,
}


def get(name: str, **overrides: Any) -> dict:
    """Preset ``name`` with ``overrides`` applied, validated (raises naming bad keys/values)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    d = dict(PRESETS[name](), **overrides)
    full = model_config_from(d).to_dict()  # validates; every ModelConfig field, so any can be overridden
    full["vocab_size"] = d["vocab_size"]  # keep 0 = "from the tokenizer"
    return full


__all__ = ["PRESETS", "get"] + list(PRESETS)
