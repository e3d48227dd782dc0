"""The ``panels`` linear kind: the float linear with its weight stored in 16-column panels, for
few-row decoding on XLA:CPU (``ops.panels``: a decode step, a speculative verify, a small batch).

    cfg, state = to_panels(cfg, state)        # or model = with_panels(model); pallasite generate --cpu-panels

``PanelLinear`` has the float ``Linear``'s parameters, ``kernel [in, out]`` and ``bias``, with the
kernel's numbers in ``ops.panels.pack`` order: same shape, so sharding rules and orbax checkpoints
work unchanged (a checkpoint records ``linear="panels"``); ``from_panels`` goes back to the float
kind (HF export needs it). Every call is ``ops.panels.panel_matmul``: the FFI kernel on CPU for
float32 or bfloat16 models (stored and computed in the same dtype; sums in float32, the result
rounded to the compute dtype once) and up to ``ops.panels.MAX_ROWS`` rows, else the jnp reference
(unpack + dot). A row's result does not depend on how many rows share the call, unlike XLA:CPU's
mat-vec / GEMM switch.
Every linear's output width must be a multiple of 16.

The tied LM head is ``x @ E.T``, a linear of width V: ``PanelEmbed`` (the kind's ``embed_class``)
stores the table ``E [V, D]`` as ``pack(E.T)`` read back as ``[V, D]``, i.e. each block of 16 rows
transposed, so ``attend`` is one ``panel_matmul`` and a lookup reads row v from block v // 16 at
stride 16. A vocabulary that is not a multiple of 16 keeps the plain ``Embed`` (XLA's dot), and so
does an untied model (whose ``lm_head`` is a float ``Linear`` for every linear kind).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite.errors import ConfigError
from pallasite.models.config import ModelConfig
from pallasite.models.layers import Embed, Linear
from pallasite.ops.panels import KERNEL_DTYPES, PANEL, panel_matmul
from pallasite.ops.panels.reference import pack, unpack
from pallasite.registry import LINEAR


@LINEAR.register("panels")
class PanelLinear(Linear):
    """y = x @ unpack(kernel) (+ bias), the kernel stored in panel order."""

    def __init__(self, in_features: int, out_features: int, **kwargs):
        if out_features % PANEL:
            raise ConfigError(f"linear='panels': a linear of output width {out_features} is not a multiple of "
                              f"{PANEL}; use linear='float' for this model")
        super().__init__(in_features, out_features, **kwargs)

    @staticmethod
    def to_float(cfg: ModelConfig, state) -> tuple:
        """The float model with the same numbers (``export_hf`` writes it)."""
        return from_panels(cfg, state)

    def product(self, x: jax.Array) -> jax.Array:
        return panel_matmul(x.astype(self.dtype), self.kernel[...].astype(self.dtype))

    @staticmethod
    def embed_class(cfg: ModelConfig):
        # an untied model's table is only looked up (its lm_head is a float Linear): kept as it is
        return PanelEmbed if cfg.tie_embeddings and cfg.vocab_size % PANEL == 0 else None


def pack_table(table_VD: jax.Array) -> jax.Array:
    """An embedding table [V, D] -> [V, D] holding ``pack(table.T)`` (blocks of 16 rows transposed)."""
    V, D = table_VD.shape
    return pack(table_VD.T).reshape(V, D)


def unpack_table(packed_VD: jax.Array) -> jax.Array:
    """The inverse of ``pack_table``."""
    V, D = packed_VD.shape
    return unpack(packed_VD.reshape(D, V)).T


class PanelEmbed(Embed):
    """``Embed`` with the table in ``pack_table`` order: the tied head runs on the panels kernel."""

    def rows(self, ids: jax.Array) -> jax.Array:
        V, D = self.embedding.shape
        blocks = self.embedding[...].reshape(V // PANEL, D, PANEL)
        return blocks[ids // PANEL, :, ids % PANEL]

    def attend(self, x: jax.Array) -> jax.Array:
        V, D = self.embedding.shape
        table_DV = self.embedding[...].astype(self.dtype).reshape(D, V)
        return panel_matmul(x.astype(self.dtype), table_DV).astype(self.dtype)


def _convert(cfg: ModelConfig, state, kind: str, reorder: Callable, reorder_table: Callable) -> tuple:
    """(cfg with ``linear=kind``, state whose linear kernels went through ``reorder`` and whose
    ``PanelEmbed`` table went through ``reorder_table``)."""
    from pallasite.models.transformer import abstract_model

    new_cfg = cfg.replace(linear=kind)
    model = abstract_model(new_cfg if kind == "panels" else cfg)
    how_by_type = {PanelLinear: ("kernel", reorder), PanelEmbed: ("embedding", reorder_table)}
    paths = {tuple(p) + (how_by_type[t][0],): how_by_type[t][1] for p, m in nnx.iter_modules(model)
             for t in how_by_type if isinstance(m, t)}
    flat = dict(nnx.to_flat_state(state))

    def each(path, value):
        if path not in paths:
            return value
        how = paths[path]
        return value.replace(how(value[...])) if hasattr(value, "replace") else how(value)

    new_state = nnx.from_flat_state({p: each(p, v) for p, v in flat.items()})
    return new_cfg, new_state


def to_panels(cfg: ModelConfig, state) -> tuple:
    """A float model (``linear="float"``) as a ``panels`` model: same numbers, kernels reordered."""
    if cfg.linear != "float":
        raise ConfigError(f"to_panels: the model's linear kind is {cfg.linear!r}; expected 'float'")
    dtype, param_dtype = jnp.dtype(cfg.dtype).name, jnp.dtype(cfg.param_dtype).name
    if param_dtype not in KERNEL_DTYPES or dtype != param_dtype:
        raise ConfigError(f"to_panels: the model stores {param_dtype} and computes in {dtype}; the panels' CPU kernel "
                          f"reads one of {' / '.join(KERNEL_DTYPES)} as stored (load the model with dtype float32 or "
                          "bfloat16)")
    return _convert(cfg, state, "panels", pack, pack_table)


def from_panels(cfg: ModelConfig, state) -> tuple:
    """The inverse of ``to_panels``."""
    if cfg.linear != "panels":
        raise ConfigError(f"from_panels: the model's linear kind is {cfg.linear!r}; expected 'panels'")
    return _convert(cfg, state, "float", unpack, unpack_table)


def with_panels(model):
    """A ``pallasite.Model`` with a float linear kind as the same model on ``panels`` (the tokenizer
    and folder kept); a model already on ``panels`` is returned as it is."""
    if model.config.linear == "panels":
        return model
    cfg, state = to_panels(model.config, model.state)
    return type(model)(cfg, state, model.tokenizer, path=model.path)


__all__ = ["PanelLinear", "PanelEmbed", "pack_table", "unpack_table", "to_panels", "from_panels", "with_panels"]
