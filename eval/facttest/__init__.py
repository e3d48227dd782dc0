"""FactTest: factuality testing with Type I error control (Nie, Hou, Lin, Zou, Yao, Zhang;
ICML 2025, arXiv 2411.02603; official code fannie1208/FactTest), for any ``pallasite.load`` model.

    from pallasite.eval import facttest as FT
    splits = FT.make_splits(FT.build_qa(), n_cal=400, n_test=200, n_shift=200)
    col = {k: FT.collect(model, v, FT.CollectConfig(m_ve=5, m_se=10)) for k, v in splits.items()}
    result = FT.run_facttest(col["calibration"], {"test": col["test"], "shifted": col["shifted"]},
                             alphas=(0.05, 0.1), delta=0.05)
    thr = FT.calibrate(h0_scores, alpha=0.05, delta=0.01)   # the rule alone: thr.answers(scores)

Modules: ``calibration`` (the rule), ``scores`` (ve / se / kle / white-box), ``judges``
(entailment without an NLI model), ``outputs`` (the model calls: ``collect``), ``shift`` (covariate shift),
``qa_data`` (the offline QA set), ``pipeline`` (end to end), ``simulation`` (the guarantee).
"""


from pallasite.lazy import lazy_exports

_EXPORTS = {
    "Threshold": "pallasite.eval.facttest.calibration",
    "calibrate": "pallasite.eval.facttest.calibration",
    "evaluate": "pallasite.eval.facttest.calibration",
    "k_hat": "pallasite.eval.facttest.calibration",
    "log_binomial_tail": "pallasite.eval.facttest.calibration",
    "min_n0": "pallasite.eval.facttest.calibration",
    "CollectConfig": "pallasite.eval.facttest.outputs",
    "Collected": "pallasite.eval.facttest.outputs",
    "collect": "pallasite.eval.facttest.outputs",
    "LMJudge": "pallasite.eval.facttest.judges",
    "NormalizedJudge": "pallasite.eval.facttest.judges",
    "make_judge": "pallasite.eval.facttest.judges",
    "SCORE_NAMES": "pallasite.eval.facttest.pipeline",
    "alpha_sweep": "pallasite.eval.facttest.pipeline",
    "certainty_scores": "pallasite.eval.facttest.pipeline",
    "run_facttest": "pallasite.eval.facttest.pipeline",
    "QAItem": "pallasite.eval.facttest.qa_data",
    "build_qa": "pallasite.eval.facttest.qa_data",
    "is_correct": "pallasite.eval.facttest.qa_data",
    "make_splits": "pallasite.eval.facttest.qa_data",
    "normalize": "pallasite.eval.facttest.qa_data",
    "prompt_for": "pallasite.eval.facttest.qa_data",
    "DensityRatio": "pallasite.eval.facttest.shift",
    "calibrate_under_shift": "pallasite.eval.facttest.shift",
    "fit_density_ratio": "pallasite.eval.facttest.shift",
    "fit_logistic": "pallasite.eval.facttest.shift",
    "rejection_sample": "pallasite.eval.facttest.shift",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
