"""Multi-needle retrieval check for CateKV on SmolLM2-135M (offline GGUF): does the head
classification matter? Full cache vs CateKV (calibrated mask) vs the inverted mask (the
highest-CV heads kept full, same count) vs a random mask (same count) vs a StreamingLLM-style
window (init + newest tokens for every head), all but the full cache at the same KV memory.

Task ("lines"): filler text holding ``n_needles`` marked lines ``### LINE <name>: <5 digits> ###``
at random depths, ending with a neutral sentence. The prefill (whose last 64 queries classify the
heads and select the consistent heads' chunks, once) sees no question; afterwards each needle is
asked for in its own branch of the decode: ``### LINE <name>:`` is fed token by token through the
cache, then the key is read by greedy decoding (teacher-forced: every answer token must be the
argmax, which equals greedy exact match). Retrieval therefore happens at decode time, through
whatever each head kept: a head that copies from a needle must have kept that needle.

How it runs (CPU friendly): prompts of equal length are prefilled in a batch into a *dense*
cache in chunks, the last 64 prompt tokens go through a recorder cache that also keeps their
queries, and each layer's hybrid cache is built by ``CateKVCache.fill`` — the classification /
selection code the single-call prefill path runs. The mask is calibrated from the per-prompt CVs
of separate calibration prompts of the same task (as ``static.py`` does with RULER variable
tracking). ``run`` returns per-prompt scores and one-sided sign tests over prompts.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.inference.cache.catekv import memory_report
from pallasite.inference.cache.catekv_calibrate import build_hybrid, cv_of_prompts, lines_prompt, prefill
from pallasite.inference.cache.catekv_mask import calibrate_head_mask
from pallasite.inference.cache.catekv_select import CateKVConfig
from pallasite.models.transformer import abstract_model, forward

_STEP_FNS: dict = {}


def _step_fn(graphdef, cache):
    key = (graphdef, jax.tree.structure(cache), tuple(a.shape for a in jax.tree.leaves(cache)))
    if key not in _STEP_FNS:
        @jax.jit
        def step(state, cache, tok_BT, pos_BT):
            logits, cache, _ = forward(graphdef, state, tok_BT, pos_BT, cache=cache)
            return jnp.argmax(logits[:, -1], -1), cache
        _STEP_FNS[key] = step
    return _STEP_FNS[key]


def answer_needles(graphdef, state, cache, queries, n_prompt: int) -> np.ndarray:
    """bool [B, J]: for each needle j (a branch from the post-prefill ``cache``), feed row b's query
    tokens, then its answer tokens; correct when every answer token is the argmax after its prefix."""
    B, J = len(queries), len(queries[0])
    step = _step_fn(graphdef, cache)
    correct = np.zeros((B, J), bool)
    for j in range(J):
        toks = np.asarray([queries[b][j][0] + queries[b][j][1] for b in range(B)], np.int32)  # [B, Q + A]
        n_q = len(queries[0][j][0])
        c, ok = cache, np.ones(B, bool)
        for t in range(toks.shape[1] - 1):
            pred, c = step(state, c, jnp.asarray(toks[:, t:t + 1]), jnp.full((B, 1), n_prompt + t, jnp.int32))
            if t + 1 >= n_q:  # this prediction is an answer token
                ok &= np.asarray(pred) == toks[:, t + 1]
        correct[:, j] = ok
    return correct


def streaming_budget(n: int, r: float, ccfg: CateKVConfig) -> int:
    """Budget of an all-consistent window cache with the KV memory of CateKV at (n, r, B)."""
    tokens = r * n + (1 - r) * ccfg.budget
    base = ccfg.init_tokens + ccfg.recent_tokens
    return base + int(round((tokens - base) / ccfg.chunk_size)) * ccfg.chunk_size


def random_mask(shape, n_adaptive: int, rng: np.random.Generator) -> np.ndarray:
    mask = np.zeros(int(np.prod(shape)), bool)
    mask[rng.choice(mask.size, n_adaptive, replace=False)] = True
    return mask.reshape(shape)


def sign_test_greater(a: np.ndarray, b: np.ndarray) -> dict:
    """One-sided exact sign test over paired per-prompt scores: H0 'a and b are exchangeable'
    against 'a > b'; ties are dropped. p = P(Bin(n, 1/2) >= wins)."""
    d = np.asarray(a, float) - np.asarray(b, float)
    wins, n = int((d > 0).sum()), int((d != 0).sum())
    p = sum(math.comb(n, i) for i in range(wins, n + 1)) / 2 ** n if n else 1.0
    return {"wins": wins, "losses": n - wins, "ties": int((d == 0).sum()), "p": p}


def run(model, *, n_eval: int = 16, n_calib: int = 4, context: int = 1024, n_needles: int = 4, r: float = 0.4,
        ccfg: Optional[CateKVConfig] = None, chunk: int = 480, batch: Optional[int] = None, seed: int = 0,
        log=print) -> dict:
    """Calibrate a mask on ``n_calib`` prompts (one batch), then score ``n_eval`` held-out prompts
    (``batch`` at a time, default all at once) with every cache variant. ``model``: (cfg, state,
    tokenizer)."""
    cfg, state, tok = model
    ccfg = ccfg or CateKVConfig(budget=128, init_tokens=16, recent_tokens=64, adaptive_ratio=r)
    graphdef = nnx.split(abstract_model(cfg))[0]
    new_tokens = 16  # query + answer tokens fed in decode
    capacity = -(-(context + new_tokens) // 128) * 128
    rng = np.random.default_rng(seed)
    t0 = time.time()

    def batches(n, size):
        for start in range(0, n, size):
            rows = [lines_prompt(tok, context, n_needles, rng) for _ in range(min(size, n - start))]
            yield np.asarray([ids for ids, _ in rows], np.int32), [q for _, q in rows]

    cvs = []
    for ids, _ in batches(n_calib, n_calib):
        dense, q_last = prefill(graphdef, state, cfg, ids, capacity=capacity, chunk=chunk)
        cvs.append(cv_of_prompts(cfg, dense, q_last, context, ccfg))
    cvs = np.concatenate(cvs)
    mask = calibrate_head_mask(cvs, r)
    log(f"calibrated mask on {len(cvs)} prompts ({time.time() - t0:.0f}s): adaptive per layer {mask.sum(1).tolist()}")
    n_adaptive = int(mask.sum())
    window = CateKVConfig(budget=streaming_budget(context, r, ccfg), init_tokens=ccfg.init_tokens,
                          recent_tokens=ccfg.recent_tokens, chunk_size=ccfg.chunk_size, adaptive_ratio=0.0,
                          selection="recent")
    variants = {"catekv": (mask, ccfg), "inverted": (calibrate_head_mask(-cvs, r), ccfg),
                "random": (random_mask(mask.shape, n_adaptive, rng), ccfg), "window": (np.zeros_like(mask), window)}
    scores = {name: [] for name in ("full", *variants)}
    for ids, queries in batches(n_eval, batch or n_eval):
        t1 = time.time()
        dense, q_last = prefill(graphdef, state, cfg, ids, capacity=capacity, chunk=chunk)
        out = {"full": answer_needles(graphdef, state, dense, queries, context)}
        log(f"  prefill + full cache {time.time() - t1:.0f}s")
        for name, (m, c) in variants.items():
            t1 = time.time()
            hybrid = build_hybrid(cfg, dense, q_last, context, m, c, new_tokens)
            out[name] = answer_needles(graphdef, state, hybrid, queries, context)
            log(f"  {name} {time.time() - t1:.0f}s")
        for name, ok in out.items():
            scores[name].extend(ok.mean(axis=1).tolist())  # per prompt: fraction of needles retrieved
        log(f"eval {len(scores['full'])}/{n_eval}: " + ", ".join(f"{k} {np.mean(v):.3f}" for k, v in scores.items())
            + f" ({time.time() - t0:.0f}s)")
    mem = {name: memory_report(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.dh, context=context,
                               adaptive_ratio=float(m.mean()), catekv_cfg=c, head_mask_LK=m)
           for name, (m, c) in variants.items()}
    per_prompt = {k: np.asarray(v) for k, v in scores.items()}
    return {
        "task": f"lines: {n_needles} needles at {context} tokens, asked at decode time", "context": context,
        "n_needles": n_needles, "budget": ccfg.budget, "init_tokens": ccfg.init_tokens,
        "recent_tokens": ccfg.recent_tokens, "r": r, "n_eval": n_eval, "n_calib": n_calib, "seed": seed,
        "accuracy": {k: float(v.mean()) for k, v in per_prompt.items()},
        "per_prompt": {k: v.tolist() for k, v in per_prompt.items()},
        "sign_test_catekv_vs": {k: sign_test_greater(per_prompt["catekv"], per_prompt[k])
                                for k in ("inverted", "random", "window")},
        "sign_test_full_vs_catekv": sign_test_greater(per_prompt["full"], per_prompt["catekv"]),
        "ideal_memory_ratio": {k: round(v["ideal_ratio"], 3) for k, v in mem.items()},
        "layout_memory_ratio": {k: round(v["ratio"], 3) for k, v in mem.items()},
        "window_budget": window.budget, "mask_adaptive_per_layer": mask.sum(1).tolist(),
        "wall_s": round(time.time() - t0, 1),
    }
