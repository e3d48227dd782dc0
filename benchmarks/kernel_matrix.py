"""Compile matrix of the Pallas kernels, on a CPU-only machine: every TPU (Mosaic) kernel compiled
ahead of time for abstract TPU chips (``jax.experimental.topologies`` + ``jit(f).lower(...)
.compile()``, the real XLA:TPU and Mosaic compilers from libtpu), every GPU (Triton) kernel lowered
for CUDA (``jax.export(..., platforms=["cuda"])``), at the shapes of SmolLM2-135M, Llama-3-8B and
Mixtral-8x7B. Needs the ``tpu`` extra (libtpu) for the TPU half.

    python -m pallasite.benchmarks.kernel_matrix [--chips v5e,v5p] [--models smollm2-135m]
        [--only flash] [--no-cuda]

Prints one row per (kernel, model, target) with the seconds and the per-chip bytes, and ends with
one JSON line. ``tests/ops/test_kernel_compile.py`` (marker ``tpu_compile``) runs the same cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp

from pallasite.ops.attention import flash_attention
from pallasite.ops.attention.decode import (
    decode_attention,
    dense_source,
    pooled_source,
    scaled_int8_source,
)
from pallasite.ops.dispatch import target_platform
from pallasite.ops.gmm import gmm
from pallasite.ops.quant.fp4_gemm import FP4GemmSpec, fp4_dot
from pallasite.ops.quant.fp4_kernel import quantize_rows
from pallasite.ops.quant.int_gemm import int_gemm
from pallasite.ops.quant.kron_quant import kron_quantize
from pallasite.ops.quant.kv4_attention import kv4_decode_attention

# name -> model shape (head dims 64 / 128, GQA) and the kernel families compiled at it. Mixtral's
# attention is Llama-3-8B's (32 / 8 heads of 128), so it adds the grouped matmul only; SmolLM2 runs
# the grouped matmul as 8 experts of its FFN (the MoE / MoLE experiments' shape).
MODELS = {
    "smollm2-135m": dict(
        d=576,
        heads=9,
        kv_heads=3,
        head_dim=64,
        ffn=1536,
        experts=8,
        kron=(24, 24),
        families=("flash", "decode", "gmm", "quant", "fp4"),
    ),
    "llama3-8b": dict(
        d=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        ffn=14336,
        kron=(64, 64),
        families=("flash", "decode", "quant", "fp4"),
    ),
    "mixtral-8x7b": dict(
        d=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, experts=8, families=("gmm",)
    ),
}
CHIPS = {"v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
DEFAULT_CHIPS = ("v5e", "v5p")
TRITON_CALL = "__gpu$xla.gpu.triton"
COMPILE_TIMEOUT_S = float(os.environ.get("PALLASITE_COMPILE_TIMEOUT", "180"))
PREFILL_T = 2048  # prefill / training sequence of the flash cases
CACHE_S = 4096  # decode cache capacity
DECODE_B = 8
TOKENS = 2048  # rows of the gmm / quantized-linear cases


@dataclasses.dataclass(frozen=True)
class Case:
    kernel: str
    model: str
    fn: Callable
    specs: tuple  # ((shape, dtype), ...)
    platforms: tuple = ("tpu", "cuda")


def _flash_cases(name, m):
    B, T, H, K, D = 1, PREFILL_T, m["heads"], m["kv_heads"], m["head_dim"]
    qkv = (((B, T, H, D), jnp.bfloat16), ((B, T, K, D), jnp.bfloat16), ((B, T, K, D), jnp.bfloat16))

    def fwd(q, k, v):
        return flash_attention(q, k, v, interpret=False)

    def bwd(q, k, v):
        return jax.grad(
            lambda *a: jnp.sum(flash_attention(*a, interpret=False).astype(jnp.float32)),
            argnums=(0, 1, 2),
        )(q, k, v)

    return [Case("flash_fwd", name, fwd, qkv), Case("flash_bwd", name, bwd, qkv)]


def _decode_cases(name, m):
    B, S, K, G, D = DECODE_B, CACHE_S, m["kv_heads"], m["heads"] // m["kv_heads"], m["head_dim"]
    q = ((B, K, G, D), jnp.bfloat16)
    lens = ((B,), jnp.int32)
    cache = ((B, K, S, D), jnp.bfloat16)

    def dense(q, k, v, lens):
        return decode_attention(q, dense_source(k, v, "BKSD"), lens, interpret=False)

    def int8(q, kq, ks, vq, vs, lens):
        return decode_attention(
            q, scaled_int8_source(kq, ks, vq, vs, "BKSD"), lens, interpret=False
        )

    def pooled(q, k_pool, v_pool, base, lens):  # CateKV: a window of K heads in a pool of 2K
        return decode_attention(q, pooled_source(k_pool, v_pool, base, K), lens, interpret=False)

    def kv4(q, kq, ks, kz, vq, vs, vz, pos):
        return kv4_decode_attention(q, kq, ks, kz, vq, vs, vz, pos, impl="pallas", interpret=False)

    i8 = ((B, K, S, D), jnp.int8)
    scale = ((B, K, S), jnp.float32)
    codes, s4, z4 = (
        ((B, K, S, D // 2), jnp.uint8),
        ((B, K, S, 1), jnp.float32),
        ((B, K, S, 1), jnp.uint8),
    )
    pool = ((B, 2 * K, S, D), jnp.bfloat16)
    return [
        Case("decode_dense_bf16", name, dense, (q, cache, cache, lens)),
        Case("decode_int8", name, int8, (q, i8, scale, i8, scale, lens)),
        Case(
            "decode_kv4",
            name,
            kv4,
            (((B, 1, K * G, D), jnp.float32), codes, s4, z4, codes, s4, z4, ((B, 1), jnp.int32)),
        ),
        Case(
            "decode_catekv_pool",
            name,
            pooled,
            (q, pool, pool, ((), jnp.int32), lens),
            platforms=("tpu",),
        ),
    ]


def _gmm_cases(name, m):
    E, D, F = m["experts"], m["d"], m["ffn"]
    specs = (((TOKENS, D), jnp.bfloat16), ((E, D, F), jnp.bfloat16), ((E,), jnp.int32))

    def fwd(x, w, gs):
        return gmm(x, w, gs, impl="pallas", interpret=False)

    def bwd(x, w, gs):
        return jax.grad(
            lambda x, w: jnp.sum(gmm(x, w, gs, impl="pallas", interpret=False).astype(jnp.float32)),
            argnums=(0, 1),
        )(x, w)

    return [Case("gmm_fwd", name, fwd, specs), Case("gmm_bwd_tgmm", name, bwd, specs)]


def _quant_cases(name, m):
    n1, n2 = m["kron"]
    D, F = m["d"], m["ffn"]

    def kron(x, p1, p2, clip):
        return kron_quantize(x, p1, p2, clip, impl="pallas", interpret=False)

    def gemm(xq, xs, wq, ws):
        return int_gemm(xq, xs, wq, ws, impl="pallas", interpret=False)

    return [
        Case(
            "kron_quant_int4",
            name,
            kron,
            (
                ((TOKENS, D), jnp.float32),
                ((n1, n1), jnp.float32),
                ((n2, n2), jnp.float32),
                ((2,), jnp.float32),
            ),
        ),
        Case(
            "int4_gemm",
            name,
            gemm,
            (
                ((TOKENS, D // 2), jnp.uint8),
                ((TOKENS,), jnp.float32),
                ((D // 2, F), jnp.uint8),
                ((F,), jnp.float32),
            ),
        ),
    ]


def _fp4_cases(name, m):
    """FP4 training: the fused row quantizer (activations with OCC; weights per output channel,
    i.e. rows of kernel.T) and a whole FP4 linear forward + backward (quantizers, FP8-valued GEMMs,
    E5M2 gradients, DGE) at SmolLM2's FFN shape."""
    D, F = m["d"], m["ffn"]

    def act(x):
        return quantize_rows(x, occ_alpha=0.99, impl="pallas", interpret=False)

    def weight(w):
        return quantize_rows(w.T, impl="pallas", interpret=False)

    def linear(x, w):
        spec = FP4GemmSpec(impl="pallas")
        loss = lambda x, w: jnp.sum(fp4_dot(x, w, spec).astype(jnp.float32))  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1))(x, w)

    x_spec, w_spec = ((TOKENS, D), jnp.bfloat16), ((D, F), jnp.float32)
    return [
        Case("fp4_quant_act_occ", name, act, (x_spec,)),
        Case("fp4_quant_weight", name, weight, (w_spec,)),
    ] + (  # the whole linear (no kernel beyond the two above; its XLA part compiles for ~2 min
        # on a loaded 2-core host, so only at the smallest shape)
        [Case("fp4_linear_fwd_bwd", name, linear, (x_spec, w_spec))] if D <= 1024 else []
    )


def cases(models=tuple(MODELS)) -> list[Case]:
    out = []
    for name in models:
        m = MODELS[name]
        makers = dict(
            flash=_flash_cases, decode=_decode_cases, gmm=_gmm_cases, quant=_quant_cases,
            fp4=_fp4_cases,
        )
        for family in m["families"]:
            out += makers[family](name, m)
    return out


class Deadline:
    """Kill the process (exit 3, naming the step) if a compile runs past ``seconds``: a compile
    with absurd blocks once hung > 5 min instead of failing, and a hung C++ compile cannot be
    interrupted from Python."""

    def __init__(self, seconds: float, what: str):
        self.seconds, self.what = seconds, what

    def _fire(self):
        print(
            f"\nTIMEOUT: {self.what} did not finish within {self.seconds:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)

    def __enter__(self):
        self.timer = threading.Timer(self.seconds, self._fire)
        self.timer.daemon = True
        self.timer.start()
        return self

    def __exit__(self, *exc):
        self.timer.cancel()
        return False


_TOPOLOGIES: dict = {}


def tpu_device(chip: str):
    from jax.experimental import topologies

    if chip not in _TOPOLOGIES:
        _TOPOLOGIES[chip] = topologies.get_topology_desc(
            platform="tpu", topology_name=CHIPS[chip]
        ).devices[0]
    return _TOPOLOGIES[chip]


def compile_tpu(case: Case, chip: str, timeout_s: float = COMPILE_TIMEOUT_S) -> dict:
    """AOT-compile ``case`` for one abstract ``chip``; returns seconds and per-chip bytes."""
    dev = tpu_device(chip)
    sharding = jax.sharding.SingleDeviceSharding(dev)
    args = [jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in case.specs]
    t0 = time.perf_counter()
    with Deadline(timeout_s, f"TPU compile of {case.kernel} / {case.model} / {chip}"):
        with target_platform("tpu"), jax.default_device(dev):  # kernels read the chip generation
            compiled = jax.jit(case.fn).lower(*args).compile()
    seconds = time.perf_counter() - t0
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    return dict(
        seconds=round(seconds, 2),
        device_kind=dev.device_kind,
        mosaic_calls=text.count("tpu_custom_call"),
        argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes),
    )


def lower_cuda(case: Case, timeout_s: float = COMPILE_TIMEOUT_S) -> dict:
    """Lower ``case`` for CUDA through Triton with ``jax.export`` (no GPU needed)."""
    args = [jax.ShapeDtypeStruct(s, d) for s, d in case.specs]
    t0 = time.perf_counter()
    with Deadline(timeout_s, f"CUDA lowering of {case.kernel} / {case.model}"):
        with target_platform("gpu"):
            exp = jax.export.export(
                jax.jit(case.fn),
                platforms=["cuda"],
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
            )(*args)
    text = exp.mlir_module()
    return dict(seconds=round(time.perf_counter() - t0, 2), triton_calls=text.count(TRITON_CALL))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chips", default=",".join(DEFAULT_CHIPS), help=f"subset of {','.join(CHIPS)}")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--only", default="", help="kernel name substring")
    ap.add_argument("--no-cuda", action="store_true")
    args = ap.parse_args(argv)
    chips = [c for c in args.chips.split(",") if c]
    rows, failures = [], []
    t_all = time.perf_counter()
    for case in cases(tuple(args.models.split(","))):
        if args.only not in case.kernel:
            continue
        targets = [c for c in chips if "tpu" in case.platforms] + (
            ["cuda"] if "cuda" in case.platforms and not args.no_cuda else []
        )
        for target in targets:
            try:
                res = lower_cuda(case) if target == "cuda" else compile_tpu(case, target)
                ok = (res.get("mosaic_calls") or res.get("triton_calls") or 0) > 0
            except Exception as e:  # report every failure, then fail at the end
                res, ok = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"), False
            row = dict(kernel=case.kernel, model=case.model, target=target, ok=ok, **res)
            rows.append(row)
            if not ok:
                failures.append(row)
            detail = (
                f"{res['seconds']:6.2f} s  temp {res.get('temp_bytes', 0) / 2**20:8.1f} MiB"
                if "seconds" in res
                else res["error"]
            )
            print(
                f"{'ok  ' if ok else 'FAIL'} {case.kernel:20s} {case.model:13s} {target:5s} "
                f"{detail}",
                flush=True,
            )
    total = time.perf_counter() - t_all
    print(
        json.dumps(
            {
                "rows": rows,
                "n": len(rows),
                "failures": len(failures),
                "seconds": round(total, 1),
                "jax": jax.__version__,
            }
        )
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
