"""The ``fp4`` linear kind: FP4 training (Wang et al., "Optimizing Large Language Model Training
Using FP4 Quantization", ICML 2025; official code Azure/MS-AMP).

    ModelConfig(..., linear="fp4", linear_config=FP4Config(alpha=0.99, k=5.0))

``FP4Linear`` keeps float master weights ``kernel [in, out]`` (``param_dtype``) and ``bias``, the
parameters of the float ``Linear``: a checkpoint trained with FP4 loads and serves as a float
model (``linear="float"``) or as FP4. Every call quantizes the master weights per output channel
and the activations per token and runs ``ops.quant.fp4_gemm.fp4_dot`` (forward FP4 GEMM, OCC
compensation, E5M2 backward, DGE on the weight gradient); the bias and everything outside the
linears stay in the model's compute dtype. ``FP4Config`` also expresses the paper's ablations:
direct W4A4 (``w_grad="ste", occ=False``), W4A8 with DGE only (``a_bits=8, occ=False``) and W8A4
with OCC only (``w_bits=8``). 8-bit operands are FP8 E4M3 with the same vector-wise scales.
Defaults: α = 0.99, k = 5, f' clamped at 3, the paper's exact scale (``scale="pow2"``: the released
code's); see ``ops/quant/fp4.py`` for the quantizer and its deviations.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite.models.layers import LinearBase
from pallasite.ops.quant.fp4 import SCALE_KINDS, SELECTS
from pallasite.ops.quant.fp4_gemm import W_GRADS, FP4GemmSpec, fp4_matmul
from pallasite.ops.quant.fp4_grouped import fp4_gmm
from pallasite.ops.quant.fp4_kernel import IMPLS
from pallasite.registry import LINEAR

BITS_FMT = {4: "e2m1", 8: "e4m3"}


@dataclasses.dataclass(frozen=True)
class FP4Config:
    """Sub-config of ``linear="fp4"``; a bad value raises naming the field."""

    alpha: float = 0.99  # OCC quantile level, 0.5 < alpha < 1 (≈ 2(1−alpha) of each row clamped)
    occ: bool = True  # outlier clamping + high-precision compensation of the activations
    k: float = 5.0  # DGE sharpness, k > 0
    dge_clamp: float = 3.0  # upper bound of f'
    w_grad: str = "dge"  # dge | ste (straight-through)
    scale: str = "exact"  # exact (paper: 6/amax) | pow2 (released code: 2^floor(log2(6/amax)))
    w_bits: int = 4  # 4: E2M1 | 8: FP8 E4M3 (W8A4 ablation)
    a_bits: int = 4  # 4: E2M1 | 8: FP8 E4M3 (W4A8 ablation)
    grad_e5m2: bool = True  # output gradients of the backward GEMMs in FP8 E5M2
    impl: str = "auto"  # quantizer: auto (Pallas on GPU/TPU, jnp on CPU) | ref | pallas
    select: str = "auto"  # OCC threshold of the jnp quantizer: auto | top_k | bisect

    def __post_init__(self):
        def bad(name, expected):
            raise ValueError(f"FP4Config.{name}={getattr(self, name)!r}; expected {expected}")

        if not isinstance(self.alpha, (int, float)) or not 0.5 < float(self.alpha) < 1.0:
            bad("alpha", "a number with 0.5 < alpha < 1")
        if not isinstance(self.k, (int, float)) or not float(self.k) > 0:
            bad("k", "a number k > 0")
        if not isinstance(self.dge_clamp, (int, float)) or not float(self.dge_clamp) > 0:
            bad("dge_clamp", "a number > 0")
        if self.w_grad not in W_GRADS:
            bad("w_grad", f"one of {W_GRADS}")
        if self.scale not in SCALE_KINDS:
            bad("scale", f"one of {SCALE_KINDS}")
        for name in ("w_bits", "a_bits"):
            if getattr(self, name) not in BITS_FMT:
                bad(name, "4 (E2M1) or 8 (FP8 E4M3)")
        for name in ("occ", "grad_e5m2"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "True or False")
        if self.impl not in IMPLS:
            bad("impl", f"one of {IMPLS}")
        if self.select not in SELECTS:
            bad("select", f"one of {SELECTS}")

    def gemm_spec(self) -> FP4GemmSpec:
        return FP4GemmSpec(
            w_fmt=BITS_FMT[self.w_bits],
            a_fmt=BITS_FMT[self.a_bits],
            scale=self.scale,
            w_grad=self.w_grad,
            dge_k=float(self.k),
            dge_clamp=float(self.dge_clamp),
            occ_alpha=float(self.alpha) if self.occ else None,
            grad_e5m2=self.grad_e5m2,
            impl=self.impl,
            select=self.select,
        )


def fp4_config_of(cfg) -> FP4Config:
    """The model's FP4 sub-config (``cfg.linear_config``, validated by ModelConfig; defaults when
    None)."""
    return LINEAR.make_config("fp4", cfg.linear_config, field="ModelConfig.linear_config")


class FP4Linear(LinearBase):
    """y = FP4-GEMM(x, kernel) (+ bias); float master ``kernel [in, out]`` and ``bias``."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        cfg,
        axes: Sequence[Optional[str]],
        use_bias: bool = False,
        init_std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features = in_features, out_features
        self.dtype = jnp.dtype(cfg.dtype)
        self.spec = fp4_config_of(cfg).gemm_spec()
        pdt = jnp.dtype(cfg.param_dtype)
        init = jax.nn.initializers.normal(stddev=init_std)
        self.kernel = nnx.Param(
            init(rngs.params(), (in_features, out_features), pdt), logical_axes=tuple(axes)
        )
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), pdt), logical_axes=(axes[-1],))
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"FP4Linear: input last axis {x.shape[-1]} != in_features {self.in_features}"
            )
        y = fp4_matmul(x.astype(self.dtype), self.kernel[...], self.spec)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y

    @staticmethod
    def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, impl: str, cfg) -> jax.Array:
        """The expert-group form of this kind's GEMM (the MoE expert path calls it):
        ``ops.quant.fp4_grouped.fp4_gmm`` with the model's FP4 sub-config."""
        return fp4_gmm(x_MK, w_GKN, group_sizes_G, fp4_config_of(cfg).gemm_spec(), impl)


LINEAR.register("fp4", FP4Linear, config=FP4Config)

__all__ = ["FP4Config", "FP4Linear", "fp4_config_of", "BITS_FMT"]
