"""Perplexity over a token stream, the WikiText protocol of GPTQ / QuaRot / FlatQuant:
split the stream into non-overlapping windows of ``seq_len`` tokens, score every next-token
prediction inside each window (no context carried across windows), and report
``exp(mean NLL)`` over all predicted tokens.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm


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
               *, max_windows: Optional[int] = None, batch_size: int = 8, progress: bool = True) -> dict:
    """``logits_fn(ids_BT) -> logits_BTV``; returns {'nll', 'ppl', 'tokens', 'windows'}."""
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 1:
        raise ValueError(f"perplexity expects a 1-D token stream, got shape {token_ids.shape}")
    n = len(token_ids) // seq_len
    if n == 0:
        raise ValueError(f"perplexity: {len(token_ids)} tokens are fewer than one window of seq_len={seq_len}")
    if max_windows is not None:
        n = min(n, max_windows)
    windows = token_ids[: n * seq_len].reshape(n, seq_len)
    total, count = window_nll(logits_fn, windows, batch_size=batch_size, progress=progress)
    mean = total / count
    return {"nll": mean, "ppl": float(np.exp(mean)), "tokens": count, "windows": n}
