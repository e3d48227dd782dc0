"""Speculative decoding is lossless under greedy decoding and behaves like the theory says.

* Greedy identity: SD, TLI, SLEM and SLRS (a character-level drafter) emit exactly the target's
  greedy tokens on 200 ragged prompts x 64 tokens (K = 3; K = 1 and 8 are slow-marked; also with
  a confidence threshold, which drafts fewer tokens and narrows the verify), on a
  hand-built tokenizer pair whose concatenations re-tokenise differently; with stop tokens
  (nothing after a stop, rows finish at different rounds); with dense, 4-bit (kv4) and CateKV
  caches in both models (rollback).
* Efficiency: drafter = target gives ceil(n / (K + 1)) target calls, a random drafter about n,
  and acceptance falls as noise is added to the drafter's weights.
* Bad input: a drafter tokenizer that cannot spell the target's text, a drafter whose context is
  shorter than the target's cache, method="sd" across vocabularies, unknown methods, SLRS with a
  drafter whose tokens span several characters or with a target trie past ``slrs_max_nodes``.
"""

import importlib.util
import math
import pathlib
import sys

import jax
import numpy as np
import pytest

from pallasite.errors import ConfigError
from pallasite.inference import engine as E
from pallasite.inference.config import GenerationConfig
from pallasite.inference.speculative import Drafter, stats_of
from pallasite.inference.speculative.build import build_speculative


def _fixtures():
    if "spec_fixtures" not in sys.modules:  # a helper beside this file (tests is no package)
        path = pathlib.Path(__file__).with_name("spec_fixtures.py")
        spec = importlib.util.spec_from_file_location("spec_fixtures", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["spec_fixtures"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["spec_fixtures"]


F = _fixtures()
N_PROMPTS, N_NEW = 200, 64
STOP = 3  # target token "c": greedy rows reach it after different numbers of tokens


@pytest.fixture(scope="module")
def models():
    return F.trained("target"), F.trained("drafter")


@pytest.fixture(scope="module")
def prompts(models):
    return F.prompts_from(models[0][3], N_PROMPTS, seed=3)


def _run(models, prompts, gen):
    tc, tg, ts, _ = models[0]
    strategy, args = build_speculative(gen, len(prompts))
    return E.run_decode(tg, ts, tc, prompts, gen, strategy=strategy, args=args, key=jax.random.key(gen.seed))


@pytest.fixture(scope="module")
def greedy_base(models, prompts):
    tc, tg, ts, _ = models[0]
    return {stops: E.generate_ids(tg, ts, tc, prompts, max_new_tokens=N_NEW, stop_tokens=stops)
            for stops in ((), (STOP,))}


def test_fixture_pair_retokenises_differently(models):
    ttok, dtok = models[0][3], models[1][3]
    a, b = "a", "bc"
    assert ttok.encode(a + b) != ttok.encode(a) + ttok.encode(b)  # [ab, c] vs [a, bc]
    assert dtok.encode(a + b) != dtok.encode(a) + dtok.encode(b)  # [abc] vs [a, b, c]
    assert len(ttok.encode("abc cab")) != len(dtok.encode("abc cab"))


def _check_greedy(models, prompts, greedy_base, method, k, stops=(), **options):
    gen = GenerationConfig(max_new_tokens=N_NEW, stop_tokens=stops, drafter=F.drafter_for(models, method),
                           method=method, strategy_config={"num_draft_tokens": k, **options})
    s = _run(models, prompts, gen)
    got, want = E.results(s), greedy_base[stops]
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not bad, f"{method} K={k}: {len(bad)} rows differ; row {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"
    st = stats_of(s)
    acc = np.asarray(s.extra.stats.accepted_B)
    assert len(set(acc.tolist())) > 1, "rows should accept different numbers of drafts"
    assert st["accepted"] > 0, st
    out, n_out = np.asarray(s.out_BN), np.asarray(s.n_out_B)
    pad = int(models[0][0].pad_token_id or 0)
    assert (n_out <= N_NEW).all()
    assert all((out[i, n_out[i]:] == pad).all() for i in range(len(prompts))), "tokens after the end"
    return s, st


_K3 = {}  # method -> (state, stats) of the K = 3 run, shared with the confidence-threshold test


def _k3(models, prompts, greedy_base, method):
    if method not in _K3:
        _K3[method] = _check_greedy(models, prompts, greedy_base, method, 3)
    return _K3[method]


@pytest.mark.parametrize("method", ["sd", "tli", "slem", "slrs"])
def test_greedy_identity(models, prompts, greedy_base, method):
    s, st = _k3(models, prompts, greedy_base, method)
    assert st["target_calls"] < N_NEW * 0.8, st  # drafts were accepted: fewer target calls than tokens
    if method == "slrs":  # the drafter follows the text (a drafter never fed the target's tokens fails this)
        assert st["acceptance_rate"] > 0.6, st


def test_cut_spellings_keep_the_output(models, prompts, greedy_base):
    """max_spelling=1: target tokens the drafter spells in several tokens are cut to one (a
    narrower catch-up call); the drafter then misses bytes, the output must not change."""
    from pallasite.inference.speculative import pair_map

    assert pair_map(models[0][3], models[1][3], max_len=1).n_truncated > 0  # the cut happens on this pair
    _check_greedy(models, prompts, greedy_base, "tli", 3, max_spelling=1)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 8])
@pytest.mark.parametrize("method", ["sd", "tli", "slem", "slrs"])
def test_greedy_identity_k(models, prompts, greedy_base, method, k):
    _check_greedy(models, prompts, greedy_base, method, k)


@pytest.mark.parametrize("method,of", [("sd", "step"), ("tli", "step"), ("slem", "step"), ("tli", "prefix")])
def test_greedy_identity_with_confidence_threshold(models, prompts, greedy_base, method, of):
    """A row drafts only while the drafter's top probability (or the product of the round's) is
    >= 0.5: some rounds propose fewer than K drafts or none (the verify is narrower), and the
    output is still the target's."""
    s, st = _check_greedy(models, prompts, greedy_base, method, 3, confidence_threshold=0.5, confidence_of=of)
    drafted = np.asarray(s.extra.stats.drafted_B)
    rounds = np.asarray(s.extra.stats.rounds_B)
    full, _ = _k3(models, prompts, greedy_base, method)
    if method != "slem":  # (slem counts target candidates, which a re-tokenisation can make more of)
        assert (drafted <= 3 * rounds).all()
    assert 0 < drafted.sum() < np.asarray(full.extra.stats.drafted_B).sum(), (drafted.sum(), rounds.sum())


@pytest.mark.parametrize("tau", [None, 0.5])
def test_heuristic_schedule(models, prompts, greedy_base, tau):
    """schedule="heuristic" (+2 after a fully accepted round, -1 otherwise, within 1..max_draft_tokens = 4),
    alone and with a confidence threshold: the target's output, and the rows end on different K."""
    s, _ = _check_greedy(models, prompts, greedy_base, "tli", 2, schedule="heuristic", max_draft_tokens=4,
                         confidence_threshold=tau)
    k = np.asarray(s.extra.k_B)
    assert k.min() >= 1 and k.max() == 4 and len(set(k.tolist())) > 2, np.bincount(k)  # the cap is reached


def test_confidence_threshold_one_never_drafts(models, prompts, greedy_base):
    """tau = 1: no softmax of the drafter reaches it, so no round drafts: one target call per token
    (every verify is a one-token call), the target's output."""
    gen = GenerationConfig(max_new_tokens=N_NEW, stop_tokens=(), drafter=F.drafter_for(models, "tli"), method="tli",
                           strategy_config={"num_draft_tokens": 3, "confidence_threshold": 1.0})
    s = _run(models, prompts[:16], gen)
    assert E.results(s) == greedy_base[()][:16]
    st = stats_of(s)
    assert st["drafted"] == 0 and st["target_calls"] == N_NEW, st  # prefill + one call per further token


@pytest.mark.parametrize("method", ["tli", "slem", "slrs"])
def test_stop_tokens_ragged(models, prompts, greedy_base, method):
    s, _ = _check_greedy(models, prompts, greedy_base, method, 3, stops=(STOP,))
    got = E.results(s)
    assert len({len(r) for r in got}) > 3, "rows should finish after different numbers of tokens"
    assert all(STOP not in r[:-1] for r in got), "a token after the stop token"
    assert all(r[-1] == STOP or len(r) == N_NEW for r in got)
    assert any(r[-1] == STOP for r in got)


def _catekv_config(cfg, tmp_path, name):
    from pallasite.inference.cache.catekv_mask import save_head_mask

    mask = np.zeros((cfg.n_layers, cfg.n_kv_heads), bool)
    mask[:, 0] = True  # one adaptive (full) head per layer, the other keeps a budget
    path = save_head_mask(str(tmp_path / f"{name}_mask.json"), mask, cfg)
    return dict(head_mask=path, budget=40, init_tokens=8, recent_tokens=16, chunk_size=4, last_q=8, tail_tokens=8)


@pytest.mark.parametrize("kind", ["kv4", "catekv"])
@pytest.mark.parametrize("method", ["tli", "slem", "slrs"])
def test_cache_kinds_roll_back(models, tmp_path, kind, method):
    """Both models on a kv4 / CateKV cache: identical to the target's own greedy decoding on the
    same cache kind (CateKV: prompts longer than its budget, so entries are dropped; SLRS also
    writes psi's trie-node calls past each row's length, which the next feed overwrites)."""
    (tc, tg, ts, ttok) = models[0]
    dc = F.drafter_for(models, method).config
    lo, hi = (48, 64) if kind == "catekv" else (3, 12)
    ps = F.prompts_from(ttok, 24, seed=9, lo=lo, hi=hi)
    t_opts = _catekv_config(tc, tmp_path, "t") if kind == "catekv" else None
    d_opts = _catekv_config(dc, tmp_path, "d") if kind == "catekv" else None
    n_new = 40
    want = E.generate_ids(tg, ts, tc, ps, max_new_tokens=n_new, stop_tokens=(), kv_cache=kind,
                          kv_cache_config=t_opts)
    gen = GenerationConfig(max_new_tokens=n_new, stop_tokens=(), kv_cache=kind, kv_cache_config=t_opts,
                           drafter=F.drafter_for(models, method), method=method,
                           strategy_config={"num_draft_tokens": 3, "drafter_kv_cache": kind,
                                            "drafter_kv_cache_config": d_opts})
    s = _run(models, ps, gen)
    got = E.results(s)
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not bad, f"{kind}/{method}: {len(bad)} rows differ; row {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"
    assert stats_of(s)["accepted"] > 0
    assert type(s.extra.cache).__name__.lower().startswith({"kv4": "kv4", "catekv": "catekv"}[kind])


def _sd_calls(models, drafter_state, n_new, k, rows=16):
    tc, tg, ts, ttok = models[0]
    ps = F.prompts_from(ttok, rows, seed=21)
    gen = GenerationConfig(max_new_tokens=n_new, stop_tokens=(), method="sd",
                           drafter=Drafter(tc, tg, drafter_state, ttok, target_tokenizer=ttok),
                           strategy_config={"num_draft_tokens": k})
    return stats_of(_run(models, ps, gen))


def test_efficiency_sanity(models):
    tc, tg, ts, _ = models[0]
    n, k = 33, 3
    same = _sd_calls(models, ts, n, k)
    assert same["target_calls"] <= math.ceil(n / (k + 1)) + 1, same  # 1 (prefill) + 8 rounds of 4 tokens
    rand = F.random_model(tc.vocab_size, seed=77)[2]
    r = _sd_calls(models, rand, n, k)
    assert r["target_calls"] >= 0.6 * n, r
    acceptance = []
    for sigma in (0.0, 0.01, 0.03, 0.3):
        noisy = jax.tree.map(lambda a: a + sigma * jax.random.normal(jax.random.key(2), a.shape, a.dtype), ts)
        acceptance.append(_sd_calls(models, noisy, n, k)["acceptance_rate"])
    assert all(a >= b - 0.03 for a, b in zip(acceptance, acceptance[1:])), acceptance
    assert acceptance[0] > acceptance[-1] + 0.3, acceptance


# ----------------------------------------------------------------------------- bad input
def test_bad_inputs(models):
    from tokenizers import Tokenizer, decoders, normalizers
    from tokenizers import models as tm
    from transformers import PreTrainedTokenizerFast

    (tc, tg, ts, ttok), (dc, dg, ds, dtok) = models
    prompt = [ttok.encode("ab cab")]
    # a drafter tokenizer without 'c' (it becomes <unk>): it cannot spell the target's text
    vocab = {"<eos>": 0, "<unk>": 1, "a": 2, "b": 3, "▁": 4, ".": 5, "\n": 6}
    t = Tokenizer(tm.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    t.normalizer = normalizers.Replace(" ", "▁")
    t.decoder = decoders.Sequence([decoders.Replace("▁", " ")])
    no_c = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", unk_token="<unk>")
    gen = GenerationConfig(max_new_tokens=8, drafter=Drafter(dc, dg, ds, no_c, target_tokenizer=ttok), method="slem")
    with pytest.raises(ValueError, match="cannot encode the target's text"):
        build_speculative(gen, 1)
    with pytest.raises(ConfigError, match="share one vocabulary"):
        build_speculative(gen.replace(drafter=F.drafter_for(models, "tli"), method="sd"), 1)
    with pytest.raises(ValueError, match="not a speculative method"):
        GenerationConfig(drafter=F.drafter_for(models, "tli"), method="medusa")
    with pytest.raises(ValueError, match="needs a drafter"):
        GenerationConfig(method="tli")
    with pytest.raises(ConfigError, match="slrs' needs a character- or byte-level drafter"):  # the CLI's one line
        build_speculative(gen.replace(drafter=F.drafter_for(models, "tli"), method="slrs"), 1)
    with pytest.raises(ValueError, match=r"has 3 such prefixes \(SpeculativeConfig.slrs_max_nodes=2\)"):
        build_speculative(gen.replace(drafter=F.drafter_for(models, "slrs"), method="slrs",
                                      strategy_config={"slrs_max_nodes": 2}), 1)
    with pytest.raises(ValueError, match="slrs_max_nodes must be an integer >= 1"):
        build_speculative(gen.replace(drafter=F.drafter_for(models, "slrs"), method="slrs",
                                      strategy_config={"slrs_max_nodes": 0}), 1)
    with pytest.raises(ConfigError, match="confidence_threshold applies to sd, tli and slem"):
        build_speculative(gen.replace(drafter=F.drafter_for(models, "slrs"), method="slrs",
                                      strategy_config={"confidence_threshold": 0.5}), 1)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build_speculative(gen.replace(drafter=F.drafter_for(models, "tli"), strategy_config={"num_draft_tokens": 0}), 1)
    short = Drafter(dc.replace(max_seq_len=32), dg, ds, dtok, target_tokenizer=ttok)
    with pytest.raises(ValueError, match="drafter's context"):
        E.generate_ids(tg, ts, tc, prompt, max_new_tokens=64, drafter=short, method="tli")
    with pytest.raises(TypeError, match="drafter must be"):
        build_speculative(GenerationConfig(drafter="a model name", method="tli"), 1)


def test_pallasite_generate_with_drafter(models):
    """The public API: ``pallasite.generate(model, text, drafter=other_model, method=...)`` gives
    the target's own greedy text (auto -> slem for this greedy, cross-vocabulary pair)."""
    import pallasite

    (tc, tg, ts, ttok), (dc, dg, ds, dtok) = models
    target, drafter = pallasite.Model(tc, ts, ttok, tg), pallasite.Model(dc, ds, dtok, dg)
    prompts = ["ab cab ", "bca a"]
    want = pallasite.generate(target, prompts, max_new_tokens=24, stop_tokens=())
    for method in ("auto", "tli"):
        got = pallasite.generate(target, prompts, max_new_tokens=24, stop_tokens=(), drafter=drafter,
                                 method=method, strategy_config={"num_draft_tokens": 3})
        assert got == want, (method, got, want)
