"""The model a recipe starts from: fresh, or loaded (HF folder, GGUF, orbax, train workdir), then
fully fine-tuned, partially frozen (``trainable`` parameter paths) or LoRA-adapted.

``InitFields`` are the fields every recipe data kind's sub-config shares; ``model_hooks(fields,
config, workdir)`` returns the ``DataSpec`` hooks (``model_config``, ``init_state``,
``abstract_state``, ``export``) and ``finish_save`` (writes the adapters of a LoRA run), so the
loop's one train step sees only a train state whose ``params`` are what should train.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite.models import lora as lora_lib
from pallasite.models.transformer import Transformer
from pallasite.training import step as step_lib


@dataclasses.dataclass(frozen=True)
class InitFields:
    # a model pallasite.load reads (HF folder, .gguf, orbax folder, train workdir); "" = fresh
    init_from: str = ""
    lora_rank: int = 0  # > 0: LoRA adapters of this rank are the only trained parameters
    lora_alpha: float = 16.0
    lora_targets: tuple = lora_lib.DEFAULT_TARGETS  # module-path regexes (models/lora.py)
    trainable: tuple = ()  # full fine-tuning of only these parameter-path regexes; () = all


def lora_config_of(fields: InitFields) -> Optional[lora_lib.LoRAConfig]:
    if fields.lora_rank <= 0:
        return None
    return lora_lib.LoRAConfig(
        rank=fields.lora_rank,
        alpha=fields.lora_alpha,
        targets=tuple(fields.lora_targets),
        trainable=tuple(fields.trainable),
    )


def load_start_model(fields: InitFields):
    """The ``pallasite.Model`` at ``init_from`` (float32 for training), or None (fresh model)."""
    if not fields.init_from:
        return None
    from pallasite.api import load

    if not os.path.exists(fields.init_from):
        raise FileNotFoundError(
            f"data.kind_config.init_from={fields.init_from!r} does not exist; expected an HF "
            "folder, a .gguf file, a pallasite orbax folder or a training workdir"
        )
    return load(fields.init_from, dtype=jnp.float32)


def transform(model, fields: InitFields, seed: int = 0):
    """Apply LoRA or partial freezing to ``model`` in place (full fine-tuning: unchanged)."""
    lcfg = lora_config_of(fields)
    if lcfg is not None:
        return lora_lib.apply_lora(model, lcfg, seed=seed)
    if fields.trainable:
        return lora_lib.freeze(model, fields.trainable, field="data.kind_config.trainable")
    return model


def build_model(cfg, fields: InitFields, loaded, seed: int):
    if loaded is not None:
        model = nnx.merge(
            loaded.graphdef, jax.tree.map(jnp.array, loaded.state)
        )  # a copy: transforms mutate it
    else:
        model = Transformer(cfg, rngs=nnx.Rngs(params=seed))
    return transform(model, fields, seed)


def model_hooks(fields: InitFields, loaded=None) -> dict:
    """``DataSpec`` hooks for starting from ``loaded`` (or fresh) with ``fields``' transform."""

    def build(cfg, optimizer, seed):
        model = build_model(cfg, fields, loaded, seed)
        graphdef, params, other = step_lib.split_model(model)
        state = {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": optimizer.init(params),
            "other": other,
        }
        return graphdef, state

    def init_state(cfg, optimizer, mesh, rules, seed):
        graphdef, state = build(cfg, optimizer, seed)
        shardings = step_lib.state_shardings(state, mesh, rules)
        return graphdef, jax.device_put(state, shardings), shardings

    def abstract_state(cfg, optimizer, mesh, rules, seed):
        graphdef, state = build(cfg, optimizer, seed)
        shardings = step_lib.state_shardings(state, mesh, rules)
        return (
            graphdef,
            step_lib.attach_shardings(jax.eval_shape(lambda: state), shardings),
            shardings,
        )

    def export(cfg, graphdef, state):
        model = nnx.merge(graphdef, state["params"], state["other"])
        model = (
            lora_lib.merge_lora(model) if lora_lib.lora_modules(model) else lora_lib.unfreeze(model)
        )
        return cfg, nnx.state(model)

    hooks: dict[str, Any] = {
        "init_state": init_state,
        "abstract_state": abstract_state,
        "export": export,
    }
    if loaded is not None:
        hooks["model_config"] = loaded.config
    return hooks


def finish_save(fields: InitFields, graphdef, state, workdir: str) -> dict:
    """Save a LoRA run's adapters to ``workdir/adapter``: ``{"adapter_dir": ...}`` (or {})."""
    lcfg = lora_config_of(fields)
    if lcfg is None:
        return {}
    model = nnx.merge(graphdef, state["params"], state["other"])
    return {"adapter_dir": lora_lib.save_adapters(model, os.path.join(workdir, "adapter"), lcfg)}


def trained_model(graphdef, state):
    """The model of a train state with every adapter merged (ready for generation)."""
    model = nnx.merge(graphdef, state["params"], state["other"])
    model = lora_lib.merge_lora(model) if lora_lib.lora_modules(model) else lora_lib.unfreeze(model)
    return model


__all__ = [
    "InitFields",
    "lora_config_of",
    "load_start_model",
    "transform",
    "build_model",
    "model_hooks",
    "finish_save",
    "trained_model",
]
