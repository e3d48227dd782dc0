"""CateKV offline head-mask calibration from a model (Jiang et al., ICML 2025; official
``select_headmask/static.py``): prefill calibration prompts, compute every KV head's CV on each
(``catekv_select.classify_heads`` through ``CateKVCache.fill``), vote the mask
(``catekv_mask.calibrate_head_mask``) and save it next to the model with the per-prompt CVs, so
serving can pick another r (``pallasite generate --kv-cache catekv --catekv.r 0.3``).

    pallasite catekv-calibrate --model M [--r 0.4 --samples 8 --context 2048] [--output FILE]

Calibration prompts: the official code uses RULER variable-tracking samples; offline we use the
synthetic retrieval task ``lines_prompt`` (marked ``### LINE <name>: <key> ###`` lines in filler
text), which also drives ``eval/catekv_retrieval.py``. Prompts are prefilled in chunks into a
dense cache; the last 64 go through a recorder cache that keeps their queries for the fill.
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallasite.errors import InputError
from pallasite.inference.cache.base import KVCache
from pallasite.inference.cache.catekv import init_catekv_cache
from pallasite.inference.cache.catekv_mask import MASK_FILE, calibrate_head_mask, save_head_mask
from pallasite.inference.cache.catekv_select import CateKVConfig
from pallasite.inference.cache.dense import DenseKVCache, init_dense_cache
from pallasite.models.transformer import forward

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEAD = "Read the text and remember every secret line in it.\n"
TAIL = "\nThat is the end of the text.\n"
# names that are one token each after " " in the SmolLM2 tokenizer (checked by ``lines_prompt``)
NAMES = ("red", "blue", "green", "black", "white", "gold", "silver", "pink", "brown", "gray", "orange", "purple")


def _enc(tokenizer, s: str) -> list[int]:
    return list(tokenizer.encode(s, add_special_tokens=False))


def lines_prompt(tokenizer, n_tokens: int, n_needles: int, rng: np.random.Generator, *, fixed_lengths: bool = True):
    """(prompt ids of exactly ``n_tokens``, [(query ids, answer ids)] one per needle). Needles sit at
    sorted random depths in [0.05, 0.95] of the filler, with distinct names and 5-digit keys.
    ``fixed_lengths``: check that every query / answer has 5 / 6 tokens (SmolLM2's tokenizer), so
    a batch of prompts can be asked in lockstep."""
    if not 1 <= n_needles <= len(NAMES):
        raise ValueError(f"lines_prompt: n_needles={n_needles} must be in [1, {len(NAMES)}]")
    names = rng.choice(len(NAMES), n_needles, replace=False)
    keys = rng.integers(10000, 99999, n_needles)
    needles, queries = [], []
    for j, k in zip(names, keys):
        needles.append(_enc(tokenizer, f"\n### LINE {NAMES[j]}: {k} ###\n"))
        query, answer = _enc(tokenizer, f"### LINE {NAMES[j]}:"), _enc(tokenizer, f" {k}")
        if fixed_lengths and (len(query) != 5 or len(answer) != 6):
            raise ValueError(f"lines_prompt: the tokenizer splits name {NAMES[j]!r} or key {k} unexpectedly "
                             f"({len(query)} query / {len(answer)} answer tokens; expected 5 / 6)")
        queries.append((query, answer))
    head, tail, filler = _enc(tokenizer, HEAD), _enc(tokenizer, TAIL), _enc(tokenizer, FILLER * 8)
    n_fill = n_tokens - len(head) - len(tail) - sum(map(len, needles))
    if n_fill < n_needles:
        raise ValueError(f"lines_prompt: {n_tokens} tokens cannot hold {n_needles} needles and the fixed text")
    body = (filler * (-(-n_fill // len(filler))))[:n_fill]
    cuts = np.sort(rng.uniform(0.05, 0.95, n_needles) * n_fill).astype(int)
    ids, at = list(head), 0
    for cut, needle in zip(cuts, needles):
        ids += body[at:cut] + needle
        at = cut
    ids += body[at:] + tail
    assert len(ids) == n_tokens, (len(ids), n_tokens)
    return ids, queries


# ----------------------------------------------------------------------------- prefill + caches
@struct.dataclass
class _QRecorder(KVCache):
    """Dense cache that also returns the queries of the call (to build CateKV after prefill)."""
    k: jax.Array
    v: jax.Array
    q: jax.Array  # [L, B, T, H, D]

    def update_and_attend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, **kw):
        out, dense = DenseKVCache(self.k, self.v).update_and_attend(q_BTHD, k_BTKD, v_BTKD, positions_BT, **kw)
        return out, _QRecorder(dense.k, dense.v, q_BTHD.astype(self.q.dtype))


def prefill(graphdef, state, cfg, ids_BN: np.ndarray, *, capacity: int, chunk: int, last_q: int = 64):
    """Dense prefill of equal-length prompts in chunks: (dense cache, q_last [L, B, last_q, H, D])."""
    B, N = ids_BN.shape
    if (N - last_q) % chunk:
        raise ValueError(f"prefill: {N} - {last_q} tokens is not a multiple of chunk={chunk}")
    tokens = jnp.asarray(ids_BN, jnp.int32)
    cache = init_dense_cache(cfg, B, capacity)

    @jax.jit
    def run_chunk(state, cache, toks, start):
        pos = jnp.broadcast_to(start + jnp.arange(toks.shape[1], dtype=jnp.int32), toks.shape)
        return forward(graphdef, state, toks, pos, cache=cache)[1]

    for s in range(0, N - last_q, chunk):
        cache = run_chunk(state, cache, tokens[:, s:s + chunk], jnp.int32(s))

    @jax.jit
    def run_last(state, cache, toks):
        rec = _QRecorder(cache.k, cache.v, jnp.zeros((cfg.n_layers, B, last_q, cfg.n_heads, cfg.dh), cfg.dtype))
        pos = jnp.broadcast_to(N - last_q + jnp.arange(last_q, dtype=jnp.int32), toks.shape)
        _, rec, _ = forward(graphdef, state, toks, pos, cache=rec)
        return DenseKVCache(rec.k, rec.v), rec.q

    return run_last(state, cache, tokens[:, N - last_q:])


def build_hybrid(cfg, dense: DenseKVCache, q_last_LBQHD, n_prompt: int, mask_LK, ccfg: CateKVConfig, new_tokens: int):
    """CateKV cache for every layer from a dense prefill (per-layer ``CateKVCache.fill``)."""
    B = dense.k.shape[1]
    cache = init_catekv_cache(cfg, B, dense.capacity, mask_LK, catekv_cfg=ccfg, max_new_tokens=new_tokens)
    for i in range(cfg.n_layers):
        # the dense cache is head-major [L, B, K, S, D]; the fill takes the prompt slot-major [B, N, K, D]
        k_BNKD = jnp.swapaxes(dense.k[i, :, :, :n_prompt], 1, 2)
        v_BNKD = jnp.swapaxes(dense.v[i, :, :, :n_prompt], 1, 2)
        cache = _fill_layer(cache, jnp.int32(i), q_last_LBQHD[i], k_BNKD, v_BNKD)
    return cache


@functools.partial(jax.jit, donate_argnums=(0,))
def _fill_layer(cache, i, q_last_BQHD, k_BTKD, v_BTKD):
    """Layer i of the hybrid cache from its prompt K/V (the pools are shared by all layers)."""
    lengths = jnp.full((k_BTKD.shape[0],), k_BTKD.shape[1], jnp.int32)
    return cache.with_layer(i, cache.layer(i).fill(q_last_BQHD, k_BTKD, v_BTKD, lengths))


def cv_of_prompts(cfg, dense, q_last, n_prompt, ccfg) -> np.ndarray:
    """[B, L, K] CV of every head on each prompt (all heads adaptive: the fill computes CV only)."""
    probe = build_hybrid(cfg, dense, q_last, n_prompt, np.ones((cfg.n_layers, cfg.n_kv_heads), bool), ccfg, 0)
    return np.swapaxes(np.asarray(probe.cv), 0, 1)


def calibrate_model(model, *, r: float = 0.4, samples: int = 8, context: int = 2048, n_needles: int = 4,
                    ccfg: CateKVConfig = CateKVConfig(), chunk: int = 512, batch: int = 4, seed: int = 0):
    """(mask bool [L, K], per-prompt CVs [samples, L, K]) of a ``pallasite.Model`` on ``samples``
    calibration prompts of ``context`` tokens. Sliding-window layers (Gemma 3's local layers) are
    not ranked: their CVs are NaN, ``r`` is the fraction of the global layers' heads, and serving
    makes every head of a windowed layer adaptive (``init_catekv_cache``)."""
    cfg = model.config
    if model.tokenizer is None:
        raise InputError("catekv calibration: the model has no tokenizer (the calibration prompts are text)")
    windowed = np.array([w is not None for w in cfg.layer_windows], bool)
    if windowed.all():
        raise InputError("catekv calibration: every layer of this model is a sliding-window layer; CateKV "
                         "compresses global layers only (a windowed layer is served with all heads adaptive)")
    last_q = ccfg.last_q
    if context <= last_q + ccfg.init_tokens + ccfg.recent_tokens + ccfg.tail_tokens:
        raise InputError(f"catekv calibration: --context {context} leaves no middle chunks (init {ccfg.init_tokens} + "
                         f"recent {ccfg.recent_tokens} + tail {ccfg.tail_tokens} + last {last_q} queries)")
    chunk = min(chunk, context - last_q)
    while (context - last_q) % chunk:
        chunk -= 1
    rng = np.random.default_rng(seed)
    capacity = -(-context // 128) * 128
    cvs = []
    for start in range(0, samples, batch):
        ids = np.asarray([lines_prompt(model.tokenizer, context, n_needles, rng, fixed_lengths=False)[0]
                          for _ in range(min(batch, samples - start))], np.int32)
        dense, q_last = prefill(model.graphdef, model.state, cfg, ids, capacity=capacity, chunk=chunk, last_q=last_q)
        cvs.append(cv_of_prompts(cfg, dense, q_last, context, ccfg))
    cvs = np.concatenate(cvs)
    cvs[:, windowed] = np.nan  # not ranked: served with every head adaptive (init_catekv_cache)
    return calibrate_head_mask(cvs, r), cvs


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("catekv-calibrate", help="CateKV: calibrate the head mask and save it next to the model",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder, .gguf file, pallasite folder or training workdir")
    p.add_argument("--output", default=None, help=f"mask file (default: {MASK_FILE} in the model's folder)")
    p.add_argument("--r", type=float, default=0.4, help="fraction of adaptive (full-KV) heads (paper: 0.4)")
    p.add_argument("--samples", type=int, default=8, help="calibration prompts (paper: 50)")
    p.add_argument("--context", type=int, default=2048, help="tokens per calibration prompt")
    p.add_argument("--needles", type=int, default=4, help="marked lines per prompt")
    p.add_argument("--batch", type=int, default=4, help="prompts prefilled together")
    p.add_argument("--init-tokens", type=int, default=CateKVConfig.init_tokens)
    p.add_argument("--recent-tokens", type=int, default=CateKVConfig.recent_tokens)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=run)


def run(args, overrides=None) -> dict:
    import pallasite

    for name in ("samples", "context", "needles", "batch"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.r <= 1.0:
        raise InputError(f"--r {args.r} must be a fraction of heads in (0, 1]")
    t0 = time.time()
    model = pallasite.load(args.model)
    # the CV needs only the chunk geometry; the budget must fit init + recent
    ccfg = CateKVConfig(init_tokens=args.init_tokens, recent_tokens=args.recent_tokens,
                        budget=max(CateKVConfig.budget, args.init_tokens + args.recent_tokens))
    mask, cvs = calibrate_model(model, r=args.r, samples=args.samples, context=args.context, n_needles=args.needles,
                                ccfg=ccfg, batch=args.batch, seed=args.seed)
    out = args.output
    if out is None:
        if not model.path:
            raise InputError("the model has no folder to write the mask to; pass --output")
        out = os.path.join(model.path, MASK_FILE)
    path = save_head_mask(out, mask, model.config, ccfg, cv_samples=cvs,
                          extra={"task": "lines", "samples": args.samples, "context": args.context, "r": args.r,
                                 "seed": args.seed})
    summary = {"mask": path, "r": args.r, "adaptive_heads": int(mask.sum()), "heads": int(mask.size),
               "adaptive_per_layer": mask.sum(1).tolist(),
               "windowed_layers": [i for i, w in enumerate(model.config.layer_windows) if w is not None],
               "samples": args.samples, "context": args.context,
               "seconds": round(time.time() - t0, 1)}
    print(json.dumps(summary))
    return summary
