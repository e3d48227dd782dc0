"""One-shot accelerator check of the attention kernels (compiled, not interpreted) + the quick
benchmark. Run on the GPU box:

    python -m pallasite.benchmarks.gpu_check_attention                 # benchmark at 4k and 32k
    python -m pallasite.benchmarks.gpu_check_attention --contexts 4096,16384,32768

Prints one ``PASS``/``FAIL`` line per check (max error vs the jnp reference) and ends with the
benchmark's JSON line. Exits 1 if any check fails. On CPU it runs the same checks in interpret
mode (slow, small).
"""

from __future__ import annotations

import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np


def main() -> int:
    # the jnp reference must be true float32 on GPU too (XLA's default there is TF32, ~1e-3 off)
    with jax.default_matmul_precision("highest"):
        failures = _checks()
    if jax.default_backend() != "cpu":
        from pallasite.benchmarks import attention as bench

        bench.main(["--quick"] + (sys.argv[1:] or ["--contexts", "4096,32768"]))
    print("FAILED: " + ", ".join(failures) if failures else "ALL PASS", flush=True)
    return 1 if failures else 0


def _checks() -> list:
    from pallasite.inference.cache.catekv import CateKVConfig, init_catekv_cache
    from pallasite.models.config import ModelConfig
    from pallasite.ops.attention import decode_attention_dense as dense_decode
    from pallasite.ops.attention import flash_attention
    from pallasite.ops.attention.decode import decode_attention, decode_attention_reference
    from pallasite.ops.attention.kv_source import quantize_int8, scaled_int8_source
    from pallasite.ops.attention.reference import attention as ref

    on_cpu = jax.default_backend() == "cpu"
    interpret = on_cpu
    print(f"backend={jax.default_backend()} devices={jax.devices()} jax={jax.__version__}", flush=True)
    failures = []

    def check(name, fn, tol):
        t0 = time.time()
        try:
            err = float(fn())
            ok = err <= tol
        except Exception:  # report and continue: one broken lowering should not hide the others
            traceback.print_exc()
            err, ok = float("nan"), False
        print(f"{'PASS' if ok else 'FAIL'} {name}: max_err={err:.3e} (tol {tol:g}) {time.time() - t0:.1f}s", flush=True)
        if not ok:
            failures.append(name)

    def rnd(shape, dtype, seed):
        return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32).astype(dtype)

    def maxdiff(a, b):  # numpy: XLA's max reduction can drop NaN on some backends
        return np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max()

    T = 300 if not on_cpu else 40
    for dtype, tol, H, K in ((jnp.float32, 2e-5, 8, 2), (jnp.bfloat16, 3e-2, 8, 8), (jnp.bfloat16, 3e-2, 16, 2)):
        q, k, v = rnd((2, T, H, 64), dtype, 1), rnd((2, T, K, 64), dtype, 2), rnd((2, T, K, 64), dtype, 3)
        f32 = lambda x: x.astype(jnp.float32)
        check(
            f"flash {jnp.dtype(dtype).name} T={T} H={H} K={K}",
            lambda: maxdiff(
                jax.jit(lambda q, k, v: flash_attention(q, k, v, interpret=interpret))(q, k, v),
                ref(f32(q), f32(k), f32(v)),
            ),
            tol,
        )
    q, k, v = rnd((1, T, 8, 64), jnp.float32, 4), rnd((1, T, 2, 64), jnp.float32, 5), rnd((1, T, 2, 64), jnp.float32, 6)
    seg = (jnp.arange(T)[None] >= T // 3).astype(jnp.int32)
    check(
        "flash segments+window",
        lambda: maxdiff(
            flash_attention(
                q, k, v, q_segment_ids_BT=seg, k_segment_ids_BS=seg, sliding_window=37, interpret=interpret
            ),
            ref(q, k, v, q_segment_ids_BT=seg, k_segment_ids_BS=seg, sliding_window=37),
        ),
        2e-5,
    )
    w = rnd(q.shape, jnp.float32, 7)
    g_rf = jax.jit(jax.grad(lambda q, k, v: jnp.sum(ref(q, k, v) * w), (0, 1, 2)))
    for bwd in ("pallas", "reference"):
        g_fl = jax.jit(
            jax.grad(
                lambda q, k, v: jnp.sum(flash_attention(q, k, v, interpret=interpret, backward=bwd) * w), (0, 1, 2)
            )
        )
        check(
            f"flash grads backward={bwd}",
            lambda: max(float(maxdiff(a, b)) for a, b in zip(g_fl(q, k, v), g_rf(q, k, v))),
            1e-4,
        )

    S = 4096 if not on_cpu else 256
    for dtype, tol, H, K in ((jnp.float32, 2e-5, 8, 2), (jnp.bfloat16, 3e-2, 8, 8), (jnp.bfloat16, 3e-2, 32, 4)):
        q, k, v = rnd((3, 1, H, 128), dtype, 8), rnd((3, S, K, 128), dtype, 9), rnd((3, S, K, 128), dtype, 10)
        pos = jnp.array([[5], [S // 2 + 3], [S - 1]])
        f32 = lambda x: x.astype(jnp.float32)
        check(
            f"decode {jnp.dtype(dtype).name} S={S} H={H} K={K}",
            lambda: maxdiff(
                jax.jit(lambda q, k, v, p: dense_decode(q, k, v, q_positions_BT=p, interpret=interpret))(q, k, v, pos),
                ref(f32(q), f32(k), f32(v), q_positions_BT=pos),
            ),
            tol,
        )
        # the dense KV cache's own layout: head-major [B, K, S, D] (one contiguous [S, D] block per head)
        kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        check(
            f"decode head-major {jnp.dtype(dtype).name} S={S} H={H} K={K}",
            lambda: maxdiff(
                jax.jit(
                    lambda q, k, v, p: dense_decode(q, k, v, q_positions_BT=p, interpret=interpret, kv_layout="BKSD")
                )(q, kh, vh, pos),
                ref(f32(q), f32(k), f32(v), q_positions_BT=pos),
            ),
            tol,
        )
    q, k, v = (
        rnd((2, 1, 8, 128), jnp.float32, 11),
        rnd((2, S, 2, 128), jnp.float32, 12),
        rnd((2, S, 2, 128), jnp.float32, 13),
    )
    kq, ks = quantize_int8(k)
    vq, vs = quantize_int8(v)
    src = scaled_int8_source(kq, ks, vq, vs)
    qg = q.reshape(2, 2, 4, 128)
    lens = jnp.array([S, S // 3])
    check(
        "decode int8 KVSource",
        lambda: maxdiff(
            decode_attention(qg, src, lens, interpret=interpret), jax.jit(decode_attention_reference)(qg, src, lens)
        ),
        2e-5,
    )

    # CateKV: Pallas decode over both parts == jnp path
    cfg = ModelConfig(vocab_size=8, d_model=10 * 2 * 128, n_layers=1, n_heads=20, n_kv_heads=10, head_dim=128, d_ff=8)
    N = 8192 if not on_cpu else 600
    ccfg = CateKVConfig(budget=2048 if not on_cpu else 64 + 256 + 64)
    mask = np.zeros((1, 10), bool)
    mask[0, :4] = True
    cache = init_catekv_cache(cfg, 1, N + 128, mask, catekv_cfg=ccfg, max_new_tokens=128).layer(0)
    k, v = rnd((1, N, 10, 128), jnp.float32, 14), rnd((1, N, 10, 128), jnp.float32, 15)
    cache = jax.jit(lambda c, ql, k, v: c.fill(ql, k, v, jnp.array([N])))(
        cache, rnd((1, 64, 20, 128), jnp.float32, 16), k, v
    )
    q, pos = rnd((1, 1, 20, 128), jnp.float32, 17), jnp.array([[N - 1]])
    check(
        "catekv attend pallas==ref",
        lambda: maxdiff(
            cache.attend(q, pos, impl="pallas", interpret=interpret),
            jax.jit(lambda c, q, p: c.attend(q, p))(cache, q, pos),
        ),
        2e-5,
    )
    # CateKV ragged pools: 3 layers with 4 / 1 / 0 adaptive heads; layer 1's windows hold neighbours'
    # heads, which must be ignored by the Pallas path as by the jnp path
    cfg3 = cfg.replace(n_layers=3)
    mask3 = np.zeros((3, 10), bool)
    mask3[0, :4] = True
    mask3[1, 7] = True
    cache3 = init_catekv_cache(cfg3, 1, N + 128, mask3, catekv_cfg=ccfg, max_new_tokens=128)
    fill = jax.jit(lambda c, i, ql, k, v: c.with_layer(i, c.layer(i).fill(ql, k, v, jnp.array([N]))))
    for i in range(3):
        cache3 = fill(
            cache3,
            i,
            rnd((1, 64, 20, 128), jnp.float32, 20 + i),
            rnd((1, N, 10, 128), jnp.float32, 30 + i),
            rnd((1, N, 10, 128), jnp.float32, 40 + i),
        )
    layer1 = cache3.layer(1)
    check(
        "catekv ragged pools attend pallas==ref",
        lambda: maxdiff(
            layer1.attend(q, pos, impl="pallas", interpret=interpret),
            jax.jit(lambda c, q, p: c.attend(q, p))(layer1, q, pos),
        ),
        2e-5,
    )
    return failures


if __name__ == "__main__":
    sys.exit(main())
