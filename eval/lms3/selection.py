"""LMS3 demonstration selection (Liu et al., ICML 2025, arXiv 2412.12157, Alg. 1; official code
``Ljyustc/LMS3``, ``LMS3.py``), as the official code computes it.

With h the problem representations (``representation.py``) and the last layer's W_q, W_k (GQA-
expanded to W~_k) and W_v in [out, in] orientation (``weights.py``):

    Sim(test, X) = || h_test - W~_k W_q h_X ||_2        (smaller = more similar)
    Stab(X)      = || W_v h_X ||_2                        (unexpanded value projection)
    Score        = Sim * Stab;   top-k = the k smallest Score (in that order)
    rejection    : keep a chosen X only if among the int(lambda |D|) smallest Sim (lambda = 1%);
                   nothing kept -> zero-shot.

``W~_k W_q h`` is the official ``w_k1.T @ (w_q @ x)`` (its comment writes W_k^T W_q); it needs
H*Dh == D (Llama, SmolLM2, Qwen2.5). Where H*Dh != D (Gemma 3, Qwen3) that product is undefined
and ``form="auto"`` uses the comment's W~_k^T W_q h instead -- a deviation, recorded in the result.
Ties (the official ``np.argsort`` is not stable) break by a per-item key, the problem text by
default, so the choice does not depend on the pool's order. Distances in float64 numpy.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from pallasite.eval.lms3.weights import expand_kv, last_layer_qkv

FORMS = ("auto", "code", "transposed")
ONE_SHOT_PREFIX = "Here are some examples you can refer to."
ONE_SHOT_SUFFIX = (
    "\n\n---Now it's your turn!\n- Take a deep breath\n- Think step by step\n"
    "- I will tip $200\n\nQ: "
)
ZERO_SHOT_PREFIX = "Let's think step by step: "


@dataclasses.dataclass(frozen=True)
class Projections:
    w_q: np.ndarray  # [H*Dh, D]
    w_k_expanded: np.ndarray  # [H*Dh, D]
    w_v: np.ndarray  # [K*Dh, D]

    @classmethod
    def from_model(cls, model) -> "Projections":
        wq, wk, wv = last_layer_qkv(model)
        return cls(wq, expand_kv(wk, model.config.n_heads, model.config.n_kv_heads), wv)


def resolve_form(proj: Projections, form: str = "auto") -> str:
    if form not in FORMS:
        raise ValueError(f"LMS3: form={form!r}; expected one of {FORMS}")
    square = proj.w_q.shape[0] == proj.w_q.shape[1]
    if form == "auto":
        return "code" if square else "transposed"
    if form == "code" and not square:
        raise ValueError(
            f"LMS3 form='code' needs H*Dh == D; this model has H*Dh={proj.w_q.shape[0]}, "
            f"D={proj.w_q.shape[1]} (use form='transposed' or 'auto')"
        )
    return form


def transformed_pool(h_pool_ND: np.ndarray, proj: Projections, form: str = "auto") -> np.ndarray:
    """[N, D]: W~_k W_q h_X for every pool item (form 'code'), or W~_k^T W_q h_X ('transposed')."""
    form = resolve_form(proj, form)
    h = np.asarray(h_pool_ND, np.float64)
    q = h @ proj.w_q.T.astype(np.float64)  # [N, H*Dh]
    wk = proj.w_k_expanded.astype(np.float64)
    return q @ wk.T if form == "code" else q @ wk


def sim_stab(
    h_test_MD, h_pool_ND, proj: Projections, form: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """Sim [M, N] and Stab [N] (float64)."""
    t = np.asarray(h_test_MD, np.float64)
    x = transformed_pool(h_pool_ND, proj, form)
    sq = (t * t).sum(1)[:, None] + (x * x).sum(1)[None, :] - 2 * t @ x.T
    sim = np.sqrt(np.maximum(sq, 0.0))
    stab = np.linalg.norm(np.asarray(h_pool_ND, np.float64) @ proj.w_v.T.astype(np.float64), axis=1)
    return sim, stab


def tiebreak_ranks(keys: Sequence[str]) -> np.ndarray:
    """Rank of each item's key (identical keys tie; they are interchangeable demonstrations)."""
    _, inv = np.unique(np.asarray(list(keys), dtype=object), return_inverse=True)
    return inv.astype(np.int64)


def _order(values_N: np.ndarray, tiebreak_N: np.ndarray) -> np.ndarray:
    return np.lexsort((tiebreak_N, values_N))  # primary: value, then the key


def select(
    sim_MN: np.ndarray,
    stab_N: np.ndarray,
    k: int = 1,
    lam: float = 0.01,
    tiebreak_N: Optional[np.ndarray] = None,
) -> list[list[int]]:
    """Alg. 1: the k smallest Score per test item, each kept only if among the int(lam * N)
    smallest Sim; returns the kept pool indices in Score order ([] = zero-shot)."""
    sim = np.asarray(sim_MN, np.float64)
    M, N = sim.shape
    if not 1 <= k <= N:
        raise ValueError(f"LMS3 select: k={k} must lie in 1..{N} (pool size)")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"LMS3 select: lambda={lam} must lie in [0, 1]")
    tb = np.arange(N) if tiebreak_N is None else np.asarray(tiebreak_N)
    score = sim * np.asarray(stab_N, np.float64)[None, :]
    n_near = int(lam * N)
    out = []
    for m in range(M):
        top = _order(score[m], tb)[:k]
        near = set(_order(sim[m], tb)[:n_near].tolist())
        out.append([int(i) for i in top if int(i) in near])
    return out


def select_similar(
    h_test_MD, h_pool_ND, k: int, tiebreak_N: Optional[np.ndarray] = None
) -> list[list[int]]:
    """Similarity retrieval baseline: the k highest cosines on the same representations."""
    t = np.asarray(h_test_MD, np.float64)
    x = np.asarray(h_pool_ND, np.float64)
    cos = (t / np.linalg.norm(t, axis=1, keepdims=True)) @ (
        x / np.linalg.norm(x, axis=1, keepdims=True)
    ).T
    tb = np.arange(x.shape[0]) if tiebreak_N is None else np.asarray(tiebreak_N)
    return [[int(i) for i in _order(-cos[m], tb)[:k]] for m in range(t.shape[0])]


def select_random(n_test: int, n_pool: int, k: int, rng: np.random.Generator) -> list[list[int]]:
    return [rng.choice(n_pool, size=k, replace=False).tolist() for _ in range(n_test)]


def build_prompt(question: str, demos: Sequence[tuple[str, str]]) -> str:
    """The official layout: demonstrations as "Q:/A:" pairs between a fixed prefix and suffix;
    with none, the zero-shot "Let's think step by step: " prompt."""
    if not demos:
        return ZERO_SHOT_PREFIX + question + "\nA: "
    body = "".join(f"\n\nQ: {q}\nA: {a}" for q, a in demos)
    return ONE_SHOT_PREFIX + body + ONE_SHOT_SUFFIX + question + "\nA: "
