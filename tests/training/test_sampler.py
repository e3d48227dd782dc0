"""The n-per-prompt sampler (training/preference/sampler.py) on the inference engine: shapes,
greedy copies equal to one greedy generation, temperature sampling that varies with the seed."""

import pytest
from flax import nnx

from pallasite.api import Model
from pallasite.inference.engine import generate_ids
from pallasite.models.config import ModelConfig
from pallasite.models.tokenizer import train_bpe
from pallasite.models.transformer import init_model
from pallasite.training.preference.sampler import sample_responses, stop_ids
from pallasite.training.recipes import chat


@pytest.fixture(scope="module")
def model():
    tok = train_bpe(["Add 2 and 3. 5 Describe the river."] * 20, 300,
                    special_tokens=chat.CHAT_SPECIAL_TOKENS)
    tok.chat_template = chat.TOY_CHAT_TEMPLATE
    cfg = ModelConfig(vocab_size=320, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                      eos_token_id=(int(tok.eos_token_id),))
    graphdef, state = nnx.split(init_model(cfg, seed=0))
    return Model(cfg, state, tok, graphdef)


PROMPTS = [[{"role": "user", "content": "Add 2 and 3."}],
           [{"role": "user", "content": "Describe the river."}]]


def test_greedy_copies_equal_one_engine_generation(model):
    got = sample_responses(model, PROMPTS, n=3, temperature=0.0, max_new_tokens=6, batch_size=4)
    assert [len(g) for g in got] == [3, 3]
    for msgs, texts in zip(PROMPTS, got):
        ids = chat.prompt_ids(model.tokenizer, msgs, chat.TOY_CHAT_TEMPLATE)
        stops = stop_ids(model)
        out = generate_ids(model.graphdef, model.state, model.config, [ids], max_new_tokens=6,
                           temperature=0.0, stop_tokens=stops)[0]
        cut = next((i for i, t in enumerate(out) if t in stops), len(out))
        want = model.tokenizer.decode(out[:cut], skip_special_tokens=True)
        assert texts == [want] * 3


def test_sampling_varies_and_is_seeded(model):
    a = sample_responses(model, PROMPTS, n=4, temperature=1.0, max_new_tokens=6, seed=0)
    b = sample_responses(model, PROMPTS, n=4, temperature=1.0, max_new_tokens=6, seed=0)
    c = sample_responses(model, PROMPTS, n=4, temperature=1.0, max_new_tokens=6, seed=1)
    assert a == b and a != c
    assert len(set(a[0])) > 1  # a random model at temperature 1 does not repeat itself
