"""Experiment-config machinery in the big_vision style (the experiment files live in ``configs/``).

A config file defines ``get_config(arg=None) -> ml_collections.ConfigDict``. ``arg`` is a
short string that shrinks or varies the experiment (``"cpu"``, ``"runlocal"``, or
``"key=value,key2=value2"`` parsed by :func:`parse_arg`). Individual fields are then
overridden from the command line::

    pallasite train --config configs/quickstart.py:cpu --workdir /tmp/q --config.train.steps=200

:func:`load_config` applies ``--config.a.b=value`` overrides *by the type of the existing
value* (bool / int / float / str / tuple / list; ``None`` fields accept a Python literal or
a plain string). An unknown key or a value that does not parse as the expected type raises
:class:`ConfigError` naming the key and the expected type. :func:`train_defaults` is the one
schema every training config starts from, so the loop can rely on every key being present.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import sys
from typing import Any, Iterable, Optional, Sequence

import ml_collections

from pallasite.errors import ConfigError

ConfigDict = ml_collections.ConfigDict


# ----------------------------------------------------------------------------- schema
def train_defaults() -> ConfigDict:
    """Every key the training loop reads, with defaults. Experiment files start here."""
    c = ConfigDict()
    c.seed = 0
    c.model = ConfigDict()  # ModelConfig fields, filled from configs.models presets
    c.tokenizer = ConfigDict(dict(
        path="",  # an HF tokenizer folder; empty -> train a byte-level BPE on the train split
        vocab_size=2048,  # for a freshly trained BPE
        train_max_chars=3_000_000,  # BPE training text budget (first chars of the train docs)
    ))
    c.data = ConfigDict(dict(
        source="stdlib",  # stdlib | text | jsonl
        paths=(),  # files or globs for text / jsonl
        eval_paths=(),  # optional separate held-out files; default: a hashed split of `paths`
        field="text",  # jsonl field holding the document text
        heldout_percent=5,  # documents whose path hash falls below this go to eval
        max_train_bytes=0,  # 0 = all; else a deterministic hashed subset of the train docs
        max_eval_bytes=0,
        seq_len=128,
        batch_size=8,
        eval_batches=4,
    ))
    c.optim = ConfigDict(dict(
        lr=3e-3,
        min_lr_ratio=0.1,  # cosine decays to lr * min_lr_ratio
        warmup_steps=20,
        b1=0.9,
        b2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        clip_norm=1.0,  # 0 disables clipping
        decay_norms=False,
        decay_biases=False,
        decay_embeddings=False,
        moments="float32",  # Adam moments: float32 | fp8 (E4M3 first, FP16 second, per-tensor scales)
    ))
    c.train = ConfigDict(dict(
        steps=100,
        grad_accum=1,  # microbatches per step (batch_size must divide)
        loss_chunk=0,  # tokens per cross-entropy chunk (0 = whole batch at once)
        log_every=10,
        eval_every=50,  # 0 = only at the end
        checkpoint_every=50,  # 0 = only at the end
        keep_checkpoints=2,
        async_checkpointing=True,
        progress=True,
        export_hf=True,
        loss="lm",  # a registered loss kind (pallasite.registry.LOSS)
        loss_config=ConfigDict(),  # its sub-config fields
        sample_prompt="def ",
        sample_tokens=48,
        sample_temperature=0.0,  # 0 = greedy
        sample_top_p=1.0,  # nucleus sampling when < 1 (and temperature > 0)
    ))
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, tensor=1, expert=1))
    c.sharding_rules = ()  # ((logical_axis, mesh_axes), ...) overriding sharding.DEFAULT_RULES
    return c


def parse_arg(arg: Optional[str], **defaults) -> ConfigDict:
    """``"cpu,steps=10"`` -> ConfigDict(cpu=True, steps=10); types follow ``defaults``.

    A bare word sets a bool flag to True. Unknown words fail naming them."""
    out = ConfigDict(dict(defaults))
    if not arg:
        return out
    for item in arg.split(","):
        item = item.strip()
        if not item:
            continue
        key, _, value = item.partition("=")
        if key not in defaults:
            raise ConfigError(f"config arg {key!r} is unknown; expected one of {sorted(defaults)}")
        if not _:
            if not isinstance(defaults[key], bool):
                raise ConfigError(f"config arg {key!r} needs a value ({type(defaults[key]).__name__})")
            out[key] = True
        else:
            out[key] = _parse_value(f"arg.{key}", value, defaults[key])
    return out


# ----------------------------------------------------------------------------- loading
def _packaged_config(path: str) -> Optional[str]:
    """``configs/...py`` (a relative path) -> the installed package's copy, if it has one."""
    parts = os.path.normpath(path).split(os.sep)
    if os.path.isabs(path) or len(parts) < 2 or parts[0] != "configs":
        return None
    candidate = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), *parts)
    return candidate if os.path.isfile(candidate) else None


def _load_module(path_or_module: str):
    if path_or_module.endswith(".py") or os.path.sep in path_or_module or os.path.exists(path_or_module):
        path = os.path.abspath(path_or_module)
        packaged = _packaged_config(path_or_module)
        if not os.path.exists(path) and packaged is not None:
            path = packaged  # `configs/x.py` outside a checkout: the copy shipped in the package
        if not os.path.exists(path):
            raise ConfigError(f"config file {path_or_module!r} does not exist")
        name = "pallasite_config_" + os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    for candidate in (path_or_module, "pallasite.configs." + path_or_module):
        try:
            return importlib.import_module(candidate)
        except ModuleNotFoundError as e:
            if not e.name or not (candidate == e.name or candidate.startswith(e.name + ".")):
                raise  # the config module exists but one of its own imports is missing
    raise ConfigError(f"config {path_or_module!r} is neither a file nor an importable module")


def load_config(path_or_module, arg: Optional[str] = None, overrides: Sequence[str] = ()) -> ConfigDict:
    """Load ``get_config(arg)`` from a file path (``configs/x.py``, optional ``:arg`` suffix),
    a module name, or take a ConfigDict as is; then apply ``--config.a.b=value`` overrides."""
    if isinstance(path_or_module, ConfigDict):
        config = path_or_module
    else:
        spec = str(path_or_module)
        if arg is None and ":" in spec and not os.path.exists(spec):
            spec, arg = spec.rsplit(":", 1)
        module = _load_module(spec)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"config {spec!r} defines no get_config(arg)")
        config = module.get_config(arg) if arg is not None else module.get_config()
        if not isinstance(config, ConfigDict):
            raise ConfigError(f"{spec}: get_config must return an ml_collections.ConfigDict, "
                              f"got {type(config).__name__}")
    return apply_overrides(config, overrides)


def apply_overrides(config: ConfigDict, overrides: Iterable[str]) -> ConfigDict:
    for item in overrides:
        key, sep, value = str(item).partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not of the form --config.key=value")
        key = key.strip()
        for prefix in ("--config.", "config."):
            if key.startswith(prefix):
                key = key[len(prefix):]
                break
        set_value(config, key, value)
    return config


def set_value(config: ConfigDict, dotted_key: str, text: str) -> None:
    """Set ``a.b.c`` from its string form, parsed by the type of the current value."""
    parts = dotted_key.split(".")
    node = config
    for i, part in enumerate(parts[:-1]):
        if not isinstance(node, ConfigDict) or part not in node:
            where = ".".join(parts[:i]) or "<root>"
            raise ConfigError(f"unknown config key {dotted_key!r}: {where} has no field {part!r}; "
                              f"known: {sorted(node.keys()) if isinstance(node, ConfigDict) else []}")
        node = node[part]
    leaf = parts[-1]
    if not isinstance(node, ConfigDict) or leaf not in node:
        parent = ".".join(parts[:-1]) or "<root>"
        known = sorted(node.keys()) if isinstance(node, ConfigDict) else []
        raise ConfigError(f"unknown config key {dotted_key!r}: {parent} has no field {leaf!r}; known: {known}")
    current = node[leaf]
    if isinstance(current, ConfigDict):
        raise ConfigError(f"config key {dotted_key!r} is a group of fields {sorted(current.keys())}; "
                          f"override its fields (e.g. {dotted_key}.{next(iter(current.keys()), 'x')}=...)")
    value = _parse_value(dotted_key, text, current)
    with node.ignore_type():
        node[leaf] = value


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _parse_value(key: str, text: str, current: Any) -> Any:
    text = text.strip()

    def fail(expected: str):
        raise ConfigError(f"config key {key!r} expects {expected} (current value {current!r}), got {text!r}")

    if isinstance(current, bool):
        low = text.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        fail("a bool (true/false)")
    if isinstance(current, int):
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:  # 1e4 style for step counts
                f = float(text)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
            fail("an int")
    if isinstance(current, float):
        try:
            return float(text)
        except ValueError:
            fail("a float")
    if isinstance(current, str):
        return text
    if isinstance(current, (tuple, list)):
        try:
            value = ast.literal_eval(text) if text else ()
        except (ValueError, SyntaxError):
            value = tuple(s.strip() for s in text.split(","))  # a,b,c of plain strings
        if isinstance(value, (str, int, float)):
            value = (value,)
        if not isinstance(value, (tuple, list)):
            fail(f"a {type(current).__name__}")
        return type(current)(value)
    if current is None:
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return None if text.lower() == "none" else text
    fail(type(current).__name__)


def to_json_dict(config: ConfigDict) -> dict:
    """Plain JSON-able dict (tuples -> lists)."""
    import json

    return json.loads(config.to_json())


__all__ = ["ConfigDict", "ConfigError", "load_config", "apply_overrides", "set_value", "parse_arg",
           "train_defaults", "to_json_dict"]
