"""The pure, jitted train step over split NNX state, for any registered loss kind.

The model is split once (``nnx.split(model, nnx.Param, ...)``) into a static ``graphdef``, the
trainable ``params`` and any other variables; the train state is the plain pytree
``{"step", "params", "opt_state", "other"}`` and ``train_step(state, batch) -> (state, metrics)`` is
one ``jax.jit`` with explicit in/out shardings (from the logical-axis rule table) and the state
donated. The loss (``training/losses``, ``LOSS.get(kind)``) gives per-(micro)batch terms; gradient
accumulation views the batch [B, ...] as A microbatches (rows ``i, A+i, 2A+i, …`` keep the batch
sharding) and ``lax.scan`` sums the gradients of ``total_i / normalizer(whole batch)``, so A
microbatches of b rows give the gradient of one batch of A·b rows up to float summation order; aux
losses and extra metrics are averaged over microbatches. Parameters are stored in ``param_dtype``
and cast to the compute dtype inside each layer; gradients, optimizer state and the loss are float32.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallasite import sharding as shd
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import Transformer
from pallasite.registry import LOSS
from pallasite.training.losses import LM_BATCH_KEYS, LossKind


# ----------------------------------------------------------------------------- state
def split_model(model: nnx.Module):
    """(graphdef, params, other) — the one split every loop uses."""
    return nnx.split(model, nnx.Param, ...)


def _build_state(cfg: ModelConfig, optimizer: optax.GradientTransformation, seed: int):
    model = Transformer(cfg, rngs=nnx.Rngs(params=seed))
    graphdef, params, other = split_model(model)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params), "other": other}
    return graphdef, state


def _indexable(abstract: Any) -> Any:
    # sharding.state_shardings reads ``var[...]``, which ShapeDtypeStruct does not support: stand in
    # zero-stride numpy views (no memory) with the same shape and dtype.
    return jax.tree.map(lambda a: np.broadcast_to(np.zeros((), a.dtype), a.shape)
                        if isinstance(a, jax.ShapeDtypeStruct) else a, abstract)


def state_shardings(abstract_state: dict, mesh, rules) -> dict:
    """Shardings (a pytree prefix of the state) from the parameters' logical axes."""
    abstract_state = _indexable(abstract_state)
    return {
        "step": NamedSharding(mesh, P()),
        "params": shd.state_shardings(abstract_state["params"], mesh, rules),
        "opt_state": shd.state_shardings(abstract_state["opt_state"], mesh, rules),
        "other": shd.state_shardings(abstract_state["other"], mesh, rules),
    }


def abstract_train_state(cfg: ModelConfig, optimizer, mesh, rules, seed: int = 0):
    """(graphdef, abstract state with shardings attached, shardings) — allocates nothing; the
    restore target for checkpoints."""
    graphdef, abstract = jax.eval_shape(lambda: _build_state(cfg, optimizer, seed))
    shardings = state_shardings(abstract, mesh, rules)
    return graphdef, attach_shardings(abstract, shardings), shardings


def attach_shardings(abstract: Any, shardings_prefix: Any) -> Any:
    """ShapeDtypeStructs carrying the shardings of a prefix tree (NamedSharding per Variable)."""
    def one(sharding, subtree):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), subtree)

    return jax.tree.map(one, shardings_prefix, abstract, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))


def init_train_state(cfg: ModelConfig, optimizer, mesh, rules, seed: int = 0):
    """(graphdef, sharded train state, shardings): initialised directly into its shardings."""
    graphdef, _, shardings = abstract_train_state(cfg, optimizer, mesh, rules, seed)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: _build_state(cfg, optimizer, seed)[1], out_shardings=shardings)()
    return graphdef, state, shardings


def batch_shardings(mesh, rules, batch_size: int, keys=LM_BATCH_KEYS) -> dict:
    """The sharding of each batch array ``[B, ...]``: batch axis over the data axes (a prefix spec,
    so arrays of any rank share it)."""
    s = shd.batch_sharding(mesh, rules, ndim=1, batch_size=batch_size)
    return {k: s for k in keys}


def put_batch(batch: dict, shardings: dict) -> dict:
    missing = sorted(set(shardings) - set(batch))
    if missing:
        raise KeyError(f"the batch lacks {missing}; the loss needs {sorted(shardings)}")
    return {k: jax.device_put(np.asarray(batch[k]), shardings[k]) for k in shardings}


# ----------------------------------------------------------------------------- loss
def loss_value(graphdef, params, other, batch: dict, *, loss: LossKind, loss_config=None, chunk: int = 0,
               normalizer=None, aux_weight: float = 1.0):
    """(value to differentiate, LossTerms): ``total / normalizer + aux_weight · Σ aux``."""
    model = nnx.merge(graphdef, params, other)
    terms = loss.terms(model, batch, loss_config, chunk)
    denom = jnp.maximum(terms.count if normalizer is None else normalizer, 1.0)
    value = terms.total / denom + aux_weight * sum(terms.aux.values(), jnp.zeros((), jnp.float32))
    return value, terms


# ----------------------------------------------------------------------------- step
def train_step(state: dict, batch: dict, *, graphdef, optimizer, schedule: Callable, loss: LossKind,
               loss_config=None, grad_accum: int = 1, loss_chunk: int = 0):
    """One optimizer update (pure). Metrics: loss, aux losses, extra loss metrics, total_loss,
    grad_norm, lr, tokens (the loss's count)."""
    params, other = state["params"], state["other"]
    grad_fn = jax.value_and_grad(loss_value, argnums=1, has_aux=True)
    kw = dict(loss=loss, loss_config=loss_config, chunk=loss_chunk, normalizer=loss.normalizer(batch))

    if grad_accum <= 1:
        (_, terms), grads = grad_fn(graphdef, params, other, batch, **kw)
        total, count, aux, extra = terms.total, terms.count, terms.aux, terms.metrics
    else:
        A = grad_accum
        B = batch[loss.batch_keys[0]].shape[0]
        if B % A:
            raise ValueError(f"train.grad_accum={A} must divide the batch size {B}")
        micro = {k: v.reshape(B // A, A, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}

        def body(carry, mb):
            g_acc, t_acc, n_acc, aux_acc, m_acc = carry
            # aux losses are per-microbatch means: weight 1/A so the sum is their average;
            # the loss itself is already normalised by the whole batch's normalizer.
            (_, terms), g = grad_fn(graphdef, params, other, mb, aux_weight=1.0 / A, **kw)
            g_acc = jax.tree.map(jnp.add, g_acc, g)
            aux_acc = {k: aux_acc[k] + terms.aux[k] / A for k in aux_acc}
            m_acc = {k: m_acc[k] + terms.metrics[k] / A for k in m_acc}
            return (g_acc, t_acc + terms.total, n_acc + terms.count, aux_acc, m_acc), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        # aux / metric keys come from one abstract evaluation of the loss (no compute)
        _, shape = jax.eval_shape(functools.partial(loss_value, **kw), graphdef, params, other,
                                  jax.tree.map(lambda v: v[0], micro))
        zero = lambda d: {k: jnp.zeros((), jnp.float32) for k in d}  # noqa: E731
        init = (zeros, jnp.zeros(()), jnp.zeros(()), zero(shape.aux), zero(shape.metrics))
        (grads, total, count, aux, extra), _ = jax.lax.scan(body, init, micro)

    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    params = optax.apply_updates(params, updates)
    value = total / jnp.maximum(count, 1.0)
    metrics = {"loss": value, "total_loss": value + sum(aux.values(), jnp.zeros(())), "grad_norm": grad_norm,
               "lr": schedule(state["step"]), "tokens": count}
    metrics.update({f"aux/{k}": v for k, v in aux.items()})
    metrics.update({f"loss/{k}": v for k, v in extra.items()})
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "other": other}
    return new_state, metrics


def make_train_step(graphdef, optimizer, schedule, shardings: dict, mesh, rules, batch_size: int, *,
                    loss: Optional[LossKind] = None, loss_config=None, grad_accum: int = 1, loss_chunk: int = 0):
    """Jitted ``step(state, batch_on_device) -> (state, metrics)`` with the state donated.

    Call it inside ``jax.set_mesh(mesh)`` (MoE layers look the mesh up for ``shard_map``)."""
    loss = loss or LOSS.get("lm")
    step = functools.partial(train_step, graphdef=graphdef, optimizer=optimizer, schedule=schedule, loss=loss,
                             loss_config=loss_config, grad_accum=grad_accum, loss_chunk=loss_chunk)

    def fn(state, batch):
        with shd.activation_rules(rules):  # the model's activation constraints follow the config's table
            return step(state, batch)

    replicated = NamedSharding(mesh, P())
    return jax.jit(fn, in_shardings=(shardings, batch_shardings(mesh, rules, batch_size, loss.batch_keys)),
                   out_shardings=(shardings, replicated), donate_argnums=(0,))


def make_eval_step(graphdef, shardings: dict, mesh, rules, batch_size: int, *, loss: Optional[LossKind] = None,
                   loss_config=None, loss_chunk: int = 0):
    """Jitted ``eval(params, other, batch) -> (total, count)`` (no gradients)."""
    loss = loss or LOSS.get("lm")

    def fn(params, other, batch):
        with shd.activation_rules(rules):
            _, terms = loss_value(graphdef, params, other, batch, loss=loss, loss_config=loss_config, chunk=loss_chunk)
        return terms.total, terms.count

    replicated = NamedSharding(mesh, P())
    return jax.jit(fn, in_shardings=(shardings["params"], shardings["other"],
                                     batch_shardings(mesh, rules, batch_size, loss.batch_keys)),
                   out_shardings=(replicated, replicated))


__all__ = ["split_model", "init_train_state", "abstract_train_state", "attach_shardings", "state_shardings",
           "batch_shardings", "put_batch", "loss_value", "train_step", "make_train_step", "make_eval_step"]
