"""The few-row CPU kernel (``ops.panels``) against XLA:CPU's own dot, on the shape that matters.

    python -m pallasite.benchmarks.panels [--rows 1,2,4,8,16,32] [--iters 9]

Times SmolLM2-135M's 30 SwiGLU MLP blocks (d 576, ff 1536; random float32 weights, 318 MB, the
bulk of a decode step's weight reads) unrolled in one jit, at M rows: ``x @ W`` (XLA:CPU: a
mat-vec for one row, its GEMM for more) against ``ops.panels.panel_matmul`` on the packed
weights. Interleaved (XLA, panels, XLA, ...) per M, median of ``--iters``; the table gives ms, the
ratio and the weight read rate. Checks first that both give the same result (to rounding).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.ops.panels import pack, panel_matmul


def mlp_stack(matmul):
    def run(x, gates, ups, downs):
        for g, u, d in zip(gates, ups, downs):
            x = x + matmul(jax.nn.silu(matmul(x, g)) * matmul(x, u), d)
        return x
    return jax.jit(run)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--ff", type=int, default=1536)
    ap.add_argument("--iters", type=int, default=9)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    shapes = {"gates": (args.d, args.ff), "ups": (args.d, args.ff), "downs": (args.ff, args.d)}
    plain = {k: [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for _ in range(args.layers)]
             for k, s in shapes.items()}
    packed = {k: [pack(w) for w in ws] for k, ws in plain.items()}
    weight_bytes = sum(w.nbytes for ws in plain.values() for w in ws)
    systems = {"xla": (mlp_stack(lambda x, w: x @ w), plain), "panels": (mlp_stack(panel_matmul), packed)}
    x0 = jnp.asarray(rng.standard_normal((3, args.d), np.float32))
    ref, got = (fn(x0, **w) for fn, w in systems.values())
    err = float(jnp.max(jnp.abs(ref - got)) / jnp.max(jnp.abs(ref)))
    print(f"{args.layers} SwiGLU MLPs d={args.d} ff={args.ff}, {weight_bytes / 1e6:.0f} MB float32; "
          f"device {jax.devices()[0].device_kind}; relative max difference {err:.1e}")
    print(f"{'M':>4} {'xla ms':>8} {'panels ms':>10} {'speed-up':>9} {'xla GB/s':>9} {'panels GB/s':>12}")
    out = {"bench": "panels", "weight_MB": round(weight_bytes / 1e6, 1), "max_rel_diff": err, "rows": {}}
    for M in rows:
        x = jnp.asarray(rng.standard_normal((M, args.d), np.float32))
        samples = {name: [] for name in systems}
        for name, (fn, w) in systems.items():
            jax.block_until_ready(fn(x, **w))  # compile
        for _ in range(args.iters):
            for name, (fn, w) in systems.items():
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, **w))
                samples[name].append(time.perf_counter() - t0)
        ms = {name: 1e3 * float(np.median(s)) for name, s in samples.items()}
        gbs = {name: weight_bytes / (v / 1e3) / 1e9 for name, v in ms.items()}
        print(f"{M:>4} {ms['xla']:>8.1f} {ms['panels']:>10.1f} {ms['xla'] / ms['panels']:>8.2f}x "
              f"{gbs['xla']:>9.1f} {gbs['panels']:>12.1f}", flush=True)
        out["rows"][M] = {"xla_ms": round(ms["xla"], 2), "panels_ms": round(ms["panels"], 2),
                          "speedup": round(ms["xla"] / ms["panels"], 3)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
