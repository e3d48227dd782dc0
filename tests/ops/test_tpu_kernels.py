"""Every TPU (Mosaic) kernel variant against its jnp reference in the TPU interpreter on CPU.

``pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", num_cores_or_threads=2)``:
the interpreter simulates VMEM, DMAs and the grid on two cores (megacore: "parallel" grid axes
are split between them), flags races (e.g. two cores writing one output block) and fills
uninitialised buffers with NaN, so an output block a kernel forgets to write (or a scratch read
before its init) makes these comparisons fail; the ``no_races`` fixture fails a test in which the
race detector flagged any kernel (it keeps the flag across the kernels of one op). Shapes are the
odd ones of the GPU-path tests (not multiples of the blocks, GQA ratios 2-4, empty groups); grids
are kept to tens of steps (the interpreter costs ~0.1 s per step here).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpreter

from pallasite.ops import dispatch
from pallasite.ops.attention import decode_attention_dense, flash_attention, reference_attention
from pallasite.ops.attention.decode import decode_attention, decode_attention_reference
from pallasite.ops.attention.kv_source import (
    KVSource,
    dense_source,
    pooled_source,
    quantize_int8,
    scaled_int8_source,
)
from pallasite.ops.gmm import gmm, gmm_pallas, gmm_reference, tgmm_pallas, tgmm_reference
from pallasite.ops.quant import hadamard
from pallasite.ops.quant.int_gemm import int_gemm, pack_weight_int4
from pallasite.ops.quant.kron_quant import kron_quantize
from pallasite.ops.quant.kv4_attention import kv4_decode_attention
from pallasite.ops.quant.quantizers import pack_int4, quantize_kv_asym, unpack_int4

TPU = dispatch.tpu_interpret_params(
    num_cores_or_threads=2
)  # "parallel" axes split over 2 cores (v5p)
F32_TOL = 2e-5


@pytest.fixture(autouse=True)
def no_races(monkeypatch):
    """The interpreter resets its race state per kernel; record every detection instead."""
    found = []

    class Recording(tpu_interpreter.RaceDetectionState):
        @property
        def races_found(self):
            return bool(found)

        @races_found.setter
        def races_found(self, value):
            if value:
                found.append(True)

    monkeypatch.setattr(tpu_interpreter, "RaceDetectionState", Recording)
    yield
    assert not found, "the TPU interpreter detected a data race (see the printed report)"


def _normal(seed, *shapes, dtype=jnp.float32):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def _close(a, b, atol=F32_TOL):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=atol)


# ----------------------------------------------------------------------------- flash attention
def test_flash_tpu_forward_and_gradients_gqa_padding_segments_window():
    """T = 37 (padded to 48 rows, 128 keys), D = 24, GQA 2, two packed documents, a padded row,
    a sliding window: values and dq, dk, dv equal the reference's (rows that see a key)."""
    B, T, H, K, D = 2, 37, 4, 2, 24
    q, k, v, w = _normal(1, (B, T, H, D), (B, T, K, D), (B, T, K, D), (B, T, H, D))
    valid = jnp.arange(T)[None] < jnp.array([37, 23])[:, None]
    seg = jnp.where(jnp.arange(T)[None] < 15, 1, 2) * valid
    kw = dict(q_segment_ids_BT=seg, k_segment_ids_BS=seg, sliding_window=21, k_valid_BS=valid)
    rows = valid[
        :, :, None, None
    ]  # padded query rows see no key: kernel 0, reference a uniform mean

    flash = lambda q, k, v: flash_attention(q, k, v, block_q=16, interpret=TPU, **kw)  # noqa: E731
    out, vjp = jax.vjp(flash, q, k, v)  # one forward, one backward
    ref, ref_vjp = jax.vjp(lambda q, k, v: reference_attention(q, k, v, **kw), q, k, v)
    _close(out * rows, ref * rows)
    grads, ref_grads = vjp(w * rows), ref_vjp(w * rows)
    for a, b in zip(grads, ref_grads):
        _close(a, b, atol=2e-5)
    assert np.abs(np.asarray(grads[1])).max() > 0.1  # non-trivial gradients


def test_flash_tpu_skips_fully_masked_key_blocks_prefill_into_cache():
    """12 queries at positions 200..211 over a 384-slot cache, window 40: only key block 1 (of 3)
    is visible. Values in the other blocks are NaN: a kernel that did not skip them (wrong
    scalar-prefetched range) would return NaN, one that skipped a needed block would differ."""
    B, T, S, H, K, D = 1, 12, 384, 4, 2, 16
    q, k, v = _normal(2, (B, T, H, D), (B, S, K, D), (B, S, K, D))
    qpos = jnp.arange(200, 212)[None]
    ref = reference_attention(q, k, v, q_positions_BT=qpos, sliding_window=40)
    outside = (jnp.arange(S) < 128) | (jnp.arange(S) >= 256)
    v_nan = jnp.where(outside[None, :, None, None], jnp.nan, v)
    out = flash_attention(
        q, k, v_nan, q_positions_BT=qpos, sliding_window=40, interpret=TPU, kv_layout="BSKD"
    )
    assert np.isfinite(np.asarray(out)).all()
    _close(out, ref)
    # head-major K/V (the dense cache's layout) read without a transpose: same numbers
    out_hm = flash_attention(
        q,
        jnp.swapaxes(k, 1, 2),
        jnp.swapaxes(v_nan, 1, 2),
        q_positions_BT=qpos,
        sliding_window=40,
        interpret=TPU,
        kv_layout="BKSD",
    )
    _close(out_hm, ref)


def test_flash_tpu_bf16():
    q, k, v = _normal(3, (1, 33, 8, 32), (1, 33, 2, 32), (1, 33, 2, 32), dtype=jnp.bfloat16)
    out = flash_attention(q, k, v, interpret=TPU)
    ref = reference_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    assert out.dtype == jnp.bfloat16
    _close(
        out, ref, atol=3e-2
    )  # numpy: XLA:CPU's max reduction can drop NaN (jnp.max(NaN...) = -inf)


# ----------------------------------------------------------------------------- decode
def _head_major(x):
    return jnp.swapaxes(x, 1, 2)


def test_decode_tpu_dense_splits_window_nan_poisoned_unused_slots():
    """Capacity 300 (3 blocks of 128, padded), 2 splits, GQA 4: rows at positions 0, 177, 299; the
    slots after each row's position are NaN (never written): they must be neither read into the
    result nor left unmasked. With a window the walk starts past block 0."""
    B, S, H, K, D = 3, 300, 8, 2, 32
    q, k, v = _normal(4, (B, 1, H, D), (B, S, K, D), (B, S, K, D))
    pos = jnp.array([[0], [177], [299]])
    unused = jnp.arange(S)[None, :, None, None] > pos[:, :, None, None]
    k_p, v_p = (
        _head_major(jnp.where(unused, jnp.nan, k)),
        _head_major(jnp.where(unused, jnp.nan, v)),
    )
    out = decode_attention_dense(
        q, k_p, v_p, q_positions_BT=pos, block_k=128, k_splits=2, kv_layout="BKSD", interpret=TPU
    )
    assert np.isfinite(np.asarray(out)).all()
    _close(out, reference_attention(q, k, v, q_positions_BT=pos))
    # one split walking 3 blocks from the window's first (block 1 for the last row)
    win = decode_attention_dense(
        q,
        k_p,
        v_p,
        q_positions_BT=pos,
        sliding_window=150,
        block_k=128,
        k_splits=1,
        kv_layout="BKSD",
        interpret=TPU,
    )
    _close(win, reference_attention(q, k, v, q_positions_BT=pos, sliding_window=150))


def test_decode_tpu_int8_and_pooled_sources():
    B, S, H, K, D = 2, 200, 6, 3, 32
    q, k, v, pool_k, pool_v = _normal(
        5, (B, 1, H, D), (B, S, K, D), (B, S, K, D), (B, 5, S, D), (B, 5, S, D)
    )
    qg = q.reshape(B, K, H // K, D)
    lens = jnp.array([200, 37])
    src = scaled_int8_source(
        *quantize_int8(_head_major(k)), *quantize_int8(_head_major(v)), kv_layout="BKSD"
    )
    out = decode_attention(qg, src, lens, interpret=TPU)
    _close(out, decode_attention_reference(qg, src, lens))
    assert (
        np.abs(np.asarray(out - decode_attention_reference(qg, dense_source(k, v), lens))).max()
        > 1e-4
    )
    # CateKV-style window: heads 2..4 of a 5-head pool, read in place (scalar-prefetched base)
    pooled = pooled_source(pool_k, pool_v, 2, K)
    out = decode_attention(qg, pooled, lens, interpret=TPU)
    _close(
        out,
        decode_attention_reference(qg, dense_source(pool_k[:, 2:], pool_v[:, 2:], "BKSD"), lens),
    )


def test_catekv_attend_tpu_full_and_sparse_parts():
    """CateKV's decode (adaptive heads over the full part, consistent heads over their kept
    entries, per-row sparse lengths) with the TPU decode kernel == its jnp path."""
    from pallasite.inference.cache.catekv import CateKVConfig, init_catekv_cache
    from pallasite.models.config import ModelConfig

    cfg = ModelConfig(vocab_size=8, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=8)
    ccfg = CateKVConfig(budget=40, init_tokens=8, recent_tokens=16, chunk_size=4, last_q=8, tail_tokens=8)
    N = 100
    layer = init_catekv_cache(cfg, 1, N + 28, np.array([[True, False]]), catekv_cfg=ccfg,
                              max_new_tokens=4).layer(0)
    q_last, k, v, q = _normal(8, (1, 8, 4, 16), (1, N, 2, 16), (1, N, 2, 16), (1, 1, 4, 16))
    layer = layer.fill(q_last, k, v, jnp.array([N]))
    pos = jnp.array([[N - 1]])
    _close(layer.attend(q, pos, impl="pallas", interpret=TPU), layer.attend(q, pos))


@pytest.mark.parametrize("window", [None, 9])
def test_kv4_decode_tpu(window):
    rng = np.random.default_rng(11)
    B, H, K, S, Dh = 3, 6, 2, 45, 32
    kv = [jnp.asarray(rng.standard_normal((B, K, S, Dh)), jnp.float32) for _ in range(2)]
    (kq, ks, kz), (vq, vs, vz) = quantize_kv_asym(kv[0]), quantize_kv_asym(kv[1])
    cache = (pack_int4(kq), ks, kz.astype(jnp.uint8), pack_int4(vq), vs, vz.astype(jnp.uint8))
    q = jnp.asarray(rng.standard_normal((B, 1, H, Dh)), jnp.float32)
    pos = jnp.array([[0], [17], [44]], jnp.int32)
    ref = kv4_decode_attention(q, *cache, pos, sliding_window=window, impl="ref")
    out = kv4_decode_attention(q, *cache, pos, sliding_window=window, impl="pallas", interpret=TPU)
    _close(out, ref, atol=2e-6)


def test_tpu_fallbacks_are_logged_once_and_use_the_reference(caplog):
    """A source without a TPU codec, and a 4-bit cache with two quantization groups per head: the
    TPU path logs one warning naming the kernel and the shapes, then runs the reference."""
    dispatch.reset_fallback_warnings()
    B, S, K, G, D = 1, 64, 2, 2, 16
    q, k, v = _normal(6, (B, K, G, D), (B, K, S, D), (B, K, S, D))
    plain = dense_source(k, v, "BKSD")
    bare = KVSource(arrays=plain.arrays, load=plain.load, head_dim=D, kv_layout="BKSD")  # no codec
    with caplog.at_level(logging.WARNING, logger="pallasite.ops"):
        for _ in range(2):
            out = decode_attention(q, bare, jnp.array([40]), interpret=TPU)
    _close(out, decode_attention_reference(q, plain, jnp.array([40])))
    msgs = [r.getMessage() for r in caplog.records if "no TPU codec" in r.getMessage()]
    assert len(msgs) == 1 and "(2, 64" not in msgs[0] and "arrays=[(1, 2, 64, 16)" in msgs[0], msgs

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 1, 8, 256)), jnp.float32)  # Dh 256: two groups of 128
    (kq, ks, kz), (vq, vs, vz) = quantize_kv_asym(x), quantize_kv_asym(-x)
    cache = (pack_int4(kq), ks, kz.astype(jnp.uint8), pack_int4(vq), vs, vz.astype(jnp.uint8))
    qq = jnp.asarray(rng.standard_normal((1, 1, 2, 256)), jnp.float32)
    pos = jnp.array([[5]])
    with caplog.at_level(logging.WARNING, logger="pallasite.ops"):
        out = kv4_decode_attention(qq, *cache, pos, impl="pallas", interpret=TPU)
    _close(out, kv4_decode_attention(qq, *cache, pos, impl="ref"), atol=1e-6)
    assert any(
        "kv4_decode_attention" in r.getMessage() and "groups=2" in r.getMessage()
        for r in caplog.records
    )


# ----------------------------------------------------------------------------- grouped matmul
@pytest.mark.parametrize("M,K,N,gs", [(37, 24, 40, [7, 0, 13, 9, 5]), (50, 20, 18, [0, 0, 50])])
def test_gmm_tpu_forward_tgmm_and_vjp(M, K, N, gs):
    x, w, dy = _normal(M, (M, K), (len(gs), K, N), (M, N))
    gs = jnp.asarray(gs, jnp.int32)
    _close(gmm_pallas(x, w, gs, block_m=16, interpret=TPU), gmm_reference(x, w, gs))
    _close(tgmm_pallas(x, dy, gs, block_m=16, interpret=TPU), tgmm_reference(x, dy, gs))

    def loss(impl, **kw):
        return lambda x, w: jnp.sum(jnp.sin(gmm(x, w, gs, impl=impl, **kw)) * dy)

    g_ref = jax.grad(loss("ref"), argnums=(0, 1))(x, w)
    g_tpu = jax.grad(loss("pallas", block_m=16, interpret=TPU), argnums=(0, 1))(x, w)
    for a, b in zip(g_tpu, g_ref):
        _close(a, b, atol=5e-5)


# ----------------------------------------------------------------------------- FlatQuant kernels
@pytest.mark.parametrize("T,n1,n2", [(19, 12, 16), (37, 24, 24)])
def test_kron_quantize_tpu_exact_on_dyadic_inputs(T, n1, n2):
    p1 = jnp.asarray(hadamard.hadamard_matrix(n1) * 0.25, jnp.float32)
    p2 = jnp.asarray(hadamard.hadamard_matrix(n2) * 0.5, jnp.float32)
    x = jnp.asarray(np.random.default_rng(T).integers(-64, 64, (T, n1 * n2)) / 8.0, jnp.float32)
    clip = jnp.array([4.0, 2.5])
    q_ref, s_ref = kron_quantize(x, p1, p2, clip, impl="ref")
    q_tpu, s_tpu = kron_quantize(x, p1, p2, clip, impl="pallas", interpret=TPU)
    np.testing.assert_array_equal(np.asarray(q_tpu), np.asarray(q_ref))
    np.testing.assert_allclose(np.asarray(s_tpu), np.asarray(s_ref), rtol=1e-6)


def test_kron_quantize_tpu_random_floats_odd_left_factor():
    rng = np.random.default_rng(7)
    p1 = jnp.asarray(rng.standard_normal((9, 9)) / 3, jnp.float32)  # padded to 16 rows
    p2 = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 13, 9 * 64)), jnp.float32)
    q_ref, s_ref = kron_quantize(x, p1, p2, impl="ref")
    q_tpu, s_tpu = kron_quantize(x, p1, p2, impl="pallas", interpret=TPU)
    np.testing.assert_allclose(s_tpu, s_ref, rtol=1e-5)
    d = np.abs(np.asarray(unpack_int4(q_tpu), np.int32) - np.asarray(unpack_int4(q_ref), np.int32))
    assert d.max() <= 1 and d.mean() < 1e-3  # float dots in another order may flip a boundary value


@pytest.mark.parametrize("T,K,N", [(37, 200, 70), (1, 64, 16)])
def test_int_gemm_tpu(T, K, N):
    rng = np.random.default_rng(K)
    xq = jnp.asarray(rng.integers(-8, 8, (T, K)), jnp.int8)
    wq = jnp.asarray(rng.integers(-8, 8, (K, N)), jnp.int8)
    xs, ws = (jnp.asarray(rng.uniform(0.1, 1, n), jnp.float32) for n in (T, N))
    b = jnp.asarray(rng.standard_normal(N), jnp.float32)
    xp, wp = pack_int4(xq), pack_weight_int4(wq)
    acc = np.asarray(xq, np.int64) @ np.asarray(wq, np.int64)  # exact integer GEMM
    ones = int_gemm(xp, jnp.ones((T,)), wp, jnp.ones((N,)), impl="pallas", interpret=TPU)
    np.testing.assert_array_equal(np.asarray(ones), acc)
    _close(
        int_gemm(xp, xs, wp, ws, b, impl="pallas", interpret=TPU),
        int_gemm(xp, xs, wp, ws, b, impl="ref"),
        atol=1e-5,
    )


# ----------------------------------------------------------------------------- dispatch
def test_pick_variant_by_platform_and_interpret_argument():
    assert dispatch.pick_variant(TPU) == dispatch.Variant("tpu", TPU)
    assert dispatch.pick_variant(None) == dispatch.Variant(
        "gpu", True
    )  # CPU: the generic interpreter
    assert dispatch.pick_variant(True).kind == "gpu"
    with dispatch.target_platform("tpu"):
        assert dispatch.pick_variant(None) == dispatch.Variant("tpu", False)
    with dispatch.target_platform("gpu"):
        assert dispatch.pick_variant(False) == dispatch.Variant("gpu", False)
        assert dispatch.triton_params(False) is not None and dispatch.triton_params(True) is None
    with pytest.raises(ValueError, match="compiled Pallas kernels need a TPU or GPU"):
        dispatch.pick_variant(False)
    with pytest.raises(ValueError, match="target_platform"):
        with dispatch.target_platform("npu"):
            pass
