"""The FactTest calibration rule (Nie et al., ICML 2025, arXiv 2411.02603, §3.2; official code
``fannie1208/FactTest``, ``calibration/*/calculate_*_threshold.py``).

H0: the model's answer is incorrect. With T_(1) <= ... <= T_(n0) the sorted certainty scores of
the n0 *incorrect* calibration answers,

    v(k)   = P(Bin(n0, 1 - alpha) >= k) = sum_{j=k}^{n0} C(n0, j) (1 - alpha)^j alpha^(n0 - j)
    k_hat  = min{k in 1..n0 : v(k) <= delta},      tau_hat = T_(k_hat),
    answer iff score > tau_hat (strict), else abstain,

so that P_cal(P_H0(score > tau_hat) > alpha) <= delta for exchangeable H0 data (equality up to the
discreteness of k for continuous scores). v is summed in log space (``gammaln`` + ``logaddexp``).
When n0 < log(delta) / log(1 - alpha), i.e. v(n0) = (1 - alpha)^n0 > delta, no k exists: tau_hat
= +inf and the rule abstains on everything, which the result states (``always_abstain``). The
official loop sums from k = n0 down and uses the first k with v > delta as a 0-based index (=
k_hat); with no valid k it indexes past its array and it never tests k = 1 -- we return +inf and
search all of 1..n0. Its script default ``--alpha 0.8`` is not the paper's value; we set no
default.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
from scipy.special import gammaln


def log_binomial_tail(n0: int, alpha: float) -> np.ndarray:
    """log v(k) for k = 0..n0 (index k), v(k) = P(Bin(n0, 1 - alpha) >= k); v(0) = 1."""
    _check_level("alpha", alpha)
    if int(n0) != n0 or n0 < 0:
        raise ValueError(f"n0 must be a non-negative integer, got {n0!r}")
    n0 = int(n0)
    j = np.arange(n0 + 1, dtype=np.float64)
    log_pmf = (
        gammaln(n0 + 1)
        - gammaln(j + 1)
        - gammaln(n0 - j + 1)
        + j * np.log1p(-alpha)
        + (n0 - j) * np.log(alpha)
    )
    # Tail sums from the top: log v(k) = logaddexp over j >= k.
    return np.logaddexp.accumulate(log_pmf[::-1])[::-1]


def k_hat(n0: int, alpha: float, delta: float) -> Optional[int]:
    """The 1-based order statistic index k_hat, or None when n0 is too small for (alpha, delta)."""
    _check_level("delta", delta)
    if n0 == 0:
        return None
    log_v = log_binomial_tail(n0, alpha)
    ok = np.nonzero(log_v[1:] <= math.log(delta))[
        0
    ]  # v is decreasing in k: the first hit is the min
    return int(ok[0]) + 1 if ok.size else None


def min_n0(alpha: float, delta: float) -> int:
    """Smallest n0 for which a threshold exists: (1 - alpha)^n0 <= delta."""
    _check_level("alpha", alpha)
    _check_level("delta", delta)
    n = math.ceil(math.log(delta) / math.log1p(-alpha))
    while (1 - alpha) ** n > delta:  # guard the float edge of ceil
        n += 1
    while n > 1 and (1 - alpha) ** (n - 1) <= delta:
        n -= 1
    return n


@dataclasses.dataclass(frozen=True)
class Threshold:
    """A calibrated FactTest threshold: answer iff score > tau."""

    tau: float  # +inf when always_abstain
    k_hat: Optional[
        int
    ]  # 1-based order statistic of the sorted H0 scores; None when always_abstain
    n0: int
    alpha: float
    delta: float
    always_abstain: bool
    reason: str = ""

    def answers(self, scores) -> np.ndarray:
        """Boolean mask: answer (score > tau, strict), else abstain."""
        return np.asarray(scores, np.float64) > self.tau

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["tau"] = None if math.isinf(self.tau) else float(self.tau)
        return d


def calibrate(h0_scores, alpha: float, delta: float) -> Threshold:
    """tau_hat from the certainty scores of the incorrect (H0) calibration answers."""
    scores = np.sort(np.asarray(h0_scores, np.float64).ravel())
    if scores.size and not np.all(np.isfinite(scores)):
        raise ValueError("calibrate: H0 scores must be finite (got NaN or inf)")
    n0 = int(scores.size)
    k = k_hat(n0, alpha, delta)
    if k is None:
        need = min_n0(alpha, delta)
        return Threshold(
            math.inf,
            None,
            n0,
            alpha,
            delta,
            True,
            f"n0={n0} incorrect calibration answers < {need} needed for alpha={alpha}, "
            f"delta={delta} ((1-alpha)^n0 > delta): always abstain",
        )
    return Threshold(float(scores[k - 1]), k, n0, alpha, delta, False)


def evaluate(scores, correct, threshold: Threshold) -> dict:
    """Type I (answered | incorrect), Type II (abstained | correct), abstention rate, accuracy on
    the answered questions and accuracy when always answering. (The official ``eval.py`` prints
    Type I as "fnr" and Type II as "fpr"; these names are the paper's.)"""
    scores = np.asarray(scores, np.float64)
    correct = np.asarray(correct, bool)
    if scores.shape != correct.shape:
        raise ValueError(
            f"evaluate: scores {scores.shape} and correct {correct.shape} differ in shape"
        )
    answered = threshold.answers(scores)
    n_wrong, n_right = int((~correct).sum()), int(correct.sum())
    return {
        "n": int(scores.size),
        "n_answered": int(answered.sum()),
        "type1": float((answered & ~correct).sum() / n_wrong) if n_wrong else float("nan"),
        "type2": float((~answered & correct).sum() / n_right) if n_right else float("nan"),
        "abstention": float(1.0 - answered.mean()) if scores.size else float("nan"),
        "accuracy_answered": float(correct[answered].mean()) if answered.any() else float("nan"),
        "accuracy_all": float(correct.mean()) if scores.size else float("nan"),
    }


def _check_level(name: str, value: float) -> None:
    if not (isinstance(value, (int, float, np.floating)) and 0.0 < float(value) < 1.0):
        raise ValueError(f"{name} must lie strictly between 0 and 1, got {value!r}")
