"""The distributions speculative decoding compares, and the two verification rules.

``warped_probs`` is the post-warper distribution a token is actually drawn from: the engine's
temperature → top-k → top-p filters (``inference.sampling.filter_logits``) then softmax, and a
one-hot at the argmax of the raw logits for greedy rows (temperature 0). Both models go through
it, so q is exactly what the draft was sampled from (the pitfall of transformers #47932).

* ``leviathan_accept`` (standard SD, TLI, SLRS; Leviathan et al. 2023, Timor et al. Alg. 4):
  accept draft j while u_j < p_j(x_j) / q_j(x_j); n = accepted prefix length (<= k per row).
* ``residual_or_bonus``: at the first rejection draw from norm(max(0, p − q)) over the whole
  target vocabulary; after k acceptances draw the bonus token from p.
* ``exact_match`` (SLEM, Alg. 2): the target draws its own token y_j at every position; accept the
  longest prefix where the candidate equals y_j and emit y up to and including the first mismatch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallasite.inference.sampling import SamplingParams, SamplingSpec, filter_logits


def _rows(params: SamplingParams, T: int) -> SamplingParams:
    rep = lambda a: jnp.repeat(a, T, axis=0)  # noqa: E731
    return SamplingParams(rep(params.temperature_B), rep(params.top_k_B), rep(params.top_p_B))


def warped_probs(logits_BTV: jax.Array, params: SamplingParams, spec: SamplingSpec, *,
                 filters: bool = True) -> jax.Array:
    """float32 [B, T, V] probabilities each row samples from at each position (see module doc).
    ``filters=False`` gives softmax of the raw logits instead (a negative control of the tests)."""
    B, T, V = logits_BTV.shape
    logits = logits_BTV.astype(jnp.float32)
    onehot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), V, dtype=jnp.float32)
    if spec.greedy_only:
        return onehot
    flat = logits.reshape(B * T, V)
    rows = _rows(params, T)
    warped = filter_logits(flat, rows, spec) if filters else flat
    probs = jax.nn.softmax(warped, axis=-1).reshape(B, T, V)
    greedy_B = (params.temperature_B <= 0)[:, None, None]
    return jnp.where(greedy_B, onehot, probs)


def draw(key: jax.Array, probs_BV: jax.Array, greedy_only: bool = False) -> jax.Array:
    """One token per row from (unnormalised, non-negative) probabilities. ``greedy_only`` (every
    row greedy, so every distribution here is a one-hot): its argmax, the same token without
    drawing B x V random numbers."""
    if greedy_only:
        return jnp.argmax(probs_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, jnp.log(probs_BV), axis=-1).astype(jnp.int32)


def draw_from_logits(key: jax.Array, logits_BV: jax.Array, params: SamplingParams, spec: SamplingSpec) -> jax.Array:
    """One token per row from the post-warper law of ``logits_BV`` (``draw(key, warped_probs(...))``);
    when every row is greedy, the argmax without building the one-hot."""
    if spec.greedy_only:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return draw(key, warped_probs(logits_BV[:, None], params, spec)[:, 0])


def leading_true(ok_BK: jax.Array) -> jax.Array:
    """Number of leading True values per row."""
    return jnp.sum(jnp.cumprod(ok_BK.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def leviathan_accept(key: jax.Array, p_tok_BK: jax.Array, q_tok_BK: jax.Array, k_B: jax.Array) -> jax.Array:
    """Accepted prefix length n [B]: draft j (0-based, j < k) survives while u_j < p_j / q_j."""
    u = jax.random.uniform(key, p_tok_BK.shape, jnp.float32)
    ratio = p_tok_BK / jnp.maximum(q_tok_BK, 1e-30)
    ok = (u < ratio) & (jnp.arange(p_tok_BK.shape[1])[None, :] < k_B[:, None])
    return leading_true(ok)


def residual_or_bonus(key: jax.Array, p_BV: jax.Array, q_BV: jax.Array, rejected_B: jax.Array,
                      greedy_only: bool = False) -> jax.Array:
    """The token after the accepted prefix: from norm(max(0, p − q)) where the row rejected a
    draft, from p where it accepted all of them (q is ignored there). ``greedy_only``: p and q are
    one-hots and a rejected draft is not p's token, so the residual is p itself: its argmax."""
    if greedy_only:
        return jnp.argmax(p_BV, axis=-1).astype(jnp.int32)
    res = jnp.maximum(p_BV - jnp.where(rejected_B[:, None], q_BV, 0.0), 0.0)
    empty = jnp.sum(res, axis=-1, keepdims=True) <= 1e-12  # p == q: rejection has probability 0
    return draw(key, jnp.where(empty, p_BV, res))


def exact_match(cand_BK: jax.Array, n_cand_B: jax.Array, drawn_BK1: jax.Array) -> jax.Array:
    """Accepted prefix length n [B] of candidates equal to the target's own draws."""
    K = cand_BK.shape[1]
    ok = (cand_BK == drawn_BK1[:, :K]) & (jnp.arange(K)[None, :] < n_cand_B[:, None])
    return leading_true(ok)


__all__ = ["warped_probs", "draw", "draw_from_logits", "leading_true", "leviathan_accept", "residual_or_bonus",
           "exact_match"]
