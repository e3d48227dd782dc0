"""FactTest certainty scores eta(q, M(q)) from sampled answers (host-side, pure functions).

Higher = more certain. As the official code (``calibration/pararel/calculate_*_threshold.py``):

* ve  (vanilla entropy): -H of the exact-string answer frequencies over m samples (T = 1);
  lies in [-ln m, 0].
* se  (semantic entropy): m samples (T = 0.7) clustered into meaning classes C (below);
  l_k = mean token log-likelihood of sample k, L_C = logsumexp_{k in C} l_k - 5;
  eta = mean over classes of L_C (the official script's ``-entropy``).
* kle (kernel language entropy): over the *unique* answers, pairwise
  s = mean over both directions of (0.7 P(entail) + 0.3 P(neutral)), K = exp(-0.5 (1 - s))
  elementwise (the official code's stand-in for the heat kernel; diagonal 1), normalised to unit
  diagonal and divided by n; eta = sum lambda ln lambda over eigenvalues > 1e-10 (0 for one answer).
* wb  (white box): mean token log-probability of the greedy answer (the log of the geometric mean
  of token probabilities the official ``evaluate_*.py`` reports as ``predict_conf``).

Clustering (``cluster_ids``) reproduces the official single pass over the unique answers
i < j: j takes i's class when i entails j or j entails i (either direction, where semantic
entropy proper asks for both). Entailment comes from a judge (``judges.py``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
from scipy.special import logsumexp

LLH_SHIFT = 5.0
KLE_WEIGHT_ENTAIL, KLE_WEIGHT_NEUTRAL, KLE_TIME = 0.7, 0.3, 0.5


def vanilla_entropy(answers: Sequence[str]) -> float:
    """-H(frequencies of identical answer strings), natural log."""
    if len(answers) == 0:
        raise ValueError("vanilla_entropy: needs at least one answer")
    _, counts = np.unique(np.asarray(list(answers), dtype=object), return_counts=True)
    p = counts / counts.sum()
    return float((p * np.log(p)).sum())


def unique_in_order(answers: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(answers))


def cluster_ids(answers: Sequence[str], entails: Callable[[str, str], bool]) -> np.ndarray:
    """Class id per answer: one pass over the unique answers in first-seen order (the official
    code iterates ``list(set(answers))``, an arbitrary order); j takes i's id when
    ``entails(i, j) or entails(j, i)``."""
    uniq = unique_in_order(answers)
    ids = {a: n for n, a in enumerate(uniq)}
    for i, a in enumerate(uniq):
        for b in uniq[i + 1 :]:
            if entails(a, b) or entails(b, a):
                ids[b] = ids[a]
    return np.asarray([ids[a] for a in answers])


def semantic_entropy(
    mean_loglik: Sequence[float], classes: Sequence[int], shift: float = LLH_SHIFT
) -> float:
    """mean_C (logsumexp_{k in C} l_k - shift), l_k = mean token log-likelihood of sample k."""
    ll = np.asarray(mean_loglik, np.float64)
    cl = np.asarray(classes)
    if ll.shape != cl.shape or ll.size == 0:
        raise ValueError(f"semantic_entropy: {ll.shape} log-likelihoods vs {cl.shape} class ids")
    agg = [logsumexp(ll[cl == c]) for c in np.unique(cl)]
    return float(np.mean(agg) - shift)


def kle_similarity(
    probs_fwd: np.ndarray,
    probs_bwd: np.ndarray,
    w_entail: float = KLE_WEIGHT_ENTAIL,
    w_neutral: float = KLE_WEIGHT_NEUTRAL,
) -> np.ndarray:
    """s = mean over both directions of (w_e P(entail) + w_n P(neutral)); NLI probabilities are
    [..., 3] in the MNLI order (contradiction, neutral, entailment)."""
    f = w_entail * probs_fwd[..., 2] + w_neutral * probs_fwd[..., 1]
    b = w_entail * probs_bwd[..., 2] + w_neutral * probs_bwd[..., 1]
    return (f + b) / 2


def kernel_entropy(similarity_UU: np.ndarray, t: float = KLE_TIME) -> float:
    """sum lambda ln lambda of the normalised kernel exp(-t (1 - s)) over the unique answers."""
    s = np.asarray(similarity_UU, np.float64)
    n = s.shape[0]
    if s.shape != (n, n) or n == 0:
        raise ValueError(f"kernel_entropy: similarity must be square and non-empty, got {s.shape}")
    if n == 1:
        return 0.0
    dist = 1.0 - s
    np.fill_diagonal(dist, 0.0)  # the official matrix holds distances off the diagonal, 0 on it
    k = np.exp(-t * dist)
    d = np.sqrt(np.diag(k))
    k = k / np.outer(d, d) / n
    lam = np.linalg.eigvalsh(k)
    lam = lam[lam > 1e-10]
    return float((lam * np.log(lam)).sum())


def white_box(answer_logprobs: Sequence[float]) -> float:
    """Mean token log-probability of the greedy answer (higher = more certain)."""
    lp = np.asarray(answer_logprobs, np.float64)
    if lp.size == 0:
        raise ValueError("white_box: the answer has no tokens")
    return float(lp.mean())
