"""Prompt lookup decoding (strategy "lookup"): drafts copied from the row's own text.

* ``propose`` equals a plain-Python reading of the rule (longest n-gram first, most recent earlier
  occurrence, periodic continuation) on random texts over a small alphabet, where matches abound.
* Greedy identity with target-only decoding on 64 ragged prompts x 48 tokens (K = 1, 3), with stop
  tokens (nothing after a stop, rows end at different rounds) and exactly ``max_new_tokens``;
  on text that repeats itself the lookup drafts and most drafts are accepted (fewer target calls
  than tokens).
* The sampled law (G-test with a negative control) is in test_speculative_dist.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.errors import ConfigError
from pallasite.inference import engine as E
from pallasite.inference.config import GenerationConfig
from pallasite.inference.speculative import stats_of
from pallasite.inference.speculative.lookup import LookupConfig, build_lookup, propose

from . import spec_fixtures as F

STOP = 3  # target token "c" (as in test_speculative.py): rows reach it after different numbers of tokens


def reference_propose(text, k, max_ngram, min_ngram):
    """(draft, found) by the rule as one would write it by hand."""
    L = len(text)
    for n in range(max_ngram, min_ngram - 1, -1):
        if L <= n:
            continue
        suffix = text[L - n:]
        for start in range(L - n - 1, -1, -1):  # most recent first; a token must follow the match
            if text[start:start + n] == suffix:
                extended = list(text)
                for j in range(k):  # the copy reads what it has copied: periodic past the end
                    extended.append(extended[start + n + j])
                return extended[L:], True
    return None, False


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_propose_matches_the_rule_written_by_hand(max_ngram, min_ngram):
    rng = np.random.default_rng(max_ngram * 10 + min_ngram)
    B, L, k = 64, 24, 5
    text = rng.integers(0, 4, size=(B, L)).astype(np.int32)
    lengths = rng.integers(1, L + 1, size=B).astype(np.int32)
    drafts, found = jax.jit(propose, static_argnums=(2, 3, 4))(jnp.asarray(text), jnp.asarray(lengths), k,
                                                               max_ngram, min_ngram)
    drafts, found = np.asarray(drafts), np.asarray(found)
    n_found = 0
    for b in range(B):
        want, ok = reference_propose([int(t) for t in text[b, :lengths[b]]], k, max_ngram, min_ngram)
        assert bool(found[b]) == ok, (b, text[b, :lengths[b]])
        if ok:
            n_found += 1
            assert drafts[b].tolist() == want, (b, text[b, :lengths[b]])
    assert 0 < n_found < B  # both branches were exercised


def test_propose_by_hand():
    text = jnp.asarray([[1, 2, 3, 1, 2, 0, 0], [5, 6, 7, 8, 9, 0, 0]], jnp.int32)
    drafts, found = propose(text, jnp.asarray([5, 5], jnp.int32), 4, 3, 1)
    # row 0: "1 2" recurs; after it came "3", then the copy continues with itself (period 3)
    assert np.asarray(found).tolist() == [True, False]
    assert np.asarray(drafts)[0].tolist() == [3, 1, 2, 3]


@pytest.fixture(scope="module")
def target():
    return F.trained("target")


def _run(target, prompts, gen):
    tc, tg, ts, _ = target
    strategy, args = build_lookup(gen, len(prompts))
    return E.run_decode(tg, ts, tc, prompts, gen, strategy=strategy, args=args, key=jax.random.key(0))


@pytest.mark.parametrize("k,stops", [(3, ()), (1, ()), (3, (STOP,))])
def test_greedy_identity(target, k, stops):
    tc, tg, ts, tok = target
    prompts = F.prompts_from(tok, 64, seed=5)
    n_new = 48
    base = GenerationConfig(max_new_tokens=n_new, stop_tokens=stops)
    want = E.generate_ids(tg, ts, tc, prompts, base)
    gen = base.replace(strategy="lookup", strategy_config={"num_draft_tokens": k})
    s = _run(target, prompts, gen)
    got = E.results(s)
    assert got == want
    st = stats_of(s)
    assert st["drafted"] > 0 and st["accepted"] > 0
    if stops:
        lens = {len(o) for o in got}
        assert len(lens) > 2  # rows ended after different numbers of tokens
        assert all(STOP not in o[:-1] for o in got)  # nothing after a stop
    else:
        assert all(len(o) == n_new for o in got)


def test_repeated_text_takes_fewer_target_calls(target):
    """On text that repeats itself the lookup drafts every round and enough drafts are accepted
    that the target runs fewer calls than it makes tokens (target-only: one call per token;
    measured 26 calls for 40 tokens)."""
    tc, tg, ts, tok = target
    base = GenerationConfig(max_new_tokens=40)
    unit = tok.encode("ab ca bc ")
    prompts = [unit * 4, unit * 5]
    want = E.generate_ids(tg, ts, tc, prompts, base)
    s = _run(target, prompts, base.replace(strategy="lookup", strategy_config={"num_draft_tokens": 4}))
    assert E.results(s) == want
    st = stats_of(s)
    assert st["drafted"] >= 4 * (st["target_calls"] - 1), st  # a match every round
    assert st["target_calls_per_token"] < 0.8, st


def test_generate_and_bad_options(target):
    import pallasite

    tc, tg, ts, tok = target
    model = pallasite.Model(tc, ts, tok)
    text = "ab cab ca"
    assert (pallasite.generate(model, text, max_new_tokens=12, strategy="lookup", strategy_config={"k": 2})
            == pallasite.generate(model, text, max_new_tokens=12))
    with pytest.raises(ConfigError, match="min_ngram"):
        LookupConfig(max_ngram=2, min_ngram=3)
    with pytest.raises(ConfigError, match="num_draft_tokens"):
        GenerationConfig(strategy="lookup", strategy_config={"num_draft_tokens": 0})
    with pytest.raises(ConfigError, match="no drafter"):
        pallasite.generate(model, text, max_new_tokens=4, strategy="lookup", drafter=model)
    with pytest.raises(ConfigError, match="constraint"):
        build_lookup(GenerationConfig(strategy="lookup", constraint={"kind": "regex", "spec": "a+"}), 1)


@pytest.mark.parametrize("kind", ["kv4", "catekv"])
def test_cache_kinds_roll_back(target, tmp_path, kind):
    """On a kv4 / CateKV cache (CateKV: prompts longer than its budget, so entries are dropped):
    identical to target-only greedy decoding on the same cache kind; the verify writes past the
    accepted tokens, which the next round overwrites."""
    from pallasite.inference.cache.catekv_mask import save_head_mask

    tc, tg, ts, tok = target
    opts = None
    if kind == "catekv":
        mask = np.zeros((tc.n_layers, tc.n_kv_heads), bool)
        mask[:, 0] = True  # one adaptive (full) head per layer, the other keeps a budget
        opts = dict(head_mask=save_head_mask(str(tmp_path / "mask.json"), mask, tc), budget=40, init_tokens=8,
                    recent_tokens=16, chunk_size=4, last_q=8, tail_tokens=8)
    lo, hi = (48, 64) if kind == "catekv" else (3, 12)
    prompts = F.prompts_from(tok, 24, seed=9, lo=lo, hi=hi)
    base = GenerationConfig(max_new_tokens=40, stop_tokens=(), kv_cache=kind, kv_cache_config=opts)
    want = E.generate_ids(tg, ts, tc, prompts, base)
    s = _run(target, prompts, base.replace(strategy="lookup"))
    assert E.results(s) == want
    assert stats_of(s)["accepted"] > 0
    assert type(s.cache).__name__.lower().startswith(kind)
