"""Batched model calls shared by the evaluation methods, for any ``pallasite.load`` model.

* ``continuation_logprobs`` -- log p(token | prefix) of each continuation token, from one forward
  (``Transformer.__call__(..., return_hidden=True)``, LM head only at the scored positions).
* ``mean_hidden`` -- the mean of the final-normed hidden states over each sequence's tokens.
* ``next_token_logprobs`` -- log p of a fixed list of candidate next tokens (the LM judge).
* ``stop_ids_for`` -- the ids of every vocabulary token whose text contains one of some characters
  (to stop sampling at the first '.' or newline, as the official FactTest code truncates).
Sequences are right-padded (causal attention: padding never reaches the real positions).
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

LENGTH_BUCKET = 16


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _batches(n: int, batch_size: int):
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, n, batch_size):
        yield start, min(start + batch_size, n)


def _pad_rows(rows: list, batch_size: int) -> list:
    """Fill a short last batch with copies of its first row (fixed shapes: no recompiles)."""
    return rows + [rows[0]] * (batch_size - len(rows))


def stop_ids_for(model, chars: str) -> tuple[int, ...]:
    """Vocabulary ids whose decoded text contains any of ``chars``, plus the model's EOS ids."""
    tok = model.tokenizer
    if tok is None:
        raise ValueError("stop_ids_for: the model has no tokenizer")
    return _stop_ids(id(tok), tok, chars, tuple(model.config.eos_token_id or ()))


@functools.lru_cache(maxsize=8)
def _stop_ids(_key, tok, chars, eos):
    vocab = len(tok)
    texts = tok.batch_decode([[i] for i in range(vocab)], skip_special_tokens=False)
    ids = [i for i, t in enumerate(texts) if any(c in t for c in chars)]
    extra = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return tuple(sorted(set(ids) | set(eos) | set(extra)))


@functools.partial(jax.jit, static_argnums=0)
def _gather_logprobs(graphdef, state, tokens_BT, pos_BK, targets_BK):
    m = nnx.merge(graphdef, state)
    h_BTD = m(tokens_BT, return_hidden=True)[0]
    h_BKD = jnp.take_along_axis(h_BTD, pos_BK[..., None], axis=1)
    logp_BKV = jax.nn.log_softmax(m.head(h_BKD).astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp_BKV, targets_BK[..., None], axis=-1)[..., 0]


def continuation_logprobs(
    model,
    prefixes: Sequence[Sequence[int]],
    continuations: Sequence[Sequence[int]],
    *,
    batch_size: int = 16,
) -> list[np.ndarray]:
    """Per-token log-probabilities (float32, natural log) of each continuation after its prefix."""
    if len(prefixes) != len(continuations):
        raise ValueError(
            f"continuation_logprobs: {len(prefixes)} prefixes vs {len(continuations)} continuations"
        )
    out: list[np.ndarray] = []
    for lo, hi in _batches(len(prefixes), batch_size):
        pre = _pad_rows([list(map(int, p)) for p in prefixes[lo:hi]], batch_size)
        con = _pad_rows([list(map(int, c)) for c in continuations[lo:hi]], batch_size)
        if any(len(p) == 0 for p in pre):
            raise ValueError("continuation_logprobs: every prefix needs at least one token")
        T = _round_up(max(len(p) + len(c) for p, c in zip(pre, con)), LENGTH_BUCKET)
        K = _round_up(max(1, max(len(c) for c in con)), LENGTH_BUCKET)
        tokens = np.zeros((batch_size, T), np.int32)
        pos = np.zeros((batch_size, K), np.int32)
        tgt = np.zeros((batch_size, K), np.int32)
        for i, (p, c) in enumerate(zip(pre, con)):
            tokens[i, : len(p) + len(c)] = p + c
            pos[i, : len(c)] = np.arange(
                len(p) - 1, len(p) + len(c) - 1
            )  # position predicting c[j]
            tgt[i, : len(c)] = c
        lp = np.asarray(_gather_logprobs(model.graphdef, model.state, tokens, pos, tgt))
        out.extend(lp[i, : len(continuations[lo + i])] for i in range(hi - lo))
    return out


@functools.partial(jax.jit, static_argnums=0)
def _mean_hidden(graphdef, state, tokens_BT, mask_BT):
    h_BTD = nnx.merge(graphdef, state)(tokens_BT, return_hidden=True)[0].astype(jnp.float32)
    w = mask_BT.astype(jnp.float32)[..., None]
    return (h_BTD * w).sum(1) / jnp.maximum(w.sum(1), 1.0)


def mean_hidden(model, sequences: Sequence[Sequence[int]], *, batch_size: int = 16) -> np.ndarray:
    """[N, D] float32: mean over each sequence's tokens of the final-normed hidden state."""
    out = []
    for lo, hi in _batches(len(sequences), batch_size):
        rows = _pad_rows([list(map(int, s)) for s in sequences[lo:hi]], batch_size)
        if any(len(r) == 0 for r in rows):
            raise ValueError("mean_hidden: empty sequence")
        T = _round_up(max(len(r) for r in rows), LENGTH_BUCKET)
        tokens = np.zeros((batch_size, T), np.int32)
        mask = np.zeros((batch_size, T), bool)
        for i, r in enumerate(rows):
            tokens[i, : len(r)], mask[i, : len(r)] = r, True
        out.append(np.asarray(_mean_hidden(model.graphdef, model.state, tokens, mask))[: hi - lo])
    return np.concatenate(out) if out else np.zeros((0, model.config.d_model), np.float32)


def next_token_logprobs(
    model, prefixes: Sequence[Sequence[int]], candidates: Sequence[int], *, batch_size: int = 16
) -> np.ndarray:
    """[N, C] log p(candidate | prefix) of the next token, for a fixed list of candidate ids."""
    cand = [int(c) for c in candidates]
    if not cand:
        raise ValueError("next_token_logprobs: needs at least one candidate id")
    out = []
    for lo, hi in _batches(len(prefixes), batch_size):
        rows = _pad_rows([list(map(int, p)) for p in prefixes[lo:hi]], batch_size)
        if any(len(r) == 0 for r in rows):
            raise ValueError("next_token_logprobs: every prefix needs at least one token")
        T = _round_up(max(len(r) for r in rows), LENGTH_BUCKET)
        tokens = np.zeros((batch_size, T), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        pos = np.asarray([[len(r) - 1] * len(cand) for r in rows], np.int32)
        tgt = np.asarray([cand] * batch_size, np.int32)
        out.append(
            np.asarray(_gather_logprobs(model.graphdef, model.state, tokens, pos, tgt))[: hi - lo]
        )
    return np.concatenate(out) if out else np.zeros((0, len(cand)), np.float32)
