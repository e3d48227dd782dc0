"""FP4 training ops (Wang et al., ICML 2025): E2M1 quantizer, scales, DGE, OCC, fused Pallas
quantizer, FP4 GEMM and its backward. Golden values come from the official MS-AMP unit tests
(``tests/operators/test_fp4_quantize.py``)."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallasite.ops import dispatch
from pallasite.ops.quant import fp4
from pallasite.ops.quant.fp4_gemm import FP4GemmSpec, fp4_dot
from pallasite.ops.quant.fp4_kernel import quantize_rows, quantize_rows_pallas

GRID = np.array(fp4.E2M1_GRID, np.float32)


# ----------------------------------------------------------------------------- E2M1 rounding
def test_e2m1_nearest_value_ties_toward_plus_inf_and_saturation():
    # every grid value maps to itself; midpoints go to the upper neighbour (strict < in the LUT)
    np.testing.assert_array_equal(fp4.round_e2m1(jnp.asarray(GRID)), GRID)
    mids = np.array(fp4.E2M1_MIDPOINTS, np.float32)
    np.testing.assert_array_equal(fp4.round_e2m1(jnp.asarray(mids)), GRID[1:])
    np.testing.assert_array_equal(
        fp4.round_e2m1(jnp.array([0.25, -0.25, 7.0, -100.0])), [0.5, 0.0, 6.0, -6.0]
    )
    # off the midpoints: the nearest grid value
    v = np.random.default_rng(0).uniform(-7, 7, 5000).astype(np.float32)
    nearest = GRID[np.argmin(np.abs(v[:, None] - GRID[None, :]), axis=1)]
    np.testing.assert_array_equal(fp4.round_e2m1(jnp.asarray(v)), nearest)
    # the ml_dtypes E2M1 cast rounds ties to even: it differs on exactly these midpoints
    cast = np.array([0.25, -0.25], np.float32).astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    assert cast.tolist() == [0.0, 0.0]


def test_golden_per_tensor_pow2_scale_sf8():
    x = jnp.array(
        [[0.001, 0.048, 0.0997], [0.1503, 0.2002, 0.2497], [0.2974, 0.30699, 0.4001]], jnp.bfloat16
    )
    want = np.array([[0, 0.0625, 0.125], [0.125, 0.1875, 0.25], [0.25, 0.25, 0.375]], np.float32)
    rq = fp4.quantize_rows_ref(x.reshape(1, 9), scale="pow2")  # one row = the whole tensor
    assert float(1.0 / rq.dequant[0, 0]) == 8.0
    np.testing.assert_array_equal(np.asarray(rq.dequantize()).reshape(3, 3), want)
    # the golden values hold only for the power-of-two scale (exact: sf = 6/0.4001 ≈ 15)
    exact = fp4.quantize_rows_ref(x.reshape(1, 9), scale="exact").dequantize().reshape(3, 3)
    assert not np.array_equal(np.asarray(exact), want)


CHANNEL_IN = [
    [[-0.01, 0.48, -9.67], [1.623, -2.222, 24.67]],
    [[-2.874, 3.699, -34.57], [0.85, -1.343, 18.88]],
]
CHANNEL_OUT = [[[0.0, 0.5, -8.0], [1.5, -2.0, 24.0]], [[-3.0, 4.0, -32.0], [0.75, -1.5, 16.0]]]


def test_golden_channel_wise_and_token_wise():
    x = jnp.array(CHANNEL_IN, jnp.bfloat16).reshape(4, 3)  # channel-wise: one scale per column
    want = np.array(CHANNEL_OUT, np.float32).reshape(4, 3)
    w_q, _ = fp4.weight_quant(x, axis=0, scale="pow2")
    np.testing.assert_array_equal(
        np.asarray(w_q, np.float32), want
    )  # 24.67 -> 24, -34.57 -> -32, 18.88 -> 16
    tok = fp4.quantize_rows_ref(x.T, scale="pow2").dequantize()  # token-wise on the transpose
    np.testing.assert_array_equal(np.asarray(tok), want.T)


def test_weight_scale_is_per_output_channel_of_an_in_out_kernel():
    w = jax.random.normal(jax.random.PRNGKey(0), (64, 8))  # kernel [in, out]; y = x @ w
    w2 = w.at[:, 3].multiply(64.0)  # one output channel 64x larger (a power of two: exact)
    q1, _ = fp4.weight_quant(w, axis=0)
    q2, _ = fp4.weight_quant(w2, axis=0)
    others = np.arange(8) != 3
    np.testing.assert_array_equal(np.asarray(q1)[:, others], np.asarray(q2)[:, others])
    np.testing.assert_allclose(np.asarray(q2)[:, 3], 64.0 * np.asarray(q1)[:, 3], rtol=1e-6)
    # negative control: scales along the input axis mix the channels
    p1, _ = fp4.weight_quant(w, axis=1)
    p2, _ = fp4.weight_quant(w2, axis=1)
    assert not np.array_equal(np.asarray(p1)[:, others], np.asarray(p2)[:, others])


def test_exact_scale_has_lower_error_than_pow2():
    x = jax.random.normal(jax.random.PRNGKey(1), (256, 512))
    err = {
        k: float(jnp.mean((fp4.quantize_rows_ref(x, scale=k).dequantize() - x) ** 2))
        for k in fp4.SCALE_KINDS
    }
    assert err["exact"] < 0.8 * err["pow2"], err
    # the scaled absmax lands on 6 exactly (exact) or in (3, 6] (pow2)
    for kind, lo in (("exact", 6.0), ("pow2", 3.0)):
        rq = fp4.quantize_rows_ref(x, scale=kind)
        top = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / rq.dequant
        assert float(np.min(top)) > lo - 1e-4 and float(np.max(top)) <= 6.0 + 1e-4


def test_e4m3_mode_and_e5m2_gradients():
    x = jax.random.normal(jax.random.PRNGKey(2), (16, 64)) * 3
    rq = fp4.quantize_rows_ref(x, fmt="e4m3")
    assert float(np.max(np.abs(rq.q.astype(jnp.float32)))) <= 448.0
    assert float(np.max(np.abs(rq.dequantize() - x) / np.abs(x))) < 2**-3  # 3 mantissa bits
    g = jnp.array([1e-30, 3.3, -7e4, 0.0])
    g8, inv = fp4.quantize_e5m2(g)
    assert g8.dtype == jnp.float8_e5m2 and bool(jnp.all(jnp.isfinite(g8.astype(jnp.float32))))
    assert math.log2(float(inv)) == int(math.log2(float(inv)))  # power-of-two scale
    np.testing.assert_allclose(float(g8[2].astype(jnp.float32) * inv), -7e4, rtol=0.13)


# ----------------------------------------------------------------------------- DGE
DGE_GOLDEN = [
    0.2002,
    0.4375,
    0.6055,
    0.2168,
    1.8359,
    0.2695,
    0.3027,
    0.2695,
    0.2402,
    0.5781,
    0.5781,
    0.2402,
    0.2695,
    0.3027,
    0.2695,
    1.8359,
    0.2168,
    0.6055,
    0.4375,
    0.2002,
]


def test_dge_derivative_golden_values():
    x = jnp.linspace(-6.0, 6.0, 20).astype(jnp.bfloat16)
    got = fp4.dge_derivative(x, k=5.0, clamp=3.0).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.array(DGE_GOLDEN, jnp.bfloat16)))


@pytest.mark.parametrize("k", [3.0, 5.0])
def test_dge_integral_over_each_interval_is_delta_minus_clamp_loss(k):
    # f(a) = 0, f(a + δ) = δ, so ∫f' = δ; clamping f' at c removes, around each midpoint where
    # (1/k)|u|^(1/k-1) > c (|u| < u0), δ·(u0^(1/k) - c·u0) of the integral.
    c = 3.0
    u0 = (c * k) ** (1.0 / (1.0 / k - 1.0))
    keep = 1.0 - (u0 ** (1.0 / k) - c * u0)
    for left, delta in zip(fp4.DGE_LEFT, fp4.DGE_DELTA):
        n = 200_000
        xs = left + (np.arange(n) + 0.5) * (delta / n)  # midpoint rule
        integral = (
            float(jnp.sum(fp4.dge_derivative(jnp.asarray(xs, jnp.float32), k=k, clamp=c)))
            * delta
            / n
        )
        np.testing.assert_allclose(integral, delta * keep, rtol=2e-3)
        assert integral < 0.99 * delta  # the clamp loss is real


def test_dge_custom_vjp_is_upstream_times_fprime_not_ste():
    w = jax.random.normal(jax.random.PRNGKey(3), (32, 16)) * 0.1
    g = jax.random.normal(jax.random.PRNGKey(4), (32, 16))
    for scale in fp4.SCALE_KINDS:
        w_q, vjp = jax.vjp(lambda w: fp4.dge_quantize(w, axis=0, scale=scale), w)
        (dw,) = vjp(g)
        ref_q, w_scaled = fp4.weight_quant(w, axis=0, scale=scale)
        np.testing.assert_array_equal(np.asarray(w_q), np.asarray(ref_q))  # forward: hard quantizer
        np.testing.assert_allclose(
            np.asarray(dw), np.asarray(g * fp4.dge_derivative(w_scaled)), rtol=1e-6
        )
        (dw_ste,) = jax.vjp(lambda w: fp4.ste_quantize(w.T, scale=scale).T, w)[1](g)
        np.testing.assert_allclose(np.asarray(dw_ste), np.asarray(g), rtol=1e-6)  # STE: identity
        assert float(jnp.mean(jnp.abs(dw - dw_ste))) > 0.1 * float(jnp.mean(jnp.abs(g)))


# ----------------------------------------------------------------------------- OCC
@pytest.mark.parametrize("alpha,frac", [(0.999, 0.002), (0.99, 0.02), (0.97, 0.06)])
def test_occ_clamps_two_sided_fraction_per_token(alpha, frac):
    y = jax.random.t(jax.random.PRNGKey(5), 3.0, (32, 1000))
    rq = fp4.quantize_rows_ref(y, occ_alpha=alpha)
    per_token = np.asarray(jnp.mean(rq.residual != 0, axis=-1))
    np.testing.assert_allclose(per_token, frac, atol=1e-9)  # round(2(1-α)·1000) entries per row
    np.testing.assert_array_equal(
        np.asarray(jnp.abs(y) > rq.threshold), np.asarray(rq.residual != 0)
    )


def test_occ_threshold_top_k_equals_bisection():
    y = jax.random.t(jax.random.PRNGKey(6), 2.0, (24, 333))
    y = y.at[0].set(0.0).at[1, :100].set(1.5).at[2].set(jnp.abs(y[2]))  # zeros, ties, one sign
    for alpha in (0.999, 0.99, 0.9, 0.6):
        a = fp4.occ_threshold(y, alpha, "top_k")
        b = fp4.occ_threshold(y, alpha, "bisect")
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="alpha"):
        fp4.n_clamped(1.0, 100)


def test_occ_compensation_identity():
    y = jax.random.t(jax.random.PRNGKey(7), 3.0, (64, 128))
    w = jax.random.normal(jax.random.PRNGKey(8), (128, 32)) * 0.1
    rq = fp4.quantize_rows_ref(y, occ_alpha=0.99)
    q_yc, dy = rq.dequantize(), rq.residual
    hi = jax.lax.Precision.HIGHEST
    lhs = jnp.dot(q_yc, w, precision=hi) + jnp.dot(dy, w, precision=hi)
    np.testing.assert_allclose(
        np.asarray(lhs), np.asarray(jnp.dot(q_yc + dy, w, precision=hi)), rtol=1e-5, atol=1e-5
    )
    # the GEMM: Q(Y_c)·Q(W) + ΔY·W
    w_q, _ = fp4.weight_quant(w, axis=0)
    want = jnp.dot(q_yc, w_q, precision=hi) + jnp.dot(dy, w, precision=hi)
    got = fp4_dot(y, w, FP4GemmSpec(occ_alpha=0.99))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _table1(y, comp_sign=1.0):
    """(cos sim, MSE, SNR dB) per setting of the paper's Table 1, on rows ``y``."""
    out = {}
    for name, alpha, comp in [
        ("no_clamp", None, False),
        ("clamp_999", 0.999, False),
        ("comp_999", 0.999, True),
        ("comp_99", 0.99, True),
        ("comp_97", 0.97, True),
    ]:
        rq = fp4.quantize_rows_ref(y, occ_alpha=alpha)
        yq = rq.dequantize() + (comp_sign * rq.residual if comp else 0.0)
        err = yq - y
        cos = float(
            jnp.mean(
                jnp.sum(y * yq, -1) / (jnp.linalg.norm(y, axis=-1) * jnp.linalg.norm(yq, axis=-1))
            )
        )
        out[name] = (
            cos,
            float(jnp.mean(err**2)),
            float(10 * jnp.log10(jnp.sum(y**2) / jnp.sum(err**2))),
        )
    return out


def _ordered(stats):
    order = ["no_clamp", "clamp_999", "comp_999", "comp_99", "comp_97"]
    cos, mse, snr = ([stats[k][i] for k in order] for i in range(3))
    return (
        all(a < b for a, b in zip(cos, cos[1:]))
        and all(a > b for a, b in zip(mse, mse[1:]))
        and all(a < b for a, b in zip(snr, snr[1:]))
    )


def test_occ_table1_ordering_on_heavy_tailed_activations():
    heavy = jax.random.t(jax.random.PRNGKey(9), 3.0, (256, 1024))  # Student-t, 3 dof
    assert _ordered(_table1(heavy)), _table1(heavy)
    # negative control: a compensation with the wrong sign must break the ordering
    assert not _ordered(_table1(heavy, comp_sign=-1.0))


# ----------------------------------------------------------------------------- Pallas kernel
def _assert_rowquant_equal(got, ref):
    for name, a, b in zip(fp4.RowQuant._fields, got, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            np.testing.assert_array_equal(
                np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)), err_msg=name
            )


@pytest.mark.parametrize(
    "shape,dtype", [((37, 200), jnp.bfloat16), ((5, 1000), jnp.float32), ((16, 64), jnp.bfloat16)]
)
def test_pallas_quantizer_equals_reference_bit_for_bit(shape, dtype):
    """The GPU-layout kernel in the generic interpreter, every option."""
    x = (jax.random.t(jax.random.PRNGKey(10), 3.0, shape) * 0.05).astype(dtype)
    x = x.at[0].set(0)  # an all-zero row (scale 1)
    for occ in (None, 0.99):
        for scale in fp4.SCALE_KINDS:
            for fmt in ("e2m1", "e4m3"):
                got = quantize_rows_pallas(x, fmt=fmt, scale=scale, occ_alpha=occ, interpret=True)
                ref = fp4.quantize_rows_ref(x, fmt=fmt, scale=scale, occ_alpha=occ, select="top_k")
                _assert_rowquant_equal(got, ref)


@pytest.mark.parametrize("occ,scale", [(None, "pow2"), (0.99, "exact")])
def test_pallas_quantizer_tpu_variant_in_the_tpu_interpreter(occ, scale):
    """The Mosaic variant ((32, 128)-tiled blocks) under ``pltpu.InterpretParams`` (races checked,
    uninitialised memory NaN): equal to the reference bit for bit, padded rows and lanes too."""
    x = (jax.random.t(jax.random.PRNGKey(15), 3.0, (37, 200)) * 0.05).astype(jnp.bfloat16)
    got = quantize_rows_pallas(
        x, scale=scale, occ_alpha=occ, interpret=dispatch.tpu_interpret_params()
    )
    _assert_rowquant_equal(
        got, fp4.quantize_rows_ref(x, scale=scale, occ_alpha=occ, select="top_k")
    )


def test_quantize_rows_keeps_leading_axes_and_rejects_bad_options():
    x = jax.random.normal(jax.random.PRNGKey(11), (2, 3, 40))
    rq = quantize_rows(x, occ_alpha=0.99, impl="pallas", interpret=True)
    assert (
        rq.q.shape == (2, 3, 40)
        and rq.dequant.shape == (2, 3, 1)
        and rq.residual.shape == (2, 3, 40)
    )
    with pytest.raises(ValueError, match="scale"):
        quantize_rows(x, scale="log")
    with pytest.raises(ValueError, match="impl"):
        quantize_rows(x, impl="cuda")


# ----------------------------------------------------------------------------- FP4 GEMM
def _data(n=48, k=96, m=40, seed=12):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        jax.random.t(k1, 3.0, (n, k)),
        jax.random.normal(k2, (k, m)) * 0.05,
        jax.random.normal(k3, (n, m)),
    )


def _composed(spec):
    """The same function from the single-tensor quantizers and autodiff (no E5M2)."""

    def f(x, w):
        rq = fp4.quantize_rows_ref(x, occ_alpha=spec.occ_alpha)
        x_q = x + jax.lax.stop_gradient(rq.dequantize() - x)  # STE through clamp and quantizer
        w_q = fp4.dge_quantize(w, axis=0) if spec.w_grad == "dge" else fp4.ste_quantize(w.T).T
        y = jnp.dot(x_q, w_q, precision=jax.lax.Precision.HIGHEST)
        if rq.residual is not None:
            y = y + jnp.dot(
                jax.lax.stop_gradient(rq.residual), w, precision=jax.lax.Precision.HIGHEST
            )
        return y

    return f


@pytest.mark.parametrize("occ", [None, 0.99])
@pytest.mark.parametrize("w_grad", ["dge", "ste"])
def test_fp4_dot_forward_and_backward_match_composition(occ, w_grad):
    x, w, g = _data()
    spec = FP4GemmSpec(occ_alpha=occ, w_grad=w_grad, grad_e5m2=False)
    y, vjp = jax.vjp(lambda a, b: fp4_dot(a, b, spec), x, w)
    y2, vjp2 = jax.vjp(_composed(spec), x, w)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y2), rtol=1e-5, atol=1e-5)
    for a, b in zip(vjp(g), vjp2(g)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_fp4_dot_e5m2_backward_and_dge_differs_from_ste():
    x, w, g = _data(seed=13)

    def grads(**kw):
        return jax.vjp(lambda a, b: fp4_dot(a, b, FP4GemmSpec(**kw)), x, w)[1](g)

    def cos(a, b):
        return float(jnp.sum(a * b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b)))

    gx8, gw8 = grads()
    gx, gw = grads(grad_e5m2=False)
    assert not np.array_equal(np.asarray(gx8), np.asarray(gx))  # the E5M2 cast is really applied
    assert cos(gx8, gx) > 0.995 and cos(gw8, gw) > 0.995
    # E5M2 backward by hand: dx = E5M2(g·s_w) · q_w
    aw = fp4.quantize_rows_ref(w.T)
    g8, s = fp4.quantize_e5m2(g * aw.dequant[:, 0][None, :])
    np.testing.assert_allclose(
        np.asarray(gx8),
        np.asarray(jnp.dot(g8.astype(jnp.float32), aw.q.astype(jnp.float32)) * s),
        rtol=1e-5,
        atol=1e-6,
    )
    _, gw_ste = grads(w_grad="ste")
    assert cos(gw8, gw_ste) < 0.99  # DGE reshapes the weight gradient
    # bf16 inputs keep their dtype through the custom_vjp
    xb = x.astype(jnp.bfloat16)
    yb, vjp = jax.vjp(lambda a, b: fp4_dot(a, b, FP4GemmSpec()), xb, w)
    dxb, dwb = vjp(g.astype(jnp.bfloat16))
    assert yb.dtype == dxb.dtype == jnp.bfloat16 and dwb.dtype == jnp.float32


def _value_and_grads(fn):
    """jit(x, w, g -> (fn(x, w), dx, dw))."""
    return jax.jit(lambda x, w, g: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(fn, x, w)))


def test_fp4_gmm_equals_fp4_dot_per_expert_group():
    from pallasite.ops.quant.fp4_grouped import fp4_gmm

    k = jax.random.split(jax.random.PRNGKey(14), 3)
    gs = jnp.array([5, 0, 9, 6], jnp.int32)  # an empty group, and 4 rows past the groups
    x, w, g = (
        jax.random.t(k[0], 3.0, (24, 32)),
        jax.random.normal(k[1], (4, 32, 16)) * 0.05,
        jax.random.normal(k[2], (24, 16)),
    )
    ends = np.cumsum(np.asarray(gs))
    spec = FP4GemmSpec(grad_e5m2=False)  # OCC + DGE, float32 gradients: exact comparison
    y, dx, dw = _value_and_grads(lambda a, b: fp4_gmm(a, b, gs, spec, "tiles"))(x, w, g)
    per_group = _value_and_grads(lambda a, b: fp4_dot(a, b, spec))
    for e, (lo, hi) in enumerate(zip(ends - np.asarray(gs), ends)):
        if hi == lo:
            assert float(np.max(np.abs(dw[e]))) == 0.0
            continue
        for got, want in zip((y[lo:hi], dx[lo:hi], dw[e]), per_group(x[lo:hi], w[e], g[lo:hi])):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
    assert float(np.max(np.abs(y[20:]))) == 0.0 and float(np.max(np.abs(dx[20:]))) == 0.0
    # with E5M2 gradients (one per-tensor scale over all groups) the gradients stay close
    _, dx8, dw8 = _value_and_grads(lambda a, b: fp4_gmm(a, b, gs, FP4GemmSpec(), "tiles"))(x, w, g)
    for a, b in ((dx8, dx), (dw8, dw)):
        assert float(jnp.sum(a * b) / (jnp.linalg.norm(a) * jnp.linalg.norm(b))) > 0.99
