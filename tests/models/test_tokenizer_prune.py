"""``prune_bpe``: the vocabulary-trimmed BPE a drafter of a large-vocabulary target uses."""

import collections

import numpy as np
import pytest

from pallasite.models.tokenizer import encode_batch, prune_bpe, train_bpe

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma "
         "tau upsilon phi chi psi omega").split()


def _corpus(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    zipf = 1.0 / np.arange(1, len(WORDS) + 1)
    return [" ".join(rng.choice(WORDS, 40, p=zipf / zipf.sum())) + "\n" for _ in range(n)]


@pytest.fixture(scope="module")
def trained():
    texts = _corpus(300, 0)
    tok = train_bpe(texts, 420)
    return tok, texts


def test_prune_keeps_the_frequent_tokens_and_spells_every_string(trained):
    tok, texts = trained
    pruned, kept = prune_bpe(tok, texts, 330)
    assert len(pruned) == 330 == len(kept)
    assert list(kept) == sorted(kept) and len(set(kept.tolist())) == 330
    counts = collections.Counter(i for ids in encode_batch(tok, texts) for i in ids)
    top = [i for i, _ in counts.most_common(20)]
    assert set(top) <= set(kept.tolist())
    held = _corpus(20, 1) + ["zeta-omega (ψ) 42\ttabs\n"]  # unseen characters fall back to byte symbols
    for text in held:
        assert pruned.decode(encode_batch(pruned, [text])[0]) == text
    # a text the original spells with kept tokens only is spelled the same way (new ids = kept order)
    same = diff = 0
    for text in held:
        orig = encode_batch(tok, [text])[0]
        new = [int(kept[i]) for i in encode_batch(pruned, [text])[0]]
        if set(orig) <= set(kept.tolist()):
            assert new == orig
            same += 1
        else:
            assert len(new) > len(orig)  # pruned tokens fall apart into kept pieces
            diff += 1
    assert same and diff  # both cases were exercised
    assert pruned.eos_token == tok.eos_token and pruned.eos_token_id == int(np.flatnonzero(kept == tok.eos_token_id)[0])


def test_prune_maps_onto_the_original_vocabulary(trained):
    from pallasite.inference.speculative import pair_map

    tok, texts = trained
    pruned, kept = prune_bpe(tok, texts, 330)
    pm = pair_map(tok, pruned)
    mapped = pm.d2t >= 0
    assert mapped.sum() >= 330 - len(tok.all_special_ids)
    assert np.array_equal(pm.d2t[mapped], kept[mapped])  # every pruned token is the original token of its id


def test_prune_refuses_a_vocabulary_below_its_floor(trained):
    tok, texts = trained
    with pytest.raises(ValueError, match="vocab_size=100 must exceed"):
        prune_bpe(tok, texts, 100)
