"""Decode attention over a 4-bit KV cache, dequantizing inside the kernel (FlatQuant W4A4KV4,
Sun et al. ICML 2025; the official deployment uses a FlashInfer int4-KV decode kernel).

Cache (head-major, owned by ``inference/cache/kv4.py``): codes ``uint8 [B, K, S, Dh/2]`` (asymmetric
4-bit in [0, 15], channel 2j in the low nibble), ``scale float32 [B, K, S, G]``, ``zero uint8
[B, K, S, G]`` with ``G = Dh / min(128, Dh)`` groups per head; dequant ``scale · (code − zero)``.
Masking by position as ``ops/attention/reference.py`` (slot ``s`` visible iff ``s <= pos`` and
``pos - s < window``). GPU variant: this module's kernel, grid ``(B, K)``, even / odd channel
halves, online softmax over ``block_s`` slots. TPU variant: the shared split-K decode kernel
(``ops.attention.decode``) with ``kv4_source``'s codec, which folds scale and zero into the two
products (``s = scale·(q·codes − zero·Σq)``). Kernels serve one group per head (Dh <= 128); more
groups run the reference, with one logged warning.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallasite.ops.attention.decode import decode_attention
from pallasite.ops.attention.kv_source import KVSource, TPUCodec
from pallasite.ops.attention.reference import NEG_INF
from pallasite.ops.attention.reference import attention as reference_attention
from pallasite.ops.common import dot
from pallasite.ops.dispatch import pick_variant, triton_params, warn_fallback
from pallasite.ops.quant.quantizers import dequantize_kv_asym, unpack_int4


def dequantize_cache_bksd(q_BKSD2, scale_BKSG, zero_BKSG, dtype=jnp.float32):
    """[B, K, S, Dh/2] packed + [B, K, S, G] → float [B, S, K, Dh] (the dense-cache layout)."""
    codes = unpack_int4(q_BKSD2, signed=False).astype(jnp.uint8)
    Dh = codes.shape[-1]
    G = scale_BKSG.shape[-1]
    x = dequantize_kv_asym(codes, scale_BKSG, zero_BKSG, group=Dh // G, dtype=dtype)
    return jnp.swapaxes(x, 1, 2)


def kv4_decode_attention_ref(
    q_BTHD,
    k_q,
    k_scale,
    k_zero,
    v_q,
    v_scale,
    v_zero,
    q_positions_BT,
    *,
    sliding_window: Optional[int] = None,
):
    k = dequantize_cache_bksd(k_q, k_scale, k_zero)
    v = dequantize_cache_bksd(v_q, v_scale, v_zero)
    return reference_attention(
        q_BTHD.astype(jnp.float32),
        k,
        v,
        q_positions_BT=q_positions_BT,
        causal=True,
        sliding_window=sliding_window,
    ).astype(q_BTHD.dtype)


def _decode_kernel(
    qe_ref,
    qo_ref,
    pos_ref,
    kq_ref,
    ks_ref,
    kz_ref,
    vq_ref,
    vs_ref,
    vz_ref,
    oe_ref,
    oo_ref,
    *,
    block_s,
    n_s,
    window,
):
    gp, d2 = qe_ref.shape
    qe = qe_ref[...]
    qo = qo_ref[...]
    pos = pos_ref[...]

    def deq(q_ref, s_ref, z_ref, sl):
        p = q_ref[sl, :].astype(jnp.int32) & 0xFF
        s = s_ref[sl].astype(jnp.float32)[:, None]
        z = z_ref[sl].astype(jnp.float32)[:, None]
        lo = (p & 0xF).astype(jnp.float32)
        hi = ((p >> 4) & 0xF).astype(jnp.float32)
        return (lo - z) * s, (hi - z) * s

    def body(sb, carry):
        m, denom, acc_e, acc_o = carry
        sl = pl.ds(sb * block_s, block_s)
        ke, ko = deq(kq_ref, ks_ref, kz_ref, sl)
        dims = (((1,), (1,)), ((), ()))
        logits = jax.lax.dot_general(qe, ke, dims, preferred_element_type=jnp.float32)
        logits += jax.lax.dot_general(qo, ko, dims, preferred_element_type=jnp.float32)
        slot = sb * block_s + jax.lax.broadcasted_iota(jnp.int32, (gp, block_s), 1)
        visible = slot <= pos[:, None]
        if window is not None:
            visible &= (pos[:, None] - slot) < window
        logits = jnp.where(visible, logits, NEG_INF)
        m_new = jnp.maximum(m, jnp.max(logits, axis=1))
        p = jnp.exp(logits - m_new[:, None])
        corr = jnp.exp(m - m_new)
        ve, vo = deq(vq_ref, vs_ref, vz_ref, sl)
        acc_e = acc_e * corr[:, None] + jnp.dot(p, ve, preferred_element_type=jnp.float32)
        acc_o = acc_o * corr[:, None] + jnp.dot(p, vo, preferred_element_type=jnp.float32)
        return m_new, denom * corr + jnp.sum(p, axis=1), acc_e, acc_o

    init = (
        jnp.full((gp,), NEG_INF, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
        jnp.zeros((gp, d2), jnp.float32),
        jnp.zeros((gp, d2), jnp.float32),
    )
    _, denom, acc_e, acc_o = jax.lax.fori_loop(0, n_s, body, init)
    oe_ref[...] = acc_e / denom[:, None]
    oo_ref[...] = acc_o / denom[:, None]


@functools.partial(jax.jit, static_argnames=("sliding_window", "block_s", "interpret"))
def _kv4_decode_pallas(
    q_BTHD,
    k_q,
    k_scale,
    k_zero,
    v_q,
    v_scale,
    v_zero,
    q_positions_BT,
    *,
    sliding_window,
    block_s,
    interpret,
):
    B, T, H, Dh = q_BTHD.shape
    _, K, S, D2 = k_q.shape
    if T != 1:
        raise ValueError(f"kv4 decode kernel takes one query token per row, got T={T}")
    if k_scale.shape[-1] != 1:
        raise NotImplementedError(
            f"kv4 decode kernel supports one quantization group per head (Dh <= 128); "
            f"got {k_scale.shape[-1]} groups for head_dim={Dh}"
        )
    G = H // K
    Gp = max(16, 1 << (G - 1).bit_length())
    Sp = pl.cdiv(S, block_s) * block_s
    q = q_BTHD[:, 0].astype(jnp.float32).reshape(B, K, G, Dh) * (Dh**-0.5)
    q = jnp.pad(q, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    qe, qo = q[..., 0::2], q[..., 1::2]
    pos = jnp.broadcast_to(q_positions_BT[:, :1].astype(jnp.int32), (B, Gp))

    def pad_s(a):
        return jnp.pad(a, ((0, 0), (0, 0), (0, Sp - S)) + ((0, 0),) * (a.ndim - 3))

    kq, vq = pad_s(k_q), pad_s(v_q)
    ks, kz, vs, vz = (pad_s(a[..., 0]) for a in (k_scale, k_zero, v_scale, v_zero))
    kernel = functools.partial(
        _decode_kernel, block_s=block_s, n_s=Sp // block_s, window=sliding_window
    )
    qspec = pl.BlockSpec((None, None, Gp, D2), lambda b, h: (b, h, 0, 0))
    cspec = pl.BlockSpec((None, None, Sp, D2), lambda b, h: (b, h, 0, 0))
    sspec = pl.BlockSpec((None, None, Sp), lambda b, h: (b, h, 0))
    oe, oo = pl.pallas_call(
        kernel,
        grid=(B, K),
        in_specs=[
            qspec,
            qspec,
            pl.BlockSpec((None, Gp), lambda b, h: (b, 0)),
            cspec,
            sspec,
            sspec,
            cspec,
            sspec,
            sspec,
        ],
        out_specs=[qspec, qspec],
        out_shape=[jax.ShapeDtypeStruct((B, K, Gp, D2), jnp.float32)] * 2,
        interpret=interpret,
        compiler_params=triton_params(interpret),
        name="pallasite_kv4_decode",
    )(qe, qo, pos, kq, ks, kz, vq, vs, vz)
    out = jnp.stack([oe, oo], axis=-1).reshape(B, K, Gp, Dh)[:, :, :G]
    return out.reshape(B, 1, H, Dh).astype(q_BTHD.dtype)


def kv4_decode_attention(
    q_BTHD,
    k_q,
    k_scale,
    k_zero,
    v_q,
    v_scale,
    v_zero,
    q_positions_BT,
    *,
    sliding_window: Optional[int] = None,
    impl: str = "pallas",
    interpret=None,
    block_s: int = 32,
):
    """Attention of ``q [B, 1, H, Dh]`` over a 4-bit cache (layout above) → ``[B, 1, H, Dh]``.
    ``interpret``: see ``ops.dispatch.pick_variant``."""
    if impl not in ("ref", "pallas"):
        raise ValueError(f"kv4_decode_attention impl={impl!r}; expected 'ref' or 'pallas'")
    groups = k_scale.shape[-1]
    if impl == "pallas" and groups != 1:
        warn_fallback(
            "kv4_decode_attention",
            "the kernels hold one quantization group per head (Dh <= 128)",
            head_dim=q_BTHD.shape[-1],
            groups=groups,
        )
        impl = "ref"
    if impl == "ref":
        return kv4_decode_attention_ref(
            q_BTHD,
            k_q,
            k_scale,
            k_zero,
            v_q,
            v_scale,
            v_zero,
            q_positions_BT,
            sliding_window=sliding_window,
        )
    B, T, H, Dh = q_BTHD.shape
    if T != 1:
        raise ValueError(f"kv4 decode kernel takes one query token per row, got T={T}")
    variant = pick_variant(interpret)
    if variant.kind == "tpu":
        K = k_q.shape[1]
        pos = q_positions_BT[:, 0].astype(jnp.int32)
        start = None if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
        q = q_BTHD.reshape(B, K, H // K, Dh)
        out = decode_attention(
            q,
            kv4_source(k_q, k_scale, k_zero, v_q, v_scale, v_zero),
            pos + 1,
            start,
            interpret=variant.interpret,
        )
        return out.reshape(B, 1, H, Dh).astype(q_BTHD.dtype)
    return _kv4_decode_pallas(
        q_BTHD,
        k_q,
        k_scale,
        k_zero,
        v_q,
        v_scale,
        v_zero,
        q_positions_BT,
        sliding_window=sliding_window,
        block_s=block_s,
        interpret=variant.interpret,
    )


# ---------------------------------------------------------------------- shared decode interface
def _kv4_load(refs, sl):
    """``KVSource.load`` for 4-bit codes: unpack nibbles, interleave even/odd channels, rescale."""
    kq, ks, kz, vq, vs, vz = refs

    def one(q_ref, s_ref, z_ref):
        p = q_ref[sl, :].astype(jnp.int32) & 0xFF
        s = s_ref[sl].astype(jnp.float32)[:, None]
        z = z_ref[sl].astype(jnp.float32)[:, None]
        lo = ((p & 0xF).astype(jnp.float32) - z) * s
        hi = (((p >> 4) & 0xF).astype(jnp.float32) - z) * s
        return jnp.stack([lo, hi], axis=-1).reshape(lo.shape[0], 2 * lo.shape[1])

    return one(kq, ks, kz), one(vq, vs, vz)


def _nibbles(ref, h):
    """Low / high nibbles of head ``h``'s packed codes ``[bk, Dh/2]`` as float32."""
    p = ref[h].astype(jnp.int32)
    return (p & 0xF).astype(jnp.float32), ((p >> 4) & 0xF).astype(jnp.float32)


def _row(ref, h):
    """Head ``h``'s per-token factor as a ``[1, bk]`` float32 lane vector."""
    return ref[...].astype(jnp.float32)[h : h + 1, :]


def _kv4_scores(q, refs, h):
    kq, ks, kz = refs[0], refs[1], refs[2]
    lo, hi = _nibbles(kq, h)
    d2 = lo.shape[1]
    qf = q.astype(jnp.float32)  # channels deinterleaved by _even_odd: [even | odd]
    raw = dot(qf[:, :d2], lo, trans_b=True) + dot(qf[:, d2:], hi, trans_b=True)
    return _row(ks, h) * (raw - jnp.sum(qf, axis=1, keepdims=True) * _row(kz, h))


def _kv4_values(p, refs, h, mask):
    vq, vs, vz = refs[3], refs[4], refs[5]
    lo, hi = _nibbles(vq, h)
    ps = jnp.where(mask.row, p * _row(vs, h), 0.0)
    shift = jnp.sum(ps * _row(vz, h), axis=1, keepdims=True)  # Σ_s p·scale·zero
    return dot(ps, lo) - shift, dot(ps, hi) - shift


def _even_odd(q_BKGD):
    return jnp.concatenate([q_BKGD[..., 0::2], q_BKGD[..., 1::2]], axis=-1)


def _interleave(parts):
    even, odd = parts
    return jnp.stack([even, odd], axis=-1).reshape(*even.shape[:-1], 2 * even.shape[-1])


def kv4_source(k_q, k_scale, k_zero, v_q, v_scale, v_zero):
    """The 4-bit cache (head-major ``[B, K, S, ...]``, this module's layout) as an
    ``ops.attention.kv_source.KVSource`` with ``kv_layout="BKSD"``, so the shared split-K decode
    kernel reads it in place (no per-step transpose of the cache). One quantization group per
    head (``G = 1``)."""
    if k_scale.shape[-1] != 1:
        raise NotImplementedError(
            f"kv4_source: one quantization group per head expected, got {k_scale.shape[-1]}"
        )
    arrays = (k_q, k_scale[..., 0], k_zero[..., 0], v_q, v_scale[..., 0], v_zero[..., 0])
    d2 = k_q.shape[-1]
    codec = TPUCodec(_kv4_scores, _kv4_values, (d2, d2), q_in=_even_odd, out=_interleave)
    return KVSource(arrays=arrays, load=_kv4_load, head_dim=2 * d2, kv_layout="BKSD", tpu=codec)
