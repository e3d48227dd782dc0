"""LMS3's representation of a problem: the last layer's final-normed hidden state at position
``max_len - 1`` = 127 of the question tokenized with the tokenizer's own special tokens (BOS for
Llama 3, none for SmolLM2), right-padded with EOS to 128 tokens and truncated there -- the
official ``get_representation`` (``padding='max_length'``, ``hidden_states[-1][:, -1]``).

Hugging Face semantics with its attention mask: a pad query attends to the real tokens only
(neither to other pads nor to itself) and keeps its absolute position (no position ids are
passed). So h_127 depends only on the real tokens, the EOS embedding and position 127, and we
compute it exactly from the real tokens plus ONE EOS placed at position 127, with keys masked to
the real tokens -- 128 tokens of work shrink to n + 1. The mask rides on a cache object (the
model's cache seam: ``update_and_attend``) so the model's own blocks run unchanged. A question of
>= 128 tokens keeps its first 128 and h is that of its 128th token (no pad).
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from pallasite.inference.cache.base import KVCache
from pallasite.ops.attention import attention

MAX_LEN = 128
LENGTH_BUCKET = 16


@struct.dataclass
class KeyMaskCache(KVCache):
    """Not a KV store: per layer, attention among the call's own tokens with causal-by-position
    masking AND keys restricted to ``valid`` ([L, B, T] with a layer axis like every cache)."""

    valid: jax.Array

    def update_and_attend(
        self,
        q_BTHD,
        k_BTKD,
        v_BTKD,
        positions_BT,
        *,
        sliding_window=None,
        impl="ref",
        interpret=None,
    ):
        out = attention(
            q_BTHD,
            k_BTKD,
            v_BTKD,
            q_positions_BT=positions_BT,
            k_positions_BS=positions_BT,
            causal=True,
            sliding_window=sliding_window,
            k_valid_BS=self.valid,
            impl="ref",
        )
        return out, self


@functools.partial(jax.jit, static_argnums=0)
def _hidden_at_last(graphdef, state, tokens_BT, positions_BT, valid_LBT):
    m = nnx.merge(graphdef, state)
    h_BTD = m(tokens_BT, positions_BT, cache=KeyMaskCache(valid_LBT), return_hidden=True)[0]
    return h_BTD[:, -1].astype(jnp.float32)


def tokenize_questions(tokenizer, texts: Sequence[str], max_len: int = MAX_LEN) -> list[list[int]]:
    """Ids with the tokenizer's own special tokens (``add_special_tokens=True``), cut at max_len."""
    out = []
    for t in texts:
        ids = list(tokenizer(t, add_special_tokens=True)["input_ids"])[:max_len]
        if not ids:
            raise ValueError(f"LMS3: text {t!r} has no tokens")
        out.append(ids)
    return out


def representations(
    model,
    token_lists: Sequence[Sequence[int]],
    *,
    max_len: int = MAX_LEN,
    pad_id: Optional[int] = None,
    batch_size: int = 16,
) -> np.ndarray:
    """[N, D] float32 hidden state at position max_len - 1 (HF right-padding semantics)."""
    cfg = model.config
    if pad_id is None:
        tok = model.tokenizer
        pad_id = (
            tok.eos_token_id
            if tok is not None and tok.eos_token_id is not None
            else (cfg.eos_token_id or (None,))[0]
        )
    if pad_id is None:
        raise ValueError("LMS3 representations: no EOS id to pad with; pass pad_id=")
    rows = [list(map(int, t))[:max_len] for t in token_lists]
    if any(len(r) == 0 for r in rows):
        raise ValueError("LMS3 representations: empty token list")
    out = []
    for lo in range(0, len(rows), batch_size):
        chunk = rows[lo : lo + batch_size]
        n_real = len(chunk)
        chunk = chunk + [chunk[0]] * (batch_size - n_real)
        T = min(
            -(-max(min(len(r) + 1, max_len) for r in chunk) // LENGTH_BUCKET) * LENGTH_BUCKET,
            max_len,
        )
        tokens = np.full((batch_size, T), pad_id, np.int32)
        positions = np.zeros((batch_size, T), np.int32)
        valid = np.zeros((batch_size, T), bool)
        for i, r in enumerate(chunk):
            n = len(r)
            if (
                n >= max_len
            ):  # truncated: no pad, h is that of its max_len-th token (then T == max_len)
                tokens[i], positions[i], valid[i] = r, np.arange(max_len), True
            else:  # real tokens 0..n-1, junk slots n..T-2 (masked as keys), EOS at max_len - 1
                tokens[i, :n], valid[i, :n] = r, True
                positions[i, : T - 1] = np.arange(T - 1)
                positions[i, T - 1] = max_len - 1
        valid_L = np.broadcast_to(valid, (cfg.n_layers,) + valid.shape)
        h = _hidden_at_last(
            model.graphdef,
            model.state,
            jnp.asarray(tokens),
            jnp.asarray(positions),
            jnp.asarray(valid_L),
        )
        out.append(np.asarray(h)[:n_real])
    return np.concatenate(out)
