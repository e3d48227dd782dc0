"""FactTest: factuality testing with Type I error control (Nie, Hou, Lin, Zou, Yao, Zhang;
ICML 2025, arXiv 2411.02603; official code fannie1208/FactTest), for any ``pallasite.load`` model.

    from pallasite.eval import facttest as FT
    splits = FT.make_splits(FT.build_qa(), n_cal=400, n_test=200, n_shift=200)
    col = {k: FT.collect(model, v, FT.CollectConfig(m_ve=5, m_se=10)) for k, v in splits.items()}
    result = FT.run_facttest(col["calibration"], {"test": col["test"], "shifted": col["shifted"]},
                             alphas=(0.05, 0.1), delta=0.05)
    thr = FT.calibrate(h0_scores, alpha=0.05, delta=0.01)   # the rule alone: thr.answers(scores)

Modules: ``calibration`` (the rule), ``scores`` (ve / se / kle / white-box), ``judges``
(entailment without an NLI model), ``collect`` (the model calls), ``shift`` (covariate shift),
``qa_data`` (the offline QA set), ``pipeline`` (end to end), ``simulation`` (the guarantee).
"""

from pallasite.eval.facttest.calibration import (Threshold, calibrate, evaluate, k_hat, log_binomial_tail,
                                                 min_n0)
from pallasite.eval.facttest.collect import CollectConfig, Collected, collect
from pallasite.eval.facttest.judges import LMJudge, NormalizedJudge, make_judge
from pallasite.eval.facttest.pipeline import SCORE_NAMES, alpha_sweep, certainty_scores, run_facttest
from pallasite.eval.facttest.qa_data import QAItem, build_qa, is_correct, make_splits, normalize, prompt_for
from pallasite.eval.facttest.shift import (DensityRatio, calibrate_under_shift, fit_density_ratio, fit_logistic,
                                           rejection_sample)

__all__ = [
    "Threshold", "calibrate", "evaluate", "k_hat", "log_binomial_tail", "min_n0",
    "CollectConfig", "Collected", "collect", "LMJudge", "NormalizedJudge", "make_judge",
    "SCORE_NAMES", "alpha_sweep", "certainty_scores", "run_facttest",
    "QAItem", "build_qa", "is_correct", "make_splits", "normalize", "prompt_for",
    "DensityRatio", "calibrate_under_shift", "fit_density_ratio", "fit_logistic", "rejection_sample",
]
