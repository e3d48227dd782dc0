"""Several completions per prompt from ONE shared prefill, with the log-probability of every
generated token -- what sampling-based uncertainty scores need, at a fraction of the cost of
``pallasite.generate`` on m copies of each prompt (whose prefill dominates on CPU).

    rows = sample_rows(model, prompts, temperatures=[0.0] + [1.0] * 5, max_new_tokens=15,
                       stop_tokens=stops, seed=0)
    ids, logp = rows[q][r]          # prompt q, row r (row 0 greedy here)

Each prompt is prefilled once into a dense KV cache (``Transformer.__call__(..., cache=,
return_hidden=True)``, LM head at the last prompt token only); the cache rows are repeated once
per requested temperature, and all rows decode together, one jitted step per token, with the
engine's own ``inference.sampling.sample`` (temperature 0 = greedy) and the dense cache's slot
convention (the token at position p goes to slot p; right-padding junk is overwritten before it
becomes visible). ``logp`` is log softmax of the untempered logits (T = 1) at the chosen token,
as an NLL under the model would score it. A row stops after its first stop token (included).
Greedy rows equal ``pallasite.generate`` token for token (tests/eval/test_multi_sample.py).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.inference.cache import init_dense_cache
from pallasite.inference.sampling import SamplingParams, sample

LENGTH_BUCKET = 16


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _prefill(graphdef, state, cache, tokens_BT, lengths_B):
    m = nnx.merge(graphdef, state)
    B, T = tokens_BT.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    h_BTD, cache, _ = m(tokens_BT, positions, cache=cache, return_hidden=True)
    h_last = jnp.take_along_axis(h_BTD, (lengths_B - 1)[:, None, None], axis=1)
    return m.head(h_last)[:, 0].astype(jnp.float32), cache


@functools.partial(jax.jit, static_argnums=(0, 6), donate_argnums=(2,))
def _step(graphdef, state, cache, logits_BV, positions_B, key, spec, params):
    """Pick the next token from ``logits_BV``, then run it through the model at ``positions_B``."""
    tok_B = sample(logits_BV, key, params, spec)
    logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV, -1), tok_B[:, None], axis=-1)[:, 0]
    m = nnx.merge(graphdef, state)
    h, cache, _ = m(tok_B[:, None], positions_B[:, None], cache=cache, return_hidden=True)
    return tok_B, logp_B, m.head(h)[:, 0].astype(jnp.float32), cache


def sample_rows(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    temperatures: Sequence[float],
    max_new_tokens: int,
    stop_tokens: Sequence[int] = (),
    seed: int = 0,
    prompts_per_batch: int = 8,
    length_bucket: int = LENGTH_BUCKET,
) -> list[list[tuple[list[int], np.ndarray]]]:
    """For every prompt, one completion per entry of ``temperatures``: (new token ids, log-probs).
    Prompts are padded to a multiple of ``length_bucket`` (one compile per bucket)."""
    temps = [float(t) for t in temperatures]
    if not temps or min(temps) < 0:
        raise ValueError(
            f"sample_rows: temperatures must be a non-empty list of values >= 0, got {temperatures}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"sample_rows: max_new_tokens must be >= 1, got {max_new_tokens}")
    R, G = len(temps), int(prompts_per_batch)
    stops = np.asarray(sorted({int(s) for s in stop_tokens}) or [-1], np.int32)
    params, spec = SamplingParams.make(G * R, np.tile(np.asarray(temps, np.float32), G), None, None)
    key = jax.random.key(seed)
    out: list = []
    for lo in range(0, len(prompts), G):
        group = [list(map(int, p)) for p in prompts[lo : lo + G]]
        n_real = len(group)
        if any(len(p) == 0 for p in group):
            raise ValueError("sample_rows: every prompt needs at least one token")
        group += [group[0]] * (G - n_real)
        lengths = np.asarray([len(p) for p in group], np.int32)
        T = _round_up(int(lengths.max()), int(length_bucket))
        tokens = np.zeros((G, T), np.int32)
        for i, p in enumerate(group):
            tokens[i, : len(p)] = p
        cache = init_dense_cache(model.config, G, _round_up(T + max_new_tokens, 64))
        logits, cache = _prefill(
            model.graphdef, model.state, cache, jnp.asarray(tokens), jnp.asarray(lengths)
        )
        # Row b = prompt b // R at temperature temps[b % R]: repeat each prompt's cache R times.
        cache = jax.tree.map(lambda a: jnp.repeat(a, R, axis=1), cache)
        logits = jnp.repeat(logits, R, axis=0)
        pos = np.repeat(lengths, R).astype(np.int32)
        toks = np.zeros((G * R, max_new_tokens), np.int32)
        logps = np.zeros((G * R, max_new_tokens), np.float32)
        n_out = np.zeros(G * R, np.int64)
        done = np.zeros(G * R, bool)
        for t in range(max_new_tokens):
            key, sub = jax.random.split(key)
            tok, lp, logits, cache = _step(
                model.graphdef, model.state, cache, logits, jnp.asarray(pos), sub, spec, params
            )
            tok, lp = np.asarray(tok), np.asarray(lp)
            live = ~done
            toks[live, t], logps[live, t] = tok[live], lp[live]
            n_out[live] += 1
            done |= live & np.isin(tok, stops)
            pos = pos + 1
            if done.all():
                break
        for i in range(n_real):
            rows = []
            for r in range(R):
                b = i * R + r
                rows.append((toks[b, : n_out[b]].tolist(), logps[b, : n_out[b]].copy()))
            out.append(rows)
    return out
