"""ops.panels: the XLA:CPU few-row kernel against its jnp reference.

* ``pack`` / ``unpack`` are inverses (also over stacked layers) and ``pack`` puts each 16-column
  panel's rows together; a width that is not a multiple of 16 is refused.
* The FFI kernel equals the reference for 1..9, 33 and 64 rows, odd K, one panel and many; a row's
  result is bit-identical whatever the number of rows beside it (the kernel sums k in one order).
* Gradients through the ``custom_vjp`` equal those of ``x @ w``.
* bfloat16 weights (widened exactly, float32 sums) equal the reference on the same bf16 numbers.
* ``choose_impl``: more than ``MAX_ROWS`` rows or a float16 weight goes to the reference, the latter
  logged once.
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.ops import dispatch
from pallasite.ops.panels import MAX_ROWS, PANEL, choose_impl, cpu, pack, panel_matmul, unpack
from pallasite.ops.panels.reference import panel_matmul_reference


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


def test_pack_layout_and_round_trip():
    w = jnp.arange(3 * 32, dtype=jnp.float32).reshape(3, 32)
    p = np.asarray(pack(w)).reshape(-1)
    # panel 0 (columns 0..15) row by row, then panel 1
    want = np.concatenate([np.asarray(w)[:, :16].reshape(-1), np.asarray(w)[:, 16:].reshape(-1)])
    np.testing.assert_array_equal(p, want)
    stacked = _rand((4, 2, 5, 48), 0)
    np.testing.assert_array_equal(np.asarray(unpack(pack(stacked))), np.asarray(stacked))
    np.testing.assert_array_equal(np.asarray(pack(stacked)[1, 0]), np.asarray(pack(stacked[1, 0])))
    with pytest.raises(ValueError, match="multiple of 16"):
        pack(jnp.zeros((4, 40)))


def test_kernel_is_available_here():
    # CI's machines are x86-64 with AVX2 and a C++ compiler: the kernel must build, not fall back
    assert cpu.unavailable() is None


@pytest.mark.parametrize("K,N", [(576, 192), (37, 16), (1, 64), (130, 1024)])
def test_kernel_matches_reference(K, N):
    w = pack(_rand((K, N), 1))
    run = jax.jit(lambda x, w: panel_matmul(x, w, impl="cpu"))
    for M in (1, 2, 3, 4, 5, 7, 8, 9, 33, MAX_ROWS):
        x = _rand((M, K), M)
        got = np.asarray(run(x, w))
        want = np.asarray(panel_matmul_reference(x, w))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(K), err_msg=f"M={M}")


@pytest.mark.parametrize("K,N", [(576, 192), (37, 16)])
def test_bfloat16_weights(K, N):
    w = pack(_rand((K, N), 8)).astype(jnp.bfloat16)
    run = jax.jit(lambda x, w: panel_matmul(x, w, impl="cpu"))
    for M in (1, 3, 4, 9):
        x = _rand((M, K), 20 + M).astype(jnp.bfloat16)
        got = run(x, w)
        assert got.dtype == jnp.float32
        want = np.asarray(panel_matmul_reference(x, w))  # the same bf16 numbers, widened, float32 sums
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.sqrt(K), err_msg=f"M={M}")


def test_rows_do_not_depend_on_their_neighbours():
    K, N = 300, 96
    w = pack(_rand((K, N), 2))
    x = _rand((9, K), 3)
    run = jax.jit(lambda x, w: panel_matmul(x, w, impl="cpu"))
    alone = np.stack([np.asarray(run(x[i:i + 1], w))[0] for i in range(9)])
    np.testing.assert_array_equal(np.asarray(run(x, w)), alone)


def test_leading_axes_and_gradients():
    K, N = 40, 32
    w_plain = _rand((K, N), 4)
    x = _rand((2, 3, K), 5)
    y = panel_matmul(x, pack(w_plain))
    assert y.shape == (2, 3, N)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w_plain), rtol=1e-5, atol=1e-4)
    f = lambda x, w: jnp.sum(jnp.sin(panel_matmul(x, w)))
    gx, gw = jax.grad(f, argnums=(0, 1))(x, pack(w_plain))
    rx, rw = jax.grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), argnums=(0, 1))(x, w_plain)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(unpack(gw)), np.asarray(rw), rtol=1e-4, atol=1e-4)


def test_benchmark_runs_at_a_small_shape(capsys):
    from pallasite.benchmarks import panels as bench

    out = bench.main(["--rows", "1,4", "--layers", "2", "--d", "32", "--ff", "64", "--iters", "1"])
    assert out["max_rel_diff"] < 1e-5 and set(out["rows"]) == {1, 4}
    out = bench.main(["--rows", "2", "--layers", "2", "--d", "32", "--ff", "64", "--iters", "1", "--dtype", "bfloat16"])
    assert out["dtype"] == "bfloat16" and out["max_rel_diff"] < 0.05
    out = bench.main(["--head", "--vocab", "64", "--d", "32", "--rows", "1,4", "--iters", "1"])
    assert out["what"] == "head" and out["max_rel_diff"] < 1e-5
    assert '"bench": "panels"' in capsys.readouterr().out


def test_choose_impl(caplog):
    assert choose_impl(1, jnp.float32) == "cpu"
    assert choose_impl(MAX_ROWS, jnp.float32) == "cpu"
    assert choose_impl(MAX_ROWS + 1, jnp.float32) == "ref"
    assert choose_impl(4, jnp.float32, "ref") == "ref"
    with pytest.raises(ValueError, match="impl"):
        choose_impl(4, jnp.float32, "pallas")
    assert choose_impl(4, jnp.bfloat16) == "cpu"
    dispatch.reset_fallback_warnings()
    with caplog.at_level(logging.WARNING, logger="pallasite.ops"):
        assert choose_impl(4, jnp.float16) == "ref"
    assert "float32 or bfloat16 weights" in caplog.text
    w = pack(_rand((16, PANEL), 6))
    x = _rand((4, 16), 7)
    y = panel_matmul(x.astype(jnp.float16), w.astype(jnp.float16))  # served by the reference
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ unpack(w)), rtol=0.01, atol=0.05)


def test_unavailable_says_why(tmp_path, monkeypatch):
    """No compiler, or a damaged cached build: ``unavailable`` names the reason (the caller falls
    back to the reference and logs it) instead of raising."""
    monkeypatch.setenv("PALLASITE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    assert "no C++ compiler" in cpu.unavailable.__wrapped__()
    path = cpu._library_path()
    (tmp_path / "kernels").mkdir()
    with open(path, "wb") as f:
        f.write(b"not a shared object")
    assert "cannot load" in cpu.unavailable.__wrapped__()
