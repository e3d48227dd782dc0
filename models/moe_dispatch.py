"""Expert-parallel MoE dispatch with ``jax.shard_map`` + ``all_to_all``: standard and Occult
(Luo et al., ICML 2025, "collaborative communication").

Experts are split contiguously over the mesh axis ``expert``; routing is computed before the
``shard_map``, so it equals the single-device routing bit for bit. Per device: plan (each kept
(token, slot) → destination device, buffer row, slot), send, all_to_all, local experts (sort +
grouped matmul), all_to_all back, combine. The modes differ only in the plan: ``standard`` sends
one row per (token, expert) and applies the gate at the source; ``occult`` sends one row per
(token, distinct device) and the expert device sums its local experts' gate-weighted outputs
before the return trip (rows per token = CT(token)). Buffers have static worst-case shapes
(XLA:CPU has no ragged all_to_all), so the dispatch itself never drops a token; the bytes a ragged
transport would send are counted by ``models/occult_accounting.py``. Token rows are gathered,
never scattered with duplicates, so autodiff is exact. Design notes: docs/moe.md ("Notes").
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallasite.models.moe_experts import expert_ffn_rows

BATCH_MESH_AXES = ("data", "fsdp", "expert")  # the default rule table's "batch" entry


def dispatch_plan(experts_NK, keep_NK, *, num_devices: int, experts_per_device: int, mode: str):
    """Where every (token, slot) pair goes.

    Returns ``dest_NK`` (device), ``row_NK`` (row in that device's buffer; −1 when the pair
    is not sent), ``slot_NK`` (slot within the row), ``first_NK`` (pair is the first of its
    (token, device) group) and ``rows_needed`` per destination [N_d] (actual rows used)."""
    N, K = experts_NK.shape
    dest_NK = experts_NK // experts_per_device
    onehot_NKD = jax.nn.one_hot(dest_NK, num_devices, dtype=jnp.int32) * keep_NK[..., None].astype(jnp.int32)
    # rank of slot k among the token's earlier kept slots with the same destination
    slot_NK = jnp.sum((jnp.cumsum(onehot_NKD, axis=1) - 1) * onehot_NKD, axis=-1)
    first_NK = keep_NK & (slot_NK == 0)
    if mode == "standard":
        flat = onehot_NKD.reshape(N * K, num_devices)
        rank = jnp.cumsum(flat, axis=0) - 1  # pairs in (token, slot) order per destination
        row_NK = jnp.sum(rank * flat, axis=-1).reshape(N, K)
        rows_needed = jnp.sum(flat, axis=0)
        slot_NK = jnp.zeros_like(slot_NK)
    elif mode == "occult":
        present_ND = jnp.minimum(jnp.sum(onehot_NKD, axis=1), 1)  # token sends to device d
        rank_ND = jnp.cumsum(present_ND, axis=0) - 1
        row_NK = jnp.take_along_axis(rank_ND, dest_NK, axis=1)
        rows_needed = jnp.sum(present_ND, axis=0)
    else:
        raise ValueError(f"dispatch mode={mode!r}; expected 'standard' or 'occult'")
    row_NK = jnp.where(keep_NK, row_NK, -1)
    return dest_NK, row_NK, slot_NK, first_NK, rows_needed


def buffer_rows(n_tokens: int, top_k: int, experts_per_device: int, mode: str,
                seqs: Optional[int] = None, expert_capacity: Optional[int] = None) -> int:
    """Static rows per (source, destination) buffer that can never overflow."""
    rows = n_tokens * (min(top_k, experts_per_device) if mode == "standard" else 1)
    if expert_capacity is not None and seqs is not None:
        rows = min(rows, seqs * expert_capacity * experts_per_device)
    return max(rows, 1)


def _local_dispatch(x_ND, experts_NK, weights_NK, keep_NK, w_gate, w_up, w_down, *, axis, num_devices, mode,
                    act, gmm_impl, rows):
    """Body of the shard_map on one device (x, routing: this device's tokens; weights: its experts)."""
    N, D = x_ND.shape
    K = experts_NK.shape[1]
    E_loc = w_up.shape[0]
    S = 1 if mode == "standard" else min(K, E_loc)
    dest, row, slot, first, _ = dispatch_plan(experts_NK, keep_NK, num_devices=num_devices,
                                              experts_per_device=E_loc, mode=mode)
    sent = row >= 0
    d_idx = jnp.where(sent, dest, num_devices)  # out of bounds → dropped by mode="drop"
    r_idx = jnp.where(sent, row, 0)
    tok_NK = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32)[:, None], (N, K))
    # Which token fills each buffer row (−1: empty). Duplicate writes (Occult) write the same id.
    src = jnp.full((num_devices, rows), -1, jnp.int32).at[d_idx, r_idx].set(tok_NK, mode="drop")
    x_send = jnp.where((src >= 0)[..., None], jnp.take(x_ND, jnp.maximum(src, 0), axis=0), 0).astype(x_ND.dtype)
    e_send = jnp.full((num_devices, rows, S), -1, jnp.int32).at[d_idx, r_idx, slot].set(
        experts_NK % E_loc, mode="drop")
    w_val = jnp.ones_like(weights_NK) if mode == "standard" else weights_NK
    w_send = jnp.zeros((num_devices, rows, S), jnp.float32).at[d_idx, r_idx, slot].set(
        w_val.astype(jnp.float32), mode="drop")

    a2a = lambda a: jax.lax.all_to_all(a, axis, 0, 0, tiled=True)
    x_recv, e_recv, w_recv = a2a(x_send), a2a(e_send), a2a(w_send)
    y_recv = expert_ffn_rows(
        x_recv.reshape(num_devices * rows, D), e_recv.reshape(num_devices * rows, S),
        w_recv.reshape(num_devices * rows, S), w_gate, w_up, w_down, act=act, gmm_impl=gmm_impl,
    ).reshape(num_devices, rows, D)
    y_back = a2a(y_recv)

    y_NKD = y_back[jnp.minimum(d_idx, num_devices - 1), r_idx]  # gather: its transpose is scatter-add
    if mode == "standard":
        c_NK = jnp.where(sent, weights_NK, 0.0)
    else:
        c_NK = jnp.where(sent & first, 1.0, 0.0)
    return jnp.einsum("nkd,nk->nd", y_NKD.astype(jnp.float32), c_NK.astype(jnp.float32)).astype(x_ND.dtype)


def token_axes(mesh, batch_size: int, expert_axis: str) -> tuple[str, ...]:
    """Mesh axes the batch is split over inside the dispatch (must include the expert axis)."""
    axes, size = [], 1
    for a in BATCH_MESH_AXES if expert_axis in BATCH_MESH_AXES else BATCH_MESH_AXES + (expert_axis,):
        if a in mesh.axis_names and mesh.shape[a] > 1:
            axes.append(a)
            size *= mesh.shape[a]
    if batch_size % size:
        raise ValueError(
            f"expert parallelism: batch size {batch_size} is not divisible by the {size} token shards of mesh axes "
            f"{tuple(axes)} {dict((a, mesh.shape[a]) for a in axes)}; pad the batch or use a smaller expert axis"
        )
    return tuple(axes)


def expert_parallel_ffn(x_BTD, experts_BTK, weights_BTK, keep_BTK, w_gate_EDF, w_up_EDF, w_down_EFD, *, mesh,
                        expert_axis: str = "expert", mode: str = "standard", act=jax.nn.silu, gmm_impl: str = "auto",
                        expert_capacity: Optional[int] = None):
    """Expert-parallel routed FFN; equals ``expert_ffn_rows`` on one device (see module doc).
    ``w_gate_EDF=None``: non-gated experts (``MoEConfig.gated=False``)."""
    B, T, D = x_BTD.shape
    K = experts_BTK.shape[-1]
    E = w_up_EDF.shape[0]
    n_dev = mesh.shape[expert_axis]
    if E % n_dev:
        raise ValueError(
            f"expert parallelism: the '{expert_axis}' mesh axis has size {n_dev}, which does not divide "
            f"num_experts={E}; choose an expert-axis size that divides {E}"
        )
    E_loc = E // n_dev
    axes = token_axes(mesh, B, expert_axis)
    shards = 1
    for a in axes:
        shards *= mesh.shape[a]
    B_loc = B // shards
    rows = buffer_rows(B_loc * T, K, E_loc, mode, seqs=B_loc, expert_capacity=expert_capacity)
    tok_spec = P(axes if len(axes) > 1 else axes[0])
    w_spec = P(expert_axis, None, None)

    gated = w_gate_EDF is not None

    def body(x, e, w, keep, *ws):
        wg, wu, wd = ws if gated else (None, *ws)
        b = x.shape[0]
        y = _local_dispatch(
            x.reshape(b * T, D), e.reshape(b * T, K), w.reshape(b * T, K), keep.reshape(b * T, K), wg, wu, wd,
            axis=expert_axis, num_devices=n_dev, mode=mode, act=act, gmm_impl=gmm_impl, rows=rows,
        )
        return y.reshape(b, T, D)

    ws = (w_gate_EDF, w_up_EDF, w_down_EFD) if gated else (w_up_EDF, w_down_EFD)
    return jax.shard_map(
        body, mesh=mesh,
        in_specs=(tok_spec, tok_spec, tok_spec, tok_spec) + (w_spec,) * len(ws),
        out_specs=tok_spec,
    )(x_BTD, experts_BTK, weights_BTK, keep_BTK, *ws)
