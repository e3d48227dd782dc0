"""Masked next-token cross-entropy (``loss="lm"``), in float32.

``L = Σ_t m_t (logsumexp(z_t) − z_t[y_t]) / Σ_t m_t`` plus the model's auxiliary losses. With
``chunk > 0`` the logits are never materialised for the whole batch: the final hidden states are cut
into chunks of about ``chunk`` tokens (``chunk // B`` positions of every row), each chunk's logits
are produced, reduced to a scalar and dropped, and ``jax.checkpoint`` recomputes them in the
backward pass (memory O(chunk × V)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite.registry import LOSS
from pallasite.training.losses import LossKind, LossTerms


def _head(model):
    """(graphdef, state, tied) of the output projection, so chunks can apply it functionally."""
    tied = model.lm_head is None
    g, s = nnx.split(model.embed if tied else model.lm_head)
    return g, s, tied


def _apply_head(g, s, tied, h_ND):
    mod = nnx.merge(g, s)
    return mod.attend(h_ND) if tied else mod(h_ND)


def cross_entropy_sum(model, hidden_BTD, targets_BT, mask_BT, chunk: int = 0):
    """(Σ_t m_t · CE_t, Σ_t m_t) in float32, over the vocab chunk by chunk when chunk > 0.

    A chunk is ``max(1, chunk // B)`` positions of *every* sequence ([B, Tc, D]), so each chunk
    keeps the batch axis — and with it the batch sharding: every device works on its own rows in
    every chunk. (Cutting the flattened [B·T] tokens instead gives chunks that live on one
    device each; scanning over them makes XLA gather the whole hidden state onto every chip.)"""
    B, T, D = hidden_BTD.shape
    g, s, tied = _head(model)
    m_BT = mask_BT.astype(jnp.float32)

    def chunk_ce(s, h, y, m):
        logits = _apply_head(g, s, tied, h).astype(jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, y[..., None], axis=-1)[..., 0]
        return jnp.sum(m * (lse - picked))

    Tc = max(1, chunk // B)
    if chunk <= 0 or Tc >= T:
        return chunk_ce(s, hidden_BTD, targets_BT, m_BT), jnp.sum(m_BT)
    pad = (-T) % Tc
    if pad:  # padded positions carry mask 0
        hidden_BTD = jnp.pad(hidden_BTD, ((0, 0), (0, pad), (0, 0)))
        targets_BT = jnp.pad(targets_BT, ((0, 0), (0, pad)))
        m_BT = jnp.pad(m_BT, ((0, 0), (0, pad)))
    C = (T + pad) // Tc
    ce_chunk = jax.checkpoint(chunk_ce)  # recompute each chunk's logits in the backward pass

    def body(total, xs):
        h, y, m = xs
        return total + ce_chunk(s, h, y, m), None

    def by_chunk(x):  # [B, C·Tc, ...] -> [C, B, Tc, ...]
        return jnp.moveaxis(x.reshape(B, C, Tc, *x.shape[2:]), 1, 0)

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                            (by_chunk(hidden_BTD), by_chunk(targets_BT), by_chunk(m_BT)))
    return total, jnp.sum(m_BT)


def lm_terms(model, batch: dict, config=None, chunk: int = 0) -> LossTerms:
    hidden, _, aux = model(batch["tokens"], batch["positions"], segment_ids_BT=batch["segment_ids"],
                           return_hidden=True)
    ce_sum, count = cross_entropy_sum(model, hidden, batch["targets"], batch["loss_mask"], chunk)
    return LossTerms(total=ce_sum, count=count, aux={k: jnp.asarray(v, jnp.float32) for k, v in aux.items()})


def masked_tokens(batch: dict):
    return jnp.sum(batch["loss_mask"].astype(jnp.float32))


LOSS.register("lm", LossKind(terms=lm_terms, normalizer=masked_tokens))

__all__ = ["cross_entropy_sum", "lm_terms", "masked_tokens"]
