"""CateKV offline head masks: calibration from per-sample CVs (official ``select_headmask/static.py``)
and the mask file (JSON with the model shape, so a mask for another model fails clearly).

Per calibration sample the heads with ``CV <= quantile(CV, r)`` get a vote; the ``⌈r·L·K⌉``
most-voted heads are adaptive (1 = adaptive, as the shipped ``head_type_p{100r}.csv``). Deviation:
static.py keeps every head tied with the cut-off count, which can exceed ``⌈r·L·K⌉``; ties are broken
by the mean CV (lower = adaptive) so the count — and the memory — is exact.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

import numpy as np

from pallasite.inference.cache.catekv_select import CateKVConfig

_MASK_FORMAT = "pallasite.catekv.head_mask/v1"


def calibrate_head_mask(cv_SLK, r: float, *, per_layer: bool = False) -> np.ndarray:
    """Offline mask from per-sample CV matrices [samples, L, K] -> bool [L, K] (True = adaptive)."""
    cv = np.asarray(cv_SLK, np.float64)
    if cv.ndim != 3:
        raise ValueError(f"calibrate_head_mask: expected CV of shape [samples, layers, kv_heads], got {cv.shape}")
    if not 0.0 < r <= 1.0:
        raise ValueError(f"calibrate_head_mask: r={r} must be a fraction of heads in (0, 1]")
    S, L, K = cv.shape
    # a head with no finite CV in any sample was not measured (a sliding-window layer: served with
    # every head adaptive, init_catekv_cache); r is the fraction of the measured heads
    finite = np.isfinite(cv)
    eligible = finite.any(axis=0)
    if not eligible.any():
        raise ValueError("calibrate_head_mask: no head has a finite CV in any sample")
    votes = np.zeros((L, K))
    for m in cv:  # static.py: per sample, the r-quantile lowest-CV heads
        thr = np.nanquantile(m, r)
        votes += np.nan_to_num(m, nan=np.inf) <= thr
    mean_cv = np.where(eligible, np.where(finite, cv, 0.0).sum(0) / np.maximum(finite.sum(0), 1), np.inf)
    mask = np.zeros((L, K), bool)
    if per_layer:  # round(r·K) per layer (r·K is rarely whole: SmolLM2 has K = 3)
        n_keep = int(round(r * K))
        for layer in np.flatnonzero(eligible.any(axis=1)):
            order = np.lexsort((mean_cv[layer], -votes[layer]))
            mask[layer, order[:n_keep]] = True
    else:
        n_keep = int(math.ceil(r * eligible.sum()))
        order = np.lexsort((mean_cv.ravel(), -votes.ravel()))  # most votes first, then lowest mean CV
        order = order[eligible.ravel()[order]]
        mask.ravel()[order[:n_keep]] = True
    return mask


def _mask_meta(cfg) -> dict:
    return {"n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads, "n_heads": cfg.n_heads,
            "d_model": cfg.d_model, "head_dim": cfg.dh, "vocab_size": cfg.vocab_size}


MASK_FILE = "catekv_head_mask.json"


def save_head_mask(path: str, mask_LK, model_cfg, catekv_cfg: Optional[CateKVConfig] = None,
                   extra: Optional[dict] = None, cv_samples=None) -> str:
    """Write the mask as JSON (a directory gets ``catekv_head_mask.json``) with the model shape;
    with ``cv_samples`` [samples, L, K] the file can serve any other r (``load_head_mask``)."""
    mask = np.asarray(mask_LK).astype(bool)
    if mask.shape != (model_cfg.n_layers, model_cfg.n_kv_heads):
        raise ValueError(f"save_head_mask: mask shape {mask.shape} != (n_layers, n_kv_heads) = "
                         f"{(model_cfg.n_layers, model_cfg.n_kv_heads)}")
    if os.path.isdir(path):
        path = os.path.join(path, MASK_FILE)
    doc = {"format": _MASK_FORMAT, "model": _mask_meta(model_cfg), "adaptive_fraction": float(mask.mean()),
           "mask_adaptive": mask.astype(int).tolist(),
           "catekv": None if catekv_cfg is None else dataclasses.asdict(catekv_cfg), "extra": extra or {},
           "cv_samples": None if cv_samples is None else np.asarray(cv_samples, np.float64).tolist()}
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def load_head_mask(path: str, model_cfg, adaptive_ratio: Optional[float] = None) -> np.ndarray:
    """Read a mask written by ``save_head_mask``; a mask for another model shape fails clearly.
    ``adaptive_ratio`` (r): re-derived from the stored per-sample CVs, or checked against the mask."""
    if os.path.isdir(path):
        path = os.path.join(path, MASK_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"CateKV head mask {path!r} does not exist")
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != _MASK_FORMAT:
        raise ValueError(f"load_head_mask: {path} is not a CateKV head mask (format {doc.get('format')!r}, "
                         f"expected {_MASK_FORMAT!r})")
    want, got = _mask_meta(model_cfg), doc["model"]
    diff = {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]}
    if diff:
        raise ValueError(f"load_head_mask: {path} was calibrated for another model shape; "
                         f"(mask, model) differ in {diff}")
    mask = np.asarray(doc["mask_adaptive"], bool)
    if mask.shape != (model_cfg.n_layers, model_cfg.n_kv_heads):
        raise ValueError(f"load_head_mask: mask array in {path} has shape {mask.shape}, expected "
                         f"{(model_cfg.n_layers, model_cfg.n_kv_heads)}")
    if adaptive_ratio is None or int(mask.sum()) == int(math.ceil(adaptive_ratio * mask.size)):
        return mask
    if doc.get("cv_samples") is not None:
        return calibrate_head_mask(np.asarray(doc["cv_samples"], np.float64), adaptive_ratio)
    raise ValueError(f"load_head_mask: {path} holds a mask with adaptive fraction {mask.mean():.3f} and no "
                     f"calibration CVs, so it cannot serve r={adaptive_ratio}; recalibrate at that r")
