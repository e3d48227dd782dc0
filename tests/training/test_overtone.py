"""OVERTONE (training/losses/overtone.py): λ = 1 is cross-entropy exactly, no gradient flows through
the target q, the forward KL is >= 0 and 0 at π = q, and clipped-out tokens are pushed down."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.transformer import init_model
from pallasite.training.losses.lm import lm_terms
from pallasite.training.losses.overtone import (
    FILTERS,
    OvertoneConfig,
    forward_kl,
    keep_mask,
    overtone_kl,
    overtone_targets,
    overtone_terms,
)


def _case(seed=0, N=16, V=29):
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.normal(size=(N, V)) * 3.0, jnp.float32)
    y = jnp.asarray(rng.integers(0, V, size=N), jnp.int32)
    return z, y


def _ce(z, y):
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse - jnp.take_along_axis(z, y[:, None], axis=-1)[:, 0]


@pytest.mark.parametrize("filt", FILTERS)
def test_lambda_one_is_cross_entropy_exactly(filt):
    z, y = _case()
    cfg = OvertoneConfig(lam=1.0, filter=filt)
    kl, _ = overtone_kl(z, y, cfg)
    assert np.array_equal(np.asarray(kl), np.asarray(_ce(z, y)))
    g_kl = jax.grad(lambda z: jnp.sum(overtone_kl(z, y, cfg)[0]))(z)
    g_ce = jax.grad(lambda z: jnp.sum(_ce(z, y)))(z)
    np.testing.assert_allclose(np.asarray(g_kl), np.asarray(g_ce), rtol=0, atol=1e-7)
    # and a smoothed target really differs (the test can fail)
    assert (
        float(
            jnp.max(jnp.abs(overtone_kl(z, y, OvertoneConfig(lam=0.5, filter=filt))[0] - _ce(z, y)))
        )
        > 1e-2
    )


def test_lambda_one_through_the_model_matches_the_lm_loss():
    cfg = ModelConfig(vocab_size=37, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    model = init_model(cfg, seed=1)
    rng = np.random.default_rng(2)
    B, T = 2, 9
    batch = {
        "tokens": jnp.asarray(rng.integers(0, 37, (B, T)), jnp.int32),
        "targets": jnp.asarray(rng.integers(0, 37, (B, T)), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
        "segment_ids": jnp.ones((B, T), jnp.int32),
        "loss_mask": jnp.asarray(rng.random((B, T)) > 0.3, jnp.float32),
    }
    g, p, o = nnx.split(model, nnx.Param, ...)

    def value(fn, params):
        t = fn(nnx.merge(g, params, o), batch)
        return t.total / t.count

    ov = lambda m, b: overtone_terms(m, b, OvertoneConfig(lam=1.0))  # noqa: E731
    v1, g1 = jax.jit(jax.value_and_grad(lambda q: value(ov, q)))(p)
    v2, g2 = jax.jit(jax.value_and_grad(lambda q: value(lm_terms, q)))(p)
    np.testing.assert_allclose(float(v1), float(v2), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_no_gradient_flows_through_the_target():
    z, y = _case(3)
    cfg = OvertoneConfig(lam=0.6, filter="min_p", eps=0.05)
    q, _ = overtone_targets(z, y, cfg)
    g = jax.grad(lambda z: jnp.sum(overtone_kl(z, y, cfg)[0]))(z)
    # d/dz KL(sg[q] || softmax z) = softmax(z) - q
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.nn.softmax(z) - q), atol=1e-6)

    def leaky(z):  # the cross-entropy part with the stop-gradient removed: a different gradient
        p = jax.nn.softmax(z)
        keep = keep_mask(jax.lax.stop_gradient(p), cfg)
        f = jnp.where(keep, p, 0.0)
        f = f / jnp.sum(f, -1, keepdims=True)
        q = cfg.lam * jax.nn.one_hot(y, z.shape[-1]) + (1 - cfg.lam) * f
        return jnp.sum(q * (jax.nn.logsumexp(z, -1, keepdims=True) - z))

    assert float(jnp.max(jnp.abs(jax.grad(leaky)(z) - g))) > 1e-3


def test_forward_kl_is_nonnegative_and_zero_at_q():
    rng = np.random.default_rng(4)
    q = rng.dirichlet(np.full(31, 0.3), size=64).astype(np.float32)
    q[:, :5] = 0.0  # filtered-out entries (0 log 0 = 0)
    q /= q.sum(-1, keepdims=True)
    z = jnp.asarray(rng.normal(size=(64, 31)) * 2, jnp.float32)
    kl = np.asarray(forward_kl(jnp.asarray(q), z))
    assert kl.min() >= -1e-6 and kl.max() > 0.1
    z_eq = jnp.where(q > 0, jnp.log(jnp.maximum(q, 1e-30)), -1e30)  # softmax(z_eq) == q
    np.testing.assert_allclose(np.asarray(forward_kl(jnp.asarray(q), z_eq)), 0.0, atol=2e-6)


def test_clipped_out_tokens_are_pushed_down():
    z, y = _case(5, N=32, V=41)
    cfg = OvertoneConfig(lam=0.7, filter="min_p", eps=0.1)
    p = jax.nn.softmax(z)
    keep = np.asarray(keep_mask(p, cfg))
    g = np.asarray(jax.grad(lambda z: jnp.sum(overtone_kl(z, y, cfg)[0]))(z))
    g_ce = np.asarray(jax.grad(lambda z: jnp.sum(_ce(z, y)))(z))
    target = np.asarray(jax.nn.one_hot(y, z.shape[-1])) > 0
    clipped = ~keep & ~target
    kept_other = keep & ~target
    assert clipped.sum() > 100 and kept_other.sum() > 5
    assert (g[clipped] > 0).all()  # gradient descent lowers their logits ...
    np.testing.assert_allclose(
        g[clipped], np.asarray(p)[clipped], rtol=1e-5
    )  # ... by the full softmax mass
    assert (
        g[kept_other] < g_ce[kept_other] - 1e-6
    ).all()  # kept plausible tokens are pushed down less than CE
    assert (g[target] < 0).all()  # the edit target still goes up
    # negative control: at lam = 1 kept tokens get exactly the CE push (the check above fails)
    g1 = np.asarray(jax.grad(lambda z: jnp.sum(overtone_kl(z, y, OvertoneConfig(lam=1.0))[0]))(z))
    np.testing.assert_allclose(g1[kept_other], g_ce[kept_other], atol=1e-7)


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="filter='nucleus'"):
        OvertoneConfig(filter="nucleus")
    with pytest.raises(ValueError, match="lam must lie in"):
        OvertoneConfig(lam=1.5)
