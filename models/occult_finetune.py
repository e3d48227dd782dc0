"""A minimal language-model loop for Occult experiments: train a small MoE on the Python
stdlib sources (byte-level tokens, so no tokenizer is involved), and fine-tune it with pruned
routing with every non-MoE parameter frozen (Occult §collaboration pruning: "modified
fine-tuning" updates the MoE blocks only).

It is deliberately small and self-contained (one jitted AdamW step over split NNX state) so
the Occult benchmark has a *trained* routing to measure even where the project's training
package is not used; ``routing_source`` in the benchmark names the model it came from.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from typing import Iterator, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.transformer import Transformer

MOE_PARAM_NAMES = ("w_gate", "w_up", "w_down", "router", "router_bias", "shared_gate")


def stdlib_bytes(split: str = "train", max_bytes: int = 4_000_000) -> np.ndarray:
    """Concatenated stdlib ``.py`` sources as uint8; files go to ``eval`` by a stable hash (5 %)."""
    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in sorted(os.walk(root)):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "__pycache__"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            is_eval = int(hashlib.md5(path[len(root):].encode()).hexdigest(), 16) % 20 == 0
            if is_eval != (split == "eval"):
                continue
            with open(path, "rb") as f:
                data = f.read()
            chunks.append(np.frombuffer(data, np.uint8))
            total += len(data)
            if total >= max_bytes:
                return np.concatenate(chunks)
    return np.concatenate(chunks)


def byte_batches(data: np.ndarray, batch: int, seq_len: int, seed: int) -> Iterator[np.ndarray]:
    """Endless random windows [batch, seq_len + 1] of byte ids (inputs + next-token targets)."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        yield np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def is_moe_param(path) -> bool:
    names = [str(p) for p in path]
    if names and names[-1] == "value":  # pytree key paths end in the Variable's value field
        names = names[:-1]
    return "ffn" in names and (names[-1] in MOE_PARAM_NAMES or "shared_expert" in names)


def _loss(graphdef, params, rest, window):
    model = nnx.merge(graphdef, params, rest)
    logits, _, aux = model(window[:, :-1])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, window[:, 1:]).mean()
    return ce + sum(aux.values(), 0.0), ce


def make_optimizer(params, lr: float, steps: int, trainable: str = "all"):
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 20), max(steps, 2), end_value=lr * 0.1)
    adam = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.01))
    if trainable == "all":
        return adam
    if trainable != "moe":
        raise ValueError(f"trainable={trainable!r}; expected 'all' or 'moe'")
    def label(key_path, _):
        names = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in key_path]
        return "train" if is_moe_param(names) else "freeze"

    label_tree = jax.tree_util.tree_map_with_path(label, params)
    return optax.multi_transform({"train": adam, "freeze": optax.set_to_zero()}, label_tree)


def train(cfg: ModelConfig, *, steps: int, batch: int = 16, seq_len: int = 128, lr: float = 3e-3, seed: int = 0,
          state: Optional[nnx.State] = None, trainable: str = "all", data: Optional[np.ndarray] = None,
          log_every: int = 0):
    """Train (or fine-tune, from ``state``) on stdlib bytes. Returns (graphdef, params, rest, losses)."""
    model = Transformer(cfg, rngs=nnx.Rngs(params=seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if state is not None:
        nnx.update(model, state)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt = make_optimizer(params, lr, steps, trainable)
    opt_state = opt.init(params)
    data = stdlib_bytes("train") if data is None else data

    @jax.jit
    def step(params, opt_state, window):
        (loss, ce), g = jax.value_and_grad(lambda p: _loss(graphdef, p, rest, window), has_aux=True)(params)
        upd, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, ce

    losses = []
    it = byte_batches(data, batch, seq_len, seed + 1)
    for i in range(steps):
        params, opt_state, ce = step(params, opt_state, jnp.asarray(next(it)))
        losses.append(float(ce))
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"  step {i:4d} ce {losses[-1]:.4f}", flush=True)
    return graphdef, params, rest, losses


def eval_loss(graphdef, params, rest, data: np.ndarray, *, batches: int = 8, batch: int = 16, seq_len: int = 128,
              seed: int = 123) -> float:
    f = jax.jit(lambda p, w: _loss(graphdef, p, rest, w)[1])
    it = byte_batches(data, batch, seq_len, seed)
    return float(np.mean([float(f(params, jnp.asarray(next(it)))) for _ in range(batches)]))
