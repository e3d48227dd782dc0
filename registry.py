"""Registries: every seam of pallasite accepts exactly the kinds registered with it.

    from pallasite.registry import FFN
    FFN.register("my_ffn", MyFFN, config=MyFFNConfig)   # ModelConfig(ffn="my_ffn", ffn_config=MyFFNConfig())
    FFN.get("my_ffn")                                    # MyFFN; an unknown kind names the known ones

One ``Registry`` per seam: ``FFN`` (``ModelConfig.ffn``), ``LINEAR`` (``.linear``), ``KV_CACHE``
(``.kv_cache`` / generation), ``ATTENTION`` (``.attention_impl``), ``DECODE_STRATEGY``, ``LOSS``
(``config.train.loss``), the checkpoint mappings ``HF_MODEL_TYPE`` / ``HF_FFN``, and ``CONSTRAINT``
(grammar kinds of ``GenerationConfig.constraint``). A kind may carry a sub-config class: the
seam's ``*_config`` field must be an instance of it, and a mapping is validated into one (unknown
fields are named).

The built-in kinds are found lazily through ``BUILTIN_KINDS`` (kind -> the module that registers
it, imported by name on first use): this module imports nothing from the package but
``pallasite.errors`` (which imports nothing), so every other module may import it without a
cycle, and the core modules never name a method.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Mapping, Optional

from pallasite.errors import ConfigError, UserError

# seam -> kind -> module that registers it (imported on first lookup of that kind)
BUILTIN_KINDS: dict[str, dict[str, str]] = {
    "ffn": {"dense": "pallasite.models.ffn", "moe": "pallasite.models.moe", "mole": "pallasite.models.mole"},
    "linear": {"float": "pallasite.models.layers", "w4a4": "pallasite.models.quantized",
               "fp4": "pallasite.models.fp4", "panels": "pallasite.models.panel_linear"},
    "kv_cache": {"dense": "pallasite.inference.cache.dense", "kv4": "pallasite.inference.cache.kv4",
                 "catekv": "pallasite.inference.cache.catekv"},
    "attention": {"ref": "pallasite.ops.attention", "pallas": "pallasite.ops.attention"},
    "decode_strategy": {"sample": "pallasite.inference.engine",
                        "speculative": "pallasite.inference.speculative.build",
                        "lookup": "pallasite.inference.speculative.lookup",
                        "constrained": "pallasite.inference.constrained.strategy"},
    "loss": {"lm": "pallasite.training.losses.lm", "sft": "pallasite.training.losses.sft",
             "dpo": "pallasite.training.losses.dpo", "overtone": "pallasite.training.losses.overtone"},
    "hf_model_type": {**{t: "pallasite.models.hf_config" for t in ("llama", "mistral", "qwen2", "qwen3",
                                                                   "gemma3_text")},
                      **{t: "pallasite.models.hf_moe" for t in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")}},
    "hf_ffn": {"dense": "pallasite.models.hf", "moe": "pallasite.models.hf_moe"},
    "constraint": {k: "pallasite.inference.constrained.grammars" for k in ("lark", "ebnf", "json_schema", "regex")},
}


class UnknownKindError(UserError, ValueError):
    """A kind that no module registered (the message names the seam and the known kinds)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str
    value: Any
    config: Optional[type] = None  # sub-config dataclass, or None: the kind takes no options
    aliases: tuple = ()  # (short name, field) pairs accepted when building the sub-config


class Registry:
    """Kinds of one seam: ``register`` (also as a decorator), ``get``, ``names``, ``make_config``."""

    def __init__(self, seam: str, builtins: Optional[Mapping[str, str]] = None):
        self.seam = seam
        self._entries: dict[str, Entry] = {}
        self._builtins = dict(builtins or {})

    # ----------------------------------------------------------------- registration
    def register(self, kind: str, value: Any = None, *, config: Optional[type] = None,
                 aliases: Optional[Mapping[str, str]] = None, replace: bool = False):
        """Register ``value`` under ``kind``; without ``value`` returns a decorator."""
        if value is None:
            def deco(obj):
                self.register(kind, obj, config=config, aliases=aliases, replace=replace)
                return obj
            return deco
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"{self.seam} registry: a kind must be a non-empty string, got {kind!r}")
        if config is not None and not dataclasses.is_dataclass(config):
            raise TypeError(f"{self.seam} kind {kind!r}: config must be a dataclass, got {config!r}")
        old = self._entries.get(kind)
        if old is not None and not replace and old.value is not value:
            raise ValueError(f"{self.seam} kind {kind!r} is already registered ({old.value!r}); "
                             "pass replace=True to override it")
        self._entries[kind] = Entry(kind, value, config, tuple(sorted((aliases or {}).items())))
        return value

    def unregister(self, kind: str) -> None:
        self._entries.pop(kind, None)

    # ----------------------------------------------------------------- lookup
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(set(self._entries) | set(self._builtins)))

    def __contains__(self, kind) -> bool:
        return kind in self._entries or kind in self._builtins

    def entry(self, kind: str, *, field: Optional[str] = None) -> Entry:
        if kind not in self._entries and kind in self._builtins:
            importlib.import_module(self._builtins[kind])  # the module registers its kinds
            if kind not in self._entries:
                raise RuntimeError(f"{self._builtins[kind]} was imported but did not register "
                                   f"{self.seam} kind {kind!r}")
        if kind not in self._entries:
            self.check(kind, field=field)
        return self._entries[kind]

    def get(self, kind: str, *, field: Optional[str] = None) -> Any:
        return self.entry(kind, field=field).value

    def check(self, kind: Any, *, field: Optional[str] = None) -> None:
        """Raise ``UnknownKindError`` naming the known kinds unless ``kind`` is registered."""
        if kind not in self:
            where = field or self.seam
            raise UnknownKindError(f"{where}={kind!r} is not a registered {self.seam} kind; "
                                   f"known: {', '.join(self.names())}")

    # ----------------------------------------------------------------- sub-configs
    def make_config(self, kind: str, value: Any, *, field: Optional[str] = None):
        """The sub-config of ``kind`` from ``value``: None -> the class's defaults (or None when the kind
        takes no options), a mapping -> validated into the class, an instance -> itself."""
        e = self.entry(kind, field=field)
        where = field or f"{self.seam} config"
        if e.config is None:
            if value is None or (isinstance(value, Mapping) and not value):
                return None
            raise ConfigError(f"{where}: {self.seam} kind {kind!r} takes no options; got {value!r}")
        if value is None:
            return e.config()
        if isinstance(value, e.config):
            return value
        if isinstance(value, Mapping):
            return config_from_mapping(e.config, value, where=where, aliases=dict(e.aliases))
        raise TypeError(f"{where} must be a {e.config.__name__} (or a mapping of its fields) for "
                        f"{self.seam} kind {kind!r}; got {type(value).__name__}")


    def merge_config(self, kind: str, base: Any, overrides: Any, *, field: Optional[str] = None):
        """``base`` (a sub-config of ``kind`` or None) updated with ``overrides`` (a mapping, an
        instance — which replaces ``base`` — or None)."""
        if overrides is None or not isinstance(overrides, Mapping) or base is None:
            return self.make_config(kind, base if overrides is None else overrides, field=field)
        e = self.entry(kind, field=field)
        aliases = dict(e.aliases)
        merged = {**config_to_dict(self.make_config(kind, base, field=field)),
                  **{aliases.get(k, k): v for k, v in overrides.items()}}
        return self.make_config(kind, merged, field=field)


def config_from_mapping(cls: type, value: Mapping, *, where: str, aliases: Optional[Mapping[str, str]] = None):
    """``cls(**value)`` with unknown keys named; lists become tuples (configs stay hashable)."""
    aliases = dict(aliases or {})
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, v in value.items():
        if key == "__kind__":  # written by older pallasite versions
            continue
        name = aliases.get(key, key)
        if name not in fields:
            known = sorted(fields | set(aliases))
            raise ConfigError(f"{where}: unknown key {key!r}; known keys are {known}")
        kwargs[name] = tuple(v) if isinstance(v, list) else v
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as e:  # the sub-config's own validation of a user's values
        if isinstance(e, UserError):
            raise
        raise ConfigError(f"{where}: {e}") from e


def config_to_dict(value: Any) -> Any:
    """A sub-config as a JSON-ready dict (None stays None)."""
    if value is None:
        return None
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(value).items()}


FFN = Registry("ffn", BUILTIN_KINDS["ffn"])
LINEAR = Registry("linear", BUILTIN_KINDS["linear"])
KV_CACHE = Registry("kv_cache", BUILTIN_KINDS["kv_cache"])
ATTENTION = Registry("attention", BUILTIN_KINDS["attention"])
DECODE_STRATEGY = Registry("decode_strategy", BUILTIN_KINDS["decode_strategy"])
LOSS = Registry("loss", BUILTIN_KINDS["loss"])
HF_MODEL_TYPE = Registry("hf_model_type", BUILTIN_KINDS["hf_model_type"])  # config.json model_type -> ModelTypeSpec
HF_FFN = Registry("hf_ffn", BUILTIN_KINDS["hf_ffn"])  # ffn kind -> (to_hf_fn, from_hf_fn) tensor mapping
CONSTRAINT = Registry("constraint", BUILTIN_KINDS["constraint"])  # grammar kind -> source -> llguidance grammar

REGISTRIES: dict[str, Registry] = {r.seam: r for r in (FFN, LINEAR, KV_CACHE, ATTENTION, DECODE_STRATEGY, LOSS,
                                                        HF_MODEL_TYPE, HF_FFN, CONSTRAINT)}


def lookup(seam: str) -> Registry:
    if seam not in REGISTRIES:
        raise UnknownKindError(f"no registry for seam {seam!r}; known: {', '.join(sorted(REGISTRIES))}")
    return REGISTRIES[seam]


__all__ = ["Registry", "Entry", "UnknownKindError", "BUILTIN_KINDS", "FFN", "LINEAR", "KV_CACHE", "ATTENTION",
           "DECODE_STRATEGY", "LOSS", "HF_MODEL_TYPE", "HF_FFN", "CONSTRAINT", "REGISTRIES", "lookup",
           "config_from_mapping", "config_to_dict"]

