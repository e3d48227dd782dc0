"""Flash attention for prefill and training (FlashAttention-2 online softmax), differentiable.

``flash_attention`` has the signature and masks of ``reference.attention`` (positions, segments,
key validity, sliding window, grouped-query heads) and picks its kernel with ``ops.dispatch``:
the TPU variant (``flash_tpu``, head-major blocks, scalar-prefetched block skipping) on TPU or
with ``interpret=pltpu.InterpretParams(...)``, the GPU variant (``flash_gpu``, Triton) on GPU and
in the generic interpreter on CPU. A ``jax.custom_vjp`` carries the row log-sum-exp to the
FlashAttention-2 backward kernels of the same variant (``backward="pallas"``) or to the VJP of
the jnp reference (``backward="reference"``). Float32 softmax statistics and accumulators.
Deviation, by design: a query row with no visible key returns 0 (the reference's finite NEG_INF
gives a uniform average); causal self-attention never has such rows.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

import pallasite.ops.attention.flash_gpu as flash_gpu
import pallasite.ops.attention.flash_tpu as flash_tpu
from pallasite import sharding
from pallasite.ops.attention.reference import KV_LAYOUTS
from pallasite.ops.attention.reference import attention as reference_attention
from pallasite.ops.common import next_pow2
from pallasite.ops.dispatch import Variant, pick_variant


@dataclasses.dataclass(frozen=True)
class _Static:
    causal: bool
    window: Optional[int]
    use_segments: bool
    scale: float
    block_q: int
    block_k: int
    variant: Variant
    backward: str

    def kernel_kwargs(self) -> dict[str, Any]:
        return dict(
            causal=self.causal,
            window=self.window,
            use_segments=self.use_segments,
            scale=self.scale,
            block_q=self.block_q,
            block_k=self.block_k,
            interpret=self.variant.interpret,
        )


def _impl(st: _Static):
    return flash_tpu if st.variant.kind == "tpu" else flash_gpu


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _flash(q, k, v, qpos, kpos, qseg, kseg, kvalid, st: _Static):
    return _impl(st).forward(q, k, v, qpos, kpos, qseg, kseg, kvalid, **st.kernel_kwargs())[0]


def _flash_fwd(q, k, v, qpos, kpos, qseg, kseg, kvalid, st):
    out, lse = _impl(st).forward(q, k, v, qpos, kpos, qseg, kseg, kvalid, **st.kernel_kwargs())
    return out, (q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse)


def _flash_bwd(st, res, g):
    q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse = res
    if st.backward == "pallas":
        dq, dk, dv = _impl(st).backward(
            q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse, g, **st.kernel_kwargs()
        )
    else:
        # the reference reads the variant's layouts (TPU: q / out [B, H, T, D], k / v [B, K, S, D])
        tpu = st.variant.kind == "tpu"

        def ref(q_, k_, v_):
            o = reference_attention(
                jnp.swapaxes(q_, 1, 2) if tpu else q_,
                k_,
                v_,
                q_positions_BT=qpos,
                k_positions_BS=kpos,
                causal=st.causal,
                sliding_window=st.window,
                q_segment_ids_BT=qseg if st.use_segments else None,
                k_segment_ids_BS=kseg if st.use_segments else None,
                k_valid_BS=kvalid != 0,
                scale=st.scale,
                kv_layout="BKSD" if tpu else "BSKD",
            )
            return jnp.swapaxes(o, 1, 2) if tpu else o

        _, vjp = jax.vjp(ref, q, k, v)
        dq, dk, dv = vjp(g)
    return dq, dk, dv, None, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(
    q_BTHD: jax.Array,
    k_BSKD: jax.Array,
    v_BSKD: jax.Array,
    *,
    q_positions_BT: Optional[jax.Array] = None,
    k_positions_BS: Optional[jax.Array] = None,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    q_segment_ids_BT: Optional[jax.Array] = None,
    k_segment_ids_BS: Optional[jax.Array] = None,
    k_valid_BS: Optional[jax.Array] = None,
    scale: Optional[float] = None,
    block_q: Optional[int] = None,
    block_k: Optional[int] = None,
    interpret: Optional[Any] = None,
    backward: str = "pallas",
    kv_layout: str = "BSKD",
) -> jax.Array:
    """Flash attention with the signature and masks of ``reference.attention``.

    q: [B,T,H,D]; k, v: [B,S,K,D] (``kv_layout="BSKD"``) or [B,K,S,D] (``"BKSD"``), H % K == 0
    -> [B,T,H,D] in q's dtype. ``block_q`` / ``block_k``: None takes the variant's defaults (GPU
    64 / 64, rounded to powers of two >= 16; TPU 128 / 128, multiples of 16 / 128). ``interpret``:
    see ``ops.dispatch.pick_variant``.
    """
    if backward not in ("pallas", "reference"):
        raise ValueError(
            f"flash_attention: backward={backward!r}; expected 'pallas' or 'reference'"
        )
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"flash_attention: kv_layout={kv_layout!r}; expected one of {KV_LAYOUTS}")
    B, T, H, D = q_BTHD.shape
    head_major = kv_layout == "BKSD"
    if (
        k_BSKD.ndim != 4
        or v_BSKD.shape != k_BSKD.shape
        or k_BSKD.shape[0] != B
        or k_BSKD.shape[3] != D
    ):
        want = "[B, K, S, D]" if head_major else "[B, S, K, D]"
        raise ValueError(
            f"flash_attention: expected k, v {want} with B={B}, D={D} (kv_layout={kv_layout}), "
            f"got k {k_BSKD.shape}, v {v_BSKD.shape}"
        )
    K, S = (k_BSKD.shape[1], k_BSKD.shape[2]) if head_major else (k_BSKD.shape[2], k_BSKD.shape[1])
    if H % K:
        raise ValueError(
            f"flash_attention: {H} query heads are not a multiple of {K} key/value heads"
        )
    if (q_segment_ids_BT is None) != (k_segment_ids_BS is None):
        raise ValueError(
            "flash_attention: pass both q_segment_ids_BT and k_segment_ids_BS, or neither"
        )
    variant = pick_variant(interpret)
    if q_positions_BT is None:
        q_positions_BT = jnp.arange(T, dtype=jnp.int32) + (S - T)
    if k_positions_BS is None:
        k_positions_BS = jnp.arange(S, dtype=jnp.int32)
    use_segments = q_segment_ids_BT is not None
    qseg = jnp.broadcast_to(q_segment_ids_BT if use_segments else 0, (B, T)).astype(jnp.int32)
    kseg = jnp.broadcast_to(k_segment_ids_BS if use_segments else 0, (B, S)).astype(jnp.int32)
    kvalid = jnp.broadcast_to(True if k_valid_BS is None else k_valid_BS, (B, S)).astype(jnp.int32)
    qpos = jnp.broadcast_to(q_positions_BT, (B, T)).astype(jnp.int32)
    kpos = jnp.broadcast_to(k_positions_BS, (B, S)).astype(jnp.int32)
    impl = flash_tpu if variant.kind == "tpu" else flash_gpu
    st = _Static(
        causal=bool(causal),
        window=None if sliding_window is None else int(sliding_window),
        use_segments=use_segments,
        scale=float(D**-0.5 if scale is None else scale),
        block_q=int(block_q or impl.DEFAULT_BLOCK_Q),
        block_k=int(block_k or impl.DEFAULT_BLOCK_K),
        variant=variant,
        backward=backward,
    )
    if variant.kind == "tpu":  # head-major q [B, H, T, D] and k / v [B, K, S, D]
        k, v = (
            (k_BSKD, v_BSKD)
            if head_major
            else (jnp.swapaxes(k_BSKD, 1, 2), jnp.swapaxes(v_BSKD, 1, 2))
        )
        out = _per_shard(st, (jnp.swapaxes(q_BTHD, 1, 2), k, v, qpos, kpos, qseg, kseg, kvalid), head_dim=1)
        return jnp.swapaxes(out, 1, 2)
    # GPU variant: slot-major k / v [B, S, K, D]; block sizes are powers of two >= 16
    st = dataclasses.replace(st, block_q=next_pow2(st.block_q), block_k=next_pow2(st.block_k))
    k, v = (
        (jnp.swapaxes(k_BSKD, 1, 2), jnp.swapaxes(v_BSKD, 1, 2)) if head_major else (k_BSKD, v_BSKD)
    )
    return _per_shard(st, (q_BTHD, k, v, qpos, kpos, qseg, kseg, kvalid), head_dim=2)


def _per_shard(st: _Static, args, *, head_dim: int):
    """The kernel on each (batch rows, heads) shard of the ambient mesh: rows and key/value
    groups are independent, so no communication (``sharding.per_shard``)."""
    qkv = ["batch", None, None, None]
    qkv[head_dim] = "kv_heads"  # q's heads split with their key/value group
    rows = ("batch", None)
    return sharding.per_shard(lambda *a: _flash(*a, st), args, (qkv, qkv, qkv) + (rows,) * 5, qkv)


__all__ = ["flash_attention"]
