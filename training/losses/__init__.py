"""Losses over the one train step (``config.train.loss``, registered in ``pallasite.registry.LOSS``).

A loss kind is a ``LossKind``: ``terms(model, batch, config, chunk) -> LossTerms`` for one
(micro)batch and ``normalizer(batch)``, the weight of a whole batch (e.g. its masked tokens), known
before it is split into microbatches. The step differentiates ``Σ total / normalizer + Σ aux``, so
A microbatches give the gradient of the whole batch; the logged ``loss`` is ``Σ total / Σ count``.
``batch_keys`` are the arrays the data pipeline must provide (each ``[B, ...]``, sharded over the
batch axes). Built-in: ``lm`` (masked next-token cross-entropy, ``training/losses/lm.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import struct

LM_BATCH_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask")


@struct.dataclass
class LossTerms:
    total: Any  # float32 scalar: the summed loss of this (micro)batch
    count: Any  # float32 scalar: what ``total`` is a sum over (tokens, pairs, ...)
    aux: dict  # already-weighted scalar losses (FFN auxiliary losses, ...): per-microbatch means
    metrics: dict = struct.field(default_factory=dict)  # logged only: per-microbatch means


@dataclasses.dataclass(frozen=True)
class LossKind:
    terms: Callable[..., LossTerms]  # (model, batch, config, chunk) -> LossTerms
    normalizer: Callable[[dict], Any]  # whole batch -> float32 scalar weight
    batch_keys: tuple = LM_BATCH_KEYS


__all__ = ["LossKind", "LossTerms", "LM_BATCH_KEYS"]
