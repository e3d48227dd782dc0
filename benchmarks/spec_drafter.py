"""The benchmark's drafters for SmolLM2-135M, trained here (``benchmarks/speculative.py``).

* ``train_drafter`` (``--drafter-init scratch``): a small Llama with its own byte-level BPE, trained
  from random weights on the corpus and, with ``--distill-prompts``, on the target's greedy
  continuations (sequence-level distillation, Kim & Rush 2016).
* ``train_target_drafter`` (``--drafter-init target``): the target's tokenizer pruned to its
  ``--drafter-vocab`` most frequent tokens (``models.tokenizer.prune_bpe``: other ids, other splits,
  so TLI / SLEM map between two vocabularies), the target's embedding rows of those tokens, its
  first ``--drafter-layers`` blocks and its final norm, fine-tuned by token-level distillation on the
  target's teacher-forced greedy tokens or, with ``--label-top-k K``, on its top-K distribution
  (forward KL, ``teacher_labels``) (DistillSpec's finding, Zhou et al. 2024: an on-policy /
  teacher-label objective aligns a drafter with its target far better than the corpus; the
  target's embeddings as a drafter's starting point as in EAGLE / Medusa heads, here without the
  target's hidden states so that the drafter stays a model of its own). With ``--distill-prompts``
  half of the labelled windows come from the target's own greedy continuations (``distill_texts``):
  the text the drafter drafts against at decode time.

Both are kept in ``$PALLASITE_SPEC_DRAFTER`` (default: a folder under the system temp dir), one
folder per setting, so later runs reuse them.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_CORPUS_BYTES = 3_000_000  # --corpus-bytes: the training split's first 3 MB (151 of its 530 files)


def drafter_dir(args) -> str:
    root = os.environ.get("PALLASITE_SPEC_DRAFTER") or os.path.join(tempfile.gettempdir(), "pallasite_spec_drafter")
    # another corpus is another drafter (other vocabulary, other labels); the default keeps its old names
    corpus = "" if args.corpus_bytes == DEFAULT_CORPUS_BYTES else f"_c{args.corpus_bytes}"
    if args.drafter_init == "target":
        tag = f"pruned_v{args.drafter_vocab}_l{args.drafter_layers}_s{args.drafter_steps}_w{args.label_windows}"
        if args.label_top_k:
            tag += f"_top{args.label_top_k}"
        if args.distill_prompts:
            tag += f"_kd{args.distill_prompts}x{args.distill_new_tokens}"
        return os.path.join(root, tag + corpus)
    tag = f"v{args.drafter_vocab}_d{args.drafter_d}_l{args.drafter_layers}_s{args.drafter_steps}"
    if args.distill_prompts:
        tag += f"_kd{args.distill_prompts}x{args.distill_new_tokens}"
    return os.path.join(root, tag + corpus)


def distill_texts(args, target, texts):
    """Sequence-level distillation data (Kim & Rush 2016; what drafters are trained on in
    practice): the target's own greedy continuations of ``--distill-prompts`` windows of
    ``--prompt-tokens`` target tokens cut from ``texts`` (the training split), ``--distill-new-tokens``
    each, generated in batches of 32 and returned as text (prompt + continuation), so the drafter —
    whatever its tokenizer — learns what the target says next, not only the corpus. Kept in
    ``distill.json`` of the drafter folder."""
    from pallasite.inference.config import GenerationConfig
    from pallasite.inference.engine import generate_ids

    folder = drafter_dir(args)
    cache = os.path.join(folder, "distill.json")
    if os.path.exists(cache):
        with open(cache) as f:
            return json.load(f)
    rng = np.random.default_rng(1)
    prompts = []
    while len(prompts) < args.distill_prompts:
        ids = target.encode(texts[int(rng.integers(len(texts)))])
        if len(ids) > args.prompt_tokens:
            s = int(rng.integers(0, len(ids) - args.prompt_tokens))
            prompts.append(ids[s: s + args.prompt_tokens])
    gen = GenerationConfig(max_new_tokens=args.distill_new_tokens, stop_tokens=())
    out, t0 = [], time.perf_counter()
    for b in range(0, len(prompts), 32):
        rows = prompts[b: b + 32]
        for p, new in zip(rows, generate_ids(target.graphdef, target.state, target.config, rows, gen)):
            out.append(target.tokenizer.decode(list(p) + list(new)))
        print(f"  distill: {len(out)}/{len(prompts)} target continuations, {time.perf_counter() - t0:.0f} s",
              flush=True)
    os.makedirs(folder, exist_ok=True)
    with open(cache, "w") as f:
        json.dump(out, f)
    return out


def train_drafter(args, texts, distilled=()):
    """(Model, seconds) a small Llama with its own byte-level BPE tokenizer, trained on ``texts``
    and, where given, the target's ``distilled`` continuations (half of every batch from them)."""
    import optax
    from flax import nnx

    import pallasite
    from pallasite.models.config import ModelConfig
    from pallasite.models.tokenizer import train_bpe
    from pallasite.models.transformer import forward, init_model

    folder = drafter_dir(args)
    if os.path.exists(os.path.join(folder, "done")):
        return pallasite.load(folder), 0.0
    t0 = time.perf_counter()
    tok = train_bpe(list(texts) + list(distilled), args.drafter_vocab)
    eos = tok.eos_token_id

    def stream(docs):
        return np.concatenate([np.asarray(tok.encode(t) + [eos], np.int32) for t in docs]) if docs else None

    ids, kd_ids = stream(list(texts)), stream(list(distilled))
    cfg = ModelConfig(vocab_size=len(tok), d_model=args.drafter_d, n_layers=args.drafter_layers,
                      n_heads=max(2, args.drafter_d // 64), n_kv_heads=max(1, args.drafter_d // 128),
                      d_ff=args.drafter_d * 8 // 3 // 32 * 32, max_seq_len=4096, tie_embeddings=True,
                      eos_token_id=(eos,), bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    g, state = nnx.split(init_model(cfg, seed=0))
    params = nnx.to_pure_dict(state)
    sched = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 50, args.drafter_steps, 3e-4)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    opt_state = opt.init(params)

    def loss_fn(p, batch):
        st = nnx.State(state)
        nnx.replace_by_pure_dict(st, p)
        logits = forward(g, st, batch[:, :-1])[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def update(p, o, batch):
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        upd, o = opt.update(grads, o, p)
        return optax.apply_updates(p, upd), o, loss

    rng = np.random.default_rng(0)
    seq, bs = 128, 16
    for step in range(args.drafter_steps):
        sources = [ids] * bs if kd_ids is None else [ids] * (bs // 2) + [kd_ids] * (bs - bs // 2)
        batch = jnp.asarray(np.stack([src[s: s + seq + 1] for src in sources
                                      for s in [int(rng.integers(0, len(src) - seq - 1))]]))
        params, opt_state, loss = update(params, opt_state, batch)
        if step % 200 == 0 or step == args.drafter_steps - 1:
            print(f"  drafter step {step}: loss {float(loss):.3f}", flush=True)
    nnx.replace_by_pure_dict(state, params)
    model = pallasite.Model(cfg, state, tok, g)
    os.makedirs(folder, exist_ok=True)
    model.save(folder, format="orbax")
    open(os.path.join(folder, "done"), "w").close()
    return pallasite.load(folder), time.perf_counter() - t0


def teacher_labels(target, drafter_tok, texts, n_windows: int, window: int = 144, seq: int = 128,
                   seed: int = 2, top_k: int = 0):
    """Drafter-token training rows labelled by the target: {"inputs": [N, seq+1], "labels": [N, seq]}
    and, with ``top_k``, the soft labels {"soft_ids", "soft_p"}: [N, seq, top_k].

    ``n_windows`` windows of ``window`` target tokens are cut from ``texts``; the target's argmax
    at every position is its greedy next token. Each window's text is re-encoded by the drafter's
    tokenizer; a drafter position that ends on a target-token boundary is labelled with the first
    drafter token of the target's greedy token there (what tli would have to draft), one inside a
    target token with the drafter's next token of the text (the rest of that token's spelling).
    Soft labels (forward-KL distillation, DistillSpec, Zhou et al. 2024): at a boundary the target's
    ``top_k`` most likely tokens, each as its first drafter token (tokens sharing one add up in the loss),
    probabilities renormalised over those the drafter can spell; inside a token the text's next
    drafter token with probability 1 (the spelling is fixed there)."""
    from pallasite.inference.speculative import pair_map
    from pallasite.models.transformer import forward

    pm = pair_map(target.tokenizer, drafter_tok)
    T, D = pm.target, pm.drafter
    S = seq  # drafter positions per row (< window: the drafter's encoding is longer than the target's)
    rng = np.random.default_rng(seed)
    windows = []
    while len(windows) < n_windows:
        ids = target.encode(texts[int(rng.integers(len(texts)))])
        if len(ids) > window + 1:
            s = int(rng.integers(0, len(ids) - window))
            windows.append(ids[s: s + window])
    def target_labels(x):  # the greedy token and, with top_k, the top-k (ids, probabilities)
        logits = forward(target.graphdef, target.state, x)[0]
        p, ids = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), -1), top_k) if top_k else (None, None)
        return jnp.argmax(logits, -1), ids, p

    fwd = jax.jit(target_labels)
    inputs, labels, soft_ids, soft_p, t0 = [], [], [], [], time.perf_counter()
    for b in range(0, n_windows, 16):
        rows = windows[b: b + 16]
        greedy, top_ids, top_p = (None if a is None else np.asarray(a) for a in fwd(jnp.asarray(rows, jnp.int32)))
        for r, (ids, g) in enumerate(zip(rows, greedy)):
            t_off = np.cumsum([0] + [T.nbytes(i) for i in ids])
            dids, _ = D.encode(T.text_of(ids))
            if len(dids) < S + 1:
                continue
            d_off = np.cumsum([0] + [D.nbytes(i) for i in dids])
            boundary = {int(o): j for j, o in enumerate(t_off[1:])}  # bytes after target tokens 0..j
            lab = np.asarray(dids[1: S + 1], np.int64)
            # soft: inside a target token the text's next piece with p = 1, at a boundary the top-k below
            s_ids, s_p = np.zeros((S, max(top_k, 1)), np.int64), np.zeros((S, max(top_k, 1)), np.float32)
            s_ids[:, 0], s_p[:, 0] = lab, 1.0
            for m in range(S):
                j = boundary.get(int(d_off[m + 1]))
                if j is not None and pm.t2d_len[g[j]] > 0:
                    lab[m] = s_ids[m, 0] = pm.t2d[g[j], 0]
                    if top_k:  # duplicate first pieces keep one entry each: the loss adds their p
                        t_ids, t_p = top_ids[r, j], top_p[r, j]
                        spelled = pm.t2d_len[t_ids] > 0
                        s_ids[m] = np.where(spelled, pm.t2d[t_ids, 0], 0)
                        s_p[m] = np.where(spelled, t_p, 0.0) / max(float(t_p[spelled].sum()), 1e-9)
            inputs.append(dids[: S + 1])
            labels.append(lab)
            if top_k:
                soft_ids.append(s_ids)
                soft_p.append(s_p)
        print(f"  teacher labels: {min(b + 16, n_windows)}/{n_windows} windows, {time.perf_counter() - t0:.0f} s",
              flush=True)
    out = {"inputs": np.asarray(inputs, np.int32), "labels": np.asarray(labels, np.int32)}
    if top_k:
        out.update(soft_ids=np.asarray(soft_ids, np.int32), soft_p=np.asarray(soft_p, np.float32))
    return out


def target_cut(target, tok, kept, layers):
    """A drafter Model cut from ``target``: tokenizer ``tok`` (``prune_bpe``'s, keeping the target
    ids ``kept``), those ids' embedding rows (and LM-head columns when untied), the target's blocks
    ``layers`` (in that order) and its final norm."""
    import dataclasses

    from flax import nnx

    import pallasite
    from pallasite.models.transformer import abstract_model

    layers = list(layers)
    cfg = dataclasses.replace(target.config, n_layers=len(layers), vocab_size=len(tok),
                              eos_token_id=(tok.eos_token_id,), bos_token_id=tok.bos_token_id,
                              pad_token_id=tok.pad_token_id, layer_types=None)
    full, rows = nnx.to_pure_dict(target.state), jnp.asarray(kept)
    g, state = nnx.split(abstract_model(cfg))
    params = {"embed": {"embedding": jnp.asarray(full["embed"]["embedding"])[rows]}, "final_norm": full["final_norm"],
              "layers": {j: full["layers"][layer] for j, layer in enumerate(layers)}}
    if "lm_head" in full:  # untied: the LM head's columns of the kept tokens
        params["lm_head"] = {"kernel": jnp.asarray(full["lm_head"]["kernel"])[:, rows]}
    nnx.replace_by_pure_dict(state, params)
    return pallasite.Model(cfg, state, tok, g)


def train_target_drafter(args, target, texts):
    """(Model, seconds): the pruned-vocabulary drafter initialised from the target (module doc),
    fine-tuned for ``--drafter-steps`` steps of 16 rows on ``--label-windows`` labelled windows."""
    import optax
    from flax import nnx

    import pallasite
    from pallasite.models.tokenizer import prune_bpe
    from pallasite.models.transformer import forward

    folder = drafter_dir(args)
    if os.path.exists(os.path.join(folder, "done")):
        return pallasite.load(folder), 0.0
    if args.label_top_k < 0:
        raise SystemExit(f"--label-top-k {args.label_top_k}: expected 0 (greedy labels) or a positive k")
    if args.distill_prompts and args.prompt_tokens + args.distill_new_tokens < 146:
        raise SystemExit("--drafter-init target --distill-prompts: --prompt-tokens + --distill-new-tokens must be "
                         "at least 146 (labelled windows are 144 target tokens)")
    t0 = time.perf_counter()
    tok, kept = prune_bpe(target.tokenizer, texts, args.drafter_vocab)
    labels_file = os.path.join(folder, "labels.npz")
    if os.path.exists(labels_file):
        rows = dict(np.load(labels_file))
    else:
        n_own = args.label_windows // 2 if args.distill_prompts else 0
        rows = teacher_labels(target, tok, texts, args.label_windows - n_own, top_k=args.label_top_k)
        if n_own:  # half the windows from the target's own greedy continuations (what it drafts against)
            own = teacher_labels(target, tok, distill_texts(args, target, texts), n_own, seed=3, top_k=args.label_top_k)
            order = np.random.default_rng(4).permutation(len(rows["inputs"]) + len(own["inputs"]))  # held-out rows
            rows = {k: np.concatenate([own[k], v])[order] for k, v in rows.items()}  # from both sources
        os.makedirs(folder, exist_ok=True)
        np.savez(labels_file, **rows)
    inputs, labels = rows["inputs"], rows["labels"]
    soft = (rows["soft_ids"], rows["soft_p"]) if args.label_top_k else None
    cut = target_cut(target, tok, kept, range(args.drafter_layers))
    cfg, g, state = cut.config, cut.graphdef, cut.state
    params = nnx.to_pure_dict(state)
    warm = min(50, max(1, args.drafter_steps // 10))
    sched = optax.warmup_cosine_decay_schedule(0.0, args.drafter_lr, warm, max(args.drafter_steps, warm + 1),
                                               args.drafter_lr / 10)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.0))
    opt_state = opt.init(params)

    def loss_fn(p, x, y, soft_ids=None, soft_p=None):
        st = nnx.State(state)
        nnx.replace_by_pure_dict(st, p)
        logits = forward(g, st, x)[0]
        if soft_ids is None:  # the target's greedy token (hard label)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        else:  # forward KL to the target's top-k (up to its constant entropy)
            ce = -(jnp.take_along_axis(jax.nn.log_softmax(logits, -1), soft_ids, -1) * soft_p).sum(-1)
        return ce.mean(), (jnp.argmax(logits, -1) == y).mean()

    @jax.jit
    def update(p, o, x, y, *soft):
        (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, x, y, *soft)
        upd, o = opt.update(grads, o, p)
        return optax.apply_updates(p, upd), o, loss, acc

    rng = np.random.default_rng(0)
    n_eval = max(16, len(inputs) // 50)
    eval_x, eval_y = jnp.asarray(inputs[:n_eval, :-1]), jnp.asarray(labels[:n_eval])
    tr_x, tr_y = inputs[n_eval:, :-1], labels[n_eval:]
    tr_soft = () if soft is None else tuple(a[n_eval:] for a in soft)
    for step in range(args.drafter_steps):
        idx = rng.integers(0, len(tr_x), 16)
        batch_soft = tuple(jnp.asarray(a[idx]) for a in tr_soft)
        params, opt_state, loss, acc = update(params, opt_state, jnp.asarray(tr_x[idx]), jnp.asarray(tr_y[idx]),
                                              *batch_soft)
        if step % 100 == 0 or step == args.drafter_steps - 1:
            _, held = loss_fn(params, eval_x, eval_y)
            print(f"  drafter step {step}: loss {float(loss):.3f}, label agreement {float(acc):.3f} "
                  f"(held-out rows, windows of the same files: {float(held):.3f}), "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
    nnx.replace_by_pure_dict(state, params)
    model = pallasite.Model(cfg, state, tok, g)
    os.makedirs(folder, exist_ok=True)
    model.save(folder, format="orbax")
    open(os.path.join(folder, "done"), "w").close()
    return pallasite.load(folder), time.perf_counter() - t0
