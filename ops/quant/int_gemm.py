"""Int4 × int4 GEMM with an int32 accumulator and a dequantization epilogue (FlatQuant's
``Linear4bit`` after the fused transform+quantize kernel; Sun et al., ICML 2025):
``y[t, o] = (Σ_k xq[t, k] · wq[k, o]) · x_scale[t] · w_scale[o] (+ bias[o])``.

Activations come packed along K as ``kron_quantize`` emits them (``uint8 [T, K/2]``, element 2j
in the low nibble), weights packed along K too (``uint8 [K/2, N]``, ``pack_weight_int4``). Nibbles
are unpacked into int8 containers (Hopper has int8 but no int4 tensor cores; the TPU MXU's
integer path likewise) and the reduction splits into even and odd halves, ``Σ_k = Σ_j xe·We +
Σ_j xo·Wo``, so nothing is interleaved. GPU variant (here): grid over (token, output) blocks, a
``fori_loop`` over K. TPU variant: ``int_gemm_tpu`` (K on the grid, VMEM int32 accumulator).
Sizes are zero-padded to the blocks (a zero byte is two zero nibbles: exact).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import pallasite.ops.quant.int_gemm_tpu as int_gemm_tpu
from pallasite.ops.dispatch import pick_variant, triton_params
from pallasite.ops.quant.int_gemm_tpu import nibbles_i8
from pallasite.ops.quant.quantizers import pack_int4, unpack_int4


def pack_weight_int4(wq_KN: jax.Array) -> jax.Array:
    """int values [K, N] → uint8 [K/2, N], pairs (2j, 2j+1) along K."""
    return pack_int4(wq_KN.T).T


def unpack_weight_int4(wp: jax.Array) -> jax.Array:
    return unpack_int4(wp.T).T


def int_gemm_ref(xq_packed, x_scale_T, wq_packed, w_scale_N, bias_N=None):
    """Reference: unpack, exact integer matmul, float32 epilogue.

    The products of int4 values are at most 64 in magnitude, so for K < 2^18 every partial sum
    is an integer below 2^24 and a float32 matmul is *exact* — and far faster than an int32
    matmul on XLA:CPU (used for perplexity runs)."""
    K = 2 * xq_packed.shape[-1]
    if K * 64 >= 2**24:
        raise ValueError(f"int_gemm_ref: K={K} too large for an exact float32 accumulation")
    xq = unpack_int4(xq_packed).astype(jnp.float32)
    wq = unpack_weight_int4(wq_packed).astype(jnp.float32)
    acc = jnp.dot(xq, wq, precision=jax.lax.Precision.HIGHEST)
    y = (
        acc.astype(jnp.float32)
        * x_scale_T.astype(jnp.float32)[:, None]
        * w_scale_N.astype(jnp.float32)[None, :]
    )
    if bias_N is not None:
        y = y + bias_N.astype(jnp.float32)[None, :]
    return y


def _int_gemm_kernel(x_ref, xs_ref, w_ref, ws_ref, b_ref, o_ref, *, block_k, n_k):
    bm, bn = o_ref.shape

    def body(kb, acc):
        cols = pl.ds(kb * block_k, block_k)
        xe, xo = nibbles_i8(x_ref[:, cols])
        we, wo = nibbles_i8(w_ref[cols, :])
        acc = acc + jnp.dot(xe, we, preferred_element_type=jnp.int32)
        return acc + jnp.dot(xo, wo, preferred_element_type=jnp.int32)

    acc = jax.lax.fori_loop(0, n_k, body, jnp.zeros((bm, bn), jnp.int32))
    y = acc.astype(jnp.float32) * xs_ref[...][:, None] * ws_ref[...][None, :]
    o_ref[...] = y + b_ref[...][None, :]


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def _int_gemm_pallas(
    xq_packed, x_scale, wq_packed, w_scale, bias, *, block_m, block_n, block_k, interpret
):
    T, K2 = xq_packed.shape
    N = wq_packed.shape[1]
    Tp = pl.cdiv(T, block_m) * block_m
    Np = pl.cdiv(N, block_n) * block_n
    K2p = pl.cdiv(K2, block_k) * block_k
    x = jnp.pad(xq_packed, ((0, Tp - T), (0, K2p - K2)))
    w = jnp.pad(wq_packed, ((0, K2p - K2), (0, Np - N)))
    xs = jnp.pad(x_scale.astype(jnp.float32), (0, Tp - T))
    ws = jnp.pad(w_scale.astype(jnp.float32), (0, Np - N))
    b = jnp.pad(bias.astype(jnp.float32), (0, Np - N))
    kernel = functools.partial(_int_gemm_kernel, block_k=block_k, n_k=K2p // block_k)
    y = pl.pallas_call(
        kernel,
        grid=(Tp // block_m, Np // block_n),
        in_specs=[
            pl.BlockSpec((block_m, K2p), lambda i, j: (i, 0)),
            pl.BlockSpec((block_m,), lambda i, j: (i,)),
            pl.BlockSpec((K2p, block_n), lambda i, j: (0, j)),
            pl.BlockSpec((block_n,), lambda i, j: (j,)),
            pl.BlockSpec((block_n,), lambda i, j: (j,)),
        ],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Tp, Np), jnp.float32),
        interpret=interpret,
        compiler_params=triton_params(interpret),
        name="pallasite_int_gemm",
    )(x, xs, w, ws, b)
    return y[:T, :N]


def int_gemm(
    xq_packed,
    x_scale,
    wq_packed,
    w_scale,
    bias=None,
    *,
    impl: str = "pallas",
    interpret=None,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    block_k: Optional[int] = None,
):
    """xq_packed uint8 [..., K/2], x_scale [...], wq_packed uint8 [K/2, N], w_scale [N] → float32
    [..., N]. Blocks: None takes the variant's defaults (GPU 16 / 64 / 32, TPU 128 / 256 / 512
    packed bytes)."""
    lead = xq_packed.shape[:-1]
    if xq_packed.shape[-1] != wq_packed.shape[0]:
        raise ValueError(
            f"int_gemm: packed K mismatch, activations {xq_packed.shape} vs weights "
            f"{wq_packed.shape}"
        )
    if impl not in ("ref", "pallas"):
        raise ValueError(f"int_gemm impl={impl!r}; expected 'ref' or 'pallas'")
    x2 = xq_packed.reshape(-1, xq_packed.shape[-1])
    s2 = x_scale.reshape(-1)
    N = wq_packed.shape[1]
    if impl == "ref":
        y = int_gemm_ref(x2, s2, wq_packed, w_scale, bias)
    else:
        variant = pick_variant(interpret)
        b = jnp.zeros((N,), jnp.float32) if bias is None else bias
        impl_fn, defaults = (
            (int_gemm_tpu.int_gemm, int_gemm_tpu.DEFAULT_BLOCKS)
            if variant.kind == "tpu"
            else (_int_gemm_pallas, (16, 64, 32))
        )
        y = impl_fn(
            x2,
            s2,
            wq_packed,
            w_scale,
            b,
            block_m=block_m or defaults[0],
            block_n=block_n or defaults[1],
            block_k=block_k or defaults[2],
            interpret=variant.interpret,
        )
    return y.reshape(*lead, N)
