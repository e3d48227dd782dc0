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
