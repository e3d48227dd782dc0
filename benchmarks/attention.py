"""Attention benchmark: flash (Pallas) vs reference prefill, and one decode step of attention over
a full KV cache vs the CateKV hybrid cache at long context, side by side in one process.

    python -m pallasite.benchmarks.attention --quick      # < 3 min on 2 CPU cores, reaches 32k

Decode: a Llama-like shape chosen so that r·K is a whole number of heads for both r = 0.4 and
r = 0.3 (K = 10 KV heads, G = 2, head_dim 128), 128 slots of decode room in both caches; ``--layers``
layers (scanned like the model, CateKV's shared pools in the scan carry) × ``--batch`` rows per
step — default 1 × 1 on CPU, 8 × 4 on a GPU, where one layer of one row (0.1–0.2 ms) only
measures launch overhead. The CateKV cache is filled by its real selection code
(``CateKVCache.fill``: middle attention of 64 last queries, CV, chunk scores, top chunks) from
random K/V. Timed: the attention of one new token over the cache contents (``reference_attention``
over the dense cache vs ``CateKVCache.attend``: two attentions over the adaptive part and the kept
entries, plus the head gather / scatter), compiled XLA on CPU; on a GPU the Pallas decode kernel
for both (and the XLA path too). Memory: bytes of the arrays each cache allocates (index tables
included; asserted equal to ``memory_report``) and the paper's ideal ratio ``1 / (r + (1 − r)·B/N)``.
A second memory table puts a global (ragged) mask on the SmolLM2-135M shape (30 layers × 3 KV
heads): the packed pools vs the previous per-layer padded layout.

Prefill (causal): on CPU the Pallas kernel only runs in interpret mode (correctness, not speed), so
the CPU row reports the XLA reference time and the interpret-mode error; on a GPU the Triton kernel
is timed against the XLA reference and XLA's fused attention (``jax.nn.dot_product_attention``,
cuDNN's flash attention for bf16 when it accepts the shape; ``fused_impl`` says which ran).

The last line printed is one JSON object; ``catekv_memory_ratio`` / ``catekv_decode_speedup``
are full ÷ CateKV at r = 0.4, B = 2048 at the longest context measured (``context``).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.benchmarks.timing import median_time
from pallasite.inference.cache.catekv import CateKVConfig, init_catekv_cache, memory_report
from pallasite.models.config import ModelConfig
from pallasite.ops.attention.reference import attention as reference_attention

_time = median_time


def _interleaved(fns, args_list, rounds=5, iters=4):
    if jax.default_backend() != "cpu":  # microsecond kernels: amortise the dispatch jitter
        iters *= 10
    """Median time of each fn, measured in alternating rounds (fair on a noisy shared machine)."""
    for fn, a in zip(fns, args_list):
        jax.block_until_ready(fn(*a))
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for i, (fn, a) in enumerate(zip(fns, args_list)):
            samples[i].append(_time(fn, *a, iters=iters, warmup=0))
    return [float(np.median(s)) for s in samples]


def _stack_layers(layer, dense_k, dense_v, L):
    """An L-layer copy of one filled layer: dense [L, B, S, K, D]; CateKV pools tiled along the head
    axis with base l·a (what ``pool_offsets`` gives for equal per-layer counts)."""
    per, (kf, vf, ks, vs) = layer.split_shared()
    a, c = kf.shape[2], ks.shape[2]
    per = jax.tree.map(lambda x: jnp.broadcast_to(x, (L,) + x.shape), per)
    per = per.replace(full_base=jnp.arange(L, dtype=jnp.int32) * a, sparse_base=jnp.arange(L, dtype=jnp.int32) * c)
    tile = lambda x: jnp.tile(x, (1, 1, L, 1))
    cache = per.join_shared((tile(kf), tile(vf), tile(ks), tile(vs)))
    return cache, jnp.broadcast_to(dense_k, (L,) + dense_k.shape), jnp.broadcast_to(dense_v, (L,) + dense_v.shape)


def _over_layers(attend_one):
    """Attention of one query per layer, over every layer of a cache (``lax.scan``, like the model)."""
    def dense(q, kc_L, vc_L, p):
        return jax.lax.scan(lambda _, kv: (None, attend_one(q, kv[0], kv[1], p)), None, (kc_L, vc_L))[1]
    return dense


def decode_bench(context: int, r: float, *, K=10, G=2, D=128, new=128, dtype=jnp.float32, use_pallas=False, seed=0,
                 rounds=5, layers=1, batch=1):
    """One decode step of attention over ``layers`` layers (scanned) for ``batch`` rows."""
    L, Bn = layers, batch
    cfg = ModelConfig(vocab_size=16, d_model=K * G * D, n_layers=1, n_heads=K * G, n_kv_heads=K, head_dim=D, d_ff=16,
                      dtype=jnp.dtype(dtype).name)
    ccfg = CateKVConfig(budget=2048, adaptive_ratio=r)
    n_adaptive = int(round(r * K))
    mask = np.zeros((1, K), bool)
    mask[:, :n_adaptive] = True
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    S = context + new
    k = jax.random.normal(ks[0], (Bn, context, K, D), dtype)
    v = jax.random.normal(ks[1], (Bn, context, K, D), dtype)
    q_last = jax.random.normal(ks[2], (Bn, ccfg.last_q, K * G, D), dtype)
    q = jax.random.normal(ks[3], (Bn, 1, K * G, D), dtype)
    dense_k = jnp.zeros((Bn, S, K, D), dtype).at[:, :context].set(k)
    dense_v = jnp.zeros((Bn, S, K, D), dtype).at[:, :context].set(v)
    cache = init_catekv_cache(cfg, Bn, S, mask, catekv_cfg=ccfg, max_new_tokens=new, dtype=dtype)
    layer = cache.layer(0)
    layer = jax.jit(lambda c, ql, k, v: c.fill(ql, k, v, jnp.full((Bn,), context)))(layer, q_last, k, v)
    del k, v
    pos = jnp.full((Bn, 1), context - 1, jnp.int32)  # attend as the last prompt token would (all N entries)
    if L > 1:
        cache_L, dense_k, dense_v = _stack_layers(layer, dense_k, dense_v, L)
    else:
        cache_L = None

    def cate_fn(impl):
        one = lambda c, q, p: c.attend(q, p, impl=impl, interpret=False if impl == "pallas" else None)
        if L == 1:
            return jax.jit(one)

        def many(c, q, p):
            per, pools = c.split_shared()
            return jax.lax.scan(lambda _, lc: (None, one(lc.join_shared(pools), q, p)), None, per)[1]
        return jax.jit(many)

    def full_fn(one):
        return jax.jit(one if L == 1 else _over_layers(one))

    cate_arg = layer if L == 1 else cache_L
    full_ref = full_fn(lambda q, kc, vc, p: reference_attention(q, kc, vc, q_positions_BT=p))
    cate_ref = cate_fn("ref")
    t_full, t_cate = _interleaved([full_ref, cate_ref], [(q, dense_k, dense_v, pos), (cate_arg, q, pos)], rounds=rounds,
                                  iters=2 if rounds < 5 else 4)
    err = float(np.max(np.abs(cate_ref(cate_arg, q, pos).astype(jnp.float32) -
                                full_ref(q, dense_k, dense_v, pos).astype(jnp.float32))))
    full_bytes = int(dense_k.size * dense_k.dtype.itemsize + dense_v.size * dense_v.dtype.itemsize)
    cate_bytes = int(sum(a.nbytes for a in jax.tree.leaves(cate_arg)))
    rep = memory_report(n_layers=L, n_kv_heads=K, head_dim=D, context=context, new_tokens=new, adaptive_ratio=r,
                        catekv_cfg=ccfg, dtype_bytes=jnp.dtype(dtype).itemsize, batch=Bn)
    assert rep["full_bytes"] == full_bytes, (rep, full_bytes)
    assert rep["hybrid_bytes"] == cate_bytes, (rep, cate_bytes)  # the arrays are exactly the formula
    row = {"context": context, "r": r, "layers": L, "batch": Bn, "full_ms": 1e3 * t_full, "catekv_ms": 1e3 * t_cate,
           "speedup": t_full / t_cate, "full_bytes": full_bytes, "catekv_bytes": cate_bytes,
           "memory_ratio": full_bytes / cate_bytes, "ideal_ratio": rep["ideal_ratio"],
           "formula_ratio": rep["ratio"], "max_abs_diff_vs_full": err}
    if use_pallas:
        from pallasite.ops.attention import decode_attention_dense

        full_pl = full_fn(lambda q, kc, vc, p: decode_attention_dense(q, kc, vc, q_positions_BT=p, interpret=False))
        cate_pl = cate_fn("pallas")
        tf, tc = _interleaved([full_pl, cate_pl], [(q, dense_k, dense_v, pos), (cate_arg, q, pos)], rounds=rounds)
        full_err = np.abs(np.asarray(full_pl(q, dense_k, dense_v, pos), np.float32)
                          - np.asarray(full_ref(q, dense_k, dense_v, pos), np.float32)).max()
        cate_err = np.abs(np.asarray(cate_pl(cate_arg, q, pos), np.float32)
                          - np.asarray(cate_ref(cate_arg, q, pos), np.float32)).max()
        row.update({"full_pallas_ms": 1e3 * tf, "catekv_pallas_ms": 1e3 * tc, "speedup_pallas": tf / tc,
                    "pallas_full_err": float(full_err), "pallas_catekv_err": float(cate_err)})
    return row


def global_mask_memory(contexts=(1088, 2048, 8192), r=0.4, seed=0):
    """SmolLM2-135M shape (30 layers × 3 KV heads, head dim 64, bf16) with a global (ragged) mask:
    full ÷ hybrid for the packed pools (formula == allocated arrays) vs the old per-layer padded
    layout, budget 384 / 512 / 2048 as in the retrieval runs."""
    from pallasite.inference.cache.catekv import calibrate_head_mask

    L, K, D = 30, 3, 64
    rng = np.random.default_rng(seed)
    mask = calibrate_head_mask(rng.random((4, L, K)) + np.linspace(0, 1, L)[None, :, None], r)  # depth-skewed
    budgets = {1088: 384, 2048: 512}
    cfg = ModelConfig(vocab_size=16, d_model=9 * D, n_layers=L, n_heads=9, n_kv_heads=K, head_dim=D, d_ff=16,
                      dtype="bfloat16")
    rows = []
    for n in contexts:
        ccfg = CateKVConfig(budget=budgets.get(n, 2048))
        rep = memory_report(n_layers=L, n_kv_heads=K, head_dim=D, context=n, adaptive_ratio=r, catekv_cfg=ccfg,
                            head_mask_LK=mask)
        shapes = jax.eval_shape(lambda: init_catekv_cache(cfg, 1, n, mask, catekv_cfg=ccfg, max_new_tokens=0))
        alloc = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(shapes))
        assert alloc == rep["hybrid_bytes"], (alloc, rep)
        P = -(-ccfg.kept_max // 128) * 128
        padded = L * (mask.sum(1).max() * n + (~mask).sum(1).max() * P) * 2 * D * 2
        rows.append({"context": n, "budget": ccfg.budget, "ratio": rep["ratio"], "ideal_ratio": rep["ideal_ratio"],
                     "padded_layout_ratio": rep["full_bytes"] / padded,
                     "adaptive_per_layer_max": int(mask.sum(1).max()), "adaptive_heads": int(mask.sum())})
    return rows


def _fused_attention(q, k, v, on_gpu):
    """XLA's fused attention (``jax.nn.dot_product_attention``): on a GPU cuDNN's flash attention
    is asked for first; (implementation, callable, why cuDNN did not run or None). The
    implementation that ran is printed in the table, and a cuDNN refusal is printed with it."""
    why = None
    for impl in (("cudnn", "xla") if on_gpu else ("xla",)):
        fn = jax.jit(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                implementation=impl))
        try:
            jax.block_until_ready(fn(q, k, v))
            return impl, fn, why
        except Exception as e:  # noqa: BLE001 — cuDNN rejects the dtype / shape / GPU: said in the table
            why = f"cudnn refused: {type(e).__name__}: {str(e)[:200]}"
    raise RuntimeError(f"jax.nn.dot_product_attention did not run ({why})")


def prefill_bench(T: int, *, H=16, K=4, D=128, dtype=jnp.float32, on_gpu=False):
    """Causal prefill: flash (Pallas) vs the jnp reference vs XLA's fused attention."""
    from pallasite.ops.attention import flash_attention

    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(ks[0], (1, T, H, D), dtype)
    k = jax.random.normal(ks[1], (1, T, K, D), dtype)
    v = jax.random.normal(ks[2], (1, T, K, D), dtype)
    ref = jax.jit(lambda q, k, v: reference_attention(q, k, v))
    interpret = None if on_gpu else True  # on an accelerator the backend's compiled variant
    fl = jax.jit(lambda q, k, v: flash_attention(q, k, v, interpret=interpret))
    fused_impl, fused, fused_why = _fused_attention(q, k, v, on_gpu)
    want = np.asarray(ref(q, k, v), np.float32)
    err = float(np.abs(np.asarray(fl(q, k, v), np.float32) - want).max())  # numpy max keeps NaN
    fused_err = float(np.abs(np.asarray(fused(q, k, v), np.float32) - want).max())
    if on_gpu:
        t_ref, t_fl, t_fused = _interleaved([ref, fl, fused], [(q, k, v)] * 3)
    else:  # interpret mode: one timing for the record, not a speed claim
        t_ref = _time(ref, q, k, v, iters=3, warmup=1)
        t_fl = _time(fl, q, k, v, iters=1, warmup=0)
        t_fused = _time(fused, q, k, v, iters=3, warmup=1)
    return {"T": T, "H": H, "K": K, "D": D, "dtype": jnp.dtype(dtype).name, "ref_ms": 1e3 * t_ref,
            "flash_ms": 1e3 * t_fl, "fused_ms": 1e3 * t_fused, "fused_impl": fused_impl, "fused_note": fused_why,
            "flash_vs_fused": t_fused / t_fl, "flash_mode": "compiled" if on_gpu else "interpret",
            "max_abs_err": err, "fused_max_abs_err": fused_err}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="few iterations; still reaches 32k context")
    p.add_argument("--contexts", default="4096,16384,32768")
    p.add_argument("--layers", type=int, default=None,
                   help="decode layers timed per step (scanned); default 1 on CPU, 8 on a GPU (launch-bound otherwise)")
    p.add_argument("--batch", type=int, default=None, help="decode batch; default 1 on CPU, 4 on a GPU")
    args = p.parse_args(argv)
    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    contexts = [int(c) for c in args.contexts.split(",")]
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    layers = args.layers or (8 if on_gpu else 1)
    batch = args.batch or (4 if on_gpu else 1)
    t0 = time.time()

    print(f"backend={backend} devices={jax.devices()}")
    print("\n== prefill (causal): flash (Pallas) vs reference vs XLA fused (jax.nn.dot_product_attention) ==")
    pre_T = [1024, 4096] if on_gpu else [256]
    if on_gpu and not args.quick:
        pre_T.append(8192)
    prefill = [prefill_bench(T, dtype=dtype, on_gpu=on_gpu) for T in pre_T]
    print(f"{'T':>6} {'mode':>9} {'ref ms':>9} {'flash ms':>9} {'fused ms':>9} {'fused':>6} {'fused/flash':>11} "
          f"{'max err':>9}")
    for r in prefill:
        print(f"{r['T']:>6} {r['flash_mode']:>9} {r['ref_ms']:>9.2f} {r['flash_ms']:>9.2f} {r['fused_ms']:>9.2f} "
              f"{r['fused_impl']:>6} {r['flash_vs_fused']:>11.2f} {r['max_abs_err']:>9.2e}")
        if r["fused_note"]:
            print(f"   ^ fused ran XLA's implementation, not cuDNN: {r['fused_note']}")

    print(f"\n== decode step attention: full cache vs CateKV (B=2048, {layers} layer(s), batch {batch}, "
          "K=10, G=2, D=128) ==")
    rows = []
    for ctx in contexts:
        for r in (0.4, 0.3):
            if args.quick and r == 0.3 and ctx != contexts[-1]:
                continue
            rows.append(decode_bench(ctx, r, dtype=dtype, use_pallas=on_gpu, rounds=3 if args.quick else 5,
                                     layers=layers, batch=batch))
    hdr = f"{'N':>6} {'r':>4} {'full ms':>8} {'cate ms':>8} {'speedup':>8} {'mem ratio':>9} {'ideal':>6} {'|diff|':>8}"
    if on_gpu:
        hdr += f" {'pl full':>8} {'pl cate':>8} {'pl x':>6}"
    print(hdr)
    for r in rows:
        line = (f"{r['context']:>6} {r['r']:>4} {r['full_ms']:>8.2f} {r['catekv_ms']:>8.2f} {r['speedup']:>8.2f} "
                f"{r['memory_ratio']:>9.3f} {r['ideal_ratio']:>6.3f} {r['max_abs_diff_vs_full']:>8.3f}")
        if on_gpu:
            line += f" {r['full_pallas_ms']:>8.3f} {r['catekv_pallas_ms']:>8.3f} {r['speedup_pallas']:>6.2f}"
        print(line)
    print("\n== memory, global (ragged) mask on the SmolLM2-135M shape (30 layers x 3 KV heads, r=0.4) ==")
    gm = global_mask_memory()
    print(f"{'N':>6} {'B':>5} {'full/hybrid':>11} {'ideal':>6} {'old padded layout':>17}")
    for g in gm:
        print(f"{g['context']:>6} {g['budget']:>5} {g['ratio']:>11.3f} {g['ideal_ratio']:>6.3f} "
              f"{g['padded_layout_ratio']:>17.3f}")
    main_row = [r for r in rows if r["r"] == 0.4 and r["context"] == max(contexts)][0]
    r03 = [r for r in rows if r["r"] == 0.3 and r["context"] == max(contexts)][0]
    result = {
        "benchmark": "attention", "backend": backend, "context": main_row["context"],
        "catekv_memory_ratio": round(main_row["memory_ratio"], 4),
        "catekv_ideal_memory_ratio": round(main_row["ideal_ratio"], 4),
        "catekv_decode_speedup": round(main_row["speedup"], 3),
        "catekv_memory_ratio_r0.3": round(r03["memory_ratio"], 4),
        "catekv_decode_speedup_r0.3": round(r03["speedup"], 3),
        "decode_layers": layers, "decode_batch": batch, "global_mask_memory_smollm2": gm,
        "decode_rows": rows, "prefill_rows": prefill, "wall_s": round(time.time() - t0, 1),
        "prefill_flash_vs_fused": round(prefill[-1]["flash_vs_fused"], 3),
    }
    if on_gpu:
        result["catekv_decode_speedup_pallas"] = round(main_row["speedup_pallas"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
