"""FactTest under covariate shift: the rejection-sampled rule holds on a shifted 1-D example
where the unweighted rule fails, with the known density ratio and with one estimated by the
logistic-regression classifier; the classifier itself recovers a known log-ratio."""

import math

import numpy as np
import pytest

from pallasite.eval.facttest import shift as SH
from pallasite.eval.facttest import simulation as SIM


def test_shifted_rule_holds_where_unweighted_rule_fails():
    r = SIM.simulate_shift(n0=500, alpha=0.1, delta=0.05, reps=20000, estimated_reps=1000, seed=3)
    slack = 4 * math.sqrt(0.05 * 0.95 / 20000)
    assert r["violation_rate_unweighted"] >= 0.8  # negative control
    assert r["violation_rate_shifted_known_w"] <= 0.05 + slack
    assert r["violation_rate_shifted_estimated_w"] <= 0.05 + 4 * math.sqrt(0.05 * 0.95 / 1000)
    assert 230 < r["mean_accepted"] < 270  # E[w/B] = 1/2 of 500


def test_logistic_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20000, 2))
    y = (rng.random(20000) < 1 / (1 + np.exp(-(1.5 * x[:, 0] - 0.5 * x[:, 1] + 0.3)))).astype(float)
    coef, bias = SH.fit_logistic(x, y, l2=1e-6)
    np.testing.assert_allclose(coef, [1.5, -0.5], atol=0.08)
    assert abs(bias - 0.3) < 0.06
    # batched problems give the same answer as one at a time
    cb, bb = SH.fit_logistic(
        np.stack([x[:500], x[500:1000]]), np.stack([y[:500], y[500:1000]]), l2=1e-3
    )
    c1, b1 = SH.fit_logistic(x[500:1000], y[500:1000], l2=1e-3)
    np.testing.assert_allclose(cb[1], c1, rtol=1e-8)


def test_density_ratio_of_two_gaussians():
    rng = np.random.default_rng(1)
    cal, test = rng.normal(0, 1, (4000, 1)), rng.normal(1, 1, (2000, 1))
    w = SH.fit_density_ratio(cal, test, l2=1e-6)
    grid = np.array([[-1.0], [0.0], [1.0], [2.0]])
    true = np.exp(grid[:, 0] - 0.5)  # N(1,1)/N(0,1)
    np.testing.assert_allclose(w(grid), true, rtol=0.15)


def test_rejection_sampling_acceptance_and_errors():
    rng = np.random.default_rng(0)
    w = np.array([0.0, 1.0, 2.0])
    keep = np.stack([SH.rejection_sample(w, rng) for _ in range(4000)])
    np.testing.assert_allclose(keep.mean(0), [0.0, 0.5, 1.0], atol=0.03)
    with pytest.raises(ValueError, match="bound"):
        SH.rejection_sample(w, rng, bound=1.0)
    with pytest.raises(ValueError, match="non-negative"):
        SH.rejection_sample(np.array([-1.0]), rng)
    with pytest.raises(ValueError, match="same F"):
        SH.fit_density_ratio(np.zeros((3, 2)), np.zeros((3, 4)))


def test_calibrate_under_shift_uses_only_accepted_points():
    rng = np.random.default_rng(0)
    scores = np.arange(300, dtype=float)
    w = (scores >= 150).astype(float)  # only the upper half can be drawn
    thr, keep = SH.calibrate_under_shift(scores, w, 0.1, 0.05, rng)
    assert keep[:150].sum() == 0 and keep[150:].all()
    assert thr.n0 == 150 and thr.tau >= 150
