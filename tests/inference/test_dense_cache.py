"""The dense KV cache is head-major ``[L, B, K, S, D]`` (inference/cache/dense.py): the scatter
writes slot = position in that layout, and cached decode over a ragged batch gives the logits and
greedy tokens of a full-sequence forward without a cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite.inference import engine as E
from pallasite.inference.cache import DenseKVCache, init_dense_cache
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import forward, init_model
from pallasite.ops.attention import reference_attention

# K=2, Dh=8, S=48, B=3, L=3: every axis of the cache has a distinct size, so a swapped layout
# shows up in the shape check and in the per-slot checks.
CFG = ModelConfig(vocab_size=97, d_model=48, n_layers=3, n_heads=6, n_kv_heads=2, d_ff=64, rope_theta=500.0)
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 7, 7, 31, 80], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24]]
STEPS = 6
CACHE_LEN = 48


@functools.partial(jax.jit, static_argnums=0)
def _full(g, st, tokens_BT):
    return forward(g, st, tokens_BT)[0]


@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
def test_head_major_cache_ragged_decode_equals_full_forward(scan):
    cfg = CFG.replace(scan_layers=scan)
    g, st = nnx.split(init_model(cfg, seed=4))
    tokens, lengths, _ = E.prepare_prompts(PROMPTS, vocab_size=cfg.vocab_size, pad_id=0, max_new_tokens=STEPS,
                                           cache_len=CACHE_LEN)
    B, T = tokens.shape
    cache = init_dense_cache(cfg, B, CACHE_LEN)
    want_shape = (cfg.n_layers, B, cfg.n_kv_heads, CACHE_LEN, cfg.dh)
    assert cache.k.shape == cache.v.shape == want_shape
    assert (cache.batch_size, cache.n_kv_heads, cache.capacity) == (B, cfg.n_kv_heads, CACHE_LEN)

    logits, cache = E.forward_with_cache(g, st, cache, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), (B, T)))
    seqs = [list(p) for p in PROMPTS]
    step_logits = [np.asarray(logits[i, len(p) - 1]) for i, p in enumerate(PROMPTS)]
    per_step = [step_logits]
    for t in range(STEPS):
        nxt = np.array([int(np.argmax(lg)) for lg in per_step[-1]])  # greedy, from the cached logits
        for i in range(B):
            seqs[i].append(int(nxt[i]))
        lg, cache = E.forward_with_cache(g, st, cache, jnp.asarray(nxt[:, None], jnp.int32),
                                         jnp.asarray(lengths[:, None] + t))
        per_step.append([np.asarray(lg[i, 0]) for i in range(B)])
    assert cache.k.shape == cache.v.shape == want_shape  # still head-major after prefill + decode

    # reference: each full sequence (prompt + greedy tokens), no cache, one padded batch
    toks = np.zeros((B, CACHE_LEN), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    full = np.asarray(_full(g, st, jnp.asarray(toks)))
    for i, p in enumerate(PROMPTS):
        for t in range(STEPS + 1):
            np.testing.assert_allclose(per_step[t][i], full[i, len(p) - 1 + t], atol=1e-5, rtol=0,
                                       err_msg=f"row {i}, decode step {t}")
        # identical greedy tokens: the full forward's argmax reproduces every generated token
        assert [int(x) for x in full[i, len(p) - 1:len(p) - 1 + STEPS].argmax(-1)] == seqs[i][len(p):]

    # slot = position in the head-major layout: each row's written slots [0, len + STEPS) hold
    # keys, slots past both the row and the padded prompt were never written
    k = np.asarray(cache.k)
    for i, p in enumerate(PROMPTS):
        n = len(p) + STEPS
        assert (np.abs(k[:, i, :, :n]).sum(-1) > 0).all(), f"row {i}: an unwritten slot below {n}"
        assert (k[:, i, :, max(n, T):] == 0).all(), f"row {i}: a write past slot {max(n, T)}"


def test_write_is_slot_equals_position_and_attend_matches_reference():
    """One layer: ragged positions, T=2, one position past the capacity (dropped)."""
    B, K, S, D, H = 3, 2, 24, 8, 4
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (B, 2, H, D))
    k_new = jax.random.normal(kk, (B, 2, K, D))
    v_new = jax.random.normal(kv, (B, 2, K, D))
    pos = jnp.array([[0, 1], [10, 11], [23, 24]])  # row 2's second token is out of range
    layer = DenseKVCache(k=jnp.zeros((B, K, S, D)), v=jnp.zeros((B, K, S, D)))
    out, new = layer.update_and_attend(q, k_new, v_new, pos)
    k = np.asarray(new.k)
    want = np.zeros((B, K, S, D), np.float32)
    for b in range(B):
        for t in range(2):
            if int(pos[b, t]) < S:
                want[b, :, int(pos[b, t])] = np.asarray(k_new[b, t])
    np.testing.assert_array_equal(k, want)
    # attention over the written cache == the reference over its slot-major copy
    ref = reference_attention(q, jnp.swapaxes(new.k, 1, 2), jnp.swapaxes(new.v, 1, 2), q_positions_BT=pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
    with pytest.raises(ValueError, match=r"\[B, K, S, D\]"):  # an old slot-major layer cache is refused
        DenseKVCache(k=jnp.zeros((B, S, K, D)), v=jnp.zeros((B, S, K, D))).update_and_attend(q, k_new, v_new, pos)


def test_bfloat16_head_major_prefill_and_decode_run_and_match_reference():
    """bf16 cache: prefill (T > 1) and decode (T = 1) over the head-major layout compile and run
    on XLA:CPU (a bf16 x bf16 -> f32 einsum in the wrong output order does not) and match the
    slot-major reference within bf16 tolerance."""
    B, K, S, D, H, T = 2, 2, 32, 16, 4, 5
    ks = jax.random.split(jax.random.PRNGKey(3), 6)
    q, q1 = (jax.random.normal(ks[0], (B, T, H, D)).astype(jnp.bfloat16),
             jax.random.normal(ks[1], (B, 1, H, D)).astype(jnp.bfloat16))
    k, v = (jax.random.normal(kk, (B, T, K, D)).astype(jnp.bfloat16) for kk in ks[2:4])
    k1, v1 = (jax.random.normal(kk, (B, 1, K, D)).astype(jnp.bfloat16) for kk in ks[4:6])
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    layer = DenseKVCache(k=jnp.zeros((B, K, S, D), jnp.bfloat16), v=jnp.zeros((B, K, S, D), jnp.bfloat16))

    @jax.jit
    def run(layer):
        out, layer = layer.update_and_attend(q, k, v, pos)
        out1, layer = layer.update_and_attend(q1, k1, v1, jnp.full((B, 1), T))
        return out, out1

    out, out1 = run(layer)
    want = reference_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), q_positions_BT=pos)
    kk_, vv_ = (jnp.concatenate([a, b], 1).astype(jnp.float32) for a, b in ((k, k1), (v, v1)))
    want1 = reference_attention(q1.astype(jnp.float32), kk_, vv_, q_positions_BT=jnp.full((B, 1), T))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=3e-2)
    np.testing.assert_allclose(np.asarray(out1, np.float32), np.asarray(want1), atol=3e-2)
