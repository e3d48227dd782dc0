"""The greedy shortcuts of ``speculative.probs``: the same tokens as drawing from the one-hots."""

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.inference.speculative import probs as P


def test_greedy_draw_and_residual_equal_the_sampled_rule_on_one_hots():
    V, B = 50, 64
    rng = np.random.default_rng(0)
    p = jax.nn.one_hot(rng.integers(0, V, B), V)
    q = jax.nn.one_hot(rng.integers(0, V, B), V)
    rejected = jnp.asarray(rng.random(B) < 0.5)
    for seed in range(3):
        key = jax.random.key(seed)
        assert np.array_equal(P.draw(key, p, greedy_only=True), P.draw(key, p))
        want = P.residual_or_bonus(key, p, q, rejected)
        assert np.array_equal(P.residual_or_bonus(key, p, q, rejected, greedy_only=True), want)
    assert np.array_equal(want, np.argmax(p, -1))
    # not one-hots: the shortcut is the argmax, the rule a draw (they differ: the shortcut is greedy-only)
    soft = jax.nn.softmax(jnp.asarray(rng.normal(size=(B, V)), jnp.float32))
    assert not np.array_equal(P.draw(jax.random.key(0), soft, greedy_only=True), P.draw(jax.random.key(0), soft))


def test_draw_from_logits_is_a_draw_from_the_warped_law():
    from pallasite.inference.sampling import SamplingParams

    B, V = 16, 30
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(B, V)) * 3, jnp.float32)
    greedy, gspec = SamplingParams.make(B, 0.0, None, None)
    assert np.array_equal(P.draw_from_logits(jax.random.key(0), logits, greedy, gspec), np.argmax(logits, -1))
    params, spec = SamplingParams.make(B, 0.7, 3, None)
    for seed in range(3):
        key = jax.random.key(seed)
        want = P.draw(key, P.warped_probs(logits[:, None], params, spec)[:, 0])
        assert np.array_equal(P.draw_from_logits(key, logits, params, spec), want)
    # top-k 3: every draw among each row's 3 largest logits (a draw from the raw softmax would not be)
    top3 = np.argsort(-np.asarray(logits), -1)[:, :3]
    draws = [np.asarray(P.draw_from_logits(jax.random.key(s), logits, params, spec)) for s in range(20)]
    assert all(d[b] in top3[b] for d in draws for b in range(B))


def test_drafter_call_at_equals_the_full_call_at_that_position():
    """The catch-up's head at one position per row == the logits of the full call there."""
    from flax import nnx

    from pallasite.inference.speculative import drafter as D
    from pallasite.models.config import ModelConfig
    from pallasite.models.transformer import init_model

    cfg = ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=64,
                      tie_embeddings=True)
    g, state = nnx.split(init_model(cfg, seed=0))
    B, T = 3, 7
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 40, (B, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + 5, (B, T))
    idx = jnp.asarray([0, 6, 3], jnp.int32)
    full, cache_full = D.call(g, state, D.create_cache(cfg, "dense", None, B, 32), tokens, pos)
    one, cache_one = D.call_at(g, state, D.create_cache(cfg, "dense", None, B, 32), tokens, pos, idx)
    np.testing.assert_allclose(np.asarray(one), np.asarray(full)[np.arange(B), np.asarray(idx)], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache_one.k), np.asarray(cache_full.k))
