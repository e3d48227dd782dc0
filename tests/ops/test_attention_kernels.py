"""Pallas flash / decode attention (interpret mode on CPU) against the jnp reference.

Tolerances: float32 inputs 2e-5 absolute (observed ~1e-6); bfloat16 inputs 3e-2 absolute on
outputs of unit scale (bf16 has 8 mantissa bits; both paths accumulate in float32 but round
their inputs/probabilities differently).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.ops.attention import attention, reference_attention
from pallasite.ops.attention.decode import (
    KVSource,
    decode_attention,
    decode_attention_reference,
    dense_decode,
    dense_source,
    quantize_int8,
    scaled_int8_source,
)
from pallasite.ops.attention.flash import flash_attention

F32_TOL = 2e-5
BF16_TOL = 3e-2


def _qkv(B, T, S, H, K, D, dtype=jnp.float32, seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (B, T, H, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, K, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, K, D), jnp.float32).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("H,K", [(4, 4), (8, 2), (8, 1)])  # GQA ratios 1, 4, 8
def test_flash_matches_reference_causal_odd_lengths_gqa(H, K):
    # T = S = 37: not a multiple of the 16-blocks; D = 24: padded to 32 inside.
    q, k, v = _qkv(2, 37, 37, H, K, 24, seed=H * 10 + K)
    out = flash_attention(q, k, v, block_q=16, block_k=16)
    ref = reference_attention(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=F32_TOL)


def test_flash_batch_with_different_lengths_padding_segments_window():
    B, T, H, K, D = 2, 40, 4, 2, 16
    q, k, v = _qkv(B, T, T, H, K, D, seed=3)
    lengths = jnp.array([40, 23])
    valid = jnp.arange(T)[None] < lengths[:, None]
    seg = jnp.where(jnp.arange(T)[None] < 15, 1, 2) * valid  # two packed docs, pad = segment 0
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    kw = dict(q_positions_BT=pos, k_positions_BS=pos, q_segment_ids_BT=seg, k_segment_ids_BS=seg,
              k_valid_BS=valid, sliding_window=9)
    out = flash_attention(q, k, v, block_q=16, block_k=16, **kw)
    ref = reference_attention(q, k, v, **kw)
    rows = np.asarray(valid)  # padded query rows see no key: kernel gives 0, reference a uniform mean
    np.testing.assert_allclose(np.asarray(out)[rows], np.asarray(ref)[rows], atol=F32_TOL)


def test_flash_prefill_into_cache_positions_and_block_skipping():
    # 12 new tokens at positions 50..61 against a 64-slot cache: q block sees only a prefix of K.
    B, T, S, H, K, D = 1, 12, 64, 4, 2, 16
    q, k, v = _qkv(B, T, S, H, K, D, seed=4)
    qpos = jnp.arange(50, 62)[None]
    out = flash_attention(q, k, v, q_positions_BT=qpos, block_q=16, block_k=16)
    ref = reference_attention(q, k, v, q_positions_BT=qpos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=F32_TOL)
    # negative control: keys beyond the query positions carry huge values; if the kernel failed
    # to mask (or skipped the wrong blocks) the output would differ by orders of magnitude.
    v_bad = v.at[:, 62:].set(1e4)
    out_bad = flash_attention(q, k, v_bad, q_positions_BT=qpos, block_q=16, block_k=16)
    np.testing.assert_allclose(np.asarray(out_bad), np.asarray(ref), atol=F32_TOL)


def test_flash_bf16_tolerance():
    q, k, v = _qkv(1, 33, 33, 8, 2, 32, dtype=jnp.bfloat16, seed=5)
    out = flash_attention(q, k, v, block_q=16, block_k=16)
    ref = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    assert out.dtype == jnp.bfloat16
    err = np.abs(np.asarray(out, np.float32) - np.asarray(ref)).max()  # numpy: XLA:CPU's max can drop NaN
    assert err < BF16_TOL, err


@pytest.mark.parametrize("backward", ["pallas", "reference"])
def test_flash_gradients_equal_reference(backward):
    B, T, H, K, D = 2, 40, 8, 2, 24  # odd length and head dim, GQA 4, padding + segments + window
    q, k, v = _qkv(B, T, T, H, K, D, seed=6)
    valid = jnp.arange(T)[None] < jnp.array([40, 23])[:, None]
    seg = jnp.where(jnp.arange(T)[None] < 15, 1, 2) * valid
    kw = dict(q_segment_ids_BT=seg, k_segment_ids_BS=seg, sliding_window=21)
    w = jax.random.normal(jax.random.PRNGKey(9), q.shape)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

    flash = lambda q, k, v: flash_attention(q, k, v, block_q=16, block_k=16, backward=backward, **kw)
    g_flash = jax.jit(jax.grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.grad(loss(lambda q, k, v: reference_attention(q, k, v, **kw)), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_flash, g_ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert float(jnp.max(jnp.abs(g_flash[1]))) > 0.1  # non-trivial gradients


def test_attention_dispatch_pallas_and_bad_impl():
    q, k, v = _qkv(1, 17, 17, 4, 2, 16, seed=7)
    out = attention(q, k, v, impl="pallas")
    np.testing.assert_allclose(np.asarray(out), np.asarray(attention(q, k, v, impl="ref")), atol=F32_TOL)
    with pytest.raises(ValueError, match="impl"):
        attention(q, k, v, impl="cuda")
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2))


@pytest.mark.parametrize("H,K", [(4, 4), (8, 2), (8, 1)])
def test_decode_matches_reference_rows_at_different_lengths(H, K):
    B, S, D = 3, 150, 32  # capacity 150 is not a multiple of block_k=32 -> padded
    q, k, v = _qkv(B, 1, S, H, K, D, seed=20 + H + K)
    pos = jnp.array([[0], [77], [149]])
    out = dense_decode(q, k, v, q_positions_BT=pos, block_k=32, k_splits=4)
    ref = reference_attention(q, k, v, q_positions_BT=pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=F32_TOL)


def test_decode_sliding_window_and_unused_slots_are_never_read():
    B, S, H, K, D = 2, 128, 4, 2, 16
    q, k, v = _qkv(B, 1, S, H, K, D, seed=30)
    pos = jnp.array([[40], [90]])
    # poison every slot after the row's position (unused cache) with NaN: a kernel that read or
    # failed to mask them would return NaN.
    poison = jnp.arange(S)[None, :, None, None] > pos[:, :, None, None]
    k_p, v_p = jnp.where(poison, jnp.nan, k), jnp.where(poison, jnp.nan, v)
    out = dense_decode(q, k_p, v_p, q_positions_BT=pos, sliding_window=16, block_k=16, k_splits=4)
    ref = reference_attention(q, k, v, q_positions_BT=pos, sliding_window=16)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=F32_TOL)


def _head_major(x_BSKD):
    return jnp.swapaxes(x_BSKD, 1, 2)  # [B, S, K, D] -> [B, K, S, D]


def test_reference_head_major_layout_equals_slot_major_and_flash():
    # prefill-shaped (T > 1) with sliding window: the same numbers from either K/V layout
    q, k, v = _qkv(2, 13, 29, 6, 2, 16, seed=60)
    pos = jnp.broadcast_to(jnp.arange(16, 29), (2, 13))
    ref = reference_attention(q, k, v, q_positions_BT=pos, sliding_window=9)
    hm = reference_attention(q, _head_major(k), _head_major(v), q_positions_BT=pos, sliding_window=9, kv_layout="BKSD")
    np.testing.assert_allclose(np.asarray(hm), np.asarray(ref), atol=1e-6)
    fl = attention(q, _head_major(k), _head_major(v), q_positions_BT=pos, sliding_window=9, impl="pallas",
                   kv_layout="BKSD")
    np.testing.assert_allclose(np.asarray(fl), np.asarray(ref), atol=F32_TOL)
    with pytest.raises(ValueError, match="kv_layout"):
        reference_attention(q, k, v, kv_layout="SBKD")
    # T == 1 over a head-major cache takes the 4-D decode einsums: same numbers, with every mask
    q1, pos1 = q[:, :1], jnp.array([[20], [28]])
    valid = jnp.arange(29)[None, :] % 5 != 3
    seg_q, seg_k = jnp.array([[1], [2]]), jnp.where(jnp.arange(29)[None, :] < 12, 1, 2).repeat(2, 0)
    kw = dict(q_positions_BT=pos1, sliding_window=11, k_valid_BS=valid, q_segment_ids_BT=seg_q, k_segment_ids_BS=seg_k)
    ref1 = reference_attention(q1, k, v, **kw)
    hm1 = reference_attention(q1, _head_major(k), _head_major(v), kv_layout="BKSD", **kw)
    np.testing.assert_allclose(np.asarray(hm1), np.asarray(ref1), atol=1e-6)
    assert float(jnp.max(jnp.abs(ref1 - reference_attention(q1, k, v, q_positions_BT=pos1)))) > 1e-2  # masks matter


@pytest.mark.parametrize("H,K", [(4, 4), (8, 2), (6, 3)])
def test_decode_kernel_reads_head_major_cache(H, K):
    """The Pallas decode kernel on the dense cache's [B, K, S, D] layout (interpret mode) == the
    reference over the same cache; unused slots are NaN-poisoned, capacity 150 is padded."""
    B, S, D = 3, 150, 32
    q, k, v = _qkv(B, 1, S, H, K, D, seed=70 + H + K)
    pos = jnp.array([[0], [77], [149]])
    poison = jnp.arange(S)[None, :, None, None] > pos[:, :, None, None]
    k_p, v_p = _head_major(jnp.where(poison, jnp.nan, k)), _head_major(jnp.where(poison, jnp.nan, v))
    ref = reference_attention(q, k, v, q_positions_BT=pos)
    out = dense_decode(q, k_p, v_p, q_positions_BT=pos, block_k=32, k_splits=4, kv_layout="BKSD")
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=F32_TOL)
    win = dense_decode(q, k_p, v_p, q_positions_BT=pos, sliding_window=20, block_k=16, k_splits=3, kv_layout="BKSD")
    np.testing.assert_allclose(np.asarray(win), np.asarray(reference_attention(q, k, v, q_positions_BT=pos,
                                                                               sliding_window=20)), atol=F32_TOL)
    # the jnp twin agrees in both layouts
    qg = q.reshape(B, K, H // K, D)
    hm = jax.jit(decode_attention_reference)(qg, dense_source(_head_major(k), _head_major(v), "BKSD"), pos[:, 0] + 1)
    sm = jax.jit(decode_attention_reference)(qg, dense_source(k, v), pos[:, 0] + 1)
    np.testing.assert_allclose(np.asarray(hm), np.asarray(sm), atol=1e-6)
    np.testing.assert_allclose(np.asarray(hm).reshape(B, 1, H, D), np.asarray(ref), atol=F32_TOL)


def test_decode_head_major_quantized_source_and_layout_errors():
    B, S, H, K, D = 2, 64, 4, 2, 16
    q, k, v = _qkv(B, 1, S, H, K, D, seed=80)
    kq, ks = quantize_int8(_head_major(k))
    vq, vs = quantize_int8(_head_major(v))
    qg = q.reshape(B, K, H // K, D)
    lens = jnp.array([64, 21])
    src = scaled_int8_source(kq, ks, vq, vs, kv_layout="BKSD")
    assert (src.capacity, src.n_kv_heads) == (S, K)
    out = decode_attention(qg, src, lens, block_k=16, k_splits=2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(decode_attention_reference)(qg, src, lens)),
                               atol=F32_TOL)
    sm = scaled_int8_source(*quantize_int8(k), *quantize_int8(v))  # same codes, slot-major
    np.testing.assert_allclose(np.asarray(out), np.asarray(decode_attention(qg, sm, lens, block_k=16, k_splits=2)),
                               atol=F32_TOL)
    # a slot-major cache declared head-major is refused (its K axis reads as 64 heads)
    with pytest.raises(ValueError, match="kv_layout=BKSD"):
        decode_attention(qg, dense_source(k, v, "BKSD"), lens)
    with pytest.raises(ValueError, match="kv_layout"):
        dense_source(k, v, "KBSD")


def test_dense_cache_layer_pallas_decode_equals_ref():
    """DenseKVCache.update_and_attend, one layer, T = 1: impl='pallas' (decode kernel on the
    head-major cache) == impl='ref', with a sliding window."""
    from pallasite.inference.cache import DenseKVCache

    B, S, H, K, D = 2, 40, 4, 2, 16
    q, k, v = _qkv(B, 1, S, H, K, D, seed=90)
    _, k_new, v_new = _qkv(B, 1, 1, H, K, D, seed=91)
    layer = DenseKVCache(k=_head_major(k), v=_head_major(v))
    pos = jnp.array([[5], [39]])
    outs = {impl: layer.update_and_attend(q, k_new, v_new, pos, sliding_window=12, impl=impl)
            for impl in ("ref", "pallas")}
    np.testing.assert_allclose(np.asarray(outs["pallas"][0]), np.asarray(outs["ref"][0]), atol=F32_TOL)
    np.testing.assert_array_equal(np.asarray(outs["pallas"][1].k), np.asarray(outs["ref"][1].k))


def test_decode_quantized_source_plugs_in():
    # The KVSource seam: an int8 cache with per-(token, head) scales, dequantised in-kernel.
    B, S, H, K, D = 2, 64, 8, 2, 16
    q, k, v = _qkv(B, 1, S, H, K, D, seed=40)
    kq, ks = quantize_int8(k)
    vq, vs = quantize_int8(v)
    src = scaled_int8_source(kq, ks, vq, vs)
    qg = q.reshape(B, K, H // K, D)
    lens = jnp.array([64, 31])
    out = decode_attention(qg, src, lens, block_k=16, k_splits=2)
    ref = jax.jit(decode_attention_reference)(qg, src, lens)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=F32_TOL)
    # and it is a real quantisation: close to, but not equal to, the float cache
    dense = jax.jit(decode_attention_reference)(qg, dense_source(k, v), lens)
    err = float(np.max(np.abs(out - dense)))
    assert 1e-4 < err < 0.1, err


def test_decode_empty_range_returns_zero_and_shape_errors():
    B, S, H, K, D = 1, 32, 2, 1, 16
    q, k, v = _qkv(B, 1, S, H, K, D, seed=50)
    out = decode_attention(q.reshape(B, K, H, D), dense_source(k, v), jnp.array([0]), block_k=16)
    assert float(np.max(np.abs(out))) == 0.0
    with pytest.raises(ValueError, match="does not match the cache"):
        decode_attention(q.reshape(B, K, H, D)[..., :8], dense_source(k, v), jnp.array([3]))
    assert isinstance(dense_source(k, v), KVSource)


@pytest.mark.slow  # two model compiles with interpret-mode kernels inside
def test_dense_cache_uses_decode_kernel_end_to_end():
    """Model decode with attention_impl='pallas' (flash prefill + decode kernel) == ref impl."""
    from flax import nnx

    from pallasite.inference.cache import init_dense_cache
    from pallasite.models.config import ModelConfig
    from pallasite.models.transformer import forward, init_model

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    graphdef, state = nnx.split(init_model(cfg, seed=1))
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 10), 0, 64)
    outs = {}
    for impl in ("ref", "pallas"):
        gd = nnx.split(init_model(cfg.replace(attention_impl=impl), seed=1))[0]

        @jax.jit
        def run(state, tokens):
            cache = init_dense_cache(cfg, 2, 32)
            logits, cache, _ = forward(gd, state, tokens[:, :9], cache=cache)
            step, cache, _ = forward(gd, state, tokens[:, 9:], jnp.full((2, 1), 9), cache=cache)
            return logits, step

        outs[impl] = run(state, tokens)
    del graphdef
    np.testing.assert_allclose(np.asarray(outs["pallas"][0]), np.asarray(outs["ref"][0]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(outs["pallas"][1]), np.asarray(outs["ref"][1]), atol=1e-4)
