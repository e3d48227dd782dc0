"""LoRA (Hu et al. 2022) as a params transform on the module tree, plus freezing by path.

    model = apply_lora(model, LoRAConfig(rank=8, alpha=16, targets=("attn/(q|v)_proj",)))
    ...train: only lora_a / lora_b are nnx.Param; every other weight is Frozen (the state's "other")
    save_adapters(model, "adapter/"); model2 = load_adapters(base_model, "adapter/")
    served = merge_lora(model)            # plain float linears, W' = W + (alpha / rank) * A @ B

Each targeted float ``Linear`` (module path, e.g. ``layers/0/attn/q_proj``, matched with
``re.search`` against every pattern of ``targets``) becomes a ``LoRALinear``: y = x W (+ b) +
(alpha / r) · (x A) B with A [in, r] ~ N(0, 1/in) and B [r, out] = 0 (so the model is unchanged at
step 0). W and b keep their names and become ``Frozen`` — a variable kind the train step's split
(``nnx.split(model, nnx.Param, ...)``) puts into the non-trained collection, so the one train step
trains only the adapters, with no optimizer mask. ``freeze(model, trainable=...)`` applies the
same mechanism without adapters (full fine-tuning of chosen modules, e.g. one MLP for editing).
Why a transform and not a ``LINEAR`` kind: targets are module paths, which a linear constructor
never sees, and LoRA must also freeze embeddings and norms that no linear kind owns.
Scanned (stacked) layers work: the factors carry the same leading layer axis as the kernel.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.errors import ConfigError, DataError
from pallasite.models.layers import Linear, LinearBase

DEFAULT_TARGETS = ("attn/(q|k|v|o)_proj", "ffn/(gate|up|down)_proj")
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


class Frozen(nnx.Variable):
    """A weight held fixed during training (not an ``nnx.Param``: the train step does not
    differentiate it). ``unfreeze`` turns it back into a Param."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    rank: int = 8
    alpha: float = 16.0
    targets: tuple = DEFAULT_TARGETS  # regexes searched in module paths ("layers/0/attn/q_proj")
    trainable: tuple = ()  # regexes of other parameter paths that stay trainable ("final_norm")

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "trainable", tuple(self.trainable))
        if int(self.rank) < 1:
            raise ConfigError(f"LoRAConfig.rank must be >= 1, got {self.rank!r}")
        if not self.targets:
            raise ConfigError("LoRAConfig.targets is empty; name at least one module path pattern")

    @property
    def scale(self) -> float:
        return float(self.alpha) / float(self.rank)


class LoRALinear(LinearBase):
    """A float linear with a frozen kernel (and bias) plus a trainable low-rank update."""

    def __init__(self, linear: Linear, *, rank: int, alpha: float, rngs: nnx.Rngs):
        kernel = linear.kernel
        lead, (d_in, d_out) = kernel.shape[:-2], kernel.shape[-2:]
        axes = tuple(kernel.get_metadata().get("logical_axes", (None, None)))[-2:]
        self.in_features, self.out_features, self.dtype = d_in, d_out, linear.dtype
        self.rank, self.alpha = int(rank), float(alpha)
        self.kernel = Frozen(kernel[...], **kernel.get_metadata())
        self.bias = (
            None if linear.bias is None else Frozen(linear.bias[...], **linear.bias.get_metadata())
        )
        a = jax.random.normal(rngs.params(), (*lead, d_in, self.rank), jnp.float32) / np.sqrt(d_in)
        self.lora_a = nnx.Param(a.astype(kernel[...].dtype), logical_axes=(axes[0], None))
        self.lora_b = nnx.Param(
            jnp.zeros((*lead, self.rank, d_out), kernel[...].dtype), logical_axes=(None, axes[1])
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        y = jnp.dot(x.astype(dt), self.kernel[...].astype(dt), preferred_element_type=jnp.float32)
        xa = jnp.dot(x.astype(dt), self.lora_a[...].astype(dt), preferred_element_type=jnp.float32)
        y = y + (self.alpha / self.rank) * jnp.dot(
            xa.astype(dt), self.lora_b[...].astype(dt), preferred_element_type=jnp.float32
        )
        y = y.astype(dt)
        if self.bias is not None:
            y = y + self.bias[...].astype(dt)
        return y

    def merged_kernel(self) -> jax.Array:
        k = self.kernel[...]
        delta = jnp.einsum(
            "...ir,...ro->...io",
            self.lora_a[...].astype(jnp.float32),
            self.lora_b[...].astype(jnp.float32),
        )
        return (k.astype(jnp.float32) + (self.alpha / self.rank) * delta).astype(k.dtype)


# ----------------------------------------------------------------------------- tree helpers
def _path_str(path) -> str:
    return "/".join(str(p) for p in path)


def _parent_and_key(model, path):
    parent = model
    for p in path[:-1]:
        parent = parent[p] if isinstance(p, int) else getattr(parent, p)
    return parent, path[-1]


def _set_child(model, path, value) -> None:
    parent, key = _parent_and_key(model, path)
    if isinstance(key, int):
        parent[key] = value
    else:
        setattr(parent, key, value)


def linear_paths(model) -> list[str]:
    """Paths of every linear module (any kind) in ``model``."""
    return [_path_str(p) for p, m in nnx.iter_modules(model) if isinstance(m, LinearBase)]


def _variables(model):
    """(module path, attribute, Variable) of every variable held directly by a module."""
    for path, module in nnx.iter_modules(model):
        for name, value in list(vars(module).items()):
            if isinstance(value, nnx.Variable):
                yield path, name, value


def _compile(patterns: Sequence[str], field: str):
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ConfigError(f"{field}: {p!r} is not a valid regular expression ({e})") from None
    return out


def freeze(model, trainable: Sequence[str] = (), *, field: str = "trainable"):
    """Turn every ``nnx.Param`` whose path (``module/path/name``) matches none of ``trainable`` into
    ``Frozen`` (in place; returns ``model``). A pattern that matches no parameter is an error."""
    pats = _compile(trainable, field)
    hits = [0] * len(pats)
    for path, name, var in list(_variables(model)):
        if not isinstance(var, nnx.Param):
            continue
        full = _path_str((*path, name))
        keep = [i for i, p in enumerate(pats) if p.search(full)]
        for i in keep:
            hits[i] += 1
        if not keep:
            module = model if not path else _get(model, path)
            setattr(module, name, Frozen(var[...], **var.get_metadata()))
    for p, n in zip(trainable, hits):
        if n == 0:
            raise ConfigError(
                f"{field}: pattern {p!r} matches no parameter; parameters look like "
                f"{', '.join(_param_paths(model)[:6])}, ..."
            )
    return model


def _get(model, path):
    node = model
    for p in path:
        node = node[p] if isinstance(p, int) else getattr(node, p)
    return node


def _param_paths(model) -> list[str]:
    return [_path_str((*p, n)) for p, n, v in _variables(model)]


def unfreeze(model):
    """Every ``Frozen`` variable back to an ``nnx.Param`` (in place; returns ``model``)."""
    for path, name, var in list(_variables(model)):
        if isinstance(var, Frozen):
            setattr(
                _get(model, path) if path else model,
                name,
                nnx.Param(var[...], **var.get_metadata()),
            )
    return model


def apply_lora(model, config: LoRAConfig, *, seed: int = 0):
    """Wrap every float linear whose path matches ``config.targets`` in a ``LoRALinear`` and freeze
    every other parameter except ``config.trainable`` (in place; returns ``model``). A target that
    matches no linear module, or matches a non-float linear, is an error naming it."""
    if not isinstance(config, LoRAConfig):
        raise TypeError(f"apply_lora: config must be a LoRAConfig, got {type(config).__name__}")
    pats = _compile(config.targets, "LoRAConfig.targets")
    linears = [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, LinearBase)]
    if any(isinstance(m, LoRALinear) for _, m in linears):
        raise ValueError("apply_lora: the model already carries LoRA adapters (merge_lora first)")
    chosen, hits = [], [0] * len(pats)
    for path, module in linears:
        s = _path_str(path)
        matched = [i for i, p in enumerate(pats) if p.search(s)]
        for i in matched:
            hits[i] += 1
        if matched:
            if type(module) is not Linear:
                raise ConfigError(
                    f"LoRA target {s!r} is a {type(module).__name__}; LoRA wraps float linears only"
                )
            chosen.append((path, module))
    for p, n in zip(config.targets, hits):
        if n == 0:
            shown = ", ".join(_path_str(q) for q, _ in linears[:8])
            raise ConfigError(
                f"LoRA target {p!r} matches no module; linear modules are {shown}"
                f"{', ...' if len(linears) > 8 else ''}"
            )
    freeze(model, config.trainable, field="LoRAConfig.trainable")
    rngs = nnx.Rngs(params=seed)
    for path, module in chosen:
        _set_child(model, path, LoRALinear(module, rank=config.rank, alpha=config.alpha, rngs=rngs))
    model.__dict__["_lora_config"] = (
        config  # plain attribute (not graph state): remembered for saving
    )
    return model


def lora_modules(model) -> list[tuple[str, LoRALinear]]:
    return [(_path_str(p), m) for p, m in nnx.iter_modules(model) if isinstance(m, LoRALinear)]


def merge_lora(model):
    """Fold every adapter into its kernel (W + (alpha/r) A B), restore plain float linears and make
    every parameter trainable again: the model has the original structure (in place; returns it)."""
    for path, module in [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, LoRALinear)]:
        ns = types.SimpleNamespace(
            dtype=str(module.dtype), param_dtype=str(module.kernel[...].dtype)
        )
        lin = Linear(
            1, 1, cfg=ns, axes=(None, None), use_bias=module.bias is not None, rngs=nnx.Rngs(0)
        )
        lin.in_features, lin.out_features = module.in_features, module.out_features
        lin.kernel = nnx.Param(module.merged_kernel(), **module.kernel.get_metadata())
        lin.bias = (
            None
            if module.bias is None
            else nnx.Param(module.bias[...], **module.bias.get_metadata())
        )
        _set_child(model, path, lin)
    model.__dict__.pop("_lora_config", None)
    return unfreeze(model)


# ----------------------------------------------------------------------------- adapters on disk
def adapter_arrays(model) -> dict[str, np.ndarray]:
    out = {}
    for path, m in lora_modules(model):
        out[f"{path}/lora_a"] = np.asarray(jax.device_get(m.lora_a[...]))
        out[f"{path}/lora_b"] = np.asarray(jax.device_get(m.lora_b[...]))
    return out


def save_adapters(model, directory: str, config: LoRAConfig | None = None) -> str:
    """Write the adapters (safetensors) and their config (JSON, with the wrapped module paths)."""
    from safetensors.numpy import save_file

    config = config or model.__dict__.get("_lora_config")
    if config is None:
        raise ValueError("save_adapters: the model carries no LoRA adapters (apply_lora first)")
    os.makedirs(directory, exist_ok=True)
    arrays = adapter_arrays(model)
    save_file(arrays, os.path.join(directory, ADAPTER_WEIGHTS))
    meta = {**dataclasses.asdict(config), "modules": [p for p, _ in lora_modules(model)]}
    meta = {k: (list(v) if isinstance(v, tuple) else v) for k, v in meta.items()}
    with open(os.path.join(directory, ADAPTER_CONFIG), "w") as f:
        json.dump(meta, f, indent=1)
    return directory


def load_adapters(model, directory: str):
    """Apply the saved LoRA config to ``model`` (a base model) and load the saved factors."""
    from safetensors.numpy import load_file

    cfg_path = os.path.join(directory, ADAPTER_CONFIG)
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"load_adapters: no {ADAPTER_CONFIG} in {directory!r}")
    with open(cfg_path) as f:
        meta = json.load(f)
    saved_modules = meta.pop("modules")
    config = LoRAConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in meta.items()})
    apply_lora(model, config)
    got = [p for p, _ in lora_modules(model)]
    if got != saved_modules:
        raise DataError(
            f"load_adapters: the adapters in {directory!r} were saved for modules "
            f"{saved_modules[:4]}..., "
            f"this model's targets give {got[:4]}..."
        )
    arrays = load_file(os.path.join(directory, ADAPTER_WEIGHTS))
    for path, m in lora_modules(model):
        for name in ("lora_a", "lora_b"):
            value = arrays[f"{path}/{name}"]
            var = getattr(m, name)
            if tuple(value.shape) != tuple(var.shape):
                raise DataError(
                    f"load_adapters: {path}/{name} has shape {value.shape} in {directory!r}, "
                    f"the model expects {tuple(var.shape)} (different rank or model)"
                )
            var[...] = jnp.asarray(value, var[...].dtype)
    return model


__all__ = [
    "Frozen",
    "LoRAConfig",
    "LoRALinear",
    "DEFAULT_TARGETS",
    "apply_lora",
    "merge_lora",
    "freeze",
    "unfreeze",
    "lora_modules",
    "linear_paths",
    "adapter_arrays",
    "save_adapters",
    "load_adapters",
]
