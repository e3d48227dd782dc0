"""LUT-mode MoLE inference: per-step row transfer wired into the pure forward.

Paper: Jie et al., "Mixture of Lookup Experts", ICML 2025, §3.3 / Fig. 1: at inference the
experts are lookups; the rows ``LUT[ids]`` of the tokens being processed are fetched from where
the LUT lives (host RAM or disk) and moved to the device — ``L·N·d`` values per token — while
the device holds only the dense model plus the routers.

* ``set_lut_rows(model, rows_BTLND)`` writes one step's rows into the ``LUTRows`` variables of a
  LUT-mode model (list or scan layout).
* ``lut_forward(graphdef, state, rows_BTLND, tokens_BT, ...)`` is the pure forward of a LUT-mode
  model: ``core forward`` with the rows injected — same signature plus the rows; jit it.
* ``attach_lut_store(lut_model, store)`` makes the model fetch its rows itself through a host
  callback, so the project's one generation engine (``inference/engine.py``: jitted prefill,
  ``while_loop`` decode) runs LUT models unchanged — there is no MoLE-specific decode loop.
  Per step the callback receives the ids, the store gathers exactly those rows (from RAM or
  the memory-mapped file) and hands them to the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

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


def attach_lut_store(lut_model, store) -> None:
    """Let a LUT-mode model fetch its own rows from ``store`` (host RAM or disk): each layer's FFN
    gets its index and the store, and — when no rows were written with ``set_lut_rows`` — calls
    back to the host with the current token ids (``jax.pure_callback``). The model then runs in
    the unchanged generation engine (``inference.engine.generate_ids``) and in ``forward``.

    Per forward: one host gather of all layers' rows for the ids (``LUTStore.layer_rows``
    memoises it across the layers) and L transfers of ``[B, T, N, d]``. The store is checked
    against the model first (shapes and fingerprint)."""
    store.check_model(lut_model)
    cfg = lut_model.cfg
    if mole_config_of(cfg).mode != "lut":
        raise ValueError("attach_lut_store: the model is not in LUT mode; use models.mole_lut.to_lut_model first")
    if cfg.scan_layers:
        lut_model.layers.ffn.layer_index.set_value(jnp.arange(cfg.n_layers, dtype=jnp.int32))
        lut_model.layers.ffn.lut_store = store
    else:
        for i, block in enumerate(lut_model.layers):
            block.ffn.layer_index.set_value(jnp.asarray(i, jnp.int32))
            block.ffn.lut_store = store
