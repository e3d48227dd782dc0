"""Attention ops: ``attention(q, k, v, *, impl, kv_layout, interpret, **mask_kwargs)``.

``impl`` is a kind of the ``pallasite.registry.ATTENTION`` seam, registered here: ``"ref"`` (the jnp
reference, ``reference.attention``) and ``"pallas"`` (``flash.flash_attention``, whose variant —
TPU Mosaic, GPU Triton, CPU interpreter — ``ops.dispatch`` picks). ``kv_layout="BSKD"`` (default)
or ``"BKSD"`` (head-major, the dense KV cache's layout) says how k / v are laid out; both paths read
either. ``decode_attention_dense`` is the one-token decode over a dense cache (split-K kernel,
``ops.attention.decode``); ``decode_attention`` takes any ``KVSource``.
"""

from __future__ import annotations

from typing import Any, Optional

from pallasite.ops.attention.decode import decode_attention, decode_attention_dense
from pallasite.ops.attention.flash import flash_attention
from pallasite.ops.attention.reference import KV_LAYOUTS, NEG_INF, attention_mask
from pallasite.ops.attention.reference import attention as reference_attention
from pallasite.registry import ATTENTION


def _ref_impl(q_BTHD, k, v, *, kv_layout="BSKD", interpret=None, **mask_kwargs):
    del interpret  # the reference has no kernel
    return reference_attention(q_BTHD, k, v, kv_layout=kv_layout, **mask_kwargs)


def _pallas_impl(q_BTHD, k, v, *, kv_layout="BSKD", interpret=None, **mask_kwargs):
    return flash_attention(q_BTHD, k, v, kv_layout=kv_layout, interpret=interpret, **mask_kwargs)


ATTENTION.register("ref", _ref_impl)
ATTENTION.register("pallas", _pallas_impl)


def attention(
    q_BTHD,
    k,
    v,
    *,
    impl: str = "ref",
    kv_layout: str = "BSKD",
    interpret: Optional[Any] = None,
    **mask_kwargs,
):
    """Grouped-query attention with the impl registered as ``impl``; see ``reference.attention``
    for the masking semantics (positions, segments, key validity, sliding window)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"attention: kv_layout={kv_layout!r}; expected one of {KV_LAYOUTS}")
    return ATTENTION.get(impl, field="impl")(
        q_BTHD, k, v, kv_layout=kv_layout, interpret=interpret, **mask_kwargs
    )


__all__ = [
    "attention",
    "attention_mask",
    "reference_attention",
    "flash_attention",
    "decode_attention",
    "decode_attention_dense",
    "NEG_INF",
    "KV_LAYOUTS",
]
