"""Attention ops: ``attention`` dispatches between the jnp reference and Pallas kernels.

``impl="ref" | "pallas"``; Pallas kernels run in interpret mode on CPU (``interpret=None``
picks it by platform). The Pallas kernels are registered by ``ops.attention.flash`` and
``ops.attention.decode`` when present.

``kv_layout="BSKD"`` (default) or ``"BKSD"`` (head-major, the dense KV cache's layout) says how
k/v are laid out; the flash kernel reads slot-major, so a head-major cache is swapped for it
(prefill only: one-token decode over the dense cache goes to ``ops.attention.decode``, which reads
the head-major cache directly).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from pallasite.ops.attention.reference import KV_LAYOUTS, NEG_INF, attention as reference_attention, attention_mask

_PALLAS_IMPLS: dict[str, Callable] = {}


def register_pallas(name: str, fn: Callable) -> None:
    _PALLAS_IMPLS[name] = fn


def default_interpret() -> bool:
    return jax.default_backend() == "cpu"


def attention(q_BTHD, k_BSKD, v_BSKD, *, impl: str = "ref", interpret: Optional[bool] = None,
              kv_layout: str = "BSKD", **kwargs):
    """Grouped-query attention; see ``reference.attention`` for the masking semantics."""
    if impl == "ref":
        return reference_attention(q_BTHD, k_BSKD, v_BSKD, kv_layout=kv_layout, **kwargs)
    if impl == "pallas":
        if "flash" not in _PALLAS_IMPLS:
            try:
                from pallasite.ops.attention import flash  # noqa: F401  (registers itself)
            except ImportError as e:
                raise NotImplementedError("attention impl='pallas' needs ops/attention/flash.py") from e
        if kv_layout == "BKSD":  # the flash kernel's BlockSpecs read [B, S, K, D]
            k_BSKD, v_BSKD = jnp.swapaxes(k_BSKD, 1, 2), jnp.swapaxes(v_BSKD, 1, 2)
        elif kv_layout not in KV_LAYOUTS:
            raise ValueError(f"attention: kv_layout={kv_layout!r}; expected one of {KV_LAYOUTS}")
        return _PALLAS_IMPLS["flash"](q_BTHD, k_BSKD, v_BSKD, interpret=interpret, **kwargs)
    raise ValueError(f"attention impl={impl!r}; expected 'ref' or 'pallas'")


__all__ = ["attention", "attention_mask", "reference_attention", "register_pallas", "default_interpret", "NEG_INF"]
