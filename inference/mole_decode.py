"""LUT-mode MoLE inference: per-step row transfer wired into the pure forward.

Paper: Jie et al., "Mixture of Lookup Experts", ICML 2025, §3.3 / Fig. 1: at inference the
experts are lookups; the rows ``LUT[ids]`` of the tokens being processed are fetched from where
the LUT lives (host RAM or disk) and moved to the device — ``L·N·d`` values per token — while
the device holds only the dense model plus the routers.

* ``set_lut_rows(model, rows_BTLND)`` writes one step's rows into the ``LUTRows`` variables of a
  LUT-mode model (list or scan layout).
* ``lut_forward(graphdef, state, rows_BTLND, tokens_BT, ...)`` is the pure forward of a LUT-mode
  model: ``core forward`` with the rows injected — same signature plus the rows; jit it.
* ``MoLEGenerator`` runs prefill + greedy decode with a dense KV cache; at each step it fetches
  the rows of exactly the tokens fed to the model (host numpy gather from the store, one
  ``device_put``), and counts bytes moved. The project's generation engine
  (``inference/engine.py``) is being written concurrently; once it exposes a forward hook this
  class should become a thin adapter over it rather than a second engine.
"""

from __future__ import annotations

import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.inference.cache.dense import init_dense_cache
from pallasite.models.mole import mole_config_of


def set_lut_rows(model, rows_BTLND: jax.Array) -> None:
    """Write ``rows [B, T, L, N, d]`` into the model's per-layer ``lut_rows`` (in place on a
    merged module; call inside the jitted function that merged it)."""
    cfg = model.cfg
    m = mole_config_of(cfg)
    if m.mode != "lut":
        raise ValueError("set_lut_rows: the model is not in LUT mode (mole.mode='lut'); use models.mole_lut.to_lut_model")
    want = (cfg.n_layers, m.n_experts, cfg.d_model)
    if rows_BTLND.ndim != 5 or tuple(rows_BTLND.shape[2:]) != want:
        raise ValueError(f"set_lut_rows: rows have shape {tuple(rows_BTLND.shape)}, expected [B, T, {want[0]}, {want[1]}, {want[2]}]")
    if cfg.scan_layers:
        model.layers.ffn.lut_rows.set_value(jnp.moveaxis(rows_BTLND, 2, 0))
    else:
        for i, block in enumerate(model.layers):
            block.ffn.lut_rows.set_value(rows_BTLND[:, :, i])


def lut_forward(graphdef, state, rows_BTLND, tokens_BT, positions_BT=None, *, cache=None, segment_ids_BT=None):
    """Pure forward of a LUT-mode MoLE model: (float32 logits, cache, aux)."""
    model = nnx.merge(graphdef, state)
    set_lut_rows(model, rows_BTLND)
    return model(tokens_BT, positions_BT, cache=cache, segment_ids_BT=segment_ids_BT)


class MoLEGenerator:
    """Greedy generation of a LUT-mode model whose LUT lives in a ``LUTStore`` (host or disk).

    ``generate(prompt_BT, n)`` → ``int32 [B, n]``. Per step: the sampled ids come to the host
    (they must: the host gathers their rows), the rows move to the device, one jitted step.
    ``stats`` counts steps, tokens and LUT bytes moved."""

    def __init__(self, lut_model, store, *, max_len: int = 256, cache_dtype=None):
        store.check_model(lut_model)
        self.cfg = lut_model.cfg
        self.store = store
        self.max_len = max_len
        self.cache_dtype = cache_dtype
        self.graphdef, self.state = nnx.split(lut_model)

        def step(state, payload, tokens, positions, cache):
            rows = store.decode(payload)
            logits, cache, _ = lut_forward(self.graphdef, state, rows, tokens, positions, cache=cache)
            return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

        self._step = jax.jit(step, donate_argnums=(4,))
        self.stats = {"steps": 0, "tokens": 0, "lut_bytes": 0, "fetch_s": 0.0}

    def _run(self, ids_np, positions, cache):
        t0 = time.perf_counter()
        payload = self.store.fetch(ids_np)
        self.stats["fetch_s"] += time.perf_counter() - t0
        self.stats["lut_bytes"] += int(sum(p.nbytes for p in payload))
        self.stats["steps"] += 1
        self.stats["tokens"] += int(ids_np.size)
        return self._step(self.state, jax.device_put(payload), jnp.asarray(ids_np), positions, cache)

    def generate(self, prompt_BT, max_new_tokens: int) -> np.ndarray:
        prompt = np.asarray(prompt_BT, np.int32)
        B, T = prompt.shape
        if T + max_new_tokens > self.max_len:
            raise ValueError(f"MoLEGenerator: prompt {T} + {max_new_tokens} new tokens exceeds max_len={self.max_len}")
        cache = init_dense_cache(self.cfg, B, self.max_len, self.cache_dtype)
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        nxt, cache = self._run(prompt, pos, cache)
        out = [np.asarray(nxt)]
        for i in range(max_new_tokens - 1):
            ids = out[-1][:, None]
            nxt, cache = self._run(ids, jnp.full((B, 1), T + i, jnp.int32), cache)
            out.append(np.asarray(nxt))
        return np.stack(out, axis=1)


def greedy_reference(graphdef, state, cfg, prompt_BT, max_new_tokens: int, *, max_len: int = 256):
    """Greedy decode of a training-mode (or any core) model with the same cache and steps as
    ``MoLEGenerator`` — the reference that LUT-mode generation must reproduce token for token."""
    from pallasite.models.transformer import forward

    @jax.jit
    def step(state, tokens, positions, cache):
        logits, cache, _ = forward(graphdef, state, tokens, positions, cache=cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    prompt = jnp.asarray(prompt_BT, jnp.int32)
    B, T = prompt.shape
    cache = init_dense_cache(cfg, B, max_len)
    nxt, cache = step(state, prompt, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)), cache)
    out = [nxt]
    for i in range(max_new_tokens - 1):
        nxt, cache = step(state, out[-1][:, None], jnp.full((B, 1), T + i, jnp.int32), cache)
        out.append(nxt)
    return np.asarray(jnp.stack(out, axis=1))
