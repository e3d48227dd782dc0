"""Grouped matmul: Pallas kernel (interpret mode) == ragged_dot reference, values and VJP."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.ops.gmm import gmm, gmm_pallas, gmm_reference, gmm_tiles, tgmm_pallas, tgmm_reference


def _dense_reference(x, w, gs):
    """Row-by-row loop: the definition of a grouped matmul."""
    x, w, gs = np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(gs)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, n in enumerate(gs):
        out[start : start + n] = x[start : start + n] @ w[g]
        start += n
    return out


@pytest.mark.parametrize("M,K,N,gs", [(37, 24, 40, [7, 0, 13, 9, 5]), (16, 16, 16, [16]), (50, 20, 18, [0, 0, 50])])
def test_pallas_matches_reference(M, K, N, gs):
    kx, kw = jax.random.split(jax.random.key(M))
    x = jax.random.normal(kx, (M, K))
    w = jax.random.normal(kw, (len(gs), K, N))
    gs = jnp.asarray(gs, jnp.int32)
    want = _dense_reference(x, w, gs)
    ref = gmm_reference(x, w, gs)
    pal = gmm_pallas(x, w, gs, block_m=16, block_k=16, block_n=16)
    np.testing.assert_allclose(ref, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(pal, want, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(gmm_tiles(x, w, gs, block_m=16), want, atol=2e-5, rtol=1e-5)
    # rows past sum(group_sizes) are exactly zero
    assert np.all(np.asarray(pal)[int(gs.sum()) :] == 0)


def test_tgmm_pallas_matches_reference():
    kx, ky = jax.random.split(jax.random.key(3))
    x = jax.random.normal(kx, (29, 20))
    dy = jax.random.normal(ky, (29, 33))
    gs = jnp.asarray([5, 11, 0, 9], jnp.int32)  # 4 rows past the groups are ignored
    np.testing.assert_allclose(
        tgmm_pallas(x, dy, gs, block_m=16, block_k=16, block_n=16), tgmm_reference(x, dy, gs), atol=2e-5, rtol=1e-5
    )


def test_custom_vjp_matches_ragged_dot_grad():
    kx, kw = jax.random.split(jax.random.key(7))
    x = jax.random.normal(kx, (37, 24))
    w = jax.random.normal(kw, (5, 24, 40))
    gs = jnp.asarray([7, 0, 13, 9, 5], jnp.int32)

    def loss(impl):
        return lambda x, w: jnp.sum(jnp.sin(gmm(x, w, gs, impl=impl, block_m=16, block_k=16, block_n=16)))

    g_ref = jax.grad(loss("ref"), argnums=(0, 1))(x, w)
    for impl in ("pallas", "tiles"):
        for a, b in zip(g_ref, jax.grad(loss(impl), argnums=(0, 1))(x, w)):
            np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-5)

    # negative control: a wrong group split gives different gradients
    g_bad = jax.grad(
        lambda x, w: jnp.sum(jnp.sin(gmm(x, w, gs[::-1], impl="pallas", block_m=16, block_k=16, block_n=16))), argnums=1
    )(x, w)
    assert float(jnp.abs(g_bad - g_ref[1]).max()) > 1e-2


def test_bad_shapes_fail_naming_sizes():
    with pytest.raises(ValueError, match="contraction"):
        gmm(jnp.ones((4, 3)), jnp.ones((2, 5, 6)), jnp.array([2, 2]))
    with pytest.raises(ValueError, match="groups"):
        gmm(jnp.ones((4, 3)), jnp.ones((2, 3, 6)), jnp.array([4]))
    with pytest.raises(ValueError, match="impl"):
        gmm(jnp.ones((4, 3)), jnp.ones((1, 3, 6)), jnp.array([4]), impl="cuda")
