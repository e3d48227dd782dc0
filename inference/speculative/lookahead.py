"""Dynamic draft length by the drafter's confidence, and a verify only as wide as the round's drafts.

Mamou et al., "Dynamic Speculation Lookahead Accelerates Speculative Decoding of Large Language
Models" (DISCO, 2024), and transformers' ``assistant_confidence_threshold``: a row stops drafting
when the drafter is unsure of its next token. DISCO decides with a classifier trained on the
drafter's features; transformers, as here, with the drafter's own probability, and it also re-fits
its threshold online from the observed acceptances. Here the threshold is fixed (no training, no
online fit). A row drafts step j only while

    c_j = max_x softmax(z_j)(x) >= tau,

z_j the drafter's logits at step j after the masks it drafts under (TLI's intersection, a
constraint), before the draft is drawn; or, with ``confidence_of="prefix"``, while c_0 · ... · c_j
>= tau (the drafter's estimate that every draft of the round is accepted: SpecDec++'s stopping
rule, Huang et al. 2024, with the drafter's own confidence standing in for its trained head). The
decision to draft step j then depends only on the drafts before it, so the draft length is a
stopping time and Leviathan's test (and SLEM's exact match) stays lossless. A rule that drops a
draft because of the draft's own probability would bias the output when sampling. Deviation from
transformers: there the first draft whose probability is below the threshold is kept and drafting
stops after it; here it is not proposed, so a round can propose nothing, and its verify is a plain
one-token target step.

The verify then runs at the narrowest compiled width that holds the widest row's drafts plus the
target's own token (``verify_widths``: 1..4, the powers of two, K + 1; one compiled target call per
width, each in a loop that runs once or not at all: ``narrow_call``). Where a (K + 1)-token target
call costs well over a one-token one (XLA:CPU, 1.5-2x at K = 3: docs/speculative.md), a round with
few drafts pays for few.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_probability(logits_BV: jax.Array) -> jax.Array:
    """float32 [B]: the largest softmax probability of each row (masked entries are -inf; a row
    masked everywhere gives 0, so it never counts as confident)."""
    z = logits_BV.astype(jnp.float32)
    top = jnp.max(z, axis=-1, keepdims=True)
    finite = jnp.isfinite(top[:, 0])
    total = jnp.sum(jnp.exp(z - jnp.where(jnp.isfinite(top), top, 0.0)), axis=-1)
    return jnp.where(finite, 1.0 / jnp.maximum(total, 1.0), 0.0)


def verify_widths(k_max: int) -> tuple:
    """The verify widths compiled for a draft cap of ``k_max``: every width up to 4, the powers of
    two above it, and k_max + 1 (sorted, unique)."""
    full = k_max + 1
    widths = set(range(1, min(full, 4) + 1)) | {full}
    w = 8
    while w < full:
        widths.add(w)
        w *= 2
    return tuple(sorted(widths))


def narrow_call(call, cache, tokens_BT: jax.Array, positions_BT: jax.Array, needed: jax.Array, widths: tuple):
    """``call(cache, tokens, positions) -> (logits [B, w, ...], cache)`` at the narrowest of ``widths``
    that is >= ``needed`` (a traced int32 scalar, <= T); the logits are zero-padded back to T
    positions (positions >= the width are not read by the caller: they hold no draft).

    One ``while_loop`` per width, the chosen one running once and the others not at all, rather
    than a ``lax.switch``: XLA copies an operand that a conditional's branch updates in place, i.e.
    every cache array twice a round (measured: docs/speculative.md), while a loop carry is updated
    in place."""
    T = tokens_BT.shape[1]
    if widths[-1] != T:
        raise ValueError(f"narrow_call: the widest width ({widths[-1]}) must be the token buffer's ({T})")
    index = jnp.searchsorted(jnp.asarray(widths, jnp.int32), jnp.asarray(needed, jnp.int32))
    index = jnp.minimum(index, len(widths) - 1)  # needed > T (not expected) runs the full width
    shape = jax.eval_shape(lambda c: call(c, tokens_BT, positions_BT)[0], cache)
    logits = jnp.zeros(shape.shape, shape.dtype)
    for i, w in enumerate(widths):
        def run_once(state, w=w):
            _, cache, _ = state
            logits_w, cache = call(cache, tokens_BT[:, :w], positions_BT[:, :w])
            pad = [(0, 0), (0, T - w)] + [(0, 0)] * (logits_w.ndim - 2)
            return jnp.pad(logits_w, pad), cache, jnp.bool_(False)

        logits, cache, _ = jax.lax.while_loop(lambda state: state[2], run_once, (logits, cache, index == i))
    return logits, cache


def verify_call(ctx, s, cand_BK, needed=None):
    """One target call over the row's last token and its candidates: (logits [B, K+1, V], cache).
    ``needed`` (a traced width): run only that many positions (``lookahead.narrow_call``; the rest
    are zeros, which no row reads)."""
    tokens = jnp.concatenate([s.last_tokens_B[:, None], cand_BK], axis=1)
    positions = s.next_positions_B[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    if needed is None:
        return ctx.model(s.cache, tokens, positions)
    return narrow_call(ctx.model, s.cache, tokens, positions, needed, verify_widths(tokens.shape[1] - 1))


__all__ = ["top_probability", "verify_widths", "narrow_call", "verify_call"]
