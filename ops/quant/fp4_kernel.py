"""Fused FP4 row quantizer as a Pallas kernel (Wang et al., ICML 2025; see ``ops/quant/fp4.py``).

One program owns ``block_rows`` whole rows: (OCC: per-row clamp threshold by bisection on the
float bits — the exact (n+1)-th largest |x|, equal to ``lax.top_k`` — then the clamp and the
residual ΔY) -> row absmax -> scale (exact or power of two) -> E2M1 (or E4M3) rounding -> the grid
values as FP8 E4M3 plus the dequant scale 1/sf per row. The arithmetic is the reference's own
(``fp4.quantize_block``), so the kernel equals ``quantize_rows_ref`` bit for bit.

Variants, picked by ``ops.dispatch.pick_variant(interpret)`` like every kernel (docs/kernels.md):

* GPU (Triton, ``triton_params``): K zero-padded to a power of two, ``block_rows`` a power of two
  sized so a block stays near 8K elements (registers).
* TPU (Mosaic): K padded to a multiple of 128 (lanes), ``block_rows`` a multiple of 32 (sublanes
  of the 8-bit output) sized for a ~4 MiB VMEM working set, ``dimension_semantics=("parallel",)``.
* CPU: the GPU layout in the generic interpreter; ``pltpu.InterpretParams`` runs the TPU variant
  in the TPU interpreter.

Zero padding is exact: padded columns neither change the absmax nor the k-th largest |x| (k ≤ K),
padded rows are sliced away. Scales and thresholds are written lane-dense ([rows, 128]) and the
wrapper keeps column 0. Both variants are in the compile matrix (``benchmarks/kernel_matrix.py``);
neither has run on GPU/TPU hardware yet.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallasite.ops import dispatch
from pallasite.ops.common import next_pow2, pad_axis, round_up
from pallasite.ops.quant import fp4

LANES = 128
IMPLS = ("auto", "ref", "pallas")


def _block_shape(n_rows: int, k: int, variant: str) -> tuple[int, int]:
    """(block_rows, padded K) of one program."""
    if variant == "gpu":
        kp = next_pow2(k, 16)
        rows = max(1, min(16, 8192 // kp))
        return 1 << (rows.bit_length() - 1), kp
    kp = round_up(k, LANES)
    # x f32 + q 8-bit + residual, double-buffered; rows a multiple of 32 (8-bit sublane tiling)
    rows = max(32, min(256, (4 << 20) // (kp * 16) // 32 * 32))
    return min(rows, round_up(n_rows, 32)), kp


def _kernel(x_ref, q_ref, d_ref, *occ_refs, fmt, scale, kth):
    x = x_ref[...].astype(jnp.float32)
    threshold = None
    if kth is not None:
        r_ref, t_ref = occ_refs
        threshold = fp4.kth_largest_bisect(jnp.abs(x), kth)
    q, inv, residual = fp4.quantize_block(x, fmt, scale, threshold)
    q_ref[...] = q.astype(q_ref.dtype)
    d_ref[...] = jnp.broadcast_to(inv, d_ref.shape)
    if kth is not None:
        r_ref[...] = residual.astype(r_ref.dtype)
        t_ref[...] = jnp.broadcast_to(threshold, t_ref.shape)


@functools.partial(jax.jit, static_argnames=("fmt", "scale", "occ_alpha", "q_dtype", "interpret"))
def quantize_rows_pallas(
    x_NK: jax.Array,
    *,
    fmt: str = "e2m1",
    scale: str = "exact",
    occ_alpha: Optional[float] = None,
    q_dtype=jnp.float8_e4m3fn,
    interpret=None,
) -> fp4.RowQuant:
    """The fused kernel on 2-D rows ``x [N, K]``; same outputs as ``fp4.quantize_rows_ref``.
    ``interpret``: None (by platform), True, False or a ``pltpu.InterpretParams``."""
    fp4.check_format(fmt, scale)
    if x_NK.ndim != 2:
        raise ValueError(f"quantize_rows_pallas: expected x [N, K], got shape {x_NK.shape}")
    variant = dispatch.pick_variant(interpret)
    N, K = x_NK.shape
    bm, kp = _block_shape(N, K, variant.kind)
    np_ = round_up(N, bm)
    x = pad_axis(pad_axis(x_NK, 0, np_), 1, kp)
    kth = None if occ_alpha is None else fp4.n_clamped(occ_alpha, K) + 1
    row_block = pl.BlockSpec((bm, kp), lambda i: (i, 0))
    lane_block = pl.BlockSpec((bm, LANES), lambda i: (i, 0))
    out_shape = [
        jax.ShapeDtypeStruct((np_, kp), q_dtype),
        jax.ShapeDtypeStruct((np_, LANES), jnp.float32),
    ]
    out_specs = [row_block, lane_block]
    if kth is not None:
        out_shape += [
            jax.ShapeDtypeStruct((np_, kp), x_NK.dtype),
            jax.ShapeDtypeStruct((np_, LANES), jnp.float32),
        ]
        out_specs += [row_block, lane_block]
    if variant.kind == "tpu":
        params = pltpu.CompilerParams(dimension_semantics=("parallel",))
    else:
        params = dispatch.triton_params(variant.interpret)
    outs = pl.pallas_call(
        functools.partial(_kernel, fmt=fmt, scale=scale, kth=kth),
        grid=(np_ // bm,),
        in_specs=[row_block],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=variant.interpret,
        compiler_params=params,
        name="fp4_quantize_rows",
    )(x)
    q, inv = outs[0][:N, :K], outs[1][:N, :1]
    if kth is None:
        return fp4.RowQuant(q, inv)
    return fp4.RowQuant(q, inv, outs[2][:N, :K], outs[3][:N, :1])


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"fp4 quantizer impl={impl!r}; expected one of {IMPLS}")
    if impl == "auto":  # interpret-mode Pallas on CPU proves correctness, not speed
        return "ref" if dispatch.platform() == "cpu" else "pallas"
    return impl


def quantize_rows(
    x: jax.Array,
    *,
    fmt: str = "e2m1",
    scale: str = "exact",
    occ_alpha: Optional[float] = None,
    select: str = "auto",
    impl: str = "auto",
    q_dtype=jnp.float8_e4m3fn,
    interpret=None,
) -> fp4.RowQuant:
    """Quantize the rows of ``x [..., K]`` (per-row absmax scales, optional OCC): the reference or
    the fused Pallas kernel (``impl``); leading axes are kept."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if resolve_impl(impl) == "ref":
        rq = fp4.quantize_rows_ref(
            x2, fmt=fmt, scale=scale, occ_alpha=occ_alpha, select=select, q_dtype=q_dtype
        )
    else:
        rq = quantize_rows_pallas(
            x2,
            fmt=fmt,
            scale=scale,
            occ_alpha=occ_alpha,
            q_dtype=q_dtype,
            interpret=interpret,
        )
    return fp4.RowQuant(*(None if a is None else a.reshape(*lead, a.shape[-1]) for a in rq))


__all__ = [
    "quantize_rows",
    "quantize_rows_pallas",
    "resolve_impl",
    "IMPLS",
]
