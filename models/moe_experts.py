"""Expert compute of a routed MoE layer: ``y_r = Σ_s w[r,s] · Expert_{e[r,s]}(x_r)``.

The (row, slot) pairs are sorted by expert and run as grouped matmuls (``ops.gmm``, dropless);
decode-sized inputs take exact shortcuts (gathered expert weights, or all experts densely) chosen
from static shapes. Used by the single-device layer and on every device of the expert-parallel
dispatch (``models/moe_dispatch.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallasite.ops.gmm import gmm
from pallasite.registry import LINEAR


def linear_grouped_matmul(cfg):
    """The linear kind's GEMM in expert-group form (``cls.grouped_matmul(x, w, group_sizes, *, impl,
    cfg)``, e.g. FP4 training's), bound to ``cfg``; None when the kind has none (plain ``gmm``)."""
    fn = getattr(LINEAR.get(cfg.linear, field="ModelConfig.linear"), "grouped_matmul", None)
    return None if fn is None else functools.partial(fn, cfg=cfg)


def expert_ffn_rows(x_RD, experts_RS, weights_RS, w_gate_EDF, w_up_EDF, w_down_EFD, *, act, gmm_impl="auto",
                    grouped_matmul=None):
    """y_r = Σ_s weights[r,s] · Expert_{experts[r,s]}(x_r); expert id −1 means an empty slot.

    Expert_e(x) = down_e(act(x·gate_e) ⊙ x·up_e), or down_e(act(x·up_e)) when ``w_gate_EDF`` is
    None (non-gated experts).

    The (row, slot) pairs are sorted by expert and the experts run as grouped matmuls over
    the sorted rows (dropless). Used by the single-device layer (rows = tokens, slots = the k
    choices) and on every device of the expert-parallel dispatch (rows = received buffer
    rows, slots = the local experts a row visits).

    ``grouped_matmul`` (from ``linear_grouped_matmul``) replaces ``gmm`` for the three expert
    GEMMs and gets the float master weights; the decode-size shortcuts, which are plain einsums,
    are then skipped so every input takes the kind's GEMM."""
    R, S = experts_RS.shape
    E = w_up_EDF.shape[0]
    if gmm_impl == "auto" and grouped_matmul is None:
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
    if grouped_matmul is None:
        mm = lambda x, w: gmm(x, w.astype(dt), group_sizes, impl=gmm_impl)  # noqa: E731
    else:
        mm = lambda x, w: grouped_matmul(x, w, group_sizes, impl=gmm_impl)  # noqa: E731
    u = mm(xs_PD, w_up_EDF)
    h = act(u) if w_gate_EDF is None else act(mm(xs_PD, w_gate_EDF)) * u
    ys_PD = mm(h, w_down_EFD)
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
