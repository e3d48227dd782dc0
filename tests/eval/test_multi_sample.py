"""The shared-prefill sampler and the batched scoring helpers against the engine and against
each other, on a tiny random model: greedy rows equal ``pallasite.generate`` token for token,
recorded log-probabilities equal an independent forward, sampled rows follow the model's
distribution, stop tokens end a row."""

import numpy as np
import pytest

import pallasite
from pallasite.eval.model_calls import continuation_logprobs, mean_hidden, next_token_logprobs
from pallasite.eval.multi_sample import sample_rows

torch = pytest.importorskip("torch")
from pallasite.testing import make_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, path = make_tiny_hf_model("llama", tmp_path_factory.mktemp("ms_llama"), seed=5)
    return pallasite.load(path)


PROMPTS = [[5, 9, 33, 4], [7, 100, 3, 3, 8, 21, 40, 9, 17, 200, 6], [1], [77, 78]]


def test_greedy_rows_equal_generate_and_logprobs_equal_a_forward(model):
    want = pallasite.generate(model, PROMPTS, max_new_tokens=12, stop_tokens=[-5])
    rows = sample_rows(
        model, PROMPTS, temperatures=[0.0, 0.0], max_new_tokens=12, prompts_per_batch=3
    )
    for w, r in zip(want, rows):
        assert r[0][0] == w and r[1][0] == w
    lp = continuation_logprobs(model, PROMPTS, [r[0][0] for r in rows], batch_size=3)
    for r, x in zip(rows, lp):
        np.testing.assert_allclose(r[0][1], x, atol=2e-4)


def test_stop_tokens_end_rows(model):
    free = sample_rows(model, PROMPTS, temperatures=[1.0] * 4, max_new_tokens=10, seed=1)
    stop = {t for q in free for ids, _ in q for t in ids[2:4]}
    rows = sample_rows(
        model, PROMPTS, temperatures=[1.0] * 4, max_new_tokens=10, stop_tokens=stop, seed=1
    )
    for q in rows:
        for ids, lp in q:
            assert len(ids) == len(lp)
            hits = [i for i, t in enumerate(ids) if t in stop]
            assert (
                not hits or hits[0] == len(ids) - 1
            )  # the first stop token is the last one emitted


def test_sampled_first_tokens_follow_the_model_distribution(model):
    p = np.exp(next_token_logprobs(model, [PROMPTS[0]], list(range(model.config.vocab_size)))[0])
    rows = sample_rows(
        model,
        [PROMPTS[0]] * 8,
        temperatures=[1.0] * 64,
        max_new_tokens=1,
        seed=3,
        prompts_per_batch=8,
    )
    firsts = np.array([ids[0] for q in rows for ids, _ in q])
    top = np.argsort(-p)[:3]
    for t in top:  # 512 draws: the frequency of each of the 3 likeliest tokens within 5 sigma
        f = (firsts == t).mean()
        assert abs(f - p[t]) < 5 * np.sqrt(p[t] * (1 - p[t]) / 512) + 1e-3
    assert len(set(firsts.tolist())) > 3  # not greedy


def test_mean_hidden_ignores_padding(model):
    a = mean_hidden(model, [PROMPTS[0]], batch_size=1)
    b = mean_hidden(model, [PROMPTS[0], PROMPTS[1]], batch_size=2)[0]
    np.testing.assert_allclose(a[0], b, atol=1e-5)


def test_bad_inputs_fail_clearly(model):
    with pytest.raises(ValueError, match="temperatures"):
        sample_rows(model, PROMPTS, temperatures=[], max_new_tokens=3)
    with pytest.raises(ValueError, match="at least one token"):
        sample_rows(model, [[]], temperatures=[0.0], max_new_tokens=3)
