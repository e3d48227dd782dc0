"""The last attention layer's projections as LMS3 uses them (official ``LMS3.py``:
``get_last_layer_attention_weights`` and ``w_k1``), read from any loaded model's state.

Returned in the torch [out, in] orientation of the official code: W_q [H*Dh, D], W_k and W_v
[K*Dh, D]. pallasite kernels are [in, out] (``layers[i].attn.{q,k,v}_proj.kernel``); scanned models
stack the layers on axis 0. ``expand_kv`` is the official GQA expansion
``w_k.reshape(K, Dh, D).repeat(1, H // K, 1).reshape(H*Dh, D)``: each KV head's Dh-row block
repeated H/K times in place, so query head i pairs with KV head i // (H/K) (HF ``repeat_kv``).
Biases (Qwen2) are not used, as in the official code.
"""

from __future__ import annotations

import numpy as np
from flax import nnx


def last_layer_qkv(model) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(W_q, W_k, W_v) of the last layer, float32, [out, in]."""
    cfg = model.config
    module = nnx.merge(model.graphdef, model.state)
    layers = module.layers
    attn = layers.attn if cfg.scan_layers else layers[len(layers) - 1].attn

    def weight(proj_name):
        proj = getattr(attn, proj_name, None)
        kernel = getattr(proj, "kernel", None)
        if kernel is None:
            raise ValueError(
                f"LMS3: the last layer's attn.{proj_name} has no float 'kernel' "
                f"(linear kind {cfg.linear!r}); LMS3 needs the float projection weights"
            )
        k = np.asarray(kernel[...], np.float32)
        if cfg.scan_layers:
            k = k[-1]
        return k.T

    wq, wk, wv = weight("q_proj"), weight("k_proj"), weight("v_proj")
    D, Dh = cfg.d_model, cfg.dh
    want = {
        "q_proj": (cfg.n_heads * Dh, D),
        "k_proj": (cfg.n_kv_heads * Dh, D),
        "v_proj": (cfg.n_kv_heads * Dh, D),
    }
    for name, w in zip(want, (wq, wk, wv)):
        if w.shape != want[name]:
            raise ValueError(
                f"LMS3: last-layer {name} has shape {w.shape} [out, in]; expected {want[name]}"
            )
    return wq, wk, wv


def expand_kv(w_k: np.ndarray, n_heads: int, n_kv_heads: int) -> np.ndarray:
    """[K*Dh, D] -> [H*Dh, D]: KV head j's rows repeated for query heads j*G .. j*G + G - 1."""
    if n_heads % n_kv_heads:
        raise ValueError(
            f"expand_kv: {n_heads} query heads are not a multiple of {n_kv_heads} KV heads"
        )
    rows, d = w_k.shape
    if rows % n_kv_heads:
        raise ValueError(f"expand_kv: {rows} rows do not split into {n_kv_heads} KV heads")
    dh = rows // n_kv_heads
    return np.repeat(w_k.reshape(n_kv_heads, 1, dh, d), n_heads // n_kv_heads, axis=1).reshape(
        n_heads * dh, d
    )
