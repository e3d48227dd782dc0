"""Token selection from next-token logits: greedy, temperature, top-k, top-p (nucleus) and
their combinations, as pure functions over ``[B, V]`` float logits with explicit PRNG keys.

Every parameter is per row (an array ``[B]`` or a scalar broadcast to it), so one compiled
step serves a batch whose rows ask for different temperatures / k / p. Semantics follow
Hugging Face ``transformers`` (``TemperatureLogitsWarper``, ``TopKLogitsWarper``,
``TopPLogitsWarper``) and apply in the same order: temperature, then top-k, then top-p.

* greedy: ``argmax`` (first index on ties, like ``torch.argmax``).
* temperature ``t``: logits / t. ``t == 0`` means greedy for that row.
* top-k: keep the tokens whose logit is >= the k-th largest logit (ties at the k-th value are
  kept, as in HF); ``k <= 0`` or ``k >= V`` disables it for that row.
* top-p: sort descending, keep the smallest prefix whose cumulative probability reaches
  ``p`` — token i is kept iff the probability mass strictly before it is < p — so at least one
  token always survives. This is HF's rule (drop a token iff the ascending cumulative mass up
  to and including it is <= 1 - p), rewritten in descending order. Deviation: tokens whose
  logit ties the smallest kept logit are kept too (HF breaks such ties by sort order).
  ``p >= 1`` disables it for that row.

Masked tokens get ``-inf``; sampling is ``jax.random.categorical`` (Gumbel-max), one
independent draw per row from a single key.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.errors import InputError

MASKED = -jnp.inf


def _per_row(value, batch: int, dtype) -> jax.Array:
    """Broadcast a scalar / [B] value to a [B] array of ``dtype``."""
    arr = jnp.asarray(value, dtype)
    if arr.ndim == 0:
        return jnp.broadcast_to(arr, (batch,))
    if arr.shape != (batch,):
        raise ValueError(f"sampling parameter has shape {arr.shape}; expected a scalar or shape ({batch},)")
    return arr


def greedy(logits_BV: jax.Array) -> jax.Array:
    """[B, V] -> [B] int32 argmax (first maximal index)."""
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)


def apply_temperature(logits_BV: jax.Array, temperature_B) -> jax.Array:
    """logits / t per row; rows with t <= 0 are left unchanged (they decode greedily)."""
    t = _per_row(temperature_B, logits_BV.shape[0], jnp.float32)
    safe_t = jnp.where(t > 0, t, 1.0)
    return logits_BV.astype(jnp.float32) / safe_t[:, None]


def top_k_mask(logits_BV: jax.Array, k_B) -> jax.Array:
    """Set to -inf every logit below the row's k-th largest (k <= 0 or k >= V: no-op)."""
    B, V = logits_BV.shape
    k = _per_row(k_B, B, jnp.int32)
    active = (k > 0) & (k < V)
    sorted_desc = -jnp.sort(-logits_BV, axis=-1)
    kth = jnp.take_along_axis(sorted_desc, jnp.clip(k - 1, 0, V - 1)[:, None], axis=-1)  # [B, 1]
    keep = (logits_BV >= kth) | ~active[:, None]
    return jnp.where(keep, logits_BV, MASKED)


def top_p_mask(logits_BV: jax.Array, p_B) -> jax.Array:
    """Nucleus filter (HF semantics, see module docstring); p >= 1 is a no-op."""
    B, V = logits_BV.shape
    p = _per_row(p_B, B, jnp.float32)
    logits = logits_BV.astype(jnp.float32)
    sorted_desc = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive cumulative sum
    kept_sorted = mass_before < p[:, None]
    kept_sorted = kept_sorted.at[:, 0].set(True)  # always keep the most likely token
    n_kept = jnp.sum(kept_sorted, axis=-1)
    threshold = jnp.take_along_axis(sorted_desc, (n_kept - 1)[:, None], axis=-1)  # smallest kept logit
    keep = (logits >= threshold) | (p >= 1.0)[:, None]
    return jnp.where(keep, logits, MASKED)


@dataclasses.dataclass(frozen=True)
class SamplingSpec:
    """Which filters a compiled step contains (static); their values are per-row arrays.

    Keeping the *structure* static lets a pure-greedy batch compile to a bare argmax (no
    sort over the vocabulary per step), while the values can change without recompiling.
    """

    greedy_only: bool = True
    use_top_k: bool = False
    use_top_p: bool = False


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingParams:
    """Per-row values: temperature (0 = greedy), top_k (0 = off), top_p (1 = off)."""

    temperature_B: jax.Array
    top_k_B: jax.Array
    top_p_B: jax.Array

    @staticmethod
    def make(batch: int, temperature=0.0, top_k: Optional[int] = None, top_p: Optional[float] = None):
        """Build per-row params and the static spec from user-facing scalars or per-row lists."""

        def rows(value, default, dtype, name, valid, expected):
            try:
                arr = np.asarray(default if value is None else value, dtype)
            except (TypeError, ValueError):
                raise InputError(f"{name} must be {expected} (a scalar or one per prompt); "
                                 f"got {value!r}") from None
            if arr.ndim == 0:
                arr = np.broadcast_to(arr, (batch,))
            if arr.shape != (batch,):
                raise InputError(f"{name} must be a scalar or a list of {batch} values (one per "
                                 f"prompt); got shape {arr.shape}")
            bad = [v for v in arr.tolist() if not valid(v)]
            if bad:
                raise InputError(f"{name} must be {expected}; got {bad[:4]}")
            return jnp.asarray(arr)

        t = rows(temperature, 0.0, np.float32, "temperature", lambda v: v >= 0, ">= 0 (0 = greedy)")
        k = rows(top_k, 0, np.int32, "top_k", lambda v: v >= 0, "an integer >= 0 (0 = off)")
        p = rows(top_p, 1.0, np.float32, "top_p", lambda v: 0.0 < v <= 1.0, "in (0, 1] (1 = off)")
        greedy_only = bool(np.all(np.asarray(t) == 0))
        spec = SamplingSpec(
            greedy_only=greedy_only,
            use_top_k=(not greedy_only) and top_k is not None,
            use_top_p=(not greedy_only) and top_p is not None,
        )
        return SamplingParams(t, k, p), spec


def filter_logits(logits_BV: jax.Array, params: SamplingParams, spec: SamplingSpec) -> jax.Array:
    """Temperature → top-k → top-p (HF order); float32 [B, V] with -inf for removed tokens."""
    logits = apply_temperature(logits_BV, params.temperature_B)
    if spec.use_top_k:
        logits = top_k_mask(logits, params.top_k_B)
    if spec.use_top_p:
        logits = top_p_mask(logits, params.top_p_B)
    return logits


def sample(logits_BV: jax.Array, key: jax.Array, params: SamplingParams, spec: SamplingSpec) -> jax.Array:
    """Next token per row: greedy rows take the argmax, others draw from the filtered softmax."""
    if spec.greedy_only:
        return greedy(logits_BV)
    drawn = jax.random.categorical(key, filter_logits(logits_BV, params, spec), axis=-1).astype(jnp.int32)
    return jnp.where(params.temperature_B > 0, drawn, greedy(logits_BV))


__all__ = [
    "greedy", "apply_temperature", "top_k_mask", "top_p_mask", "filter_logits", "sample",
    "SamplingParams", "SamplingSpec",
]
