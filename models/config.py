"""Model configuration: one frozen, hashable dataclass for every decoder-only family.

Families are flags, not forks: llama (Llama 2/3, llama3 RoPE scaling, SmolLM2), mistral (sliding
window), qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorm), gemma3_text (``GEMMA3_FLAGS``: (1 + w)
RMSNorm, sandwich norms, √d-scaled embeddings, query_pre_attn_scalar, interleaved local/global
layers with their own RoPE bases, GeGLU) and the MoE families of ``models/hf_moe.py``.
Methods plug in through the seams, each validated against its registry
(``pallasite.registry``): ``ffn`` + ``ffn_config``, ``linear`` + ``linear_config``, ``kv_cache`` +
``kv_cache_config`` (the model's default serving cache) and ``attention_impl``. A ``*_config`` is
the sub-config dataclass the kind registered (None -> its defaults; a mapping is validated).

The config sits inside NNX graphdefs, which jit treats as static, so it is hashable: mappings are
stored as sorted tuples of items (``rope_scaling_dict`` gives them back).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

from pallasite import registry

# (seam field, its sub-config field, registry)
SEAMS = (
    ("ffn", "ffn_config", registry.FFN),
    ("linear", "linear_config", registry.LINEAR),
    ("kv_cache", "kv_cache_config", registry.KV_CACHE),
)
REMAT_KINDS = ("none", "full", "dots")
ACTIVATIONS = ("silu", "gelu", "gelu_exact")
LAYER_TYPES = ("full", "sliding")  # per layer: global causal | causal within sliding_window


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
    sliding_window: Optional[int] = None  # Mistral: every layer; with layer_types: "sliding" ones
    hidden_act: str = "silu"
    # Gemma 2/3 (all off by default, so other families are unchanged)
    layer_types: Optional[tuple] = None  # per layer "full" | "sliding"; None: all layers alike
    rope_local_theta: Optional[float] = None  # RoPE base of "sliding" layers (None: as global)
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w) instead of w
    sandwich_norm: bool = False  # also norm the attention / FFN outputs before the residual add
    scale_embeddings: bool = False  # embedding output times sqrt(d_model), in the compute dtype
    query_pre_attn_scalar: Optional[float] = None  # attention scale s**-0.5 (None: head_dim**-0.5)
    family: str = "llama"
    # numerics
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"  # storage dtype of parameters
    # structure and seams (kinds are registrations: pallasite.registry)
    scan_layers: bool = False
    remat: str = "none"  # none | full | dots (checkpoint policy inside each block)
    ffn: str = "dense"
    ffn_config: Any = None
    linear: str = "float"
    linear_config: Any = None
    kv_cache: str = "dense"  # the cache generation uses unless it asks for another
    kv_cache_config: Any = None
    attention_impl: str = "ref"
    # token ids (optional; generation falls back to the tokenizer's)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[tuple] = None
    pad_token_id: Optional[int] = None

    def __post_init__(self):
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, tuple):
            object.__setattr__(self, "rope_scaling", _freeze(self.rope_scaling))
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.eos_token_id, int):
            object.__setattr__(self, "eos_token_id", (self.eos_token_id,))
        elif isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        self.validate()
        for kind_field, config_field, reg in SEAMS:
            value = reg.make_config(
                getattr(self, kind_field), getattr(self, config_field), field=f"ModelConfig.{config_field}"
            )
            object.__setattr__(self, config_field, value)

    # ------------------------------------------------------------------ helpers
    @property
    def dh(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def layer_windows(self) -> tuple:
        """Each layer's sliding window (None: full attention)."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.n_layers
        return tuple(self.sliding_window if t == "sliding" else None for t in self.layer_types)

    @property
    def mixed_layers(self) -> bool:
        """True when layers differ in attention (window, RoPE base): layer type is data then."""
        return self.layer_types is not None and len(set(self.layer_types)) > 1

    @property
    def query_scale(self) -> float:
        s = self.dh if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar
        return float(s) ** -0.5

    @property
    def rope_scaling_dict(self) -> Optional[dict]:
        return None if self.rope_scaling is None else _thaw(self.rope_scaling)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes``; changing a seam's kind drops its old sub-config (defaults)."""
        for kind_field, config_field, _ in SEAMS:
            if (
                kind_field in changes
                and config_field not in changes
                and changes[kind_field] != getattr(self, kind_field)
            ):
                changes[config_field] = None
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
        need(
            self.head_dim is not None or self.d_model % self.n_heads == 0,
            f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim explicitly",
        )
        need(self.dh % 2 == 0, f"head_dim={self.dh} must be even for rotary embeddings")
        for kind_field, _, reg in SEAMS:
            reg.check(getattr(self, kind_field), field=f"ModelConfig.{kind_field}")
        registry.ATTENTION.check(self.attention_impl, field="ModelConfig.attention_impl")
        need(self.qk_norm_scope in ("head", "full"), f"qk_norm_scope={self.qk_norm_scope!r}; expected head | full")
        need(self.remat in REMAT_KINDS, f"remat={self.remat!r}; expected one of {REMAT_KINDS}")
        need(self.hidden_act in ACTIVATIONS, f"hidden_act={self.hidden_act!r}; expected one of {ACTIVATIONS}")
        need(
            self.sliding_window is None or int(self.sliding_window) > 0,
            f"sliding_window={self.sliding_window!r} must be a positive integer or None",
        )
        if self.layer_types is not None:
            need(
                len(self.layer_types) == self.n_layers,
                f"layer_types has {len(self.layer_types)} entries for n_layers={self.n_layers}",
            )
            bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            need(not bad, f"layer_types {bad} unknown; expected each of {LAYER_TYPES}")
            need(
                "sliding" not in self.layer_types or self.sliding_window is not None,
                "layer_types has 'sliding' layers but sliding_window is None",
            )
        need(
            self.rope_local_theta is None or self.layer_types is not None,
            "rope_local_theta needs layer_types (it is the RoPE base of the 'sliding' layers)",
        )
        need(
            self.query_pre_attn_scalar is None or float(self.query_pre_attn_scalar) > 0,
            f"query_pre_attn_scalar={self.query_pre_attn_scalar!r} must be positive or None",
        )

    def to_dict(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if dataclasses.is_dataclass(v):
                v = registry.config_to_dict(v)
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
        return cls(**dict(d))

    def num_params(self) -> int:
        """Parameter count of the dense model (embeddings included once when tied)."""
        d, f, dh = self.d_model, self.d_ff, self.dh
        attn = d * dh * (self.n_heads * 2 + self.n_kv_heads * 2)
        if self.qkv_bias:
            attn += dh * (self.n_heads + 2 * self.n_kv_heads)
        mlp = 3 * d * f
        norms = (4 if self.sandwich_norm else 2) * d + (2 * dh if self.qk_norm else 0)
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * (attn + mlp + norms) + emb + d


# Gemma 3 text (transformers' Gemma3ForCausalLM): the flags every gemma3_text config sets; the
# shapes, layer_types, window and RoPE bases come from its config.json / GGUF metadata.
GEMMA3_FLAGS = dict(
    family="gemma3_text",
    norm_unit_offset=True,
    sandwich_norm=True,
    scale_embeddings=True,
    qk_norm=True,
    qk_norm_scope="head",
)


def gemma3_layer_types(n_layers: int, pattern: int = 6) -> tuple:
    """Gemma 3's interleave: every ``pattern``-th layer is global, the rest local (5 : 1)."""
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(n_layers))


def model_config_from(d, *, vocab_size: Optional[int] = None) -> ModelConfig:
    """ModelConfig from a dict or ConfigDict of its fields; ``vocab_size=0`` in ``d`` ("take it from
    the tokenizer") is replaced by ``vocab_size`` (or by a placeholder for validation)."""
    if hasattr(d, "to_dict"):
        d = d.to_dict()
    d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(d).items()}
    if not d.get("vocab_size"):
        d["vocab_size"] = vocab_size if vocab_size else 1
    return ModelConfig.from_dict(d)


def kind_config(cfg: ModelConfig, seam: str, kind: str, cls: type):
    """``cfg.<seam>_config`` for a module that implements ``kind``: a clear error when the config
    selects another kind (the sub-config is already validated by ``ModelConfig``)."""
    if getattr(cfg, seam) != kind:
        raise ValueError(f"ModelConfig.{seam}={getattr(cfg, seam)!r}; this needs {seam}={kind!r}")
    value = getattr(cfg, f"{seam}_config")
    if not isinstance(value, cls):
        raise TypeError(f"ModelConfig.{seam}_config must be a {cls.__name__}, got {type(value).__name__}")
    return value
