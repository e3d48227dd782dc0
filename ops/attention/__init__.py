"""Attention ops: ``attention`` dispatches between the jnp reference and Pallas kernels.

``impl="ref" | "pallas"``; Pallas kernels run in interpret mode on CPU (``interpret=None``
picks it by platform). The Pallas kernels are registered by ``ops.attention.flash`` and
``ops.attention.decode`` when present.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax

from pallasite.ops.attention.reference import NEG_INF, attention as reference_attention, attention_mask

_PALLAS_IMPLS: dict[str, Callable] = {}


def register_pallas(name: str, fn: Callable) -> None:
    _PALLAS_IMPLS[name] = fn


def default_interpret() -> bool:
    return jax.default_backend() == "cpu"


def attention(q_BTHD, k_BSKD, v_BSKD, *, impl: str = "ref", interpret: Optional[bool] = None, **kwargs):
    """Grouped-query attention; see ``reference.attention`` for the masking semantics."""
    if impl == "ref":
        return reference_attention(q_BTHD, k_BSKD, v_BSKD, **kwargs)
    if impl == "pallas":
        if "flash" not in _PALLAS_IMPLS:
            try:
                from pallasite.ops.attention import flash  # noqa: F401  (registers itself)
            except ImportError as e:
                raise NotImplementedError("attention impl='pallas' needs ops/attention/flash.py") from e
        return _PALLAS_IMPLS["flash"](q_BTHD, k_BSKD, v_BSKD, interpret=interpret, **kwargs)
    raise ValueError(f"attention impl={impl!r}; expected 'ref' or 'pallas'")


__all__ = ["attention", "attention_mask", "reference_attention", "register_pallas", "default_interpret", "NEG_INF"]
