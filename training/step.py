"""The pure, jitted language-model train step over split NNX state.

The model is split once (``nnx.split(model, nnx.Param, ...)``) into a static ``graphdef``, the
trainable ``params`` and any other variables; the train state is the plain pytree

    {"step": int32[], "params": nnx.State, "opt_state": optax state, "other": nnx.State}

and ``train_step(state, batch) -> (state, metrics)`` is one ``jax.jit`` with explicit in/out
shardings (from the logical-axis rule table, ``sharding.state_shardings``) and the state
donated, so parameters and Adam moments are updated in place.

Loss: masked next-token cross-entropy in float32,
``L = sum_t m_t * (logsumexp(z_t) - z_t[y_t]) / sum_t m_t``, plus the sum of the model's ``aux``
losses (FFN auxiliary losses arrive already weighted by their coefficients). The logits are never
materialised for the whole batch at once when ``loss_chunk > 0``: the final hidden states are
cut into chunks of ``loss_chunk`` tokens, each chunk's logits are produced, reduced to a scalar
and dropped, and ``jax.checkpoint`` recomputes them in the backward pass (memory O(chunk x V)
instead of O(B x T x V)).

Gradient accumulation: the batch [B, T] is viewed as A microbatches (rows ``i, A+i, 2A+i, …`` —
each microbatch keeps the batch sharding); ``lax.scan`` sums the gradients of
``sum_ce_i / N_total`` (N_total = masked tokens of the *whole* batch, known up front), so A
microbatches of b rows give the same gradient as one batch of A·b rows up to float summation
order. Aux losses are averaged over microbatches.

Mixed precision: parameters are stored in ``param_dtype`` (float32) and cast to the model's
compute ``dtype`` inside each layer; gradients, optimizer state and the loss are float32.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from pallasite import sharding as shd
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import Transformer

BATCH_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask")


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


def batch_shardings(mesh, rules, batch_size: int) -> dict:
    s = shd.batch_sharding(mesh, rules, ndim=2, batch_size=batch_size)
    return {k: s for k in BATCH_KEYS}


def put_batch(batch: dict, shardings: dict) -> dict:
    return {k: jax.device_put(np.asarray(batch[k]), shardings[k]) for k in BATCH_KEYS}


# ----------------------------------------------------------------------------- loss
def _head(model: Transformer):
    """(graphdef, state, tied) of the output projection, so chunks can apply it functionally."""
    tied = model.lm_head is None
    g, s = nnx.split(model.embed if tied else model.lm_head)
    return g, s, tied


def _apply_head(g, s, tied, h_ND):
    mod = nnx.merge(g, s)
    return mod.attend(h_ND) if tied else mod(h_ND)


def cross_entropy_sum(model: Transformer, hidden_BTD, targets_BT, mask_BT, chunk: int = 0):
    """sum_t m_t * CE_t in float32 (and sum_t m_t), over the vocab chunk by chunk when chunk > 0."""
    B, T, D = hidden_BTD.shape
    g, s, tied = _head(model)
    h_ND = hidden_BTD.reshape(B * T, D)
    y_N = targets_BT.reshape(B * T)
    m_N = mask_BT.reshape(B * T).astype(jnp.float32)

    def chunk_ce(s, h, y, m):
        logits = _apply_head(g, s, tied, h).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, y[:, None], axis=-1)[:, 0]
        return jnp.sum(m * (lse - picked))

    N = B * T
    if chunk <= 0 or chunk >= N:
        return chunk_ce(s, h_ND, y_N, m_N), jnp.sum(m_N)
    pad = (-N) % chunk
    if pad:  # padded tokens carry mask 0
        h_ND = jnp.concatenate([h_ND, jnp.zeros((pad, D), h_ND.dtype)])
        y_N = jnp.concatenate([y_N, jnp.zeros((pad,), y_N.dtype)])
        m_N = jnp.concatenate([m_N, jnp.zeros((pad,), m_N.dtype)])
    C = (N + pad) // chunk
    ce_chunk = jax.checkpoint(chunk_ce)  # recompute each chunk's logits in the backward pass

    def body(total, xs):
        h, y, m = xs
        return total + ce_chunk(s, h, y, m), None

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                            (h_ND.reshape(C, chunk, D), y_N.reshape(C, chunk), m_N.reshape(C, chunk)))
    return total, jnp.sum(m_N)


def lm_loss(graphdef, params, other, batch: dict, *, loss_chunk: int = 0, normalizer=None, aux_weight: float = 1.0):
    """(loss to differentiate, (ce_sum, token_count, aux dict));
    loss = ce_sum / normalizer + aux_weight * sum(aux)."""
    model = nnx.merge(graphdef, params, other)
    hidden, _, aux = model(batch["tokens"], batch["positions"], segment_ids_BT=batch["segment_ids"],
                           return_hidden=True)
    ce_sum, count = cross_entropy_sum(model, hidden, batch["targets"], batch["loss_mask"], loss_chunk)
    denom = jnp.maximum(count if normalizer is None else normalizer, 1.0)
    aux = {k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}
    loss = ce_sum / denom + aux_weight * sum(aux.values(), jnp.zeros((), jnp.float32))
    return loss, (ce_sum, count, aux)


# ----------------------------------------------------------------------------- step
def train_step(state: dict, batch: dict, *, graphdef, optimizer, schedule: Callable, grad_accum: int = 1,
               loss_chunk: int = 0):
    """One optimizer update (pure). Metrics: loss (masked CE), aux losses, total_loss, grad_norm,
    lr, tokens."""
    params, other = state["params"], state["other"]
    grad_fn = jax.value_and_grad(lm_loss, argnums=1, has_aux=True)
    total_tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))

    if grad_accum <= 1:
        (_, (ce_sum, count, aux)), grads = grad_fn(graphdef, params, other, batch, loss_chunk=loss_chunk,
                                                   normalizer=total_tokens)
    else:
        A = grad_accum
        B = batch["tokens"].shape[0]
        if B % A:
            raise ValueError(f"train.grad_accum={A} must divide the batch size {B}")
        micro = {k: v.reshape(B // A, A, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}

        def body(carry, mb):
            g_acc, ce_acc, n_acc, aux_acc = carry
            (_, (ce, n, aux)), g = grad_fn(graphdef, params, other, mb, loss_chunk=loss_chunk,
                                           normalizer=total_tokens, aux_weight=1.0 / A)
            # aux losses are per-microbatch means: weight 1/A so the sum is their average;
            # the CE part is already normalised by the whole batch's token count.
            g_acc = jax.tree.map(jnp.add, g_acc, g)
            aux_acc = {k: aux_acc[k] + aux[k] / A for k in aux_acc}
            return (g_acc, ce_acc + ce, n_acc + n, aux_acc), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        # aux keys come from one abstract evaluation of the loss (no compute)
        _, (_, _, aux_shape) = jax.eval_shape(
            functools.partial(lm_loss, loss_chunk=loss_chunk), graphdef, params, other,
            jax.tree.map(lambda v: v[0], micro))
        aux0 = {k: jnp.zeros((), jnp.float32) for k in aux_shape}
        (grads, ce_sum, count, aux), _ = jax.lax.scan(body, (zeros, jnp.zeros(()), jnp.zeros(()), aux0), micro)

    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], params)
    params = optax.apply_updates(params, updates)
    loss = ce_sum / jnp.maximum(count, 1.0)
    metrics = {"loss": loss, "total_loss": loss + sum(aux.values(), jnp.zeros(())), "grad_norm": grad_norm,
               "lr": schedule(state["step"]), "tokens": count}
    metrics.update({f"aux/{k}": v for k, v in aux.items()})
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "other": other}
    return new_state, metrics


def make_train_step(graphdef, optimizer, schedule, shardings: dict, mesh, rules, batch_size: int, *,
                    grad_accum: int = 1, loss_chunk: int = 0):
    """Jitted ``step(state, batch_on_device) -> (state, metrics)`` with the state donated.

    Call it inside ``jax.set_mesh(mesh)`` (MoE layers look the mesh up for ``shard_map``)."""
    fn = functools.partial(train_step, graphdef=graphdef, optimizer=optimizer, schedule=schedule,
                           grad_accum=grad_accum, loss_chunk=loss_chunk)
    replicated = NamedSharding(mesh, P())
    return jax.jit(fn, in_shardings=(shardings, batch_shardings(mesh, rules, batch_size)),
                   out_shardings=(shardings, replicated), donate_argnums=(0,))


def make_eval_step(graphdef, shardings: dict, mesh, rules, batch_size: int, *, loss_chunk: int = 0):
    """Jitted ``eval(params, other, batch) -> (ce_sum, token_count)`` (no gradients)."""

    def fn(params, other, batch):
        _, (ce_sum, count, _) = lm_loss(graphdef, params, other, batch, loss_chunk=loss_chunk)
        return ce_sum, count

    replicated = NamedSharding(mesh, P())
    return jax.jit(fn, in_shardings=(shardings["params"], shardings["other"], batch_shardings(mesh, rules, batch_size)),
                   out_shardings=(replicated, replicated))


__all__ = ["split_model", "init_train_state", "abstract_train_state", "attach_shardings", "state_shardings",
           "batch_shardings", "put_batch", "cross_entropy_sum", "lm_loss", "train_step", "make_train_step",
           "make_eval_step", "BATCH_KEYS"]
