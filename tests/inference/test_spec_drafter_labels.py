"""Benchmark helpers of speculative decoding: ``spec_drafter.teacher_labels`` (drafter rows labelled with
the target's greedy tokens), ``spec_drafter.target_cut`` (a drafter cut from the target) and
``speculative.teacher_forced_agreement`` (the drafter's top-1 agreement)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallasite
from pallasite.benchmarks.spec_drafter import target_cut, teacher_labels
from pallasite.inference.speculative import pair_map
from pallasite.models.transformer import forward

from .spec_fixtures import corpus, drafter_tokenizer, random_model, target_tokenizer

TEXTS = [corpus(600, seed=s) for s in range(4)]


def _target():
    tok = target_tokenizer()
    cfg, g, st = random_model(len(tok), seed=3, scale=4.0)
    return pallasite.Model(cfg, st, tok, g)


def test_same_tokenizer_labels_are_the_targets_argmax():
    # drafter tokenizer == target tokenizer: every position is a boundary and t2d is the identity, so
    # every label must be the target's own argmax after the row's prefix
    target = _target()
    rows = teacher_labels(target, target.tokenizer, TEXTS, n_windows=6, window=40, seq=24)
    x, y = rows["inputs"], rows["labels"]
    assert x.shape == (6, 25) and y.shape == (6, 24)
    greedy = np.asarray(jnp.argmax(forward(target.graphdef, target.state, jnp.asarray(x[:, :-1]))[0], -1))
    np.testing.assert_array_equal(y, greedy)
    assert (y != x[:, 1:]).any()  # the labels are the target's, not the text's next token


def test_other_tokenizer_labels_boundaries_by_the_target_and_the_rest_by_the_text():
    target = _target()
    dtok = drafter_tokenizer()
    pm = pair_map(target.tokenizer, dtok)
    T, D = pm.target, pm.drafter
    rows = teacher_labels(target, dtok, TEXTS, n_windows=6, window=40, seq=24)
    x, y = rows["inputs"], rows["labels"]
    spellings = {pm.t2d[t, 0] for t in range(T.size) if pm.t2d_len[t] > 0}
    n_intra = n_from_target = 0
    for row, lab in zip(x, y):
        text = D.text_of(row.tolist())
        t_off = set(np.cumsum([T.nbytes(i) for i in target.encode(text.decode())]).tolist())
        d_off = np.cumsum([D.nbytes(i) for i in row.tolist()])
        for m in range(len(lab)):
            if int(d_off[m]) in t_off:  # a target-token boundary: a first drafter piece of a target token
                assert lab[m] in spellings
                n_from_target += int(lab[m] != row[m + 1])
            else:  # inside a target token: the rest of its spelling, from the text
                assert lab[m] == row[m + 1]
                n_intra += 1
    assert n_intra and n_from_target  # both kinds of position were exercised


def _continuations(target, n: int = 3, new: int = 12):
    from pallasite.inference.config import GenerationConfig
    from pallasite.inference.engine import generate_ids

    prompts = [target.encode(TEXTS[i][:60]) for i in range(n)]
    outs = generate_ids(target.graphdef, target.state, target.config, prompts,
                        GenerationConfig(max_new_tokens=new, stop_tokens=()))
    return [(len(p), list(p) + list(o)) for p, o in zip(prompts, outs)]


def test_teacher_forced_agreement_of_the_target_with_itself_is_one_and_of_another_model_its_argmax_share():
    from pallasite.benchmarks.speculative import teacher_forced_agreement

    target = _target()
    texts = _continuations(target)
    same = teacher_forced_agreement(target, target, texts)
    assert same["t2d"]["agreement"] == 1.0 and same["t2d"]["in_intersection"] == 1.0
    assert same["t2d"]["positions"] == same["t2d"]["of"] == 3 * 12
    # another model on the same tokenizer: the share of positions where its own argmax after the
    # target's prefix is the target's greedy token, recomputed here from one forward per text
    tok = target.tokenizer
    cfg, g, st = random_model(len(tok), seed=7, scale=4.0)
    other = pallasite.Model(cfg, st, tok, g)
    hits = 0
    for p, ids in texts:
        pred = np.asarray(jnp.argmax(forward(g, st, jnp.asarray([ids[:-1]], jnp.int32))[0][0], -1))
        hits += int((pred[p - 1:] == np.asarray(ids[p:])).sum())
    got = teacher_forced_agreement(target, other, texts)["t2d"]
    assert got["agreement"] == hits / (3 * 12) < 1.0


def test_teacher_forced_share_in_the_intersection_is_the_share_of_target_tokens_a_drafter_token_spells():
    from pallasite.benchmarks.speculative import teacher_forced_agreement

    target = _target()
    dtok = drafter_tokenizer()
    cfg, g, st = random_model(len(dtok), seed=5)
    drafter = pallasite.Model(cfg, st, dtok, g)
    texts = _continuations(target)
    pm = pair_map(target.tokenizer, dtok)
    drafter_strings = {b for b in pm.drafter.bytes if b}
    cont = [t for p, ids in texts for t in ids[p:]]
    want = sum(pm.target.bytes[t] in drafter_strings for t in cont) / len(cont)
    got = teacher_forced_agreement(target, drafter, texts)["t2d"]["in_intersection"]
    assert 0.0 < want < 1.0 and got == want


def test_target_cut_keeps_the_named_rows_and_blocks():
    target = _target()
    V, n_layers = target.config.vocab_size, target.config.n_layers
    x = jnp.asarray([[1, 7, 3, 4, 9, 2, 5]], jnp.int32)
    # every token and every block in order: the target itself, bit for bit
    whole = target_cut(target, target.tokenizer, np.arange(V), range(n_layers))
    np.testing.assert_array_equal(np.asarray(forward(whole.graphdef, whole.state, x)[0]),
                                  np.asarray(forward(target.graphdef, target.state, x)[0]))
    # other rows and blocks in the order given: embedding row j is target row kept[j], block j is
    # target block layers[j]
    kept, layers = np.random.default_rng(0).permutation(V), [n_layers - 1, 0]
    cut = target_cut(target, target.tokenizer, kept, layers)
    assert (cut.config.n_layers, cut.config.vocab_size) == (2, V)
    full, got = nnx.to_pure_dict(target.state), nnx.to_pure_dict(cut.state)
    np.testing.assert_array_equal(got["embed"]["embedding"], np.asarray(full["embed"]["embedding"])[kept])
    np.testing.assert_array_equal(got["lm_head"]["kernel"], np.asarray(full["lm_head"]["kernel"])[:, kept])
    for j, layer in enumerate(layers):
        for a, b in zip(jax.tree.leaves(got["layers"][j]), jax.tree.leaves(full["layers"][layer])):
            np.testing.assert_array_equal(a, b)


def test_soft_labels_are_the_targets_top_k_renormalised():
    # same tokenizer: every position is a boundary and t2d is the identity, so the soft labels are
    # the target's own top-k tokens with their probabilities over the top-k
    target = _target()
    rows = teacher_labels(target, target.tokenizer, TEXTS, n_windows=4, window=40, seq=24, top_k=3)
    x, y, ids, p = rows["inputs"], rows["labels"], rows["soft_ids"], rows["soft_p"]
    assert ids.shape == p.shape == (4, 24, 3)
    probs = np.asarray(jax.nn.softmax(forward(target.graphdef, target.state, jnp.asarray(x[:, :-1]))[0], -1))
    want_ids = np.argsort(-probs, -1)[..., :3]
    want_p = np.take_along_axis(probs, want_ids, -1)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(p, want_p / want_p.sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(ids[..., 0], y)  # the greedy token leads
    # hard labels are unchanged by asking for soft ones
    np.testing.assert_array_equal(y, teacher_labels(target, target.tokenizer, TEXTS, n_windows=4, window=40,
                                                    seq=24)["labels"])


def test_soft_labels_inside_a_target_token_are_the_spelling():
    target = _target()
    dtok = drafter_tokenizer()
    pm = pair_map(target.tokenizer, dtok)
    T, D = pm.target, pm.drafter
    rows = teacher_labels(target, dtok, TEXTS, n_windows=4, window=40, seq=24, top_k=3)
    x, y, ids, p = rows["inputs"], rows["labels"], rows["soft_ids"], rows["soft_p"]
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
    np.testing.assert_array_equal(ids[..., 0], y)  # the greedy token leads
    spellings = {pm.t2d[t, 0] for t in range(T.size) if pm.t2d_len[t] > 0}
    n_spread = 0
    for row, r_ids, r_p in zip(x, ids, p):
        t_off = set(np.cumsum([T.nbytes(i) for i in target.encode(D.text_of(row.tolist()).decode())]).tolist())
        d_off = np.cumsum([D.nbytes(i) for i in row.tolist()])
        for m in range(len(r_ids)):
            if int(d_off[m]) in t_off:  # a boundary: first drafter pieces of the target's top tokens
                assert set(r_ids[m][r_p[m] > 0].tolist()) <= spellings
                n_spread += int((r_p[m] > 0).sum() > 1)
            else:  # inside a target token: the text's next piece, certain
                assert r_ids[m, 0] == row[m + 1] and r_p[m, 0] == 1.0 and not r_p[m, 1:].any()
    assert n_spread  # some boundary carries more than the greedy token
