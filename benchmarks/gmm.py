"""Grouped matmul side by side: ``python -m pallasite.benchmarks.gmm [--quick]`` times Pallas (the
backend's variant), ``ragged_dot`` and the padded-tile XLA path, forward and forward+backward, and
ends with one JSON line (absolute times only mean something on an accelerator).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.ops.gmm import gmm


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu or args.quick:
        M, K, N, G, dtype = (
            (512, 64, 128, 8, jnp.float32) if on_cpu else (8192, 1024, 1024, 8, jnp.bfloat16)
        )
    else:
        M, K, N, G, dtype = 32768, 2048, 1408, 16, jnp.bfloat16
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (M, K), dtype)
    w = (jax.random.normal(kw, (G, K, N), jnp.float32) / np.sqrt(K)).astype(dtype)
    cuts = jnp.sort(jax.random.randint(kg, (G - 1,), 0, M))
    gs = jnp.diff(
        jnp.concatenate([jnp.zeros(1, jnp.int32), cuts, jnp.full(1, M, jnp.int32)])
    ).astype(jnp.int32)
    # the variant's own defaults on TPU (128/512/512); the GPU kernel's larger tiles on GPU
    blocks = {"tpu": {}, "gpu": dict(block_m=128, block_k=64, block_n=128)}.get(
        jax.default_backend(), dict(block_m=64, block_k=64, block_n=64)
    )
    res = {"backend": jax.default_backend(), "shape": [M, K, N, G], "dtype": jnp.dtype(dtype).name}
    ref = gmm(x, w, gs, impl="ref").astype(jnp.float32)
    for impl in ("ref", "tiles", "pallas"):
        kw_ = blocks if impl == "pallas" else {"block_m": blocks.get("block_m", 64)}
        f = jax.jit(lambda x, w, impl=impl, kw_=kw_: gmm(x, w, gs, impl=impl, **kw_))
        g = jax.jit(
            jax.grad(
                lambda x, w, impl=impl, kw_=kw_: jnp.sum(
                    gmm(x, w, gs, impl=impl, **kw_).astype(jnp.float32) ** 2
                ),
                argnums=(0, 1),
            )
        )
        out = jax.block_until_ready(f(x, w))
        jax.block_until_ready(g(x, w))
        times = {}
        for name, fn in (("fwd", f), ("fwd_bwd", g)):
            ts = []
            for _ in range(3 if args.quick or on_cpu else 10):
                t = time.perf_counter()
                jax.block_until_ready(fn(x, w))
                ts.append(time.perf_counter() - t)
            times[name] = float(np.median(ts))
        err = float(
            jnp.max(jnp.abs(out.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-9)
        )
        res[impl] = {
            "fwd_ms": round(times["fwd"] * 1e3, 3),
            "fwd_bwd_ms": round(times["fwd_bwd"] * 1e3, 3),
            "rel_err_vs_ref": err,
        }
        print(
            f"{impl:7s} fwd {times['fwd'] * 1e3:9.3f} ms  "
            f"fwd+bwd {times['fwd_bwd'] * 1e3:9.3f} ms  rel err {err:.2e}"
        )
    res["pallas_vs_ref_fwd"] = round(res["ref"]["fwd_ms"] / res["pallas"]["fwd_ms"], 3)
    res["pallas_vs_ref_fwd_bwd"] = round(res["ref"]["fwd_bwd_ms"] / res["pallas"]["fwd_bwd_ms"], 3)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
