"""Quantizers, int4 packing, Hadamard, GPTQ and the three Pallas kernels of FlatQuant W4A4KV4
(interpret mode on CPU) against their jnp references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.ops.quant import gptq, hadamard
from pallasite.ops.quant.int_gemm import int_gemm, pack_weight_int4, unpack_weight_int4
from pallasite.ops.quant.kron_quant import kron_quantize, kron_transform_ref, round_half_even
from pallasite.ops.quant.kv4_attention import kv4_decode_attention
from pallasite.ops.quant.quantizers import (
    dequantize_kv_asym,
    fake_quant_act_sym,
    pack_int4,
    quantize_act_sym,
    quantize_kv_asym,
    quantize_weight_sym,
    unpack_int4,
)


def test_pack_unpack_roundtrip_signed_and_unsigned():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.integers(-8, 8, (5, 7, 34)), jnp.int8)
    p = pack_int4(q)
    assert p.dtype == jnp.uint8 and p.shape == (5, 7, 17)
    np.testing.assert_array_equal(unpack_int4(p), q)
    # layout: element 2j in the low nibble
    assert int(pack_int4(jnp.array([1, -2], jnp.int8))[0]) == (1 | (0xE << 4))
    u = jnp.asarray(rng.integers(0, 16, (3, 10)), jnp.uint8)
    np.testing.assert_array_equal(unpack_int4(pack_int4(u), signed=False), u)
    with pytest.raises(ValueError, match="must be even"):
        pack_int4(jnp.zeros((3,), jnp.int8))


def test_quantizer_ranges_and_definitions():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((6, 32)) * 3, jnp.float32)
    q, s = quantize_act_sym(x)
    assert int(q.min()) >= -8 and int(q.max()) <= 7
    np.testing.assert_allclose(s[:, 0], jnp.max(jnp.abs(x), axis=1) / 7, rtol=1e-6)
    # learned clip: sigmoid(4) shrinks the range, values beyond it saturate at the ends
    qc, sc = quantize_act_sym(x, jnp.array([4.0, 4.0]))
    np.testing.assert_allclose(sc[:, 0], jnp.max(jnp.abs(x), axis=1) * jax.nn.sigmoid(4.0) / 7, rtol=1e-6)
    # all-zero rows get scale 1 (official), not NaN
    assert float(quantize_act_sym(jnp.zeros((1, 8)))[1][0, 0]) == 1.0
    # weights: per output channel = per column of the [in, out] kernel
    w = jnp.asarray(rng.standard_normal((16, 5)), jnp.float32)
    qw, sw = quantize_weight_sym(w)
    np.testing.assert_allclose(sw, jnp.max(jnp.abs(w), axis=0) / 7, rtol=1e-6)
    assert int(qw.min()) >= -8 and int(qw.max()) <= 7
    # STE: the fake quantizer passes gradients straight through round()
    g = jax.grad(lambda a: jnp.sum(fake_quant_act_sym(a) * 0 + fake_quant_act_sym(a)))(x)
    assert jnp.all(jnp.isfinite(g)) and float(jnp.abs(g).sum()) > 0


def test_kv_asym_per_group_roundtrip():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 4, 2, 256)), jnp.float32)
    q, s, z = quantize_kv_asym(x, group=128)
    assert q.dtype == jnp.uint8 and s.shape == (3, 4, 2, 2) and int(q.max()) <= 15
    assert jnp.all((z >= 0) & (z <= 15))
    err = jnp.abs(dequantize_kv_asym(q, s, z, group=128) - x)
    # rounding error of an asymmetric grid is at most one step (half a step plus the zero-point rounding)
    assert float(np.max(err / jnp.repeat(s, 128, axis=-1))) <= 1.0 + 1e-5


def test_round_half_even_matches_jnp_round():
    z = jnp.concatenate([jnp.arange(-20, 21) * 0.5, jnp.linspace(-9, 9, 1001)])
    np.testing.assert_array_equal(round_half_even(z), jnp.round(z))


def test_kronecker_identity_and_factor_rule():
    from pallasite.models.quantized import decompose_dim

    assert decompose_dim(4096) == (64, 64) and decompose_dim(14336) == (112, 128)
    assert decompose_dim(11008) == (86, 128) and decompose_dim(576) == (24, 24) and decompose_dim(1536) == (32, 48)
    rng = np.random.default_rng(3)
    for n1, n2 in [(24, 24), (4, 8), (3, 5)]:
        p1, p2 = rng.standard_normal((n1, n1)), rng.standard_normal((n2, n2))
        x = rng.standard_normal((7, n1 * n2))
        with jax.enable_x64(True):
            y = kron_transform_ref(jnp.asarray(x), jnp.asarray(p1), jnp.asarray(p2))
            np.testing.assert_allclose(np.asarray(y), x @ np.kron(p1, p2), atol=1e-12)
        # a column-major reshape (or swapped factors) is NOT the same map
        assert not np.allclose(x @ np.kron(p2, p1), x @ np.kron(p1, p2))


def _hadamard_pair(n1, n2, seed=0):
    # ±1 Hadamard factors times powers of two: every product and sum in the kernel is exact in f32
    return (jnp.asarray(hadamard.hadamard_matrix(n1) * 0.25, jnp.float32),
            jnp.asarray(hadamard.hadamard_matrix(n2) * 0.5, jnp.float32))


@pytest.mark.parametrize("T,n1,n2", [(19, 12, 16), (5, 24, 24)])
def test_kron_quantize_pallas_equals_reference_exact(T, n1, n2):
    p1, p2 = _hadamard_pair(n1, n2)
    rng = np.random.default_rng(T)
    x = jnp.asarray(rng.integers(-64, 64, (T, n1 * n2)) / 8.0, jnp.float32)  # dyadic: exact arithmetic
    clip = jnp.array([4.0, 2.5])
    q_ref, s_ref = kron_quantize(x, p1, p2, clip, impl="ref")
    q_pal, s_pal = kron_quantize(x, p1, p2, clip, impl="pallas", interpret=True)
    assert q_pal.shape == (T, n1 * n2 // 2) and q_pal.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(q_pal), np.asarray(q_ref))
    np.testing.assert_allclose(np.asarray(s_pal), np.asarray(s_ref), rtol=1e-6)
    # and the reference is the documented composition: transform, then per-token quantizer, then pack
    q2, s2 = quantize_act_sym(kron_transform_ref(x, p1, p2), clip)
    np.testing.assert_array_equal(np.asarray(pack_int4(q2)), np.asarray(q_ref))


def test_kron_quantize_pallas_random_floats_and_odd_factor():
    rng = np.random.default_rng(7)
    n1, n2 = 9, 64  # o_proj-like factors (9 heads × head_dim 64): the left factor is padded to 16
    p1, p2 = rng.standard_normal((n1, n1)) / 3, rng.standard_normal((n2, n2)) / 8
    x = jnp.asarray(rng.standard_normal((3, 13, n1 * n2)), jnp.float32)
    q_ref, s_ref = kron_quantize(x, jnp.asarray(p1, jnp.float32), jnp.asarray(p2, jnp.float32), impl="ref")
    q_pal, s_pal = kron_quantize(x, jnp.asarray(p1, jnp.float32), jnp.asarray(p2, jnp.float32), impl="pallas")
    assert q_pal.shape == (3, 13, n1 * n2 // 2) and s_pal.shape == (3, 13)
    np.testing.assert_allclose(s_pal, s_ref, rtol=1e-5)
    # float dots in another order may flip a value sitting on a rounding boundary: ≤ 1 code, rarely
    d = np.abs(np.asarray(unpack_int4(q_pal), np.int32) - np.asarray(unpack_int4(q_ref), np.int32))
    assert d.max() <= 1 and d.mean() < 1e-3


@pytest.mark.parametrize("T,K,N", [(37, 200, 70), (1, 64, 16)])
def test_int_gemm_pallas_equals_reference(T, K, N):
    rng = np.random.default_rng(K)
    xq = jnp.asarray(rng.integers(-8, 8, (T, K)), jnp.int8)
    wq = jnp.asarray(rng.integers(-8, 8, (K, N)), jnp.int8)
    xs = jnp.asarray(rng.uniform(0.1, 1, T), jnp.float32)
    ws = jnp.asarray(rng.uniform(0.1, 1, N), jnp.float32)
    b = jnp.asarray(rng.standard_normal(N), jnp.float32)
    wp = pack_weight_int4(wq)
    np.testing.assert_array_equal(unpack_weight_int4(wp), wq)
    acc = np.asarray(xq, np.int64) @ np.asarray(wq, np.int64)  # exact integer GEMM
    ones_t, ones_n = jnp.ones((T,), jnp.float32), jnp.ones((N,), jnp.float32)
    for impl in ("ref", "pallas"):  # with unit scales the output is the int32 accumulator: exact
        np.testing.assert_array_equal(np.asarray(int_gemm(pack_int4(xq), ones_t, wp, ones_n, impl=impl)), acc)
    ref = int_gemm(pack_int4(xq), xs, wp, ws, b, impl="ref")
    pal = int_gemm(pack_int4(xq), xs, wp, ws, b, impl="pallas", interpret=True)
    np.testing.assert_allclose(np.asarray(pal), np.asarray(ref), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ref), acc * np.asarray(xs)[:, None] * np.asarray(ws)[None] + np.asarray(b),
                               rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="packed K mismatch"):
        int_gemm(pack_int4(xq), xs, wp[:-1], ws)


def _random_kv4_cache(rng, B, K, S, Dh):
    k = jnp.asarray(rng.standard_normal((B, K, S, Dh)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, K, S, Dh)), jnp.float32)
    kq, ks, kz = quantize_kv_asym(k)
    vq, vs, vz = quantize_kv_asym(v)
    return pack_int4(kq), ks, kz.astype(jnp.uint8), pack_int4(vq), vs, vz.astype(jnp.uint8)


@pytest.mark.parametrize("window", [None, 9])
def test_kv4_decode_pallas_equals_reference(window):
    rng = np.random.default_rng(11)
    B, H, K, S, Dh = 3, 6, 2, 45, 32
    cache = _random_kv4_cache(rng, B, K, S, Dh)
    q = jnp.asarray(rng.standard_normal((B, 1, H, Dh)), jnp.float32)
    pos = jnp.array([[0], [17], [44]], jnp.int32)  # odd lengths incl. the first slot only
    ref = kv4_decode_attention(q, *cache, pos, sliding_window=window, impl="ref")
    pal = kv4_decode_attention(q, *cache, pos, sliding_window=window, impl="pallas", interpret=True)
    np.testing.assert_allclose(np.asarray(pal), np.asarray(ref), atol=2e-6)


def test_hadamard_matrices():
    for n in (12, 24, 48, 64, 576, 1536):
        H = hadamard.hadamard_matrix(n).astype(np.float64)  # ±1 entries: float64 BLAS is exact here
        np.testing.assert_array_equal(H @ H.T, n * np.eye(n))
    R = hadamard.random_hadamard(24, seed=3)
    np.testing.assert_allclose(R @ R.T, np.eye(24), atol=1e-12)
    with pytest.raises(ValueError, match="order 9"):
        hadamard.hadamard_matrix(9)


def test_gptq_beats_rtn_on_correlated_inputs():
    rng = np.random.default_rng(5)
    n_in, n_out, n = 64, 32, 512
    mix = rng.standard_normal((n_in, n_in))
    x = rng.standard_normal((n, n_in)) @ mix  # strongly correlated input channels
    w = rng.standard_normal((n_in, n_out))
    qg, sg = gptq.gptq_quantize(w, gptq.hessian_from_inputs(x), blocksize=16)
    qr, sr = quantize_weight_sym(jnp.asarray(w))
    np.testing.assert_allclose(sg, np.asarray(sr), rtol=1e-5)  # same per-channel grid
    err = lambda q, s: float(np.mean((x @ (np.asarray(q, np.float64) * np.asarray(s)) - x @ w) ** 2))  # noqa: E731
    assert err(qg, sg) < 0.7 * err(qr, sr)
    assert qg.min() >= -8 and qg.max() <= 7


def test_kv4_cache_plugs_into_shared_decode_kernel():
    """The 4-bit cache as a KVSource of ops/attention/decode.py == this module's kernel."""
    decode = pytest.importorskip("pallasite.ops.attention.decode")
    from pallasite.ops.quant.kv4_attention import kv4_source

    rng = np.random.default_rng(12)
    B, H, K, S, Dh = 2, 6, 2, 40, 32
    cache = _random_kv4_cache(rng, B, K, S, Dh)
    q = jnp.asarray(rng.standard_normal((B, 1, H, Dh)), jnp.float32)
    pos = jnp.array([[5], [39]], jnp.int32)
    ours = kv4_decode_attention(q, *cache, pos, impl="ref")
    src = kv4_source(*cache)
    q_bkgd = q.reshape(B, K, H // K, Dh)
    for fn in (decode.decode_attention_reference, decode.decode_attention):
        out = fn(q_bkgd, src, pos[:, 0] + 1, block_k=16, k_splits=2)
        np.testing.assert_allclose(np.asarray(out).reshape(B, 1, H, Dh), np.asarray(ours), atol=2e-6)


def test_quant_ppl_fp_model_half_precision_rows():
    """benchmarks/quant_ppl.py ``--fp-dtypes``: ``fp_model(cfg, pure, "float32")`` gives the original
    model's logits bit-exactly; bfloat16/float16 store parameters in that dtype and compute in it
    (logits close to float32 but not equal — the negative control that the dtype is really used);
    an unknown dtype is named."""
    from flax import nnx

    from pallasite.benchmarks.quant_ppl import fp_model
    from pallasite.models.config import ModelConfig
    from pallasite.models.transformer import forward, init_model

    cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    graphdef, state = nnx.split(init_model(cfg, seed=3))
    pure = nnx.to_pure_dict(state)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12)), jnp.int32)
    ref = np.asarray(forward(graphdef, state, ids)[0])
    np.testing.assert_array_equal(np.asarray(forward(*fp_model(cfg, pure, "float32"), ids)[0]), ref)
    for dtype, tol in (("bfloat16", 0.05), ("float16", 0.01)):
        g, s = fp_model(cfg, pure, dtype)
        assert {str(a.dtype) for a in jax.tree.leaves(s)} == {dtype}
        out = np.asarray(forward(g, s, ids)[0])
        assert out.dtype == np.float32  # logits are float32 for the perplexity's log-softmax
        err = np.max(np.abs(out - ref)) / np.max(np.abs(ref))
        assert 0 < err < tol, (dtype, err)
        # the compute dtype is used too, not only the storage: float32 compute on the same rounded
        # weights gives different logits
        g32, _ = nnx.split(init_model(cfg.replace(param_dtype=dtype), seed=3))
        assert not np.array_equal(np.asarray(forward(g32, s, ids)[0]), out), dtype
    with pytest.raises(ValueError, match="'int8'"):
        fp_model(cfg, pure, "int8")
