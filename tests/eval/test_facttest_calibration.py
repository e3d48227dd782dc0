"""FactTest's calibration rule: k_hat against an exact rational binomial tail, the n0-too-small
branch, the strict inequality, and the guarantee itself by Monte Carlo (20k calibrations) with
the naive empirical quantile as a negative control that must fail."""

import math
from fractions import Fraction

import numpy as np
import pytest

from pallasite.eval.facttest import calibration as C
from pallasite.eval.facttest import simulation as SIM


def brute_k_hat(n0, alpha, delta):
    """min{k : sum_{j>=k} C(n0,j)(1-a)^j a^(n0-j) <= delta} in exact rational arithmetic."""
    a = Fraction(alpha).limit_denominator(10**6)
    d = Fraction(delta).limit_denominator(10**6)
    tail = Fraction(0)
    best = None
    for k in range(n0, 0, -1):
        tail += math.comb(n0, k) * (1 - a) ** k * a ** (n0 - k)
        if tail <= d:
            best = k
        else:
            break
    return best


@pytest.mark.parametrize("n0", [1, 5, 29, 30, 44, 45, 89, 90, 100, 257, 500])
@pytest.mark.parametrize(
    "alpha,delta", [(0.05, 0.01), (0.05, 0.05), (0.1, 0.01), (0.1, 0.05), (0.2, 0.1)]
)
def test_k_hat_equals_brute_force_binomial_tail(n0, alpha, delta):
    assert C.k_hat(n0, alpha, delta) == brute_k_hat(n0, alpha, delta)


def test_log_tail_matches_exact_sum():
    exact = [
        float(
            sum(
                math.comb(40, j) * Fraction(9, 10) ** j * Fraction(1, 10) ** (40 - j)
                for j in range(k, 41)
            )
        )
        for k in range(41)
    ]
    np.testing.assert_allclose(np.exp(C.log_binomial_tail(40, 0.1)), exact, rtol=1e-10)


def test_log_space_survives_large_n0():
    # v(k) underflows float64 far in the tail; the log-space sum still finds k_hat.
    k = C.k_hat(20000, 0.05, 1e-6)
    assert k is not None and 19000 < k < 20000
    assert np.all(np.isfinite(C.log_binomial_tail(20000, 0.05)))


def test_min_n0_and_always_abstain_branch():
    assert C.min_n0(0.05, 0.01) == 90  # the paper's example
    assert C.min_n0(0.1, 0.05) == 29
    for n0 in (0, 1, 89):
        thr = C.calibrate(np.arange(n0, dtype=float), 0.05, 0.01)
        assert thr.always_abstain and thr.tau == math.inf and thr.k_hat is None
        assert "always abstain" in thr.reason and "90" in thr.reason
        assert not thr.answers(np.array([1e30])).any()
        assert thr.to_dict()["tau"] is None
    thr = C.calibrate(np.arange(90, dtype=float), 0.05, 0.01)
    assert not thr.always_abstain and thr.k_hat == 90 and thr.tau == 89.0


def test_tau_is_the_k_hat_order_statistic_and_answering_is_strict():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=200)
    thr = C.calibrate(scores, 0.1, 0.05)
    assert thr.tau == np.sort(scores)[thr.k_hat - 1]
    assert not thr.answers([thr.tau])[0]  # equal -> abstain
    assert thr.answers([np.nextafter(thr.tau, np.inf)])[0]
    # Tied scores: tau on the top atom answers nothing (the paper's discrete-score pitfall).
    tied = np.concatenate([np.zeros(150), -np.ones(50)])
    thr = C.calibrate(tied, 0.1, 0.05)
    assert thr.tau == 0.0 and not thr.answers(tied).any()


def test_bad_levels_and_scores_fail_clearly():
    with pytest.raises(ValueError, match="alpha"):
        C.calibrate([0.0], 0.0, 0.05)
    with pytest.raises(ValueError, match="delta"):
        C.calibrate([0.0], 0.1, 1.5)
    with pytest.raises(ValueError, match="finite"):
        C.calibrate([0.0, np.nan], 0.1, 0.05)


def test_evaluate_counts_type1_type2():
    thr = C.Threshold(0.5, 1, 10, 0.1, 0.05, False)
    m = C.evaluate([0.9, 0.1, 0.7, 0.2], [True, True, False, False], thr)
    assert m["type1"] == 0.5 and m["type2"] == 0.5 and m["abstention"] == 0.5
    assert m["accuracy_answered"] == 0.5 and m["accuracy_all"] == 0.5


CONTINUOUS = [(n0, a, d) for n0 in (30, 100, 500) for a in (0.05, 0.1) for d in (0.01, 0.05)]


@pytest.mark.parametrize("n0,alpha,delta", CONTINUOUS)
def test_guarantee_holds_and_is_tight_for_continuous_scores(n0, alpha, delta):
    r = SIM.simulate_guarantee(SIM.NormalLaw(), n0, alpha, delta, reps=20000, seed=n0)
    slack = 4 * math.sqrt(delta * (1 - delta) / 20000)
    assert r["violation_rate_facttest"] <= delta + slack
    # exact for continuous laws: the observed rate matches v(k_hat) within Monte-Carlo error
    assert abs(r["violation_rate_facttest"] - r["expected_continuous"]) <= 4 * r["mc_se"] + 1e-12
    if r["k_hat"] is not None and n0 >= 100:
        assert r["expected_continuous"] >= delta / 3  # close to delta, not vacuous
    assert (
        r["violation_rate_naive"] >= 0.45
    )  # negative control: the plain quantile fails ~half the time


@pytest.mark.parametrize("n0,alpha,delta", [(100, 0.05, 0.05), (500, 0.1, 0.01), (30, 0.1, 0.05)])
def test_guarantee_holds_for_tied_discrete_scores(n0, alpha, delta):
    for law in (SIM.rounded_normal_law(0.25), SIM.ve_like_law()):
        r = SIM.simulate_guarantee(law, n0, alpha, delta, reps=20000, seed=1)
        assert r["violation_rate_facttest"] <= delta + 4 * math.sqrt(delta * (1 - delta) / 20000)


def test_non_strict_rule_breaks_on_ties():
    """Answering at score >= tau (instead of >) violates alpha with tied scores: the strict
    inequality is needed for validity."""
    law = SIM.ve_like_law()
    rng = np.random.default_rng(0)
    x = law.sample(rng, (2000, 100))
    k = C.k_hat(100, 0.1, 0.05)
    tau = np.sort(x, axis=1)[:, k - 1]
    atoms, probs = np.asarray(law.atoms), np.asarray(law.probs)
    type1_ge = (probs * (atoms >= tau[:, None])).sum(1)
    assert (type1_ge > 0.1).mean() > 0.5
    assert (law.sf(tau) > 0.1).mean() <= 0.05
