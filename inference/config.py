"""``GenerationConfig``: every generation option in one validated, frozen dataclass.

    gen = GenerationConfig(max_new_tokens=64, temperature=0.7, top_p=0.9, kv_cache="catekv",
                           kv_cache_config={"head_mask": "catekv_head_mask.json"})
    pallasite.generate(model, prompts, gen)            # or pallasite.generate(model, prompts, max_new_tokens=64, ...)

Sampling values may be scalars or one value per prompt. ``stop_tokens=None`` means the model's eos
ids. ``kv_cache=None`` means the model's default cache (``ModelConfig.kv_cache``); a kind's options
go in ``kv_cache_config`` (validated against the kind's registered sub-config). ``strategy`` names a
registered decode strategy (``pallasite.registry.DECODE_STRATEGY``; ``"sample"``: greedy /
temperature / top-k / top-p) with its options in ``strategy_config``. ``constraint`` is a
``pallasite.inference.constrained.Constraint`` (a grammar, JSON schema or regex; CRANE spans), a
mapping of its fields, or one per prompt (None = unconstrained row); with the default strategy it
selects ``"constrained"`` (sampling under the grammar's masks, docs/constrained.md). ``drafter``
(a second model) selects ``"speculative"`` decoding with ``method`` (docs/speculative.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from pallasite.errors import InputError
from pallasite.registry import DECODE_STRATEGY, KV_CACHE


def _tuple(v):
    return tuple(v) if isinstance(v, list) else v


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 32
    temperature: Any = 0.0  # 0 = greedy; scalar or one per prompt
    top_k: Any = None
    top_p: Any = None
    seed: int = 0
    stop_tokens: Optional[tuple] = None  # None: the model's eos ids; () : none
    cache_len: Optional[int] = None  # default: longest prompt + max_new_tokens, rounded up to 64
    kv_cache: Optional[str] = None  # None: ModelConfig.kv_cache
    kv_cache_config: Any = None
    strategy: str = "sample"
    strategy_config: Any = None
    logits_processors: tuple = ()  # proc(logits_BV, state) -> logits_BV, before the sampling filters
    pad_id: Optional[int] = None
    drafter: Any = None  # speculative decoding: a pallasite.Model (or speculative.Drafter) that drafts
    method: Optional[str] = None  # with a drafter: auto | sd | slem | tli | slrs (None: auto)
    constraint: Any = None  # Constraint | mapping of its fields | one per prompt | None

    def __post_init__(self):
        for name in ("temperature", "top_k", "top_p", "stop_tokens", "logits_processors"):
            object.__setattr__(self, name, _tuple(getattr(self, name)))
        if self.constraint is not None:
            from pallasite.inference.constrained.constraint import normalize

            object.__setattr__(self, "constraint", normalize(self.constraint))
            if self.strategy == "sample" and self.drafter is None:  # the default ignores masks: use the masking one
                object.__setattr__(self, "strategy", "constrained")
        if self.drafter is not None or self.method is not None:
            from pallasite.inference.speculative.options import check_method

            if self.drafter is None:
                raise ValueError(f"GenerationConfig.method={self.method!r} needs a drafter (drafter=<a model>)")
            check_method(self.method or "auto")
            if self.strategy == "sample":  # a drafter selects the speculative strategy (it applies constraints too)
                object.__setattr__(self, "strategy", "speculative")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InputError(f"GenerationConfig.max_new_tokens must be an integer >= 1; got {self.max_new_tokens!r}")
        if self.cache_len is not None and int(self.cache_len) < 1:
            raise InputError(f"GenerationConfig.cache_len must be >= 1 or None; got {self.cache_len!r}")
        if self.kv_cache is not None:
            KV_CACHE.check(self.kv_cache, field="GenerationConfig.kv_cache")
        DECODE_STRATEGY.check(self.strategy, field="GenerationConfig.strategy")
        object.__setattr__(self, "strategy_config", DECODE_STRATEGY.make_config(
            self.strategy, self.strategy_config, field="GenerationConfig.strategy_config"))

    def replace(self, **changes) -> "GenerationConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def make(cls, config: Optional["GenerationConfig"] = None, **overrides) -> "GenerationConfig":
        """``config`` (default: the defaults) with ``overrides``; an unknown option is named."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown generation option(s) {unknown}; known: {sorted(known)}")
        base = config if config is not None else cls()
        if not isinstance(base, cls):
            raise TypeError(f"config must be a GenerationConfig, got {type(base).__name__}")
        return dataclasses.replace(base, **overrides) if overrides else base


def cache_kind(model_cfg, gen: GenerationConfig) -> tuple[str, Any]:
    """(kind, validated sub-config) of the KV cache a generation uses: the model's kind and options
    updated by the generation's, or the generation's kind with its own options."""
    field = "GenerationConfig.kv_cache_config"
    if gen.kv_cache is None or gen.kv_cache == model_cfg.kv_cache:
        kind = model_cfg.kv_cache
        return kind, KV_CACHE.merge_config(kind, model_cfg.kv_cache_config, gen.kv_cache_config, field=field)
    return gen.kv_cache, KV_CACHE.make_config(gen.kv_cache, gen.kv_cache_config, field=field)


__all__ = ["GenerationConfig", "cache_kind"]
