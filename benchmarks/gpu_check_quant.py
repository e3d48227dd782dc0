"""GPU check of the FlatQuant W4A4KV4 Pallas kernels (compiled, not interpreted) against their
jnp references, then the quick kernel benchmark.

    python -m pallasite.benchmarks.gpu_check_quant   # prints one line per check + the benchmark JSON

Checks: fused Kronecker transform + int4 quantize (SmolLM2 576 = 24×24 with padding, o_proj
9×64, LLaMA 4096 = 64×64; exact on dyadic inputs, ≤ 1 code on random floats), int4 GEMM (int32
accumulator exact with unit scales), 4-bit KV decode attention (float tolerance). Exits non-zero
on a mismatch.
"""

from __future__ import annotations

import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


def deployed_tiny_model_diffs():
    """A tiny Llama quantized with Hadamard+RTN: deployed logits with the Pallas kernels (fused
    transform+quantize, int GEMM, KV4 decode for the last token) vs the jnp reference path."""
    import dataclasses

    from flax import nnx

    from pallasite.models.config import ModelConfig
    from pallasite.models.transformer import abstract_model, forward, init_model
    from pallasite.training.quant_baselines import quantize_model

    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    _, state = nnx.split(init_model(cfg, seed=0))
    qm = quantize_model(cfg, state.to_pure_dict(), "hadamard")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 9)))
    out = {}
    for impl in ("ref", "pallas"):
        cfg_i = qm.cfg.replace(linear_config=dataclasses.replace(qm.cfg.linear_config, impl=impl), attention_impl="ref")
        st = qm.state  # same parameters; the graphdef (which carries the config) is rebuilt per impl
        gd_i, abs_i = nnx.split(abstract_model(cfg_i))
        nnx.replace_by_pure_dict(abs_i, st.to_pure_dict())
        cache = qm.init_cache(2, 10)
        prefill, cache, _ = forward(gd_i, abs_i, tokens[:, :8], cache=cache)
        pos = jnp.full((2, 1), 8, jnp.int32)
        # the KV4 cache picks its decode kernel from the model's attention impl
        gd_d, abs_d = nnx.split(abstract_model(cfg_i.replace(attention_impl=impl)))
        nnx.replace_by_pure_dict(abs_d, st.to_pure_dict())
        step, _, _ = forward(gd_d, abs_d, tokens[:, 8:9], pos, cache=cache)
        out[impl] = (prefill, step)
    d_pre = float(np.abs(np.asarray(out["ref"][0] - out["pallas"][0])).max())  # numpy max keeps NaN
    d_dec = float(np.abs(np.asarray(out["ref"][1] - out["pallas"][1])).max())
    scale = float(np.abs(np.asarray(out["ref"][0])).max())
    return d_pre, d_dec, scale


def main():
    from pallasite.ops.quant.hadamard import hadamard_matrix
    from pallasite.ops.quant.int_gemm import int_gemm, pack_weight_int4
    from pallasite.ops.quant.kron_quant import kron_quantize
    from pallasite.ops.quant.kv4_attention import kv4_decode_attention
    from pallasite.ops.quant.quantizers import pack_int4, quantize_kv_asym, unpack_int4

    print("backend", jax.default_backend(), jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    ok = True
    rng = np.random.default_rng(0)
    interp = jax.default_backend() == "cpu"  # on CPU: the same checks in interpret mode, small shapes only
    big = not interp

    def report(name, good, detail):
        nonlocal ok
        ok &= bool(good)
        print(f"{'PASS' if good else 'FAIL'} {name}: {detail}", flush=True)

    def check_kron_dyadic():
        for T, n1, n2 in [(300, 24, 24), (77, 64, 64)][: 2 if big else 1]:
            p1 = jnp.asarray(hadamard_matrix(n1) * 0.25, jnp.float32)
            p2 = jnp.asarray(hadamard_matrix(n2) * 0.125, jnp.float32)
            x = jnp.asarray(rng.integers(-64, 64, (T, n1 * n2)) / 8.0, jnp.float32)
            clip = jnp.array([4.0, 3.0])
            qr, sr = kron_quantize(x, p1, p2, clip, impl="ref")
            qp, sp = kron_quantize(x, p1, p2, clip, impl="pallas", interpret=interp)
            report(
                f"kron_quantize dyadic T={T} {n1}x{n2}",
                np.array_equal(np.asarray(qr), np.asarray(qp))
                and np.allclose(np.asarray(sr), np.asarray(sp), rtol=1e-6),
                f"mismatching bytes {int((qr != qp).sum())}",
            )

    def check_kron_random():
        for T, n1, n2 in [(129, 9, 64), (64, 64, 64)][: 2 if big else 1]:
            p1 = jnp.asarray(rng.standard_normal((n1, n1)) / np.sqrt(n1), jnp.float32)
            p2 = jnp.asarray(rng.standard_normal((n2, n2)) / np.sqrt(n2), jnp.float32)
            x = jnp.asarray(rng.standard_normal((T, n1 * n2)), jnp.float32)
            with jax.default_matmul_precision("highest"):
                qr, sr = kron_quantize(x, p1, p2, impl="ref")
            qp, sp = kron_quantize(x, p1, p2, impl="pallas", interpret=interp)
            d = np.abs(np.asarray(unpack_int4(qr), np.int32) - np.asarray(unpack_int4(qp), np.int32))
            report(
                f"kron_quantize random T={T} {n1}x{n2}",
                d.max() <= 1 and d.mean() < 5e-3,
                f"max code diff {d.max()}, frac {d.mean():.2e}, scale rel {np.abs(np.asarray(sp / sr - 1)).max():.1e}",
            )

    def check_int_gemm():
        for T, K, N in [(77, 576, 1536), (256, 4096, 4096)][: 2 if big else 1]:
            xq = jnp.asarray(rng.integers(-8, 8, (T, K)), jnp.int8)
            wq = jnp.asarray(rng.integers(-8, 8, (K, N)), jnp.int8)
            xp, wp = pack_int4(xq), pack_weight_int4(wq)
            acc = np.asarray(xq, np.int64) @ np.asarray(wq, np.int64)
            one_t, one_n = jnp.ones((T,)), jnp.ones((N,))
            out = int_gemm(xp, one_t, wp, one_n, impl="pallas", interpret=interp, block_m=64, block_n=128, block_k=64)
            report(f"int_gemm T={T} K={K} N={N}", np.array_equal(np.asarray(out), acc), "int32 accumulator exact")
            if K == 4096:
                xs, ws = (
                    jnp.asarray(rng.uniform(0.1, 1, T), jnp.float32),
                    jnp.asarray(rng.uniform(0.1, 1, N), jnp.float32),
                )
                f_p = jax.jit(
                    lambda a, b, c, d: int_gemm(
                        a, b, c, d, impl="pallas", interpret=interp, block_m=64, block_n=128, block_k=64
                    )
                )
                f_r = jax.jit(lambda a, b, c, d: int_gemm(a, b, c, d, impl="ref"))
                xf, wf = jax.random.normal(jax.random.key(0), (T, K)), jax.random.normal(jax.random.key(1), (K, N))
                f_f = jax.jit(lambda a, b: a @ b)
                ts = {}
                for name, fn, a in (
                    ("pallas_int4", f_p, (xp, xs, wp, ws)),
                    ("ref", f_r, (xp, xs, wp, ws)),
                    ("fp32_gemm", f_f, (xf, wf)),
                ):
                    jax.block_until_ready(fn(*a))
                    t = time.perf_counter()
                    for _ in range(20):
                        r = fn(*a)
                    jax.block_until_ready(r)
                    ts[name] = (time.perf_counter() - t) / 20 * 1e3
                print("  int_gemm timings (ms):", {k: round(v, 3) for k, v in ts.items()}, flush=True)

    def check_kv4_decode():
        B, H, K, S, Dh = 4, 9, 3, (1000 if big else 200), 64
        k = jnp.asarray(rng.standard_normal((B, K, S, Dh)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((B, K, S, Dh)), jnp.float32)
        kq, ks, kz = quantize_kv_asym(k)
        vq, vs, vz = quantize_kv_asym(v)
        cache = (pack_int4(kq), ks, kz.astype(jnp.uint8), pack_int4(vq), vs, vz.astype(jnp.uint8))
        q = jnp.asarray(rng.standard_normal((B, 1, H, Dh)), jnp.float32)
        pos = jnp.array([[0], [S // 3], [S - 2], [S - 1]], jnp.int32)
        for window in (None, 100):
            with jax.default_matmul_precision("highest"):
                ref = kv4_decode_attention(q, *cache, pos, sliding_window=window, impl="ref")
            pal = kv4_decode_attention(
                q, *cache, pos, sliding_window=window, impl="pallas", interpret=interp, block_s=64
            )
            err = float(np.abs(np.asarray(ref - pal)).max())
            report(f"kv4_decode window={window}", err < 5e-3, f"max abs err {err:.2e} (TF32 dots allowed)")

    def check_deployed_tiny():
        d_pre, d_dec, scale = deployed_tiny_model_diffs()
        report(
            "deployed tiny model, pallas vs ref",
            d_pre < 0.05 * scale and d_dec < 0.05 * scale,
            f"prefill max |Δlogit| {d_pre:.2e}, decode {d_dec:.2e} "
            f"(logit scale {scale:.2f}; rare rounding ties allowed)",
        )

    for fn in (check_kron_dyadic, check_kron_random, check_int_gemm, check_kv4_decode, check_deployed_tiny):
        try:  # one broken lowering must not hide the other checks
            fn()
        except Exception:
            traceback.print_exc()
            report(fn.__name__, False, "raised (traceback above)")

    if big:
        from pallasite.benchmarks import quant as bench

        bench.main(["--quick"])
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
