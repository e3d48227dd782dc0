"""Grouped matrix multiplication for mixture-of-experts layers (MegaBlocks' "grouped GEMM", Gale et
al. 2023): ``gmm(lhs_MK, rhs_GKN, group_sizes_G)`` multiplies rows ``[s_g, s_g + group_sizes[g])``
(``s_g`` the exclusive cumsum) by ``rhs[g]``; rows past ``sum(group_sizes)`` give zeros.

``impl``: ``"ref"`` (``jax.lax.ragged_dot``, autodiff by XLA), ``"tiles"`` (the kernels' padded-tile
algorithm in plain XLA, the fast choice on XLA:CPU) or ``"pallas"``: a ``jax.custom_vjp`` over the
kernels of the variant ``ops.dispatch`` picks — TPU (``gmm.tpu``: scalar-prefetched tile groups)
or GPU (``gmm.gpu``: Triton; the generic interpreter on CPU). Backward: ``dlhs = gmm(dout, rhsᵀ)``
(the TPU kernel reads ``rhs`` transposed in place) and ``drhs = tgmm(lhs, dout)``. Block sizes:
None takes the variant's defaults (GPU 64/64/64, TPU 128/512/512 for m/k/n).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp

import pallasite.ops.gmm.gpu as gpu
import pallasite.ops.gmm.tpu as tpu
from pallasite.ops.dispatch import Variant, pick_variant
from pallasite.ops.gmm.layout import check
from pallasite.ops.gmm.reference import gmm_reference, gmm_tiles, tgmm_reference


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the grouped-matmul kernels (None: the variant's default)."""

    block_m: Optional[int] = None
    block_k: Optional[int] = None
    block_n: Optional[int] = None

    def resolve(self, variant: Variant) -> dict[str, int]:
        m, k, n = (tpu if variant.kind == "tpu" else gpu).DEFAULT_BLOCKS
        return dict(block_m=self.block_m or m, block_k=self.block_k or k, block_n=self.block_n or n)


def gmm_pallas(
    lhs_MK,
    rhs_GKN,
    group_sizes_G,
    *,
    block_m: Optional[int] = None,
    block_k: Optional[int] = None,
    block_n: Optional[int] = None,
    interpret: Optional[Any] = None,
    out_dtype=None,
):
    """Forward grouped matmul as a Pallas kernel (no autodiff: ``gmm(impl="pallas")`` has it)."""
    check(lhs_MK, rhs_GKN, group_sizes_G)
    variant = pick_variant(interpret)
    out_dtype = out_dtype or jnp.result_type(lhs_MK.dtype, rhs_GKN.dtype)
    blocks = BlockSizes(block_m, block_k, block_n).resolve(variant)
    impl = tpu if variant.kind == "tpu" else gpu
    return impl.gmm(
        lhs_MK,
        rhs_GKN,
        group_sizes_G.astype(jnp.int32),
        interpret=variant.interpret,
        out_dtype=out_dtype,
        **blocks,
    )


def tgmm_pallas(
    lhs_MK,
    dout_MN,
    group_sizes_G,
    *,
    block_m: Optional[int] = None,
    block_k: Optional[int] = None,
    block_n: Optional[int] = None,
    interpret: Optional[Any] = None,
    out_dtype=jnp.float32,
):
    """Transposed grouped matmul as a Pallas kernel: drhs[g] = lhs_gᵀ · dout_g → [G, K, N]."""
    variant = pick_variant(interpret)
    blocks = BlockSizes(block_m, block_k, block_n).resolve(variant)
    impl = tpu if variant.kind == "tpu" else gpu
    return impl.tgmm(
        lhs_MK,
        dout_MN,
        group_sizes_G.astype(jnp.int32),
        interpret=variant.interpret,
        out_dtype=out_dtype,
        **blocks,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm_vjp(lhs_MK, rhs_GKN, group_sizes_G, variant: Variant, blocks: BlockSizes):
    return gmm_pallas(
        lhs_MK, rhs_GKN, group_sizes_G, interpret=variant.interpret, **dataclasses.asdict(blocks)
    )


def _gmm_fwd(lhs_MK, rhs_GKN, group_sizes_G, variant, blocks):
    return _gmm_vjp(lhs_MK, rhs_GKN, group_sizes_G, variant, blocks), (
        lhs_MK,
        rhs_GKN,
        group_sizes_G,
    )


def _gmm_bwd(variant, blocks, res, dout_MN):
    lhs_MK, rhs_GKN, group_sizes_G = res
    kw = blocks.resolve(variant)
    if variant.kind == "tpu":  # reads rhs[g]ᵀ in place
        dlhs = tpu.gmm(
            dout_MN,
            rhs_GKN,
            group_sizes_G,
            interpret=variant.interpret,
            out_dtype=lhs_MK.dtype,
            transpose_rhs=True,
            **kw,
        )
    else:
        dlhs = gpu.gmm(
            dout_MN,
            jnp.swapaxes(rhs_GKN, 1, 2),
            group_sizes_G,
            interpret=variant.interpret,
            out_dtype=lhs_MK.dtype,
            **kw,
        )
    impl = tpu if variant.kind == "tpu" else gpu
    # float32 accumulation inside the kernel, written in the weights' dtype (no [G, K, N] f32 copy)
    drhs = impl.tgmm(
        lhs_MK, dout_MN, group_sizes_G, interpret=variant.interpret, out_dtype=rhs_GKN.dtype, **kw
    )
    # group_sizes is integer: its cotangent is the float0 zero.
    return dlhs, drhs, jnp.zeros(group_sizes_G.shape, jax.dtypes.float0)


_gmm_vjp.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(
    lhs_MK,
    rhs_GKN,
    group_sizes_G,
    *,
    impl: str = "ref",
    interpret: Optional[Any] = None,
    block_m: Optional[int] = None,
    block_k: Optional[int] = None,
    block_n: Optional[int] = None,
):
    """Grouped matmul [M,K] × [G,K,N] → [M,N]; differentiable in lhs and rhs for every impl."""
    if impl == "ref":
        return gmm_reference(lhs_MK, rhs_GKN, group_sizes_G)
    if impl == "tiles":
        return gmm_tiles(lhs_MK, rhs_GKN, group_sizes_G, block_m=block_m or gpu.DEFAULT_BLOCKS[0])
    if impl == "pallas":
        check(lhs_MK, rhs_GKN, group_sizes_G)
        return _gmm_vjp(
            lhs_MK,
            rhs_GKN,
            group_sizes_G.astype(jnp.int32),
            pick_variant(interpret),
            BlockSizes(block_m, block_k, block_n),
        )
    raise ValueError(f"gmm impl={impl!r}; expected 'ref', 'tiles' or 'pallas'")


__all__ = [
    "gmm",
    "gmm_reference",
    "gmm_tiles",
    "tgmm_reference",
    "gmm_pallas",
    "tgmm_pallas",
    "BlockSizes",
]
