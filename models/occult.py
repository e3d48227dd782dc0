"""Occult expert placement and profiling (Luo et al., ICML 2025, "Occult: Optimizing Collaborative
Communication across Experts for Accelerated Parallel MoE Training and Inference").

N_e experts over N_d devices, E_loc = N_e / N_d contiguous experts per device. CT(token) = number of
distinct devices among its k experts; Occult's dispatch moves CT replicas instead of k. This module
changes *which experts sit together*: ``profile_routing`` records each MoE layer's routing through
the model's own blocks (taps ``ffn.in``, ``moe.experts``, ``moe.router_probs``); ``coactivation``
builds ``P[i, j]`` = tokens that chose both; ``greedy_placement`` is Algorithm 1 as we read it
(devices filled one after another, each seeded by the unassigned expert with the largest total
collaboration — the seed is our choice — then grown by the expert with the highest collaboration
with the device's experts); ``apply_placement`` permutes expert weights, router columns and
similarity tables (the function is unchanged); ``expert_similarity`` feeds similarity pruning
(``models/moe_routing.prune_routing``). Gated and non-gated experts are both handled.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Iterable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.models.context import Taps
from pallasite.models.transformer import capture

EXPERT_PARAM_NAMES = ("w_gate", "w_up", "w_down")  # w_gate is absent for non-gated experts


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
        for layer, p in enumerate(perm_LE):
            if sorted(p.tolist()) != list(range(perm_LE.shape[1])):
                raise ValueError(f"placement layer {layer} is not a permutation of "
                                 f"0..{perm_LE.shape[1] - 1}: {p.tolist()}")
        if perm_LE.shape[1] % num_devices:
            raise ValueError(f"placement: {num_devices} devices do not divide {perm_LE.shape[1]} experts")
        return cls(tuple(tuple(int(i) for i in p) for p in perm_LE), int(num_devices))

    def validate(self, *, num_layers: int, num_experts: int, num_devices: Optional[int] = None) -> None:
        if self.num_layers != num_layers:
            raise ValueError(f"placement was computed for {self.num_layers} MoE layers, the model has {num_layers}")
        if self.num_experts != num_experts:
            raise ValueError(f"placement was computed for {self.num_experts} experts, the model has {num_experts}")
        if num_devices is not None and self.num_devices != num_devices:
            raise ValueError(f"placement was computed for {self.num_devices} devices, "
                             f"the expert axis has {num_devices}")


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


PLACEMENT_FILE = "occult_placement.json"


def save_placement(path: str, placement: Placement) -> str:
    with open(path, "w") as f:
        f.write(placement.to_json())
    return path


def load_placement(path: str) -> Placement:
    if not os.path.exists(path):
        raise FileNotFoundError(f"Occult placement file {path!r} does not exist")
    with open(path) as f:
        text = f.read()
    try:
        return Placement.from_json(text)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not an Occult placement (JSON with 'perm' [layers][experts] and "
                         f"'num_devices'): {e}") from None


def apply_config_placement(cfg, state, folder: Optional[str] = None):
    """(cfg, state) with ``cfg.ffn_config.placement`` applied: experts and router columns permuted
    once, and the config's ``placement`` cleared (the weights are now in placed order, so saving
    the model keeps them placed and a reload does not permute twice). Unchanged without one."""
    mcfg = getattr(cfg, "ffn_config", None)
    if cfg.ffn != "moe" or getattr(mcfg, "placement", None) is None:
        return cfg, state
    path = mcfg.placement
    if not os.path.isabs(path) and folder:
        path = os.path.join(folder, path)
    placed = apply_placement(state, load_placement(path))
    return cfg.replace(ffn_config=dataclasses.replace(mcfg, placement=None)), placed


# ----------------------------------------------------------------------------- state traversal
def _moe_leaf_paths(flat: dict) -> dict:
    """Map layer key → {param name: path} for every MoE FFN in a flat state dict."""
    layers: dict = {}
    for path in flat:
        names = EXPERT_PARAM_NAMES + ("router", "router_bias", "similarity")
        if len(path) >= 2 and path[-2] == "ffn" and path[-1] in names:
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
        raise ValueError("state has no MoE FFN parameters (…/ffn/w_up); is cfg.ffn == 'moe'?")
    (key, names), = list(layers.items())[:1]
    w = flat[names["w_up"]][...]
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
    """Run the model on ``batches`` (int [B, T] token arrays) and return, per MoE layer (in depth
    order), the selected ``experts`` [N, k], router ``probs`` [N, E] and ``inputs`` [N, D] (the MoE
    layer's input, the post-attention-normed hidden state), captured inside the model's own
    blocks (either layer layout)."""
    model = nnx.merge(graphdef, state)
    if model.cfg.ffn != "moe":
        raise ValueError(f"profile_routing: the model has no MoE layers (ffn={model.cfg.ffn!r})")
    run = _PROFILE_FNS.get(graphdef)
    if run is None:
        run = _PROFILE_FNS[graphdef] = jax.jit(functools.partial(_profile_forward, graphdef))
    out = {"experts": [], "probs": [], "inputs": []}
    for tokens in batches:
        rec = run(state, jnp.asarray(tokens))
        for key in out:
            for i, val in enumerate(np.asarray(rec[key])):
                if len(out[key]) <= i:
                    out[key].append([])
                out[key][i].append(val)
    return {k: [np.concatenate(x) for x in v] for k, v in out.items()}


_PROFILE_FNS: dict = {}  # graphdef → jitted profiling forward (graphdefs are hashable)
_PROFILE_TAPS = Taps(capture=("ffn.in", "moe.experts", "moe.router_probs"))


def _profile_forward(graphdef, st, tokens_BT):
    _, inter = capture(graphdef, st, tokens_BT, _PROFILE_TAPS)
    u_LBTD = inter["ffn.in"]
    return {"experts": inter["moe.experts"], "probs": inter["moe.router_probs"],
            "inputs": u_LBTD.reshape(u_LBTD.shape[0], -1, u_LBTD.shape[-1])}


def coactivation(experts_NK: np.ndarray, num_experts: int) -> np.ndarray:
    """P[i, j] = number of tokens that selected both i and j (P[i, i] = load of i)."""
    e = np.asarray(experts_NK)
    onehot = np.zeros((e.shape[0], num_experts), np.float64)
    np.put_along_axis(onehot, e, 1.0, axis=1)
    return onehot.T @ onehot


def expert_similarity(w_gate_EDF, w_up_EDF, w_down_EFD, x_ND, act=jax.nn.silu) -> np.ndarray:
    """Mean over tokens of the cosine similarity between experts' outputs → [E, E]
    (``w_gate_EDF`` None: non-gated experts ``down(act(x·up))``)."""
    x = jnp.asarray(x_ND, jnp.float32)
    u = jnp.einsum("nd,edf->enf", x, w_up_EDF)
    h = act(u) if w_gate_EDF is None else act(jnp.einsum("nd,edf->enf", x, w_gate_EDF)) * u
    y = jnp.einsum("enf,efd->end", h, w_down_EFD)
    y = y / (jnp.linalg.norm(y, axis=-1, keepdims=True) + 1e-9)
    return np.asarray(jnp.einsum("ind,jnd->ij", y, y) / x.shape[0])


def layer_expert_weights(state) -> list:
    """[(w_gate or None, w_up, w_down)] per MoE layer (list layout)."""
    flat = _flat(state)
    return [tuple(flat[names[n]][...] if n in names else None for n in EXPERT_PARAM_NAMES)
            for names in _moe_leaf_paths(flat).values()]
