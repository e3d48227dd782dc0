"""Fused Kronecker transform + per-token int4 quantization (FlatQuant, Sun et al. ICML 2025, §3.2
"Kernel fusion"; official Triton kernel ``deploy/kernels/kron_matmul.py``).

Per token ``x ∈ R^n``, ``n = n1·n2``: ``Y = P1ᵀ · reshape(x, n1×n2) · P2`` (row-major reshape;
equals ``x @ kron(P1, P2)``), then the symmetric per-token quantizer of ``ops.quant.quantizers``
with the learned activation clip (sigmoid factors), round half to even, clamp to [-8, 7], two
nibbles per byte -> ``uint8 [T, n/2]`` + ``scale float32 [T]``. GPU variant (here): ``[T·n1p,
n2p]`` rows (factors zero-padded to powers of two >= 16 / 32 for Triton's dot), ``P2`` split into
even / odd columns so packing is two dots and shifts, a ``fori_loop`` over the ``block_t`` tokens
of a program. TPU variant: ``kron_quant_tpu`` (batched left product, ``block_t`` 32). Zero
padding is exact.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import pallasite.ops.quant.kron_quant_tpu as kron_quant_tpu
from pallasite.ops.common import next_pow2
from pallasite.ops.dispatch import pick_variant, triton_params
from pallasite.ops.quant.quantizers import pack_int4, qrange_sym, round_half_even  # noqa: F401 (re-export)


def kron_transform_ref(x_TN: jax.Array, p1: jax.Array, p2: jax.Array) -> jax.Array:
    """``P1ᵀ · reshape(x, n1×n2) · P2`` per token, flattened back (== ``x @ kron(P1, P2)``)."""
    n1, n2 = p1.shape[0], p2.shape[0]
    lead = x_TN.shape[:-1]
    if x_TN.shape[-1] != n1 * n2:
        raise ValueError(f"kron transform: last axis {x_TN.shape[-1]} != {n1}×{n2}")
    X = x_TN.reshape(*lead, n1, n2)
    Y = jnp.einsum("ai,...ak,kb->...ib", p1, X, p2)
    return Y.reshape(*lead, n1 * n2)


def kron_quantize_ref(x_TN, p1, p2, clip_logits: Optional[jax.Array] = None, *, bits: int = 4):
    """Reference: transform in float32, then the per-token symmetric quantizer, then pack."""
    y = kron_transform_ref(x_TN.astype(jnp.float32), p1.astype(jnp.float32), p2.astype(jnp.float32))
    return quantize_rows_packed(y, clip_logits, bits=bits)


def quantize_rows_packed(y_TN, clip_logits: Optional[jax.Array] = None, *, bits: int = 4):
    """The quantize + pack half of ``kron_quantize_ref`` on already-transformed rows: lets linears
    that share one transformed input but have their own clip logits quantize it separately."""
    cmax, cmin = _clip_factors(clip_logits)
    q, scale = _quant_rows(y_TN.astype(jnp.float32), cmax, cmin, bits)
    return pack_int4(q), scale[..., 0]


def _clip_factors(clip_logits):
    if clip_logits is None:
        return jnp.float32(1.0), jnp.float32(1.0)
    f = jax.nn.sigmoid(jnp.asarray(clip_logits, jnp.float32))
    return f[0], f[1]


def _quant_rows(y, cmax, cmin, bits):
    qmin, qmax = qrange_sym(bits)
    xmax = jnp.maximum(jnp.max(y, axis=-1, keepdims=True), 0.0) * cmax
    xmin = jnp.minimum(jnp.min(y, axis=-1, keepdims=True), 0.0) * cmin
    amax = jnp.maximum(-xmin, xmax)
    scale = jnp.where(amax == 0, 1.0, amax / qmax)
    q = jnp.minimum(jnp.maximum(round_half_even(y / scale), qmin), qmax).astype(jnp.int8)
    return q, scale


def _kron_quant_kernel(
    x_ref, p1t_ref, p2e_ref, p2o_ref, c_ref, q_ref, s_ref, *, n1p, block_t, bits
):
    qmin, qmax = qrange_sym(bits)
    p1t = p1t_ref[...]
    p2e = p2e_ref[...]
    p2o = p2o_ref[...]
    cmax = c_ref[0]
    cmin = c_ref[1]

    def body(t, scales):
        rows = pl.ds(t * n1p, n1p)
        X = x_ref[rows, :]
        Z = jnp.dot(p1t, X, preferred_element_type=jnp.float32)
        ye = jnp.dot(Z, p2e, preferred_element_type=jnp.float32)
        yo = jnp.dot(Z, p2o, preferred_element_type=jnp.float32)
        xmax = jnp.maximum(jnp.maximum(jnp.max(ye), jnp.max(yo)), 0.0) * cmax
        xmin = jnp.minimum(jnp.minimum(jnp.min(ye), jnp.min(yo)), 0.0) * cmin
        amax = jnp.maximum(-xmin, xmax)
        scale = jnp.where(amax == 0, 1.0, amax / qmax)
        qe = jnp.minimum(jnp.maximum(round_half_even(ye / scale), qmin), qmax).astype(jnp.int32)
        qo = jnp.minimum(jnp.maximum(round_half_even(yo / scale), qmin), qmax).astype(jnp.int32)
        q_ref[rows, :] = ((qe & 0xF) | ((qo & 0xF) << 4)).astype(jnp.uint8)
        idx = jax.lax.broadcasted_iota(jnp.int32, (block_t,), 0)
        return jnp.where(idx == t, scale, scales)

    scales = jax.lax.fori_loop(0, block_t, body, jnp.zeros((block_t,), jnp.float32))
    s_ref[...] = scales


@functools.partial(jax.jit, static_argnames=("bits", "block_t", "interpret"))
def _kron_quantize_pallas(x_TN, p1, p2, clip_logits, *, bits, block_t, interpret):
    T, N = x_TN.shape
    n1, n2 = p1.shape[0], p2.shape[0]
    n1p, n2p = next_pow2(n1, 16), next_pow2(n2, 32)
    Tp = pl.cdiv(T, block_t) * block_t
    X = x_TN.astype(jnp.float32).reshape(T, n1, n2)
    X = jnp.pad(X, ((0, Tp - T), (0, n1p - n1), (0, n2p - n2))).reshape(Tp * n1p, n2p)
    p1t = jnp.pad(p1.astype(jnp.float32), ((0, n1p - n1), (0, n1p - n1))).T
    p2p = jnp.pad(p2.astype(jnp.float32), ((0, n2p - n2), (0, n2p - n2)))
    p2e, p2o = p2p[:, 0::2], p2p[:, 1::2]
    cmax, cmin = _clip_factors(clip_logits)
    c = jnp.stack([cmax, cmin]).astype(jnp.float32)
    kernel = functools.partial(_kron_quant_kernel, n1p=n1p, block_t=block_t, bits=bits)
    q, s = pl.pallas_call(
        kernel,
        grid=(Tp // block_t,),
        in_specs=[
            pl.BlockSpec((block_t * n1p, n2p), lambda i: (i, 0)),
            pl.BlockSpec((n1p, n1p), lambda i: (0, 0)),
            pl.BlockSpec((n2p, n2p // 2), lambda i: (0, 0)),
            pl.BlockSpec((n2p, n2p // 2), lambda i: (0, 0)),
            pl.BlockSpec((2,), lambda i: (0,)),
        ],
        out_specs=[
            pl.BlockSpec((block_t * n1p, n2p // 2), lambda i: (i, 0)),
            pl.BlockSpec((block_t,), lambda i: (i,)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((Tp * n1p, n2p // 2), jnp.uint8),
            jax.ShapeDtypeStruct((Tp,), jnp.float32),
        ],
        interpret=interpret,
        compiler_params=triton_params(interpret),
        name="pallasite_kron_quant",
    )(X, p1t, p2e, p2o, c)
    q = q.reshape(Tp, n1p, n2p // 2)[:T, :n1, : n2 // 2].reshape(T, N // 2)
    return q, s[:T]


def kron_quantize(
    x,
    p1,
    p2,
    clip_logits=None,
    *,
    bits: int = 4,
    impl: str = "pallas",
    interpret=None,
    block_t: Optional[int] = None,
):
    """Fused ``P1ᵀ X P2`` + per-token int4 quantize + pack: x [..., n] → (uint8 [..., n/2], f32
    [...]).
    ``block_t`` tokens per program: None takes the variant's default (GPU 16, TPU 32)."""
    if bits != 4:
        raise ValueError(f"kron_quantize packs int4 nibbles; bits={bits} is not supported")
    if impl not in ("ref", "pallas"):
        raise ValueError(f"kron_quantize impl={impl!r}; expected 'ref' or 'pallas'")
    n1, n2 = p1.shape[0], p2.shape[0]
    if x.shape[-1] != n1 * n2:
        raise ValueError(f"kron_quantize: last axis {x.shape[-1]} != {n1}×{n2}")
    if n2 % 2:
        raise ValueError(
            f"kron_quantize: the right factor size n2={n2} must be even to pack nibble pairs"
        )
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if impl == "ref":
        q, s = kron_quantize_ref(x2, p1, p2, clip_logits, bits=bits)
    else:
        variant = pick_variant(interpret)
        if variant.kind == "tpu":
            q, s = kron_quant_tpu.kron_quantize(
                x2,
                p1,
                p2,
                jnp.stack(_clip_factors(clip_logits)),
                bits=bits,
                block_t=block_t or kron_quant_tpu.DEFAULT_BLOCK_T,
                interpret=variant.interpret,
            )
        else:
            q, s = _kron_quantize_pallas(
                x2,
                p1,
                p2,
                clip_logits,
                bits=bits,
                block_t=block_t or 16,
                interpret=variant.interpret,
            )
    return q.reshape(*lead, -1), s.reshape(lead)
