"""FactTest under covariate shift (Nie et al., ICML 2025, §3.3; not in the official repository).

Assume P(answer correct | question) is the same under the calibration law P and the test law Q.
Then Q(q | H0) is proportional to w(q) P(q | H0) with w = dQ/dP, and keeping each incorrect
calibration item with probability w(q) / B (B >= max w) leaves an i.i.d. sample of Q(. | H0), to
which the unchanged calibration rule is applied (its guarantee then holds for Q, up to the error
of the estimated w). w is estimated by a probabilistic classifier of calibration (label 0) vs
unlabelled test questions (label 1): w(q) = (n_cal / n_test) * p(1 | q) / p(0 | q). The classifier
is L2-regularised logistic regression fitted by Newton's method (numpy; optional leading batch
axis so a simulation fits thousands of them at once) on standardised features -- for a language
model, its own question embeddings. Choices of ours (the paper leaves them open): B = the largest
estimated weight among the calibration items unless given; the ridge strength on standardised
features chosen by 5-fold cross-validated log loss (``l2="cv"``, default).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from pallasite.eval.facttest.calibration import Threshold, calibrate


def fit_logistic(x_NF, y_N, *, l2: float = 1.0, iters: int = 30, tol: float = 1e-7):
    """L2-regularised logistic regression by Newton's method: returns (coef [..., F], bias [...]).

    ``x`` is [..., N, F] and ``y`` (0/1) is [..., N]; leading axes are independent problems. The
    bias is not penalised. Minimises sum_i logloss_i + l2/2 |coef|^2."""
    x = np.asarray(x_NF, np.float64)
    y = np.asarray(y_N, np.float64)
    if x.ndim < 2 or y.shape != x.shape[:-1]:
        raise ValueError(
            f"fit_logistic: x must be [..., N, F] and y [..., N]; got {x.shape} and {y.shape}"
        )
    xb = np.concatenate([x, np.ones(x.shape[:-1] + (1,))], axis=-1)  # bias as the last feature
    F1 = xb.shape[-1]
    theta = np.zeros(x.shape[:-2] + (F1,))
    penalty = np.full(F1, l2)
    penalty[-1] = 0.0
    for _ in range(iters):
        z = (xb @ theta[..., None])[..., 0]
        p = 1.0 / (1.0 + np.exp(-z))
        grad = (np.swapaxes(xb, -1, -2) @ (p - y)[..., None])[..., 0] + penalty * theta
        s = p * (1 - p) + 1e-12
        hess = np.swapaxes(xb * s[..., None], -1, -2) @ xb + np.diag(penalty + 1e-9)
        step = np.linalg.solve(hess, grad[..., None])[..., 0]
        theta = theta - step
        if np.max(np.abs(step)) < tol:
            break
    return theta[..., :-1], theta[..., -1]


@dataclasses.dataclass(frozen=True)
class DensityRatio:
    """w(x) = dQ/dP estimated by a calibration-vs-test classifier; call it on features [N, F]."""

    mean: np.ndarray
    scale: np.ndarray
    coef: np.ndarray
    bias: float
    prior_ratio: float  # n_cal / n_test
    l2: float = 1.0  # the ridge strength used

    def log_weights(self, features) -> np.ndarray:
        z = (np.asarray(features, np.float64) - self.mean) / self.scale
        return z @ self.coef + self.bias + np.log(self.prior_ratio)

    def __call__(self, features) -> np.ndarray:
        return np.exp(self.log_weights(features))


L2_GRID = (0.1, 1.0, 10.0, 100.0, 1000.0)


def _logloss(x, y, coef, bias):
    z = x @ coef + bias
    return float(np.mean(np.logaddexp(0.0, z) - y * z))


def choose_l2(x, y, grid=L2_GRID, folds: int = 5, seed: int = 0) -> float:
    """The ridge strength with the smallest cross-validated log loss (stratified folds)."""
    rng = np.random.default_rng(seed)
    fold = np.empty(len(y), int)
    for cls in (0, 1):
        idx = np.nonzero(y == cls)[0]
        fold[rng.permutation(idx)] = np.arange(len(idx)) % folds
    losses = []
    for l2 in grid:
        loss = 0.0
        for f in range(folds):
            tr, te = fold != f, fold == f
            coef, bias = fit_logistic(x[tr], y[tr], l2=l2)
            loss += _logloss(x[te], y[te], coef, bias) * te.sum()
        losses.append(loss)
    return float(grid[int(np.argmin(losses))])


def fit_density_ratio(features_cal, features_test, *, l2="cv") -> DensityRatio:
    """Classifier-based density ratio test/calibration from unlabelled features of both sets;
    ``l2="cv"`` picks the ridge strength from ``L2_GRID`` by 5-fold cross-validated log loss."""
    fc = np.asarray(features_cal, np.float64)
    ft = np.asarray(features_test, np.float64)
    if fc.ndim != 2 or ft.ndim != 2 or fc.shape[1] != ft.shape[1]:
        raise ValueError(
            "fit_density_ratio: features must be [N, F] with the same F; "
            f"got {fc.shape} and {ft.shape}"
        )
    if len(fc) == 0 or len(ft) == 0:
        raise ValueError("fit_density_ratio: needs at least one calibration and one test point")
    x = np.concatenate([fc, ft])
    mean, scale = x.mean(0), x.std(0) + 1e-8
    y = np.concatenate([np.zeros(len(fc)), np.ones(len(ft))])
    z = (x - mean) / scale
    # The ridge solution lies in the row space of z: fit in its coordinates (exact, and r <= N).
    _, sv, vt = np.linalg.svd(z, full_matrices=False)
    basis = vt[sv > sv.max() * 1e-10].T  # [F, r]
    zr = z @ basis
    if l2 == "cv":
        l2 = choose_l2(zr, y)
    coef_r, bias = fit_logistic(zr, y, l2=float(l2))
    return DensityRatio(mean, scale, basis @ coef_r, float(bias), len(fc) / len(ft), float(l2))


def rejection_sample(
    weights, rng: np.random.Generator, bound: Optional[float] = None
) -> np.ndarray:
    """Keep item i with probability w_i / B (B = max w unless given; B must be >= max w)."""
    w = np.asarray(weights, np.float64)
    if np.any(w < 0) or not np.all(np.isfinite(w)):
        raise ValueError("rejection_sample: weights must be finite and non-negative")
    bound = float(w.max()) if bound is None else float(bound)
    if w.size and bound < w.max() * (1 - 1e-12):
        raise ValueError(f"rejection_sample: bound B={bound} is below the largest weight {w.max()}")
    if bound <= 0:
        return np.zeros(w.shape, bool)
    return rng.random(w.shape) < w / bound


def calibrate_under_shift(
    h0_scores,
    h0_weights,
    alpha: float,
    delta: float,
    rng: np.random.Generator,
    bound: Optional[float] = None,
) -> tuple[Threshold, np.ndarray]:
    """Rejection-sample the H0 calibration items by w / B, then the unchanged rule; returns the
    threshold (on the accepted n0' items) and the acceptance mask."""
    scores = np.asarray(h0_scores, np.float64)
    keep = rejection_sample(h0_weights, rng, bound)
    if keep.shape != scores.shape:
        raise ValueError(f"calibrate_under_shift: {scores.shape} scores vs {keep.shape} weights")
    return calibrate(scores[keep], alpha, delta), keep
