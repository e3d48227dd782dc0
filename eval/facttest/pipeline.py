"""FactTest end to end: certainty scores from collected model outputs, calibration on the
incorrect calibration answers, evaluation on held-out and shifted questions, and the
covariate-shift rule (density ratio from the model's question embeddings).

    col = {name: collect(model, items) for name, items in splits.items()}
    result = run_facttest(col["calibration"], {"test": col["test"], "shifted": col["shifted"]},
                          alphas=(0.05, 0.1), delta=0.05)
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from pallasite.eval.facttest import scores as S
from pallasite.eval.facttest.calibration import calibrate, evaluate
from pallasite.eval.facttest.judges import NormalizedJudge
from pallasite.eval.facttest.outputs import Collected
from pallasite.eval.facttest.shift import calibrate_under_shift, fit_density_ratio

SCORE_NAMES = ("ve", "se", "kle", "wb")


def certainty_scores(
    col: Collected, names: Sequence[str] = SCORE_NAMES, judge=None
) -> dict[str, np.ndarray]:
    """{score name: [N] certainty scores} for the collected questions."""
    unknown = sorted(set(names) - set(SCORE_NAMES))
    if unknown:
        raise ValueError(
            f"certainty_scores: unknown score(s) {unknown}; expected some of {SCORE_NAMES}"
        )
    judge = judge or NormalizedJudge()
    out: dict[str, np.ndarray] = {}
    if "ve" in names:
        out["ve"] = np.asarray([S.vanilla_entropy(a) for a in col.ve_answers])
    if "wb" in names:
        out["wb"] = np.asarray([S.white_box(lp) for lp in col.greedy_logprobs])
    if "se" in names or "kle" in names:
        uniq = [S.unique_in_order(a) for a in col.se_answers]
        triples, where = [], []
        for qi, (it, u) in enumerate(zip(col.items, uniq)):
            for i in range(len(u)):
                for j in range(len(u)):
                    if i != j:
                        triples.append((it.question, u[i], u[j]))
                        where.append((qi, i, j))
        probs = judge.nli_probs(triples) if triples else np.zeros((0, 3))
        nli = [np.zeros((len(u), len(u), 3)) for u in uniq]
        for (qi, i, j), p in zip(where, probs):
            nli[qi][i, j] = p
        if "se" in names:
            se = []
            for qi, (ans, u) in enumerate(zip(col.se_answers, uniq)):
                index = {a: n for n, a in enumerate(u)}
                entails = lambda a, b, P=nli[qi], index=index: bool(
                    np.argmax(P[index[a], index[b]]) == 2
                )  # noqa: E731
                se.append(S.semantic_entropy(col.se_mean_loglik[qi], S.cluster_ids(ans, entails)))
            out["se"] = np.asarray(se)
        if "kle" in names:
            out["kle"] = np.asarray(
                [S.kernel_entropy(S.kle_similarity(P, np.swapaxes(P, 0, 1))) for P in nli]
            )
    return {k: out[k] for k in names}


def run_facttest(
    cal: Collected,
    tests: Mapping[str, Collected],
    *,
    alphas: Sequence[float] = (0.05, 0.1),
    delta: float = 0.05,
    names: Sequence[str] = SCORE_NAMES,
    judge=None,
    covariate_shift: bool = True,
    seed: int = 0,
    l2="cv",
) -> dict:
    """Calibrate each score at each alpha on ``cal``'s incorrect answers; evaluate on every test set
    with the plain rule and, if ``covariate_shift``, with the rejection-sampled rule whose density
    ratio is fitted on ``cal`` vs that test set's (unlabelled) question embeddings."""
    cal_scores = certainty_scores(cal, names, judge)
    test_scores = {k: certainty_scores(v, names, judge) for k, v in tests.items()}
    h0 = ~cal.correct
    ratios = (
        {k: fit_density_ratio(cal.embeddings, v.embeddings, l2=l2) for k, v in tests.items()}
        if covariate_shift
        else {}
    )
    result = {
        "n_cal": int(len(cal.correct)),
        "n0": int(h0.sum()),
        "accuracy_cal": float(cal.correct.mean()),
        "delta": delta,
        "judge": (judge or NormalizedJudge()).name,
        "sets": {
            k: {"n": int(len(v.correct)), "accuracy_all": float(v.correct.mean())}
            for k, v in tests.items()
        },
        "scores": {},
    }
    for k, r in ratios.items():
        w = r(cal.embeddings)
        result["sets"][k]["weight_max_over_mean"] = float(w.max() / w.mean())
        result["sets"][k]["density_ratio_l2"] = r.l2
    for name in names:
        per_alpha = {}
        for alpha in alphas:
            thr = calibrate(cal_scores[name][h0], alpha, delta)
            row = {"threshold": thr.to_dict()}
            for k, v in tests.items():
                row[k] = evaluate(test_scores[k][name], v.correct, thr)
                if k in ratios:
                    rng = np.random.default_rng(seed)
                    thr_cs, keep = calibrate_under_shift(
                        cal_scores[name][h0], ratios[k](cal.embeddings[h0]), alpha, delta, rng
                    )
                    row[f"{k}_cs"] = {
                        **evaluate(test_scores[k][name], v.correct, thr_cs),
                        "n0_accepted": int(keep.sum()),
                        "always_abstain": thr_cs.always_abstain,
                    }
            per_alpha[str(alpha)] = row
        result["scores"][name] = per_alpha
    return result


def alpha_sweep(
    cal_scores, cal_correct, test_scores, test_correct, alphas, delta: float
) -> list[dict]:
    """Type I / abstention on a test set for a grid of alphas (the trade-off plot)."""
    h0 = ~np.asarray(cal_correct, bool)
    rows = []
    for alpha in alphas:
        thr = calibrate(np.asarray(cal_scores)[h0], float(alpha), delta)
        rows.append({"alpha": float(alpha), **evaluate(test_scores, test_correct, thr)})
    return rows
