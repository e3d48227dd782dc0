"""Few-row matmul against weights stored in 16-column panels, for decoding on XLA:CPU.

``panel_matmul(x [..., K], w_packed [K, N])`` = ``x @ unpack(w_packed)``. ``pack`` reorders a
``[K, N]`` weight so that each 16-column panel's K rows lie contiguously (``reference.py``); the
shape stays ``[K, N]``. With a few rows (a decode step, a speculative verify of K + 1 tokens, a
small batch) a matmul is bound by streaming the weights. XLA:CPU runs one row as a mat-vec but two
or more through its GEMM, which streams the weights at under half that rate from 4 rows on
(docs/kernels.md, ``benchmarks/panels.py``). The CPU variant (``cpu.py``, ``panel_matmul.cc``, an XLA FFI
handler on the intra-op thread pool) streams every panel once and keeps its 16 output columns in
registers, so 4 rows cost about what 1 row costs.

``impl``: ``"cpu"`` the FFI kernel, ``"ref"`` the jnp reference (unpack + dot), None: the kernel on
CPU for float32 or bfloat16 weights and up to ``MAX_ROWS`` rows, else the reference (logged once
by ``ops.dispatch.warn_fallback`` where the kernel cannot serve the call). The kernel takes x as
float32 and sums in float32 (a bf16 weight is widened exactly: it halves the bytes read, not the
precision of the sums); the result is float32. There is no Pallas variant:
the layout exists for XLA:CPU; on TPU and GPU the reference's dot is XLA's own fused GEMM.
Gradients (``jax.custom_vjp``): dx = dy @ Wᵀ, dW = pack(xᵀ dy).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from pallasite.ops.dispatch import platform, warn_fallback
from pallasite.ops.panels import cpu
from pallasite.ops.panels.reference import PANEL, check_shape, pack, panel_matmul_reference, unpack

MAX_ROWS = 64  # more rows than this are compute-bound: XLA's GEMM (after an unpack) is the better tool
IMPLS = ("cpu", "ref")
KERNEL_DTYPES = ("float32", "bfloat16")  # weight dtypes the CPU kernel reads


def choose_impl(rows: int, weight_dtype, impl: Optional[str] = None) -> str:
    """Which implementation ``panel_matmul`` runs for ``rows`` rows against a weight of ``weight_dtype``."""
    if impl is not None:
        if impl not in IMPLS:
            raise ValueError(f"panel_matmul: impl={impl!r}; expected one of {IMPLS} or None")
        return impl
    if platform() != "cpu":
        warn_fallback("panel_matmul", f"the panel layout serves XLA:CPU; on {platform()} every call unpacks the "
                      "weights (use linear='float' there)")
        return "ref"
    if rows > MAX_ROWS:
        return "ref"
    if jnp.dtype(weight_dtype).name not in KERNEL_DTYPES:
        warn_fallback("panel_matmul", "the CPU kernel reads float32 or bfloat16 weights",
                      dtype=jnp.dtype(weight_dtype).name)
        return "ref"
    why = cpu.unavailable()
    if why is not None:
        warn_fallback("panel_matmul", why)
        return "ref"
    return "cpu"


def panel_matmul(x: jax.Array, w_packed_KN: jax.Array, *, impl: Optional[str] = None) -> jax.Array:
    """x [..., K] @ unpack(w_packed) -> [..., N] float32."""
    K, N = w_packed_KN.shape
    check_shape(K, N)
    if x.shape[-1] != K:
        raise ValueError(f"panel_matmul: x {x.shape} does not end in the weight's K = {K}")
    rows = math.prod(x.shape[:-1])
    chosen = choose_impl(rows, w_packed_KN.dtype, impl)
    y = _matmul(chosen, x.reshape(rows, K), w_packed_KN)
    return y.reshape(*x.shape[:-1], N)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _matmul(impl: str, x_MK, w_KN):
    if impl == "cpu":
        if cpu.unavailable() is not None:
            raise RuntimeError(f"panel_matmul impl='cpu': {cpu.unavailable()}")
        return cpu.panel_matmul_cpu(x_MK, w_KN)
    return panel_matmul_reference(x_MK, w_KN)


def _matmul_fwd(impl, x_MK, w_KN):
    return _matmul(impl, x_MK, w_KN), (x_MK, w_KN)


def _matmul_bwd(impl, res, dy_MN):
    x_MK, w_KN = res
    dy = dy_MN.astype(jnp.float32)
    dx = jnp.dot(dy, unpack(w_KN).astype(jnp.float32).T).astype(x_MK.dtype)
    dw = pack(jnp.dot(x_MK.astype(jnp.float32).T, dy)).astype(w_KN.dtype)
    return dx, dw


_matmul.defvjp(_matmul_fwd, _matmul_bwd)

__all__ = ["PANEL", "MAX_ROWS", "KERNEL_DTYPES", "pack", "unpack", "panel_matmul", "panel_matmul_reference",
           "choose_impl"]
