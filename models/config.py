"""Model configuration: one frozen, hashable dataclass for every decoder-only family.

Families covered by the same code (flags, not forks):

* llama   — Llama 2/3 (incl. ``rope_scaling={"rope_type": "llama3", ...}``), SmolLM2
* mistral — Llama layout plus an optional sliding window
* qwen2   — q/k/v biases (``qkv_bias=True``)
* qwen3   — per-head RMSNorm on q and k before RoPE (``qk_norm=True``), explicit head_dim

The config is hashable (it sits inside NNX graphdefs, which jit treats as static), so
mappings are stored as sorted tuples of items; ``rope_scaling_dict`` gives them back.
Method-specific sub-configs (MoE, MoLE, quantization, attention) live in their own frozen
dataclasses and are attached through the ``ffn`` / ``linear`` / ``attention_impl`` seams.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

FFN_KINDS = ("dense", "moe", "mole")
ATTENTION_IMPLS = ("ref", "pallas")


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple) and all(isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) for i in value):
        return {k: _thaw(v) for k, v in value}
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer.

    Shapes: d_model = D, n_heads = H, n_kv_heads = K (GQA groups H // K), head_dim = Dh,
    d_ff = F (SwiGLU hidden size), vocab_size = V, n_layers = L.
    """

    vocab_size: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: Optional[int] = None  # default d_model // n_heads
    d_ff: int = 128
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[tuple] = None  # frozen mapping, see rope_scaling_dict
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 / Qwen2.5
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    qk_norm_scope: str = "head"  # head: RMSNorm per head (Qwen3) | full: over the whole q/k projection (OLMoE)
    sliding_window: Optional[int] = None  # Mistral
    hidden_act: str = "silu"
    family: str = "llama"
    # numerics
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # storage dtype of parameters
    # structure and seams
    scan_layers: bool = False
    remat: str = "none"  # none | full | dots (checkpoint policy inside each block)
    ffn: str = "dense"  # dense | moe | mole
    linear: str = "float"  # float | (quantized kinds registered by ops/quant, training/fp4)
    attention_impl: str = "ref"  # ref | pallas
    # token ids (optional; generation falls back to the tokenizer's)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[tuple] = None
    pad_token_id: Optional[int] = None
    # method sub-configs (frozen dataclasses or None), owned by their modules
    moe: Any = None
    mole: Any = None
    quant: Any = None

    def __post_init__(self):
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, tuple):
            object.__setattr__(self, "rope_scaling", _freeze(self.rope_scaling))
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        elif isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()

    # ------------------------------------------------------------------ helpers
    @property
    def dh(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def rope_scaling_dict(self) -> Optional[dict]:
        return None if self.rope_scaling is None else _thaw(self.rope_scaling)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def validate(self) -> None:
        def need(cond, msg):
            if not cond:
                raise ValueError(f"ModelConfig: {msg}")

        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"):
            need(int(getattr(self, name)) > 0, f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(
            self.n_heads % self.n_kv_heads == 0,
            f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads} (grouped-query attention)",
        )
        need(self.head_dim is not None or self.d_model % self.n_heads == 0,
             f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim explicitly")
        need(self.dh % 2 == 0, f"head_dim={self.dh} must be even for rotary embeddings")
        need(self.ffn in FFN_KINDS, f"ffn={self.ffn!r}; expected one of {FFN_KINDS}")
        need(self.attention_impl in ATTENTION_IMPLS, f"attention_impl={self.attention_impl!r}; expected one of {ATTENTION_IMPLS}")
        need(self.qk_norm_scope in ("head", "full"), f"qk_norm_scope={self.qk_norm_scope!r}; expected head | full")
        need(self.remat in ("none", "full", "dots"), f"remat={self.remat!r}; expected none | full | dots")
        need(self.hidden_act in ("silu", "gelu", "gelu_exact"), f"hidden_act={self.hidden_act!r}; expected silu | gelu | gelu_exact")

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                v = {"__kind__": type(v).__name__, **dataclasses.asdict(v)}
            elif f.name == "rope_scaling":
                v = self.rope_scaling_dict
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from a plain mapping (JSON, ConfigDict); unknown keys fail naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown key(s) {unknown}; known keys are {sorted(known)}")
        kwargs = dict(d)
        for key in ("moe", "mole", "quant"):
            sub = kwargs.get(key)
            if isinstance(sub, Mapping):
                kwargs[key] = sub_config_from_dict(key, sub)
        return cls(**kwargs)

    def num_params(self) -> int:
        """Parameter count of the dense model (embeddings included once when tied)."""
        d, f, dh = self.d_model, self.d_ff, self.dh
        attn = d * dh * (self.n_heads * 2 + self.n_kv_heads * 2)
        if self.qkv_bias:
            attn += dh * (self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * d * f
        norms = 2 * d + (2 * dh if self.qk_norm else 0)
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + norms) + emb + d


# Registry of method sub-config classes, filled by the modules that own them (moe, mole, quant),
# so that a JSON round-trip of a ModelConfig restores the right dataclass.
SUB_CONFIGS: dict[str, type] = {}


def register_sub_config(key: str, cls: type) -> type:
    SUB_CONFIGS[key] = cls
    return cls


def sub_config_from_dict(key: str, d: Mapping[str, Any]):
    d = dict(d)
    d.pop("__kind__", None)
    if key not in SUB_CONFIGS:
        # Import the owning module lazily so its register_sub_config runs.
        import importlib

        for mod in {"moe": ["pallasite.models.moe"], "mole": ["pallasite.models.mole"],
                    "quant": ["pallasite.models.quantized"]}.get(key, []):
            try:
                importlib.import_module(mod)
            except ImportError:
                pass
    if key not in SUB_CONFIGS:
        raise ValueError(f"ModelConfig: no sub-config class registered for {key!r}")
    cls = SUB_CONFIGS[key]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"ModelConfig.{key}: unknown key(s) {unknown}; known keys are {sorted(known)}")
    return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()})


def sub_config_of(cfg: "ModelConfig", key: str, cls: type):
    """The method sub-config ``cfg.<key>`` as a ``cls`` instance: defaults when None, validated
    (unknown keys named) when given as a mapping, a clear error for any other type."""
    value = getattr(cfg, key)
    if value is None:
        return cls()
    if isinstance(value, Mapping):
        return sub_config_from_dict(key, value)
    if not isinstance(value, cls):
        raise TypeError(f"ModelConfig.{key} must be a {cls.__name__}, got {type(value).__name__}")
    return value
