"""Slow: multi-needle retrieval on SmolLM2-135M at 1k context through the CateKV cache, asked at
decode time (``pallasite.eval.catekv_retrieval``), at budget B = 256 (1.82x less KV memory than
dense). The calibrated mask must beat its inverse, a random mask of the same head count and the
memory-matched StreamingLLM window, each by a one-sided sign test over held-out prompts, and stay
near the full cache. Measured with these 16 prompts (docs/attention.md): full 0.859, CateKV 0.781,
inverted 0.250, random 0.219, window 0.484 (CateKV 11-1-4 over the window, p = 0.003; full 4-2-10
over CateKV, p = 0.34). At B = 128 (2.1x) CateKV is not near full (0.53 vs 0.84 at n = 8)."""

import numpy as np
import pytest

N_EVAL = 16  # prompts x 4 needles; a sign test needs >= 7 untied wins without a loss for p < 0.01


@pytest.mark.slow
def test_multi_needle_retrieval_separates_the_calibrated_mask(smollm2):
    from pallasite.eval.catekv_retrieval import run
    from pallasite.inference.cache.catekv_select import CateKVConfig

    ccfg = CateKVConfig(budget=256, init_tokens=16, recent_tokens=64, adaptive_ratio=0.4)
    res = run(smollm2, n_eval=N_EVAL, n_calib=4, context=1024, n_needles=4, ccfg=ccfg, batch=8, log=lambda *a: None)
    acc, per_prompt = res["accuracy"], res["per_prompt"]
    assert set(acc) == {"full", "catekv", "inverted", "random", "window"}
    assert all(len(v) == N_EVAL for v in per_prompt.values())
    assert acc["full"] >= 0.75, acc  # the model does the task with the full cache (measured 0.859)
    # measured gaps: inverted 0.53, random 0.56, window 0.30 (p = 3e-5, 3e-5, 0.003)
    for baseline, margin in (("inverted", 0.25), ("random", 0.25), ("window", 0.15)):
        st = res["sign_test_catekv_vs"][baseline]
        assert acc[baseline] <= acc["catekv"] - margin and st["p"] < 0.01, (baseline, acc, st)
    assert acc["catekv"] >= acc["full"] - 0.125, acc  # near full: measured 0.078 below (5 of 64 needles)
    # equal memory: the three masks have the same head counts; the window is matched to within 1%
    ideal = res["ideal_memory_ratio"]
    assert ideal["inverted"] == ideal["random"] == ideal["catekv"] > 1.3, ideal
    assert abs(ideal["window"] / ideal["catekv"] - 1) < 0.01, ideal


def test_sign_test_and_memory_matched_window():
    """The statistics and the window budget used above: exact binomial tail, ties dropped; the
    window's token count equals CateKV's at the same (N, r, B) within one chunk."""
    from pallasite.eval.catekv_retrieval import random_mask, sign_test_greater, streaming_budget
    from pallasite.inference.cache.catekv_select import CateKVConfig

    st = sign_test_greater(np.array([1, 1, 1, 1, 1, 1, 1, 0.5]), np.array([0, 0, 0, 0, 0, 0, 0, 0.5]))
    assert (st["wins"], st["losses"], st["ties"]) == (7, 0, 1) and st["p"] == pytest.approx(1 / 128)
    st = sign_test_greater(np.array([1, 0, 1, 1]), np.array([0, 1, 0, 0]))
    assert (st["wins"], st["losses"]) == (3, 1) and st["p"] == pytest.approx(5 / 16)
    assert sign_test_greater(np.zeros(4), np.zeros(4))["p"] == 1.0
    ccfg = CateKVConfig(budget=128, init_tokens=16, recent_tokens=64, adaptive_ratio=0.4)
    b = streaming_budget(1024, 0.4, ccfg)
    assert abs(b - (0.4 * 1024 + 0.6 * 128)) <= ccfg.chunk_size / 2 and (b - 80) % ccfg.chunk_size == 0
    m = random_mask((30, 3), 36, np.random.default_rng(0))
    assert m.shape == (30, 3) and m.sum() == 36
