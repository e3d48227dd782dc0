"""Masked next-token cross-entropy (``loss="lm"``), in float32.

``L = Σ_t m_t (logsumexp(z_t) − z_t[y_t]) / Σ_t m_t`` plus the model's auxiliary losses. With
``chunk > 0`` the logits are never materialised for the whole batch: the final hidden states are cut
into chunks of ``chunk`` tokens, each chunk's logits are produced, reduced to a scalar and dropped,
and ``jax.checkpoint`` recomputes them in the backward pass (memory O(chunk × V)).
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
    """(Σ_t m_t · CE_t, Σ_t m_t) in float32, over the vocab chunk by chunk when chunk > 0."""
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


def lm_terms(model, batch: dict, config=None, chunk: int = 0) -> LossTerms:
    hidden, _, aux = model(batch["tokens"], batch["positions"], segment_ids_BT=batch["segment_ids"],
                           return_hidden=True)
    ce_sum, count = cross_entropy_sum(model, hidden, batch["targets"], batch["loss_mask"], chunk)
    return LossTerms(total=ce_sum, count=count, aux={k: jnp.asarray(v, jnp.float32) for k, v in aux.items()})


def masked_tokens(batch: dict):
    return jnp.sum(batch["loss_mask"].astype(jnp.float32))


LOSS.register("lm", LossKind(terms=lm_terms, normalizer=masked_tokens))

__all__ = ["cross_entropy_sum", "lm_terms", "masked_tokens"]
