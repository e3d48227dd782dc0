"""Perplexity over a token stream, the WikiText protocol of GPTQ / QuaRot / FlatQuant:
split the stream into non-overlapping windows of ``seq_len`` tokens, score every next-token
prediction inside each window (no context carried across windows), and report
``exp(mean NLL)`` over all predicted tokens.

``packed_nll`` scores a training run's packed evaluation batches instead (``training/data.py``:
documents packed into rows with segment ids, targets across a document boundary masked): the
same number the training loop reports as its eval loss.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from pallasite.errors import InputError


def window_nll(logits_fn: Callable[[jax.Array], jax.Array], windows_NT: np.ndarray, batch_size: int = 8,
               progress: bool = True) -> tuple[float, int]:
    """Sum of next-token NLL (float64) and the number of predicted tokens over [N, T] windows."""
    total, count = 0.0, 0

    @jax.jit
    def nll(logits_BTV, ids_BT):
        logp = jax.nn.log_softmax(logits_BTV[:, :-1].astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, ids_BT[:, 1:, None], axis=-1)[..., 0]
        return -picked.sum()

    it = range(0, len(windows_NT), batch_size)
    for start in tqdm(it, desc="perplexity", disable=not progress, leave=False):
        batch = jnp.asarray(windows_NT[start:start + batch_size], jnp.int32)
        total += float(nll(logits_fn(batch), batch))
        count += batch.shape[0] * (batch.shape[1] - 1)
    return total, count


def perplexity(logits_fn: Callable[[jax.Array], jax.Array], token_ids: np.ndarray, seq_len: int,
               *, max_windows: Optional[int] = None, batch_size: int = 8, progress: bool = True,
               bos_id: Optional[int] = None) -> dict:
    """``logits_fn(ids_BT) -> logits_BTV``; returns {'nll', 'ppl', 'tokens', 'windows'}.

    With ``bos_id`` (models trained with a leading BOS, e.g. Gemma) every window is BOS followed
    by ``seq_len - 1`` stream tokens, all of which are scored (the first one given BOS alone)."""
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 1:
        raise InputError(f"perplexity expects a 1-D token stream, got shape {token_ids.shape}")
    span = seq_len - (bos_id is not None)  # stream tokens per window
    n = len(token_ids) // span if span > 0 else 0
    if n == 0:
        raise InputError(f"perplexity: the data gives {len(token_ids)} tokens, fewer than one "
                         f"window of seq_len={seq_len}; give more text or a smaller --seq-len")
    if max_windows is not None:
        n = min(n, max_windows)
    windows = token_ids[: n * span].reshape(n, span)
    if bos_id is not None:
        windows = np.concatenate([np.full((n, 1), bos_id, windows.dtype), windows], axis=1)
    total, count = window_nll(logits_fn, windows, batch_size=batch_size, progress=progress)
    mean = total / count
    return {"nll": mean, "ppl": float(np.exp(mean)), "tokens": count, "windows": n}


def packed_nll(logits_fn: Callable[..., jax.Array], batches: Sequence[dict],
               progress: bool = True) -> dict:
    """Masked next-token NLL over packed batches (``tokens``, ``targets``, ``positions``,
    ``segment_ids``, ``loss_mask``); ``logits_fn(tokens, positions=, segment_ids=)`` is e.g.
    ``pallasite.Model.logits``. Returns {'nll', 'ppl', 'tokens', 'windows'}."""

    @jax.jit
    def nll(logits_BTV, targets_BT, mask_BT):
        logp = jax.nn.log_softmax(logits_BTV.astype(jnp.float32), axis=-1)
        picked = jnp.take_along_axis(logp, targets_BT[..., None], axis=-1)[..., 0]
        return -(picked * mask_BT).sum(), mask_BT.sum()

    total, count, windows = 0.0, 0.0, 0
    for b in tqdm(batches, desc="eval", disable=not progress, leave=False):
        logits = logits_fn(b["tokens"], positions=b["positions"], segment_ids=b["segment_ids"])
        t, n = nll(logits, jnp.asarray(b["targets"], jnp.int32),
                   jnp.asarray(b["loss_mask"], jnp.float32))
        total, count, windows = total + float(t), count + float(n), windows + len(b["tokens"])
    if count == 0:
        raise ValueError("packed_nll: the batches hold no scored token")
    mean = total / count
    return {"nll": mean, "ppl": float(np.exp(mean)), "tokens": int(count), "windows": windows}
