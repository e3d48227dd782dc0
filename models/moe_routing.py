"""MoE routing as pure functions: softmax -> top-k (-> renormalise), auxiliary losses, per-sequence
capacity, and Occult collaboration pruning (Luo et al., ICML 2025).

* ``route``: ``p = softmax(x·W_r)`` in float32, top-k of p, renormalised when ``norm_topk_prob``
  (Mixtral, Qwen3-MoE) or not (Qwen2-MoE, OLMoE).
* ``aux_losses``: Switch load balancing ``coef · E · Σ_e f_e · P_e`` (HF ``load_balancing_loss_func``:
  f_e = top-k assignments to e / tokens, so Σ f = k) and the ST-MoE router z-loss
  ``coef · mean_t (logsumexp_e logits_te)²``, returned already multiplied by their coefficients.
* ``capacity_keep``: at most ``C = ceil(c·T·k/E)`` pairs per (sequence, expert), slot-major then
  position priority (GShard/Switch); groups are sequences, so sharding never changes the drops.
* ``prune_routing``: each token keeps its experts within at most N_d' of the N_d contiguous expert
  groups: the N_d' groups with the largest sum of the token's top-k probabilities (ties -> lower
  index; our choice, the paper's rule could not be confirmed). ``score`` re-selects the top-k
  among the allowed groups' experts; ``similarity`` replaces each disallowed expert by the most
  similar free one on an allowed group (it inherits the gate probability). Requires N_d'·E_loc ≥ k.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


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


def prune_routing(probs_NE, weights_NK, experts_NK, *, num_devices: int, max_devices: int, kind: str = "score",
                  similarity_EE=None):
    """Restrict every token's k experts to at most ``max_devices`` of ``num_devices`` groups.

    ``weights_NK`` are the (un-renormalised) top-k probabilities. Returns (weights_NK, experts_NK)."""
    N, E = probs_NE.shape
    K = experts_NK.shape[1]
    E_loc = E // num_devices
    if max_devices * E_loc < K:
        raise ValueError(
            f"collaboration pruning: max_devices={max_devices} devices × {E_loc} experts each < top_k={K}; "
            f"every token needs at least k experts on its allowed devices"
        )
    if max_devices >= num_devices:
        return weights_NK, experts_NK
    dev_NK = experts_NK // E_loc
    dev_score_ND = jnp.zeros((N, num_devices), jnp.float32).at[jnp.arange(N)[:, None], dev_NK].add(weights_NK)
    # stable top-N_d' of the device scores (ties → lower index)
    _, allowed_dev = jax.lax.top_k(dev_score_ND - 1e-9 * jnp.arange(num_devices), max_devices)
    allowed_ND = jnp.zeros((N, num_devices), bool).at[jnp.arange(N)[:, None], allowed_dev].set(True)
    allowed_NE = jnp.repeat(allowed_ND, E_loc, axis=1)
    if kind == "score":
        masked = jnp.where(allowed_NE, probs_NE, -1.0)
        w, e = jax.lax.top_k(masked, K)
        return w, e.astype(jnp.int32)
    if kind == "similarity":
        if similarity_EE is None:
            raise ValueError("similarity pruning needs an expert-similarity table [E, E] (see expert_similarity)")
        sim = jnp.asarray(similarity_EE, jnp.float32)
        on_allowed_NK = jnp.take_along_axis(allowed_NE, experts_NK, axis=1)
        taken_NE = jnp.zeros((N, E), bool).at[jnp.arange(N)[:, None], experts_NK].set(on_allowed_NK)
        new_e = []
        for k in range(K):  # greedy in slot order so substitutes stay distinct
            e_k = experts_NK[:, k]
            cand = jnp.where(allowed_NE & ~taken_NE, sim[e_k], -jnp.inf)
            sub = jnp.argmax(cand, axis=1).astype(jnp.int32)
            chosen = jnp.where(on_allowed_NK[:, k], e_k, sub)
            taken_NE = taken_NE.at[jnp.arange(N), chosen].set(True)
            new_e.append(chosen)
        return weights_NK, jnp.stack(new_e, axis=1)
    raise ValueError(f"prune kind={kind!r}; expected 'score' or 'similarity'")
