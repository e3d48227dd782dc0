"""Basic layers: the linear seam, RMSNorm, Embed, activations.

Every parameter carries ``logical_axes`` metadata (names from ``sharding.py``'s rule table, which
maps them onto mesh axes). Parameters are stored in ``param_dtype`` and cast to the compute
``dtype`` at use (mixed precision).

Linear kinds (``ModelConfig.linear``, registered in ``pallasite.registry.LINEAR``) subclass
``LinearBase``: constructor ``cls(in_features, out_features, *, cfg, axes, use_bias, init_std,
rngs)``, parameters named ``kernel`` ``[in, out]`` and ``bias`` (so checkpoints and sharding rules
keep working), ``lin(x)``. A group of linears that read one input (q/k/v; gate/up) calls
``first.prepare_shared_input(x)`` once and hands the result to each member, so a kind may
precompute what all of them need (identity by default). A kind that keeps the float parameters and
changes only how ``x @ kernel`` is computed subclasses ``Linear`` and overrides ``product``
(``models/panel_linear.py``). The tied LM head is a linear too: a kind may give
``embed_class(cfg)``, the ``Embed`` subclass the model then uses (None: ``Embed``).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.registry import LINEAR


def _normal(stddev: float):
    return jax.nn.initializers.normal(stddev=stddev)


class LinearBase(nnx.Module):
    """What every linear kind shares: the shared-input hook (identity unless a kind overrides it)."""

    def prepare_shared_input(self, x: jax.Array):
        """The value the linears of a shared-input group consume instead of ``x``."""
        return x


@LINEAR.register("float")
class Linear(LinearBase):
    """y = x @ kernel (+ bias); kernel layout [in, out] (HF stores [out, in])."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        cfg: ModelConfig,
        axes: Sequence[Optional[str]],
        use_bias: bool = False,
        init_std: float = 0.02,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features = in_features, out_features
        self.dtype = jnp.dtype(cfg.dtype)
        pdt = jnp.dtype(cfg.param_dtype)
        self.kernel = nnx.Param(
            _normal(init_std)(rngs.params(), (in_features, out_features), pdt), logical_axes=tuple(axes)
        )
        self.bias = (
            nnx.Param(jnp.zeros((out_features,), pdt), logical_axes=(axes[-1],)) if use_bias else None
        )

    def product(self, x: jax.Array) -> jax.Array:
        """x @ kernel in float32 (a subclass that stores the kernel otherwise overrides this)."""
        # Accumulate in float32, round once to the compute dtype (what GPU/TPU GEMMs do anyway);
        # on XLA:CPU this also selects a fast bf16 GEMM (~2.7x faster bf16 decode at batch 8).
        return jnp.dot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), preferred_element_type=jnp.float32)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.product(x).astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def make_linear(in_features, out_features, *, cfg: ModelConfig, axes, use_bias=False, init_std=0.02, rngs):
    """A linear of the config's kind (``cfg.linear``)."""
    cls = LINEAR.get(cfg.linear, field="ModelConfig.linear")
    return cls(in_features, out_features, cfg=cfg, axes=axes, use_bias=use_bias, init_std=init_std, rngs=rngs)


class RMSNorm(nnx.Module):
    """RMSNorm (Zhang & Sennrich 2019) computed in float32, HF convention: x / rms(x) * w; with
    ``cfg.norm_unit_offset`` (Gemma) x / rms(x) * (1 + w), w stored as HF stores it (init 0)."""

    def __init__(self, dim: int, *, cfg: ModelConfig, eps: Optional[float] = None, axis_name: str = "norm",
                 rngs: nnx.Rngs | None = None):
        self.eps = cfg.norm_eps if eps is None else eps
        self.dtype = jnp.dtype(cfg.dtype)
        self.unit_offset = bool(cfg.norm_unit_offset)
        init = jnp.zeros if self.unit_offset else jnp.ones  # either way the initial scale is 1
        self.scale = nnx.Param(init((dim,), jnp.dtype(cfg.param_dtype)), logical_axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = rms_norm(x, self.scale[...], self.eps, unit_offset=self.unit_offset)
        return y.astype(self.dtype)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, *, unit_offset: bool = False) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    scale32 = scale.astype(jnp.float32)
    return x32 * (1.0 + scale32 if unit_offset else scale32)


FEW_ROWS = 256  # Embed.attend: up to this many rows take the [V, rows] layout on CPU


class Embed(nnx.Module):
    """Token embedding table [V, D]; ``attend`` gives tied-embedding logits. With
    ``cfg.scale_embeddings`` (Gemma) the lookup is multiplied by sqrt(D) rounded to the compute
    dtype (as Gemma's own ``Embedder.encode``; in bf16 sqrt(640) = 25.298 becomes 25.25)."""

    def __init__(self, vocab_size: int, dim: int, *, cfg: ModelConfig, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(cfg.dtype)
        self.multiplier = math.sqrt(dim) if cfg.scale_embeddings else None
        self.embedding = nnx.Param(
            _normal(0.02)(rngs.params(), (vocab_size, dim), jnp.dtype(cfg.param_dtype)), logical_axes=("vocab", "embed")
        )

    def rows(self, ids: jax.Array) -> jax.Array:
        """The table's rows for ``ids`` as stored (a subclass that stores the table otherwise overrides
        this and ``attend``)."""
        return jnp.take(self.embedding[...], ids, axis=0)

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = self.rows(ids).astype(self.dtype)
        return x if self.multiplier is None else x * jnp.asarray(self.multiplier, self.dtype)

    def attend(self, x: jax.Array) -> jax.Array:
        table = self.embedding[...].astype(self.dtype)
        rows = math.prod(x.shape[:-1])
        if 1 < rows <= FEW_ROWS and jax.default_backend() == "cpu":
            # A few rows (a speculative verify, a small decode batch): XLA:CPU runs x @ E.T through a
            # GEMM that re-reads the transposed [V, D] table, 1.5-1.9x slower than E @ x.T with its
            # [V, rows] result transposed afterwards (the barrier keeps XLA from folding the transpose
            # back into the dot). One row stays on the mat-vec path, which is faster still.
            y = jnp.dot(table, x.astype(self.dtype).reshape(rows, -1).T, preferred_element_type=jnp.float32)
            return jax.lax.optimization_barrier(y).T.reshape(*x.shape[:-1], -1).astype(self.dtype)
        return jnp.dot(x.astype(self.dtype), table.T, preferred_element_type=jnp.float32).astype(self.dtype)


def embed_class(cfg: ModelConfig) -> type:
    """The embedding class for ``cfg``: the linear kind's ``embed_class(cfg)`` where it gives one."""
    hook = getattr(LINEAR.get(cfg.linear), "embed_class", None)
    return (hook(cfg) if hook is not None else None) or Embed


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    if name == "silu":
        return jax.nn.silu
    if name == "gelu":  # tanh approximation (HF "gelu_pytorch_tanh")
        return lambda x: jax.nn.gelu(x, approximate=True)
    if name == "gelu_exact":  # erf GELU (HF "gelu")
        return lambda x: jax.nn.gelu(x, approximate=False)
    raise ValueError(f"unknown activation {name!r}; expected silu | gelu | gelu_exact")
