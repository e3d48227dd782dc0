"""Occult — collaborative communication for expert-parallel MoE (Luo et al., ICML 2025,
"Occult: Optimizing Collaborative Communication across Experts for Accelerated Parallel MoE
Training and Inference"; official code UNITES-Lab/Occult, not retrievable here — this is
our reading of the paper's text and of the brief in shared/papers/systems.md).

Definitions. N_e experts over N_d devices, E_loc = N_e / N_d contiguous experts per device
(after placement, slot i lives on device i // E_loc), top-k routing. Two experts chosen by
one token *collaborate*; the collaboration is intra-device when they share a device.
CT(token) = number of distinct devices among its k experts; CT = mean over tokens, with
``ceil(k·N_d/N_e) ≤ CT ≤ min(k, N_d)``. Standard EP moves k replicas per token each way,
Occult's dispatch (``models/moe_dispatch.py``, ``MoEConfig.dispatch="occult"``) moves CT.

This module holds the parts that change *which experts sit together* or *which experts a
token may use*:

* ``profile_routing`` / ``coactivation`` — run a model over profiling batches recording
  each MoE layer's routing, and build per-layer co-activation matrices
  ``P[l, i, j]`` = number of tokens that selected both i and j (diagonal: load of i).
* ``greedy_placement`` — Algorithm 1 as we read it: devices are filled one after another;
  each starts from the unassigned expert with the largest total collaboration with the
  other unassigned experts (the paper seeds FPS-style; this seed is our choice, stated
  here), then repeatedly adds the unassigned expert with the highest total collaboration
  with the experts already on that device, until it holds E_loc experts.
* ``apply_placement`` — the placement as a params → params permutation: expert weights
  (``w_gate``, ``w_up``, ``w_down``), router columns (and router bias) and the similarity
  table are permuted per layer. The model's function is unchanged (the router's softmax and
  top-k are permutation-equivariant), so its outputs are identical.
* ``prune_routing`` — collaboration pruning: each token keeps its experts within at most
  N_d' devices. The allowed devices are the N_d' with the largest sum of the token's top-k
  router probabilities (ties → lower device index) — the paper's exact device-selection rule
  could not be confirmed; this is our choice. ``score``: re-select the top-k experts by router
  probability among the allowed devices' experts. ``similarity``: keep the selected experts
  on allowed devices and replace each other one by the most similar not-yet-selected expert
  on an allowed device (similarity table from profiling data, ``expert_similarity``); the
  substitute inherits the replaced expert's gate probability. Renormalisation (Mixtral /
  ``norm_topk_prob``) happens after pruning, in the layer. Requires N_d'·E_loc ≥ k.
  With N_d' = N_d pruning is the identity.
* ``expert_similarity`` — per layer, cosine similarity of the experts' outputs on the
  profiled MoE inputs, averaged over tokens.

Communication accounting lives in ``models/occult_accounting.py``; pruned fine-tuning
(non-MoE parameters frozen, as in the paper) in ``models/occult_finetune.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

EXPERT_PARAM_NAMES = ("w_gate", "w_up", "w_down")


# ----------------------------------------------------------------------------- pruning
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


# ----------------------------------------------------------------------------- placement
@dataclasses.dataclass(frozen=True)
class Placement:
    """Per-layer expert permutation: slot i of layer l holds original expert ``perm[l][i]``;
    device d holds slots [d·E_loc, (d+1)·E_loc)."""

    perm: tuple  # tuple of tuples [L][E]
    num_devices: int

    @property
    def num_layers(self) -> int:
        return len(self.perm)

    @property
    def num_experts(self) -> int:
        return len(self.perm[0])

    def array(self) -> np.ndarray:
        return np.asarray(self.perm, np.int64)

    def to_json(self) -> str:
        return json.dumps({"perm": [list(p) for p in self.perm], "num_devices": self.num_devices})

    @classmethod
    def from_json(cls, text: str) -> "Placement":
        d = json.loads(text)
        return cls(tuple(tuple(int(i) for i in p) for p in d["perm"]), int(d["num_devices"]))

    @classmethod
    def from_array(cls, perm_LE, num_devices: int) -> "Placement":
        perm_LE = np.asarray(perm_LE)
        for l, p in enumerate(perm_LE):
            if sorted(p.tolist()) != list(range(perm_LE.shape[1])):
                raise ValueError(f"placement layer {l} is not a permutation of 0..{perm_LE.shape[1] - 1}: {p.tolist()}")
        if perm_LE.shape[1] % num_devices:
            raise ValueError(f"placement: {num_devices} devices do not divide {perm_LE.shape[1]} experts")
        return cls(tuple(tuple(int(i) for i in p) for p in perm_LE), int(num_devices))

    def validate(self, *, num_layers: int, num_experts: int, num_devices: Optional[int] = None) -> None:
        if self.num_layers != num_layers:
            raise ValueError(f"placement was computed for {self.num_layers} MoE layers, the model has {num_layers}")
        if self.num_experts != num_experts:
            raise ValueError(f"placement was computed for {self.num_experts} experts, the model has {num_experts}")
        if num_devices is not None and self.num_devices != num_devices:
            raise ValueError(f"placement was computed for {self.num_devices} devices, the expert axis has {num_devices}")


def contiguous_placement(num_layers: int, num_experts: int, num_devices: int) -> Placement:
    return Placement.from_array(np.tile(np.arange(num_experts), (num_layers, 1)), num_devices)


def random_placement(num_layers: int, num_experts: int, num_devices: int, seed: int = 0) -> Placement:
    rng = np.random.default_rng(seed)
    return Placement.from_array(np.stack([rng.permutation(num_experts) for _ in range(num_layers)]), num_devices)


def greedy_placement_layer(coact_EE: np.ndarray, num_devices: int) -> np.ndarray:
    """Algorithm 1 (greedy collaboration clustering) for one layer → permutation [E]."""
    C = np.asarray(coact_EE, np.float64).copy()
    E = C.shape[0]
    if E % num_devices:
        raise ValueError(f"greedy placement: {num_devices} devices do not divide {E} experts")
    E_loc = E // num_devices
    np.fill_diagonal(C, 0.0)
    C = C + C.T if not np.allclose(C, C.T) else C
    unassigned = list(range(E))
    perm = []
    for _ in range(num_devices):
        # seed: the unassigned expert with the largest collaboration with the other unassigned ones
        sub = C[np.ix_(unassigned, unassigned)]
        seed = unassigned[int(np.argmax(sub.sum(axis=1)))]
        group = [seed]
        unassigned.remove(seed)
        while len(group) < E_loc:
            gain = C[np.ix_(unassigned, group)].sum(axis=1)
            best = unassigned[int(np.argmax(gain))]
            group.append(best)
            unassigned.remove(best)
        perm.extend(group)
    return np.asarray(perm, np.int64)


def greedy_placement(coact_LEE, num_devices: int) -> Placement:
    coact_LEE = np.asarray(coact_LEE)
    return Placement.from_array(np.stack([greedy_placement_layer(c, num_devices) for c in coact_LEE]), num_devices)


# ----------------------------------------------------------------------------- state traversal
def _moe_leaf_paths(flat: dict) -> dict:
    """Map layer key → {param name: path} for every MoE FFN in a flat state dict."""
    layers: dict = {}
    for path in flat:
        if len(path) >= 2 and path[-2] == "ffn" and path[-1] in EXPERT_PARAM_NAMES + ("router", "router_bias", "similarity"):
            layers.setdefault(path[:-2], {})[path[-1]] = path
    # depth order: integer path parts compare as integers (layer 10 after layer 9)
    return dict(sorted(layers.items(), key=lambda kv: tuple((0, p, "") if isinstance(p, int) else (1, 0, str(p))
                                                            for p in kv[0])))


def _flat(state) -> dict:
    return {tuple(p): v for p, v in nnx.to_flat_state(state)}


def moe_layer_count(state) -> tuple[int, int, bool]:
    """(number of MoE layers, number of experts, scanned layout?) of a model state."""
    flat = _flat(state)
    layers = _moe_leaf_paths(flat)
    if not layers:
        raise ValueError("state has no MoE FFN parameters (…/ffn/w_gate); is cfg.ffn == 'moe'?")
    (key, names), = list(layers.items())[:1]
    w = flat[names["w_gate"]][...]
    if len(layers) == 1 and w.ndim == 4:  # scan_layers: [L, E, D, F]
        return int(w.shape[0]), int(w.shape[1]), True
    return len(layers), int(w.shape[0]), False


def apply_placement(state, placement: Placement, *, num_devices: Optional[int] = None):
    """Permute expert weights, router columns and similarity tables (params → params)."""
    L, E, scanned = moe_layer_count(state)
    placement.validate(num_layers=L, num_experts=E, num_devices=num_devices)
    perm = jnp.asarray(placement.array())
    flat = _flat(state)
    layers = _moe_leaf_paths(flat)
    new = {}
    for li, (key, names) in enumerate(layers.items()):
        for name, path in names.items():
            var = flat[path]
            v = var[...]
            if scanned:
                ax = {"router": 2, "router_bias": 1}.get(name, 1)
                take = jax.vmap(lambda a, p, ax=ax - 1: jnp.take(a, p, axis=ax))
                if name == "similarity":
                    v2 = jax.vmap(lambda a, p: a[p][:, p])(v, perm)
                else:
                    v2 = take(v, perm)
            else:
                p = perm[li]
                if name == "router":
                    v2 = jnp.take(v, p, axis=1)
                elif name == "similarity":
                    v2 = v[p][:, p]
                else:
                    v2 = jnp.take(v, p, axis=0)
            new[path] = var.replace(v2)
    out = dict(flat)
    out.update(new)
    return nnx.from_flat_state([(k, out[k]) for k in flat])


def set_similarity(state, similarity_LEE):
    """Write per-layer similarity tables into the MoE layers' ``similarity`` variables."""
    flat = _flat(state)
    layers = _moe_leaf_paths(flat)
    sim = jnp.asarray(similarity_LEE, jnp.float32)
    out = dict(flat)
    for li, (key, names) in enumerate(layers.items()):
        if "similarity" not in names:
            raise ValueError("the model has no similarity tables: build it with MoEConfig(prune='similarity', "
                             "occult_max_devices=...)")
        var = flat[names["similarity"]]
        out[names["similarity"]] = var.replace(sim if var[...].ndim == 3 else sim[li])
    return nnx.from_flat_state([(k, out[k]) for k in flat])


# ----------------------------------------------------------------------------- profiling
def profile_routing(graphdef, state, batches: Iterable) -> dict:
    """Run the model on ``batches`` (int [B, T] token arrays) and return, per MoE layer (in
    depth order), the selected ``experts`` [N, k], router ``probs`` [N, E] and ``inputs``
    [N, D] (the MoE layer's input, i.e. the post-attention-normed hidden state).

    The blocks are stepped here (embed → per block: attention, norm, routing, FFN) because
    the Transformer runs each block on a merged copy, so values sown inside would be lost;
    the block code itself is the model's. List layout only (``scan_layers=False``)."""
    from pallasite.models.moe import MoE

    model = nnx.merge(graphdef, state)
    cfg = model.cfg
    if cfg.scan_layers:
        raise ValueError("profile_routing needs scan_layers=False")
    if not any(isinstance(b.ffn, MoE) for b in model.layers):
        raise ValueError("profile_routing: the model has no MoE layers")

    run = _PROFILE_FNS.get(graphdef)
    if run is None:
        run = _PROFILE_FNS[graphdef] = jax.jit(functools.partial(_profile_forward, graphdef, cfg))
    out = {"experts": [], "probs": [], "inputs": []}
    for tokens in batches:
        for i, (e, p, u) in enumerate(run(state, jnp.asarray(tokens))):
            for key, val in zip(("experts", "probs", "inputs"), (e, p, u)):
                if len(out[key]) <= i:
                    out[key].append([])
                out[key][i].append(np.asarray(val))
    return {k: [np.concatenate(x) for x in v] for k, v in out.items()}


_PROFILE_FNS: dict = {}  # graphdef → jitted profiling forward (graphdefs are hashable)


def _profile_forward(graphdef, cfg, st, tokens_BT):
    """Embed, then per block: attention, norm, routing record, FFN (the Transformer's order)."""
    from pallasite.models.moe import MoE
    from pallasite.models.rope import inv_frequencies, rope_cos_sin

    mdl = nnx.merge(graphdef, st)
    B, T = tokens_BT.shape
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    rope = rope_cos_sin(pos, inv_frequencies(cfg.dh, cfg.rope_theta, cfg.rope_scaling_dict))
    x = emb = mdl.embed(tokens_BT)
    recs = []
    for block in mdl.layers:
        h, _ = block.attn(block.input_norm(x), pos, rope)
        x = x + h
        u = block.post_attn_norm(x)
        if isinstance(block.ffn, MoE):
            _, probs, _, e_BTK, _ = block.ffn.routing(u.astype(block.ffn.dtype))
            recs.append((e_BTK.reshape(B * T, -1), probs, u.reshape(B * T, -1)))
        y, _ = block.ffn(u, token_ids_BT=tokens_BT, embed_BTD=emb)
        x = x + y
    return recs


def coactivation(experts_NK: np.ndarray, num_experts: int) -> np.ndarray:
    """P[i, j] = number of tokens that selected both i and j (P[i, i] = load of i)."""
    e = np.asarray(experts_NK)
    onehot = np.zeros((e.shape[0], num_experts), np.float64)
    np.put_along_axis(onehot, e, 1.0, axis=1)
    return onehot.T @ onehot


def expert_similarity(w_gate_EDF, w_up_EDF, w_down_EFD, x_ND, act=jax.nn.silu) -> np.ndarray:
    """Mean over tokens of the cosine similarity between experts' outputs → [E, E]."""
    x = jnp.asarray(x_ND, jnp.float32)
    h = act(jnp.einsum("nd,edf->enf", x, w_gate_EDF)) * jnp.einsum("nd,edf->enf", x, w_up_EDF)
    y = jnp.einsum("enf,efd->end", h, w_down_EFD)
    y = y / (jnp.linalg.norm(y, axis=-1, keepdims=True) + 1e-9)
    return np.asarray(jnp.einsum("ind,jnd->ij", y, y) / x.shape[0])


def layer_expert_weights(state) -> list:
    """[(w_gate, w_up, w_down)] per MoE layer (list layout)."""
    flat = _flat(state)
    return [tuple(flat[names[n]][...] for n in EXPERT_PARAM_NAMES) for names in _moe_leaf_paths(flat).values()]
