"""Monte-Carlo check of the FactTest guarantee (no language model; vectorised numpy).

``simulate_guarantee``: draw ``reps`` calibration sets of n0 H0 scores from a known law, take
tau_hat = T_(k_hat) for each, and compute its *true* Type I error P_H0(S > tau_hat) from the law;
the fraction of calibrations whose Type I exceeds alpha must be <= delta. For continuous laws the
exact value is v(k_hat) = P(Bin(n0, 1 - alpha) >= k_hat) (returned as ``expected``); tied
discrete laws are conservative (strict >). The negative control is the plain empirical
(1 - alpha)-quantile, which violates about half of the time.

``simulate_shift``: a 1-D covariate shift with a known, bounded density ratio. Calibration
x ~ U(0, 1), test x ~ density 2x (w(x) = 2x, B = 2), H0 score S = x + sigma * N(0, 1), so test H0
scores are stochastically larger: the unweighted rule violates alpha on the test law, the
rejection-sampled rule (known w, or w estimated by logistic regression on (x, log x)) holds.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from scipy.special import ndtr

from pallasite.eval.facttest.calibration import k_hat, log_binomial_tail
from pallasite.eval.facttest.shift import fit_logistic


@dataclasses.dataclass(frozen=True)
class NormalLaw:
    """Continuous H0 scores ~ N(mean, std^2)."""

    mean: float = 0.0
    std: float = 1.0
    name: str = "normal"

    def sample(self, rng, shape):
        return self.mean + self.std * rng.standard_normal(shape)

    def sf(self, tau):
        return ndtr(-(np.asarray(tau) - self.mean) / self.std)


@dataclasses.dataclass(frozen=True)
class DiscreteLaw:
    """Tied scores: ``atoms`` with probabilities ``probs`` (e.g. vanilla-entropy values)."""

    atoms: tuple
    probs: tuple
    name: str = "discrete"

    def sample(self, rng, shape):
        return rng.choice(np.asarray(self.atoms, np.float64), size=shape, p=np.asarray(self.probs))

    def sf(self, tau):
        atoms, probs = np.asarray(self.atoms, np.float64), np.asarray(self.probs, np.float64)
        return (probs * (atoms > np.asarray(tau)[..., None])).sum(-1)


def rounded_normal_law(step: float = 0.25, width: float = 6.0) -> DiscreteLaw:
    """N(0, 1) rounded to a grid of ``step``: every calibration set has many ties."""
    atoms = np.arange(-width, width + step / 2, step)
    edges = np.concatenate([[-np.inf], (atoms[:-1] + atoms[1:]) / 2, [np.inf]])
    probs = np.diff(ndtr(edges))
    return DiscreteLaw(
        tuple(atoms.tolist()), tuple((probs / probs.sum()).tolist()), name=f"rounded_normal_{step}"
    )


def ve_like_law() -> DiscreteLaw:
    """The 7 values -H(answer counts) takes with m = 5 samples (0 = all five agree), top atom
    heavier than alpha: with a strict > and tau_hat = 0 nothing is answered (the paper's pitfall).
    """
    partitions = [(5,), (4, 1), (3, 2), (3, 1, 1), (2, 2, 1), (2, 1, 1, 1), (1, 1, 1, 1, 1)]
    atoms = [float((np.asarray(q) / 5 * np.log(np.asarray(q) / 5)).sum()) for q in partitions]
    return DiscreteLaw(tuple(atoms), (0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.05), name="ve_m5")


def order_statistic(x_RN: np.ndarray, k: int) -> np.ndarray:
    """The k-th smallest (1-based) value of each row."""
    return np.partition(x_RN, k - 1, axis=-1)[..., k - 1]


def simulate_guarantee(
    law, n0: int, alpha: float, delta: float, *, reps: int = 20000, seed: int = 0, chunk: int = 5000
) -> dict:
    """Violation rates of FactTest and of the naive empirical quantile over ``reps`` runs."""
    rng = np.random.default_rng(seed)
    k = k_hat(n0, alpha, delta)
    t1_ft, t1_naive = [], []
    for start in range(0, reps, chunk):
        x = law.sample(rng, (min(chunk, reps - start), n0))
        tau = np.full(len(x), np.inf) if k is None else order_statistic(x, k)
        t1_ft.append(np.where(np.isinf(tau), 0.0, law.sf(np.where(np.isinf(tau), 0.0, tau))))
        t1_naive.append(law.sf(np.quantile(x, 1 - alpha, axis=1)))
    t1_ft, t1_naive = np.concatenate(t1_ft), np.concatenate(t1_naive)
    expected = 0.0 if k is None else float(np.exp(log_binomial_tail(n0, alpha)[k]))
    return {
        "law": law.name,
        "n0": n0,
        "alpha": alpha,
        "delta": delta,
        "reps": reps,
        "k_hat": k,
        "violation_rate_facttest": float((t1_ft > alpha).mean()),
        "violation_rate_naive": float((t1_naive > alpha).mean()),
        "expected_continuous": expected,  # exact violation probability for a continuous law
        "mc_se": float(np.sqrt(max(expected, 1.0 / reps) * (1 - expected) / reps)),
        "mean_type1_facttest": float(t1_ft.mean()),
        "type1_facttest": t1_ft,
        "type1_naive": t1_naive,
    }


def _test_sf(tau_R, sigma, grid=2000):
    """P(S > tau) for x ~ density 2x on [0, 1], S = x + sigma Z (midpoint quadrature)."""
    x = (np.arange(grid) + 0.5) / grid
    return (2 * x * ndtr(-(np.asarray(tau_R)[:, None] - x) / sigma)).mean(-1)


def simulate_shift(
    n0: int = 500,
    alpha: float = 0.1,
    delta: float = 0.05,
    *,
    reps: int = 20000,
    sigma: float = 0.3,
    seed: int = 0,
    n_test: int = 500,
    estimated_reps: int = 2000,
    l2: float = 1e-3,
) -> dict:
    """Violation rates under the 1-D covariate shift: unweighted rule, rejection-sampled rule with
    the known w(x) = 2x, and with w estimated by logistic regression (``estimated_reps`` runs)."""
    rng = np.random.default_rng(seed)
    x = rng.random((reps, n0))
    s = x + sigma * rng.standard_normal((reps, n0))
    k = k_hat(n0, alpha, delta)
    t1_naive = _test_sf(order_statistic(s, k), sigma) if k is not None else np.zeros(reps)

    def shifted_type1(keep_RN, s_RN):
        out = np.zeros(len(s_RN))
        n_keep = keep_RN.sum(1)
        masked = np.where(keep_RN, s_RN, np.inf)  # rejected items sort last
        for n in np.unique(n_keep):
            rows = n_keep == n
            kk = k_hat(int(n), alpha, delta) if n > 0 else None
            if kk is not None:
                out[rows] = _test_sf(order_statistic(masked[rows], kk), sigma)
        return out, n_keep

    t1_known, n_keep = shifted_type1(rng.random((reps, n0)) < x, s)  # w / B = 2x / 2

    # Estimated w: classifier calibration-x vs test-x on (x, log x); log w = log 2 + log x is in it.
    R = min(estimated_reps, reps)
    x_test = np.sqrt(rng.random((R, n_test)))
    feats = np.stack(
        [np.concatenate([x[:R], x_test], 1), np.log(np.concatenate([x[:R], x_test], 1))], -1
    )
    mean, scale = feats.mean(1, keepdims=True), feats.std(1, keepdims=True)
    y = np.concatenate([np.zeros((R, n0)), np.ones((R, n_test))], 1)
    coef, bias = fit_logistic((feats - mean) / scale, y, l2=l2)
    z_cal = (feats[:, :n0] - mean) / scale
    w_hat = np.exp(np.einsum("rnf,rf->rn", z_cal, coef) + bias[:, None]) * (n0 / n_test)
    keep_hat = rng.random((R, n0)) < w_hat / w_hat.max(1, keepdims=True)
    t1_est, _ = shifted_type1(keep_hat, s[:R])
    return {
        "n0": n0,
        "alpha": alpha,
        "delta": delta,
        "reps": reps,
        "estimated_reps": R,
        "sigma": sigma,
        "violation_rate_unweighted": float((t1_naive > alpha).mean()),
        "violation_rate_shifted_known_w": float((t1_known > alpha).mean()),
        "violation_rate_shifted_estimated_w": float((t1_est > alpha).mean()),
        "mean_accepted": float(n_keep.mean()),
        "mean_type1_unweighted": float(t1_naive.mean()),
        "mean_type1_shifted": float(t1_known.mean()),
    }
