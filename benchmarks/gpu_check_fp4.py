"""Device check of the FP4 training ops (compiled, not interpreted) against their references.

    python -m pallasite.benchmarks.gpu_check_fp4        # one line per check, then one JSON line

Checks: the fused Pallas quantizer (the backend's variant) equals ``quantize_rows_ref`` bit for bit
on odd shapes, with and without OCC, both scale kinds; ``fp4_dot`` with FP8 operands
(``gemm_dtype="float8"``, cuBLASLt on Hopper) equals the bf16-operand GEMM exactly in the forward
and to float32 rounding in the backward; timings of the quantizer and of FP8 vs bf16 GEMMs.
On CPU the same checks run in interpret mode on small shapes. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.benchmarks.timing import median_time
from pallasite.ops import dispatch
from pallasite.ops.quant import fp4
from pallasite.ops.quant.fp4_gemm import FP4GemmSpec, fp4_dot
from pallasite.ops.quant.fp4_kernel import quantize_rows_pallas


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _equal(a, b) -> bool:
    """Bitwise-equal values in numpy (NaN never equals: XLA:CPU's max can drop NaN)."""
    a, b = _f32(a), _f32(b)
    return a.shape == b.shape and bool(np.isfinite(a).all()) and bool(np.array_equal(a, b))


def _rel_err(a, b) -> float:
    a, b = _f32(a), _f32(b)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30))


def main() -> int:
    on_cpu = jax.default_backend() == "cpu"
    print(
        "backend",
        jax.default_backend(),
        jax.devices()[0].device_kind,
        "jax",
        jax.__version__,
        flush=True,
    )
    shapes = [(37, 200), (8, 1000)] if on_cpu else [(37, 200), (4096, 4096), (1000, 11008)]
    failures, res = (
        0,
        {"backend": jax.default_backend(), "variant": dispatch.pick_variant(None).kind},
    )
    for n, k in shapes:
        x = (jax.random.t(jax.random.PRNGKey(n), 3.0, (n, k)) * 0.1).astype(jnp.bfloat16)
        for occ in (None, 0.99):
            for scale in fp4.SCALE_KINDS:
                got = quantize_rows_pallas(x, scale=scale, occ_alpha=occ)
                ref = fp4.quantize_rows_ref(x, scale=scale, occ_alpha=occ, select="top_k")
                ok = all(a is None or _equal(a, b) for a, b in zip(got, ref))
                failures += not ok
                print(
                    f"quantizer {n}x{k} occ={occ} scale={scale}: {'ok' if ok else 'MISMATCH'}",
                    flush=True,
                )
    n, k, m = (64, 256, 128) if on_cpu else (4096, 4096, 4096)
    x = jax.random.normal(jax.random.PRNGKey(1), (n, k)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(2), (k, m)) * 0.02
    g = jax.random.normal(jax.random.PRNGKey(3), (n, m)).astype(jnp.bfloat16)
    outs = {}
    for kind in ("float8", "bfloat16"):
        spec = FP4GemmSpec(gemm_dtype=kind)
        fn = jax.jit(
            lambda x, w, g, spec=spec: (lambda y, vjp: (y, *vjp(g)))(
                *jax.vjp(lambda a, b: fp4_dot(a, b, spec), x, w)
            )
        )
        outs[kind] = fn(x, w, g)
        res[f"fp4_dot_fwd_bwd_{kind}_s"] = median_time(fn, x, w, g, iters=5)
    fwd_ok = _equal(outs["float8"][0], outs["bfloat16"][0])
    bwd_err = max(_rel_err(a, b) for a, b in zip(outs["float8"][1:], outs["bfloat16"][1:]))
    failures += (not fwd_ok) + (bwd_err > 1e-2)
    print(
        f"fp4_dot float8 vs bf16 operands: forward {'equal' if fwd_ok else 'DIFFERENT'}, "
        f"backward max rel err {bwd_err:.2e}",
        flush=True,
    )
    xq = jax.jit(lambda x: quantize_rows_pallas(x, occ_alpha=0.99))
    res["quantizer_occ_s"] = median_time(xq, x, iters=5)
    res.update(fwd_equal=fwd_ok, bwd_rel_err=bwd_err, shape=[n, k, m], failures=int(failures))
    print(json.dumps(res))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
