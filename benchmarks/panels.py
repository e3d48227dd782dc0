"""The few-row CPU kernel (``ops.panels``) against XLA:CPU's own dot, on the shape that matters.

    python -m pallasite.benchmarks.panels [--rows 1,2,4,8,16,32] [--iters 9] [--dtype bfloat16] [--head]

Times SmolLM2-135M's 30 SwiGLU MLP blocks (d 576, ff 1536; random weights, 318 MB in float32, the
bulk of a decode step's weight reads) unrolled in one jit, at M rows: ``x @ W`` (XLA:CPU: a
mat-vec for one row, its GEMM for more; with ``--dtype bfloat16`` activations and weights in bf16
and float32 accumulation, as ``models.layers.Linear`` computes) against ``ops.panels.panel_matmul``
on the packed weights of the same dtype. Per M, each system's ``--iters`` calls in a row after a
warm-up, median; not interleaved call by call, because XLA's bf16 one-row mat-vec (161 ms against
12 ms on the panels) slowed the panels call right after it 2x. The table gives ms, the ratio and
the weight read rate. Checks first that both give the same result (to rounding). ``--head`` times
SmolLM2's tied LM head instead (V 49152 x d 576): ``models.layers.Embed.attend`` (XLA's dot, what
the float kind runs) against ``PanelEmbed.attend`` (the panels kind's, ``panel_matmul`` on the table
in ``pack_table`` order). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.ops.panels import pack, panel_matmul


def mlp_stack(matmul, dtype):
    def run(x, gates, ups, downs):
        for g, u, d in zip(gates, ups, downs):
            h = jax.nn.silu(matmul(x, g)) * matmul(x, u)
            x = x + matmul(h.astype(dtype), d)
        return x.astype(dtype)
    return jax.jit(run)


def xla_dot(x, w):
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def mlp_systems(args, dtype, rng):
    shapes = {"gates": (args.d, args.ff), "ups": (args.d, args.ff), "downs": (args.ff, args.d)}
    plain = {k: [jnp.asarray(rng.standard_normal(s, np.float32) * 0.02, dtype) for _ in range(args.layers)]
             for k, s in shapes.items()}
    packed = {k: [pack(w) for w in ws] for k, ws in plain.items()}
    weight_bytes = sum(w.nbytes for ws in plain.values() for w in ws)
    panels = lambda x, w: panel_matmul(x, w).astype(x.dtype)
    systems = {"xla": (mlp_stack(xla_dot, dtype), plain), "panels": (mlp_stack(panels, dtype), packed)}
    return systems, weight_bytes, f"{args.layers} SwiGLU MLPs d={args.d} ff={args.ff}"


def head_systems(args, dtype):
    from flax import nnx

    from pallasite.models.config import ModelConfig
    from pallasite.models.layers import Embed
    from pallasite.models.panel_linear import PanelEmbed, pack_table

    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d, dtype=dtype.name, param_dtype=dtype.name)
    embed = Embed(args.vocab, args.d, cfg=cfg, rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(embed)
    panel_graphdef, panel_state = nnx.split(PanelEmbed(args.vocab, args.d, cfg=cfg, rngs=nnx.Rngs(params=0)))
    panel_state["embedding"] = panel_state["embedding"].replace(pack_table(embed.embedding[...]))

    def attend(graph):
        return jax.jit(lambda x, state: nnx.merge(graph, state).attend(x).astype(jnp.float32))

    systems = {"xla": (attend(graphdef), {"state": state}), "panels": (attend(panel_graphdef), {"state": panel_state})}
    return systems, embed.embedding[...].nbytes, f"tied LM head V={args.vocab} d={args.d} (Embed vs PanelEmbed .attend)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--ff", type=int, default=1536)
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--head", action="store_true", help="time the tied LM head (Embed.attend) instead of the MLPs")
    ap.add_argument("--vocab", type=int, default=49152, help="--head: the vocabulary")
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(args.dtype)
    if args.head:
        systems, weight_bytes, what = head_systems(args, dtype)
    else:
        systems, weight_bytes, what = mlp_systems(args, dtype, rng)
    x0 = jnp.asarray(rng.standard_normal((3, args.d), np.float32), dtype)
    ref, got = (np.asarray(fn(x0, **w), np.float32) for fn, w in systems.values())
    err = float(np.max(np.abs(ref - got)) / np.max(np.abs(ref)))
    print(f"{what}, {weight_bytes / 1e6:.0f} MB {dtype.name}; "
          f"device {jax.devices()[0].device_kind}; relative max difference {err:.1e}")
    print(f"{'M':>4} {'xla ms':>8} {'panels ms':>10} {'speed-up':>9} {'xla GB/s':>9} {'panels GB/s':>12}")
    out = {"bench": "panels", "what": "head" if args.head else "mlp", "dtype": dtype.name,
           "weight_MB": round(weight_bytes / 1e6, 1), "max_rel_diff": err,
           "rows": {}}
    for M in rows:
        x = jnp.asarray(rng.standard_normal((M, args.d), np.float32), dtype)
        samples = {name: [] for name in systems}
        for name, (fn, w) in systems.items():  # one system's calls in a row, after a warm-up call
            jax.block_until_ready(fn(x, **w))
            for _ in range(args.iters):
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
