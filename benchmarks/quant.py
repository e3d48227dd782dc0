"""FlatQuant W4A4KV4 kernels side by side (one process, ratios).

    python -m pallasite.benchmarks.quant --quick

Compared, at SmolLM2-135M shapes (d 576 = 24×24, d_ff 1536 = 32×48) and LLaMA-7B shapes
(4096 = 64×64):

1. online Kronecker transform + per-token int4 quantize, **fused** (one jitted op) vs transform
   and quantize as **separate** steps (two dispatches, the transformed tensor round-trips memory);
2. the int4 GEMM with dequant epilogue vs a float32 GEMM of the same shape;
3. decode attention over a 4-bit KV cache vs the full-precision cache: time and bytes.

``transform_overhead_vs_gemm`` is the paper's ratio (≈ 0.07× for FlatQuant on LLaMA-2-7B,
RTX 3090): time of the online Kronecker transform of a ``T × 4096`` activation divided by the time
of the ``T × 4096 × 4096`` int4 GEMM it precedes (the paper's denominator: the transform runs in
front of the quantized GEMM); ``transform_overhead_vs_float_gemm`` divides by the float32 GEMM of
the same shape instead. Both denominators are printed for both shapes, with the fused
transform + quantize as well as the bare transform. On CPU the compiled XLA (jnp reference) paths are
timed — interpret-mode Pallas proves correctness, not speed; on a GPU the Pallas kernels are
timed as well (``impl=pallas``, compiled, no interpret). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.benchmarks.timing import median_time
from pallasite.ops.attention.reference import attention as reference_attention
from pallasite.ops.quant.int_gemm import int_gemm, pack_weight_int4
from pallasite.ops.quant.kron_quant import kron_quantize, kron_transform_ref
from pallasite.ops.quant.kv4_attention import kv4_decode_attention
from pallasite.ops.quant.quantizers import pack_int4, quantize_act_sym, quantize_kv_asym


def bench(fn, *args, reps=5):
    return median_time(fn, *args, iters=reps, warmup=1)


def orth(n, seed):
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, n)))
    return jnp.asarray(q, jnp.float32)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    T = 512 if args.quick else 2048
    reps = 3 if args.quick else 10
    rows, res = [], {"backend": jax.default_backend(), "tokens": T}
    key = jax.random.key(0)

    # ---- 1. fused transform + quantize vs separate, and the transform vs its GEMM
    for name, n, (n1, n2), n_out in [("smollm2 d576", 576, (24, 24), 1536), ("llama 4096", 4096, (64, 64), 4096)]:
        x = jax.random.normal(key, (T, n), jnp.float32)
        p1, p2 = orth(n1, 1), orth(n2, 2)
        clip = jnp.array([4.0, 4.0])
        fused = jax.jit(lambda x: kron_quantize(x, p1, p2, clip, impl="ref"))
        transform = jax.jit(lambda x: kron_transform_ref(x, p1, p2))
        quant = jax.jit(lambda y: (lambda q, s: (pack_int4(q), s))(*quantize_act_sym(y, clip)))
        t_fused = bench(fused, x, reps=reps)
        y = transform(x)
        t_sep = bench(transform, x, reps=reps) + bench(quant, y, reps=reps)
        t_tr = bench(transform, x, reps=reps)
        w = jax.random.normal(key, (n, n_out), jnp.float32) * 0.02
        t_gemm = bench(jax.jit(lambda x, w: x @ w), x, w, reps=reps)
        xq, xs = fused(x)
        wq = pack_weight_int4(jnp.clip(jnp.round(w / (jnp.max(jnp.abs(w), 0) / 7)), -8, 7).astype(jnp.int8))
        ws = jnp.max(jnp.abs(w), 0) / 7
        t_igemm = bench(jax.jit(lambda a, b, c, d: int_gemm(a, b, c, d, impl="ref")), xq, xs, wq, ws, reps=reps)
        entry = dict(fused_ms=t_fused * 1e3, separate_ms=t_sep * 1e3, transform_ms=t_tr * 1e3,
                     float_gemm_ms=t_gemm * 1e3, int_gemm_ms=t_igemm * 1e3,
                     transform_over_int_gemm=t_tr / t_igemm, fused_quant_over_int_gemm=t_fused / t_igemm,
                     transform_over_float_gemm=t_tr / t_gemm, fused_quant_over_float_gemm=t_fused / t_gemm)
        if gpu:
            pk = jax.jit(lambda x: kron_quantize(x, p1, p2, clip, impl="pallas", interpret=False))
            entry["pallas_fused_ms"] = bench(pk, x, reps=reps) * 1e3
            pg = jax.jit(lambda a, b, c, d: int_gemm(a, b, c, d, impl="pallas", interpret=False,
                                                     block_m=64, block_n=128, block_k=64))
            entry["pallas_int_gemm_ms"] = bench(pg, xq, xs, wq, ws, reps=reps) * 1e3
            entry["pallas_fused_over_float_gemm"] = entry["pallas_fused_ms"] / entry["float_gemm_ms"]
            entry["pallas_fused_over_int_gemm"] = entry["pallas_fused_ms"] / entry["pallas_int_gemm_ms"]
        res[name] = entry
        rows.append((f"transform+quant fused / separate [{name}]", f"{t_fused*1e3:.2f} / {t_sep*1e3:.2f} ms"))
        rows.append((f"kron transform / int4 GEMM {n}x{n_out} [{name}]",
                     f"{t_tr*1e3:.2f} / {t_igemm*1e3:.2f} ms = {t_tr/t_igemm:.3f}x"))
        rows.append((f"transform+quant (fused) / int4 GEMM [{name}]",
                     f"{t_fused*1e3:.2f} / {t_igemm*1e3:.2f} ms = {t_fused/t_igemm:.3f}x"))
        rows.append((f"kron transform / fp32 GEMM {n}x{n_out} [{name}]",
                     f"{t_tr*1e3:.2f} / {t_gemm*1e3:.2f} ms = {t_tr/t_gemm:.3f}x"))
        rows.append((f"int4 GEMM (ref) / fp32 GEMM [{name}]", f"{t_igemm*1e3:.2f} / {t_gemm*1e3:.2f} ms"))
    res["transform_overhead_vs_gemm"] = res["llama 4096"]["transform_over_int_gemm"]  # the paper's ratio
    res["transform_overhead_vs_float_gemm"] = res["llama 4096"]["transform_over_float_gemm"]
    res["transform_overhead_vs_gemm_smollm2"] = res["smollm2 d576"]["transform_over_int_gemm"]
    res["transform_overhead_vs_float_gemm_smollm2"] = res["smollm2 d576"]["transform_over_float_gemm"]
    # the denominators above are the XLA-compiled jnp int4 GEMM (``impl="ref"``) on every backend;
    # on a GPU the Pallas kernel's ratio is the extra ``pallas_fused_over_int_gemm`` key
    res["int_gemm_impl"] = "ref (XLA-compiled jnp)"

    # ---- 3. decode attention: 4-bit cache vs full precision (SmolLM2: 9 heads, 3 KV heads, Dh 64)
    B, H, K, Dh, S = 4, 9, 3, 64, (1024 if args.quick else 4096)
    k = jax.random.normal(key, (B, K, S, Dh), jnp.float32)
    v = jax.random.normal(jax.random.key(1), (B, K, S, Dh), jnp.float32)
    q = jax.random.normal(jax.random.key(2), (B, 1, H, Dh), jnp.float32)
    pos = jnp.full((B, 1), S - 1, jnp.int32)
    kq, ks, kz = quantize_kv_asym(k)
    vq, vs, vz = quantize_kv_asym(v)
    c4 = (pack_int4(kq), ks, kz.astype(jnp.uint8), pack_int4(vq), vs, vz.astype(jnp.uint8))
    kb, vb = jnp.swapaxes(k, 1, 2).astype(jnp.bfloat16), jnp.swapaxes(v, 1, 2).astype(jnp.bfloat16)
    t_dense = bench(jax.jit(lambda q, k, v: reference_attention(q, k, v, q_positions_BT=pos)), q, kb, vb, reps=reps)
    t_kv4 = bench(jax.jit(lambda q, *c: kv4_decode_attention(q, *c, pos, impl="ref")), q, *c4, reps=reps)
    bytes4 = sum(a.size * a.dtype.itemsize for a in c4)
    bytes_bf16 = 2 * B * S * K * Dh * 2
    res["kv4_bytes_ratio"] = bytes4 / bytes_bf16
    res["kv4_bytes_ratio_vs_fp32"] = bytes4 / (2 * bytes_bf16)
    res["decode"] = dict(S=S, dense_bf16_ms=t_dense * 1e3, kv4_ref_ms=t_kv4 * 1e3, kv4_bytes=bytes4,
                         bf16_bytes=bytes_bf16)
    if gpu:
        res["decode"]["kv4_pallas_ms"] = bench(jax.jit(lambda q, *c: kv4_decode_attention(
            q, *c, pos, impl="pallas", interpret=False, block_s=64)), q, *c4, reps=reps) * 1e3
    rows.append((f"decode attention S={S}: bf16 cache / 4-bit cache (ref)", f"{t_dense*1e3:.2f} / {t_kv4*1e3:.2f} ms"))
    rows.append(("KV bytes 4-bit / bf16", f"{bytes4} / {bytes_bf16} = {res['kv4_bytes_ratio']:.3f}"))
    w = max(len(r[0]) for r in rows)
    print(f"backend {jax.default_backend()}, T={T}; int4 GEMM = int_gemm(impl='ref'), XLA-compiled")
    for a, b in rows:
        print(f"{a:<{w}}  {b}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
