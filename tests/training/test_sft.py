"""Chat encoding with response-only masks, packing with per-example segments, and zero gradient at
prompt positions (training/recipes/chat.py, training/losses/sft.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.models.config import ModelConfig
from pallasite.models.tokenizer import train_bpe
from pallasite.models.transformer import init_model
from pallasite.training.losses.lm import cross_entropy_sum
from pallasite.training.recipes import chat

TEXTS = ["Add 2 and 3.", "5", "Describe the river.", "the river is calm and wide."] * 20


@pytest.fixture(scope="module")
def tok():
    t = train_bpe(TEXTS, 300, special_tokens=chat.CHAT_SPECIAL_TOKENS)
    t.chat_template = chat.TOY_CHAT_TEMPLATE
    return t


MSGS = [{"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]


def test_the_mask_covers_exactly_the_response(tok):
    ids, mask = chat.encode_example(tok, MSGS, chat.TOY_CHAT_TEMPLATE)
    assert tok.decode(ids[mask == 0]) == "<|user|>Add 2 and 3.\n<|assistant|>"
    assert tok.decode(ids[mask == 1]) == "5<|eos|>"
    assert list(ids[mask == 0]) == chat.prompt_ids(tok, MSGS[:1], chat.TOY_CHAT_TEMPLATE)


def test_a_missing_or_broken_chat_template_is_named(tok):
    bare = train_bpe(TEXTS, 300)
    with pytest.raises(ValueError, match="chat template missing: .* has no chat_template"):
        chat.chat_template_of(bare)
    broken = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
              "{% if add_generation_prompt %}<|user|>{% endif %}")
    with pytest.raises(ValueError, match="does not render the prompt as a prefix"):
        chat.encode_example(tok, MSGS, broken)
    with pytest.raises(ValueError, match="last message must be the assistant"):
        chat.messages_of({"messages": MSGS[:1]})


def test_packing_keeps_examples_whole_in_their_own_segments():
    rng = np.random.default_rng(0)
    examples = []
    for n in (5, 9, 3, 12, 7, 4):
        ids = rng.integers(10, 50, n).astype(np.int32)
        mask = np.r_[np.zeros(n // 2), np.ones(n - n // 2)].astype(np.float32)
        examples.append((ids, mask))
    rows = chat.pack_examples(examples, 16, pad_id=0)
    seen = []
    for r in range(len(rows["tokens"])):
        for s in range(1, rows["segment_ids"][r].max() + 1):
            where = np.flatnonzero(rows["segment_ids"][r] == s)
            assert (np.diff(where) == 1).all()  # contiguous
            assert (rows["positions"][r, where] == np.arange(len(where))).all()  # positions restart
            toks = np.r_[rows["tokens"][r, where], rows["targets"][r, where][-1]]
            seen.append(tuple(toks))
    assert sorted(seen) == sorted(
        tuple(e[0]) for e in examples
    )  # every example whole, exactly once
    assert (rows["loss_mask"][rows["segment_ids"] == 0] == 0).all()
    assert rows["loss_mask"].sum() == sum(e[1][1:].sum() for e in examples)
    with pytest.raises(ValueError, match="example 0 needs 19 positions"):
        chat.pack_examples([(np.arange(20, dtype=np.int32), np.ones(20, np.float32))], 16, pad_id=0)


def test_prompt_positions_get_exactly_zero_gradient():
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    model = init_model(cfg, seed=0)
    rng = np.random.default_rng(1)
    examples = [
        (
            rng.integers(3, 40, n).astype(np.int32),
            np.r_[np.zeros(p), np.ones(n - p)].astype(np.float32),
        )
        for n, p in ((9, 5), (7, 3), (10, 6))
    ]
    rows = {k: jnp.asarray(v) for k, v in chat.pack_examples(examples, 24, pad_id=0).items()}
    hidden = jax.jit(
        lambda r: model(
            r["tokens"], r["positions"], segment_ids_BT=r["segment_ids"], return_hidden=True
        )[0]
    )(rows)
    for chunk in (0, 8):  # the loss the sft / lm kinds use, whole and vocab-chunked
        grad = jax.jit(
            jax.grad(
                lambda h, r: cross_entropy_sum(model, h, r["targets"], r["loss_mask"], chunk)[0]
            )
        )
        per_pos = np.asarray(jnp.abs(grad(hidden, rows)).sum(-1))
        mask = np.asarray(rows["loss_mask"])
        assert (per_pos[mask == 0] == 0.0).all()  # exactly zero at prompt (and padding) positions
        assert (per_pos[mask == 1] > 0).all()
