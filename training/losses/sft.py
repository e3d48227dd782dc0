"""SFT with response-only loss (``loss="sft"``) and the sequence log-probs post-training shares.

The data kinds of ``training/recipes`` put prompt tokens at ``loss_mask = 0`` (only the response is
learned) and pack several examples per row as segments (``segment_ids`` 1, 2, …; attention never
crosses them; 0 = padding). The loss is ``Σ_t m_t CE_t / Σ_t m_t`` over the response tokens of the
whole batch — the ``lm`` cross-entropy (chunked over the vocabulary when
``train.loss_chunk > 0``), plus the count of response tokens as a metric.

``token_logprobs`` gives log π(y_t | x, y_<t) at every target position (float32, full logits);
``segment_sums`` turns them into per-segment sums: the sequence log-prob ``log π(y | x)`` of each
packed example's response, which DPO (``training/losses/dpo.py``) and the reference pass use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.registry import LOSS
from pallasite.training.losses import LossKind, LossTerms
from pallasite.training.losses.lm import lm_terms, masked_tokens


def forward_logits(model, batch: dict):
    """(float32 logits [B, T, V], aux losses) of a packed batch (segments respected)."""
    logits, _, aux = model(batch["tokens"], batch["positions"], segment_ids_BT=batch["segment_ids"])
    return logits.astype(jnp.float32), aux


def token_logprobs(logits_BTV, targets_BT):
    """``z_y − logsumexp(z)`` per position: the ``lm`` cross-entropy with its sign flipped."""
    lse = jax.nn.logsumexp(logits_BTV, axis=-1)
    picked = jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]
    return picked - lse


def segment_sums(values_BT, segment_ids_BT, mask_BT, n_segments: int):
    """[B, n_segments]: Σ of ``values · mask`` over the positions of segments 1..n of each row."""
    onehot_BTS = jax.nn.one_hot(
        segment_ids_BT - 1, n_segments, dtype=jnp.float32
    )  # segment 0 (pad) -> zeros
    return jnp.einsum("bt,bts->bs", values_BT * mask_BT.astype(jnp.float32), onehot_BTS)


def sequence_logprobs(model, batch: dict, n_segments: int):
    """(log π(response) per segment [B, n_segments], response tokens per segment, aux losses)."""
    logits, aux = forward_logits(model, batch)
    lp = token_logprobs(logits, batch["targets"])
    return (
        segment_sums(lp, batch["segment_ids"], batch["loss_mask"], n_segments),
        segment_sums(jnp.ones_like(lp), batch["segment_ids"], batch["loss_mask"], n_segments),
        aux,
    )


def sft_terms(model, batch: dict, config=None, chunk: int = 0) -> LossTerms:
    terms = lm_terms(model, batch, config, chunk)
    return terms.replace(metrics={"response_tokens": terms.count})


LOSS.register("sft", LossKind(terms=sft_terms, normalizer=masked_tokens))

__all__ = ["forward_logits", "token_logprobs", "segment_sums", "sequence_logprobs", "sft_terms"]
