"""Routed mixture-of-experts FFN (``cfg.ffn = "moe"``, sub-config ``cfg.moe = MoEConfig(...)``).

One layer covers the gating conventions of the three HF families we import:

* **Mixtral** (Jiang et al. 2024): ``p = softmax(x·W_r)``; top-k of p; renormalise the k
  weights to sum to one (``norm_topk_prob=True``). No shared expert.
* **Qwen2-MoE / Qwen3-MoE**: the same softmax → top-k, renormalised only when
  ``norm_topk_prob`` is set (Qwen2-MoE ships ``False``, Qwen3-MoE ``True``). Qwen2-MoE adds a
  *shared expert* (a SwiGLU MLP of width ``shared_expert_d_ff``) on every token, scaled by
  ``sigmoid(x·w_gate)`` (``shared_expert_gate=True``).
* **OLMoE** (Muennighoff et al. 2024): softmax → top-k, not renormalised
  (``norm_topk_prob=False``).

Every expert is a SwiGLU MLP ``down(act(x·W_gate) ⊙ x·W_up)`` with weights stacked over the
expert axis: ``w_gate, w_up [E, D, F]``, ``w_down [E, F, D]`` (logical axes ``expert``, …) —
the form of every HF family above (``gated=True``, the default and what HF import builds).
``gated=False`` gives non-gated two-matrix experts ``down(act(x·W_up))`` (no ``w_gate``): the
Pythia-style experts of the MoLE paper's MoE-10E / MoE-34E baselines (Jie et al. ICML 2025,
Table 2: exact-GELU MLPs of width D_r = D_s/2, top-2, so 2·2·d·D_s/2 activated FFN parameters,
the dense model's), used by ``configs/experts``.
The router runs in float32 whatever the compute dtype (its logits, softmax and top-k).

Auxiliary losses (returned in the FFN's aux dict **already multiplied by their coefficient**,
because the train step adds every aux value to the loss):

* ``moe_lb_loss = lb_loss_coef · E · Σ_e f_e · P_e`` — Switch Transformer eq. (4)–(6) as
  implemented by HF ``load_balancing_loss_func``: ``f_e`` = number of top-k assignments to
  expert e divided by the number of tokens (so Σ f = k, and a perfectly balanced router gives
  k·coef), ``P_e`` = mean router probability. Default coefficient 0.01.
* ``moe_z_loss = z_loss_coef · mean_t (logsumexp_e logits_te)²`` — ST-MoE router z-loss
  (Zoph et al. 2022). Default coefficient 0.001.
  (Padding tokens are counted like any other token: the FFN sees no mask.)

Compute:

* **Dropless** (``capacity_factor=None``, default): the (token, slot) pairs are sorted by expert
  and the experts run as grouped matmuls (``ops.gmm``, ``gmm_impl``: ``jax.lax.ragged_dot``,
  the same padded-tile algorithm as the kernel in plain XLA — the default on CPU, where
  ragged_dot is ~25× slower — or the Pallas kernel), then the outputs are unsorted, weighted by the gates and summed over
  the k slots. Decode-sized inputs under ``gmm_impl="auto"`` take exact shortcuts instead
  (``_small_batch_path``: gathered expert weights when there are no more (token, slot) pairs than
  experts, all experts densely when that is fewer rows than the padded tiles).
* **Capacity mode** (``capacity_factor=c``): each *sequence* gives each expert at most
  ``C = ceil(c · T · k / E)`` (token, slot) pairs; priority is slot-major then position
  (every token's first choice before any second choice, GShard/Switch), overflow pairs are
  dropped (their gate weight becomes 0; the residual stream carries the token). Groups are
  sequences so the set of dropped pairs does not depend on how the batch is sharded —
  expert-parallel and single-device layers drop exactly the same pairs.
* **Expert parallelism**: when the mesh in context (``jax.set_mesh``, read with
  ``jax.sharding.get_abstract_mesh()``) or the explicit ``mesh=`` argument has an ``expert``
  axis of size > 1, experts are sharded over it and tokens travel with ``jax.shard_map`` +
  ``all_to_all`` (``models/moe_dispatch.py``). ``dispatch="standard"`` sends one replica per
  (token, expert); ``dispatch="occult"`` sends one per (token, destination device) and sums the
  local experts' gate-weighted outputs on the expert device (Occult, Luo et al. ICML 2025).
  Routing, aux losses and capacity drops are computed outside the ``shard_map``, so they are
  identical to the single-device layer by construction.
* **Occult collaboration pruning** (``occult_max_devices=N_d'`` with ``occult_devices=N_d``):
  each token's k experts are restricted to at most N_d' of the N_d contiguous expert groups
  (``prune="score"`` or ``"similarity"``, see ``models/occult.py``), before renormalisation.

Deviations: shared experts and the router are replicated (outside expert parallelism, as in
Occult); expert weights do not go through the ``Linear`` seam (they are stacked tensors), so
quantized linear kinds do not apply to experts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite.models.config import ModelConfig, register_sub_config, sub_config_of
from pallasite.models.ffn import DenseFFN, register_ffn
from pallasite.models.layers import activation, dtype_of
from pallasite.ops.gmm import gmm

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

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(f"MoEConfig: {msg}")

        need(self.num_experts >= 1, f"num_experts must be ≥ 1, got {self.num_experts}")
        need(1 <= self.top_k <= self.num_experts, f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        need(self.d_expert is None or self.d_expert > 0, f"d_expert must be positive, got {self.d_expert}")
        need(self.capacity_factor is None or self.capacity_factor > 0,
             f"capacity_factor must be positive or None (dropless), got {self.capacity_factor}")
        need(self.gmm_impl in ("auto", "ref", "tiles", "pallas"),
             f"gmm_impl={self.gmm_impl!r}; expected auto | ref | tiles | pallas")
        need(self.dispatch in DISPATCH_MODES, f"dispatch={self.dispatch!r}; expected one of {DISPATCH_MODES}")
        need(self.prune in PRUNE_KINDS, f"prune={self.prune!r}; expected one of {PRUNE_KINDS}")
        if self.occult_max_devices is not None:
            need(self.occult_devices is not None, "occult_max_devices needs occult_devices (the number N_d of expert groups)")
            need(1 <= self.occult_max_devices <= self.occult_devices,
                 f"occult_max_devices={self.occult_max_devices} must be in [1, occult_devices={self.occult_devices}]")
        if self.occult_devices is not None:
            need(self.num_experts % self.occult_devices == 0,
                 f"occult_devices={self.occult_devices} does not divide num_experts={self.num_experts}")
        if self.occult_max_devices is not None:
            e_loc = self.num_experts // self.occult_devices
            need(self.occult_max_devices * e_loc >= self.top_k,
                 f"occult_max_devices={self.occult_max_devices} devices × {e_loc} experts each cannot hold "
                 f"top_k={self.top_k} experts")


register_sub_config("moe", MoEConfig)


def moe_config_of(cfg: ModelConfig) -> MoEConfig:
    return sub_config_of(cfg, "moe", MoEConfig)


class ExpertSimilarity(nnx.Variable):
    """Non-trainable [E, E] expert-similarity table used by Occult similarity pruning."""


# ----------------------------------------------------------------------------- routing
def route(logits_NE: jax.Array, top_k: int, norm_topk_prob: bool):
    """softmax → top-k (→ renormalise). Returns (probs_NE, weights_NK, experts_NK), float32."""
    probs_NE = jax.nn.softmax(logits_NE.astype(jnp.float32), axis=-1)
    weights_NK, experts_NK = jax.lax.top_k(probs_NE, top_k)
    if norm_topk_prob:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return probs_NE, weights_NK, experts_NK.astype(jnp.int32)


def aux_losses(logits_NE, probs_NE, experts_NK, num_experts: int, lb_coef: float, z_coef: float) -> dict:
    out = {}
    if lb_coef:
        N = probs_NE.shape[0]
        counts_E = jnp.zeros((num_experts,), jnp.float32).at[experts_NK.reshape(-1)].add(1.0)
        f_E = counts_E / N
        P_E = jnp.mean(probs_NE, axis=0)
        out["moe_lb_loss"] = lb_coef * num_experts * jnp.sum(f_E * P_E)
    if z_coef:
        z_N = jax.nn.logsumexp(logits_NE.astype(jnp.float32), axis=-1)
        out["moe_z_loss"] = z_coef * jnp.mean(z_N * z_N)
    return out


def expert_capacity(seq_len: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    return max(1, int(math.ceil(capacity_factor * seq_len * top_k / num_experts)))


def capacity_keep(experts_BTK: jax.Array, num_experts: int, capacity: int) -> jax.Array:
    """bool [B,T,K]: which (token, slot) pairs fit in their expert's per-sequence capacity.

    Priority is slot-major, then position: all first choices of a sequence, in order, come
    before any second choice."""
    B, T, K = experts_BTK.shape
    e_BKT = jnp.swapaxes(experts_BTK, 1, 2).reshape(B, K * T)
    onehot = jax.nn.one_hot(e_BKT, num_experts, dtype=jnp.int32)  # [B, K*T, E]
    rank = jnp.cumsum(onehot, axis=1) - 1  # rank of this pair among pairs of its expert
    rank_BKT = jnp.take_along_axis(rank, e_BKT[..., None], axis=-1)[..., 0]
    return jnp.swapaxes((rank_BKT < capacity).reshape(B, K, T), 1, 2)


# ----------------------------------------------------------------------------- expert compute
def expert_ffn_rows(x_RD, experts_RS, weights_RS, w_gate_EDF, w_up_EDF, w_down_EFD, *, act, gmm_impl="auto"):
    """y_r = Σ_s weights[r,s] · Expert_{experts[r,s]}(x_r); expert id −1 means an empty slot.

    Expert_e(x) = down_e(act(x·gate_e) ⊙ x·up_e), or down_e(act(x·up_e)) when ``w_gate_EDF`` is
    None (non-gated experts).

    The (row, slot) pairs are sorted by expert and the experts run as grouped matmuls over
    the sorted rows (dropless). Used by the single-device layer (rows = tokens, slots = the k
    choices) and on every device of the expert-parallel dispatch (rows = received buffer
    rows, slots = the local experts a row visits)."""
    R, S = experts_RS.shape
    E = w_up_EDF.shape[0]
    if gmm_impl == "auto":
        small = _small_batch_path(R, S, E)
        if small is not None:  # decode-sized batches: sorting into padded tiles would waste ≥ E tiles
            return small(x_RD, experts_RS, weights_RS, w_gate_EDF, w_up_EDF, w_down_EFD, act)
    key_P = jnp.where(experts_RS < 0, E, experts_RS).reshape(-1)  # empty slots sort last
    order_P = jnp.argsort(key_P, stable=True)
    rows_P = order_P // S
    xs_PD = jnp.take(x_RD, rows_P, axis=0)
    group_sizes = jnp.bincount(key_P, length=E + 1)[:E].astype(jnp.int32)
    dt = x_RD.dtype
    if gmm_impl == "auto":  # ragged_dot costs ~E× its FLOPs on XLA:CPU; the padded-tile path does not
        gmm_impl = "tiles" if jax.default_backend() == "cpu" else "ref"
    u = gmm(xs_PD, w_up_EDF.astype(dt), group_sizes, impl=gmm_impl)
    if w_gate_EDF is None:
        h = act(u)
    else:
        h = act(gmm(xs_PD, w_gate_EDF.astype(dt), group_sizes, impl=gmm_impl)) * u
    ys_PD = gmm(h, w_down_EFD.astype(dt), group_sizes, impl=gmm_impl)
    inv_P = jnp.argsort(order_P)
    y_RSD = jnp.take(ys_PD, inv_P, axis=0).reshape(R, S, -1)
    w_RS = jnp.where(experts_RS < 0, 0.0, weights_RS).astype(jnp.float32)
    return jnp.einsum("rsd,rs->rd", y_RSD.astype(jnp.float32), w_RS).astype(dt)


_TILE_ROWS = 64  # the tile height of ops.gmm's padded-tile / Pallas paths


def _small_batch_path(R: int, S: int, E: int):
    """Exact rewrites of ``expert_ffn_rows`` for decode-sized inputs (chosen from static shapes;
    ``gmm_impl="auto"`` only):

    * P = R·S ≤ E (e.g. batch-1 decode): gather each pair's expert weights and run P mat-vecs —
      reads only the chosen experts' weights, as a fused-MoE decode kernel does;
    * else, when every row through every expert (R·E rows) is less work than the padded tiles
      (⌈P/64⌉ + E tiles of 64 rows): run all experts densely and combine with the gates.

    Larger inputs (prefill, training) use the sorted grouped matmul."""
    if R * S <= E:
        return _experts_gathered
    if R * E <= (-(-(R * S) // _TILE_ROWS) + E) * _TILE_ROWS:
        return _experts_all_dense
    return None


def _expert_mlp(x, w_gate, w_up, w_down, act, spec_in: str, spec_out: str):
    """down(act(x·gate) ⊙ x·up), or down(act(x·up)) without a gate, for einsum specs
    ``spec_in`` (x, w → hidden) and ``spec_out`` (hidden, w_down → out)."""
    u = jnp.einsum(spec_in, x, w_up)
    h = act(u) if w_gate is None else act(jnp.einsum(spec_in, x, w_gate)) * u
    return jnp.einsum(spec_out, h, w_down)


def _experts_gathered(x_RD, experts_RS, weights_RS, w_gate_EDF, w_up_EDF, w_down_EFD, act):
    dt = x_RD.dtype
    e_RS = jnp.maximum(experts_RS, 0)  # empty slots read expert 0 and get weight 0
    take = lambda w: None if w is None else jnp.take(w, e_RS, axis=0).astype(dt)  # noqa: E731
    y_RSD = _expert_mlp(x_RD, take(w_gate_EDF), take(w_up_EDF), take(w_down_EFD), act,
                        "rd,rsdf->rsf", "rsf,rsfd->rsd")
    w_RS = jnp.where(experts_RS < 0, 0.0, weights_RS).astype(jnp.float32)
    return jnp.einsum("rsd,rs->rd", y_RSD.astype(jnp.float32), w_RS).astype(dt)


def _experts_all_dense(x_RD, experts_RS, weights_RS, w_gate_EDF, w_up_EDF, w_down_EFD, act):
    dt = x_RD.dtype
    cast = lambda w: None if w is None else w.astype(dt)  # noqa: E731
    y_RED = _expert_mlp(x_RD, cast(w_gate_EDF), cast(w_up_EDF), cast(w_down_EFD), act,
                        "rd,edf->ref", "ref,efd->red")
    E = w_up_EDF.shape[0]
    w_RS = jnp.where(experts_RS < 0, 0.0, weights_RS).astype(jnp.float32)
    gate_RE = jnp.einsum("rs,rse->re", w_RS, jax.nn.one_hot(experts_RS, E, dtype=jnp.float32))  # −1 → zero row
    return jnp.einsum("red,re->rd", y_RED.astype(jnp.float32), gate_RE).astype(dt)


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
        pdt = dtype_of(cfg.param_dtype)
        self.dtype = dtype_of(cfg.dtype)
        self.act = activation(cfg.hidden_act)
        init = jax.nn.initializers.normal(0.02)
        self.router = nnx.Param(init(rngs.params(), (D, E), pdt), logical_axes=("embed", None))
        self.router_bias = nnx.Param(jnp.zeros((E,), pdt), logical_axes=(None,)) if m.router_bias else None
        self.w_gate = (nnx.Param(init(rngs.params(), (E, D, F), pdt), logical_axes=("expert", "embed", "expert_mlp"))
                       if m.gated else None)
        self.w_up = nnx.Param(init(rngs.params(), (E, D, F), pdt), logical_axes=("expert", "embed", "expert_mlp"))
        self.w_down = nnx.Param(init(rngs.params(), (E, F, D), pdt), logical_axes=("expert", "expert_mlp", "embed"))
        if m.shared_expert_d_ff:
            self.shared_expert = DenseFFN(cfg.replace(mlp_bias=False), rngs=rngs, d_ff=m.shared_expert_d_ff)
            self.shared_gate = (
                nnx.Param(init(rngs.params(), (D, 1), pdt), logical_axes=("embed", None)) if m.shared_expert_gate else None
            )
        else:
            self.shared_expert = None
            self.shared_gate = None
        self.similarity = (
            ExpertSimilarity(jnp.eye(E, dtype=jnp.float32))
            if m.occult_max_devices is not None and m.prune == "similarity" else None
        )

    # ------------------------------------------------------------------ routing
    def router_logits(self, x_ND: jax.Array) -> jax.Array:
        logits = jnp.dot(x_ND.astype(jnp.float32), self.router[...].astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)
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
            from pallasite.models.occult import prune_routing

            sim = None if self.similarity is None else self.similarity[...]
            w, e = prune_routing(probs, w, e, num_devices=m.occult_devices, max_devices=m.occult_max_devices,
                                 kind=m.prune, similarity_EE=sim)
        if m.norm_topk_prob:
            w = w / jnp.sum(w, axis=-1, keepdims=True)
        w_BTK, e_BTK = w.reshape(B, T, -1), e.reshape(B, T, -1)
        if m.capacity_factor is not None:
            keep = capacity_keep(e_BTK, m.num_experts, expert_capacity(T, m.top_k, m.num_experts, m.capacity_factor))
        else:
            keep = jnp.ones(e_BTK.shape, bool)
        return logits, probs, w_BTK, e_BTK, keep

    # ------------------------------------------------------------------ forward
    def __call__(self, x_BTD, *, token_ids_BT=None, embed_BTD=None, mesh=None):
        m = self.mcfg
        B, T, D = x_BTD.shape
        x_BTD = x_BTD.astype(self.dtype)
        logits, probs, w_BTK, e_BTK, keep_BTK = self.routing(x_BTD)
        aux = aux_losses(logits, probs, e_BTK.reshape(B * T, -1), m.num_experts, m.lb_loss_coef, m.z_loss_coef)
        w_BTK = jnp.where(keep_BTK, w_BTK, 0.0)
        ep_mesh = _expert_mesh(mesh, m.expert_axis)
        w_gate = None if self.w_gate is None else self.w_gate[...]
        if ep_mesh is None:
            e_masked = jnp.where(keep_BTK, e_BTK, -1)
            y = expert_ffn_rows(
                x_BTD.reshape(B * T, D), e_masked.reshape(B * T, -1), w_BTK.reshape(B * T, -1),
                w_gate, self.w_up[...], self.w_down[...], act=self.act, gmm_impl=m.gmm_impl,
            ).reshape(B, T, D)
        else:
            from pallasite.models.moe_dispatch import expert_parallel_ffn

            capacity = (expert_capacity(T, m.top_k, m.num_experts, m.capacity_factor)
                        if m.capacity_factor is not None else None)
            y = expert_parallel_ffn(
                x_BTD, e_BTK, w_BTK, keep_BTK, w_gate, self.w_up[...], self.w_down[...],
                mesh=ep_mesh, expert_axis=m.expert_axis, mode=m.dispatch, act=self.act, gmm_impl=m.gmm_impl,
                expert_capacity=capacity,
            )
        if self.shared_expert is not None:
            s, _ = self.shared_expert(x_BTD)
            if self.shared_gate is not None:
                gate = jax.nn.sigmoid(jnp.dot(x_BTD.astype(jnp.float32), self.shared_gate[...].astype(jnp.float32)))
                s = (gate * s.astype(jnp.float32)).astype(self.dtype)
            y = y + s
        return y, aux


register_ffn("moe", MoE)
