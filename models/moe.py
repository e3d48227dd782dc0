"""Routed mixture-of-experts FFN (``ffn="moe"``, sub-config ``MoEConfig`` as ``ffn_config``).

One layer covers the HF families we import: Mixtral (softmax -> top-k, renormalised), Qwen2-MoE
(not renormalised; a shared SwiGLU expert scaled by ``sigmoid(x·w_gate)``), Qwen3-MoE
(renormalised) and OLMoE (not renormalised). Experts are SwiGLU MLPs stacked over the expert axis
(``w_gate, w_up [E, D, F]``, ``w_down [E, F, D]``), or non-gated ``down(act(x·W_up))`` with
``gated=False`` (the MoLE paper's MoE baselines). Routing, auxiliary losses (already weighted),
capacity and Occult pruning: ``models/moe_routing.py``; expert compute: ``models/moe_experts.py``.
With an ``expert`` mesh axis of size > 1 (``jax.set_mesh`` or ``mesh=``) experts are sharded and
tokens travel by ``shard_map`` + ``all_to_all`` (``models/moe_dispatch.py``; ``dispatch="occult"``
sends one replica per (token, device), Luo et al. ICML 2025). Routing is computed outside the
``shard_map``, so expert-parallel and single-device layers agree, drops included.
Deviations: the shared expert and the router are replicated. Expert weights are stacked tensors,
not ``Linear``s: a linear kind reaches them only through its ``grouped_matmul`` (FP4 training
defines one, ``models/moe_experts.linear_grouped_matmul``); the router stays float32. Taps:
``moe.router_probs``, ``moe.experts``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite.models.config import ModelConfig, kind_config
from pallasite.models.context import ForwardContext
from pallasite.models.ffn import DenseFFN
from pallasite.models.layers import activation
from pallasite.models.moe_dispatch import expert_parallel_ffn
from pallasite.models.moe_experts import expert_ffn_rows, linear_grouped_matmul
from pallasite.models.moe_routing import aux_losses, capacity_keep, expert_capacity, prune_routing, route
from pallasite.registry import FFN

DISPATCH_MODES = ("standard", "occult")
PRUNE_KINDS = ("score", "similarity")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sub-config of a routed-expert FFN (attached as ``ModelConfig.moe``)."""

    num_experts: int = 8
    top_k: int = 2
    d_expert: Optional[int] = None  # per-expert hidden width (HF moe_intermediate_size); None → cfg.d_ff
    gated: bool = True  # SwiGLU-form experts (HF families); False: non-gated down(act(x·W_up)) (MoLE paper MoE)
    norm_topk_prob: bool = True  # Mixtral True; Qwen2-MoE False / Qwen3-MoE True; OLMoE False
    router_bias: bool = False
    shared_expert_d_ff: int = 0  # Qwen2-MoE shared expert width; 0 = no shared expert
    shared_expert_gate: bool = True  # sigmoid(x · w) scale on the shared expert (Qwen2-MoE)
    lb_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    capacity_factor: Optional[float] = None  # None = dropless
    # auto (tiles on CPU, ref elsewhere) | ref (jax.lax.ragged_dot) | tiles (padded tiles in XLA) | pallas
    gmm_impl: str = "auto"
    dispatch: str = "standard"  # expert-parallel dispatch: standard | occult
    expert_axis: str = "expert"
    # Occult collaboration pruning (models/occult.py): N_d contiguous expert groups, keep ≤ N_d'
    occult_devices: Optional[int] = None
    occult_max_devices: Optional[int] = None
    prune: str = "score"  # score | similarity
    # Occult placement file (occult.Placement JSON; relative: the model's folder), applied to the
    # expert weights and router columns when the model is loaded (pallasite.load)
    placement: Optional[str] = None

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(f"MoEConfig: {msg}")

        need(self.num_experts >= 1, f"num_experts must be ≥ 1, got {self.num_experts}")
        need(1 <= self.top_k <= self.num_experts, f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        need(self.d_expert is None or self.d_expert > 0, f"d_expert must be positive, got {self.d_expert}")
        need(
            self.capacity_factor is None or self.capacity_factor > 0,
            f"capacity_factor must be positive or None (dropless), got {self.capacity_factor}",
        )
        need(
            self.gmm_impl in ("auto", "ref", "tiles", "pallas"),
            f"gmm_impl={self.gmm_impl!r}; expected auto | ref | tiles | pallas",
        )
        need(self.dispatch in DISPATCH_MODES, f"dispatch={self.dispatch!r}; expected one of {DISPATCH_MODES}")
        need(self.prune in PRUNE_KINDS, f"prune={self.prune!r}; expected one of {PRUNE_KINDS}")
        if self.occult_max_devices is not None:
            need(
                self.occult_devices is not None,
                "occult_max_devices needs occult_devices (the number N_d of expert groups)",
            )
            need(
                1 <= self.occult_max_devices <= self.occult_devices,
                f"occult_max_devices={self.occult_max_devices} must be in [1, occult_devices={self.occult_devices}]",
            )
        if self.occult_devices is not None:
            need(
                self.num_experts % self.occult_devices == 0,
                f"occult_devices={self.occult_devices} does not divide num_experts={self.num_experts}",
            )
        if self.occult_max_devices is not None:
            e_loc = self.num_experts // self.occult_devices
            need(
                self.occult_max_devices * e_loc >= self.top_k,
                f"occult_max_devices={self.occult_max_devices} devices × {e_loc} experts each cannot hold "
                f"top_k={self.top_k} experts",
            )


def moe_config_of(cfg: ModelConfig) -> MoEConfig:
    return kind_config(cfg, "ffn", "moe", MoEConfig)


class ExpertSimilarity(nnx.Variable):
    """Non-trainable [E, E] expert-similarity table used by Occult similarity pruning."""


# ----------------------------------------------------------------------------- mesh
def _expert_mesh(mesh, axis: str):
    """The mesh to run expert parallelism on, or None for the single-device path."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False) or axis not in mesh.axis_names:
        return None
    if mesh.shape[axis] <= 1:
        return None
    return mesh


class MoE(nnx.Module):
    """Routed SwiGLU (or non-gated) experts (+ optional Qwen shared expert); see the module docstring."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m = moe_config_of(cfg)
        self.cfg, self.mcfg = cfg, m
        D, E = cfg.d_model, m.num_experts
        F = m.d_expert or cfg.d_ff
        pdt = jnp.dtype(cfg.param_dtype)
        self.dtype = jnp.dtype(cfg.dtype)
        self.act = activation(cfg.hidden_act)
        init = jax.nn.initializers.normal(0.02)
        self.router = nnx.Param(init(rngs.params(), (D, E), pdt), logical_axes=("embed", None))
        self.router_bias = nnx.Param(jnp.zeros((E,), pdt), logical_axes=(None,)) if m.router_bias else None
        self.w_gate = (
            nnx.Param(init(rngs.params(), (E, D, F), pdt), logical_axes=("expert", "embed", "expert_mlp"))
            if m.gated
            else None
        )
        self.w_up = nnx.Param(init(rngs.params(), (E, D, F), pdt), logical_axes=("expert", "embed", "expert_mlp"))
        self.w_down = nnx.Param(init(rngs.params(), (E, F, D), pdt), logical_axes=("expert", "expert_mlp", "embed"))
        if m.shared_expert_d_ff:
            self.shared_expert = DenseFFN(cfg.replace(mlp_bias=False), rngs=rngs, d_ff=m.shared_expert_d_ff)
            self.shared_gate = (
                nnx.Param(init(rngs.params(), (D, 1), pdt), logical_axes=("embed", None))
                if m.shared_expert_gate
                else None
            )
        else:
            self.shared_expert = None
            self.shared_gate = None
        self.similarity = (
            ExpertSimilarity(jnp.eye(E, dtype=jnp.float32))
            if m.occult_max_devices is not None and m.prune == "similarity"
            else None
        )

    # ------------------------------------------------------------------ routing
    def router_logits(self, x_ND: jax.Array) -> jax.Array:
        logits = jnp.dot(
            x_ND.astype(jnp.float32), self.router[...].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        return logits

    def routing(self, x_BTD: jax.Array):
        """(logits_NE, probs_NE, weights_BTK, experts_BTK, keep_BTK) for tokens x."""
        m = self.mcfg
        B, T, D = x_BTD.shape
        logits = self.router_logits(x_BTD.reshape(B * T, D))
        probs, w, e = route(logits, m.top_k, norm_topk_prob=False)
        if m.occult_max_devices is not None and m.occult_max_devices < m.occult_devices:
            sim = None if self.similarity is None else self.similarity[...]
            w, e = prune_routing(
                probs,
                w,
                e,
                num_devices=m.occult_devices,
                max_devices=m.occult_max_devices,
                kind=m.prune,
                similarity_EE=sim,
            )
        if m.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        w_BTK, e_BTK = w.reshape(B, T, -1), e.reshape(B, T, -1)
        if m.capacity_factor is not None:
            keep = capacity_keep(e_BTK, m.num_experts, expert_capacity(T, m.top_k, m.num_experts, m.capacity_factor))
        else:
            keep = jnp.ones(e_BTK.shape, bool)
        return logits, probs, w_BTK, e_BTK, keep

    # ------------------------------------------------------------------ forward
    def __call__(self, x_BTD, ctx: Optional[ForwardContext] = None, *, mesh=None):
        m = self.mcfg
        B, T, D = x_BTD.shape
        x_BTD = x_BTD.astype(self.dtype)
        logits, probs, w_BTK, e_BTK, keep_BTK = self.routing(x_BTD)
        if ctx is not None:
            probs = ctx.tap("moe.router_probs", probs)
            e_BTK = ctx.tap("moe.experts", e_BTK.reshape(B * T, -1)).reshape(B, T, -1)
        aux = aux_losses(logits, probs, e_BTK.reshape(B * T, -1), m.num_experts, m.lb_loss_coef, m.z_loss_coef)
        w_BTK = jnp.where(keep_BTK, w_BTK, 0.0)
        ep_mesh = _expert_mesh(mesh, m.expert_axis)
        w_gate = None if self.w_gate is None else self.w_gate[...]
        mm = linear_grouped_matmul(self.cfg)  # None: plain gmm; else the linear kind's (e.g. FP4)
        if ep_mesh is None:
            e_masked = jnp.where(keep_BTK, e_BTK, -1)
            y = expert_ffn_rows(
                x_BTD.reshape(B * T, D),
                e_masked.reshape(B * T, -1),
                w_BTK.reshape(B * T, -1),
                w_gate,
                self.w_up[...],
                self.w_down[...],
                act=self.act,
                gmm_impl=m.gmm_impl,
                grouped_matmul=mm,
            ).reshape(B, T, D)
        else:
            capacity = (
                expert_capacity(T, m.top_k, m.num_experts, m.capacity_factor) if m.capacity_factor is not None else None
            )
            y = expert_parallel_ffn(
                x_BTD,
                e_BTK,
                w_BTK,
                keep_BTK,
                w_gate,
                self.w_up[...],
                self.w_down[...],
                mesh=ep_mesh,
                expert_axis=m.expert_axis,
                mode=m.dispatch,
                act=self.act,
                gmm_impl=m.gmm_impl,
                expert_capacity=capacity,
                grouped_matmul=mm,
            )
        if self.shared_expert is not None:
            s, _ = self.shared_expert(x_BTD, ctx)
            if self.shared_gate is not None:
                gate = jax.nn.sigmoid(jnp.dot(x_BTD.astype(jnp.float32), self.shared_gate[...].astype(jnp.float32)))
                s = (gate * s.astype(jnp.float32)).astype(self.dtype)
            y = y + s
        return y, aux


FFN.register("moe", MoE, config=MoEConfig)
