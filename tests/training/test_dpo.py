"""DPO (training/losses/dpo.py) and SimpleMix (training/preference/pairs.py)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.transformer import init_model
from pallasite.training.losses.dpo import DPOConfig, dpo_loss, dpo_terms
from pallasite.training.preference import pairs as P
from pallasite.training.preference.rewards import Prompt
from pallasite.training.recipes.chat import pack_pairs


def test_dpo_loss_against_a_hand_computed_value():
    # margin = 0.1 * ((-3 - -4) - (-5 - -4)) = 0.2;  loss = log(1 + e^-0.2)
    loss, margin, chosen, rejected = dpo_loss(jnp.array([[-3.0, -5.0]]), jnp.array([[-4.0, -4.0]]), 0.1)
    assert math.isclose(float(margin[0]), 0.2, rel_tol=1e-6)
    assert math.isclose(float(loss[0]), math.log1p(math.exp(-0.2)), rel_tol=1e-6)  # 0.598138869...
    assert math.isclose(float(chosen[0]), 0.1, rel_tol=1e-6) and math.isclose(float(rejected[0]), -0.1, rel_tol=1e-6)


def _pair_batch(V=23, T=24, seed=0):
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(3):
        prompt = rng.integers(3, V, 5)
        c, r = rng.integers(3, V, 4), rng.integers(3, V, 6)
        c_ids, r_ids = np.concatenate([prompt, c]), np.concatenate([prompt, r])
        pairs.append((c_ids.astype(np.int32), np.r_[np.zeros(5), np.ones(4)].astype(np.float32),
                      r_ids.astype(np.int32), np.r_[np.zeros(5), np.ones(6)].astype(np.float32)))
    return pack_pairs(pairs, T, pad_id=0)


def test_dpo_terms_on_a_model_match_a_manual_masked_sum():
    cfg = ModelConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    model = init_model(cfg, seed=0)
    rows = _pair_batch()
    rows["ref_logps"] = np.array([[-20.0, -30.0], [-25.0, -25.0], [-31.0, -22.0]], np.float32)
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    terms = jax.jit(lambda b: dpo_terms(model, b, DPOConfig(beta=0.5)))(batch)
    logits = jax.jit(lambda b: model(b["tokens"], b["positions"], segment_ids_BT=b["segment_ids"])[0])(batch)
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    tgt, seg, m = rows["targets"], rows["segment_ids"], rows["loss_mask"]
    want = 0.0
    for b in range(3):
        lp = [sum(logp[b, t, tgt[b, t]] for t in range(tgt.shape[1]) if seg[b, t] == s and m[b, t] > 0) for s in (1, 2)]
        margin = 0.5 * ((lp[0] - rows["ref_logps"][b, 0]) - (lp[1] - rows["ref_logps"][b, 1]))
        want += math.log1p(math.exp(-margin))
    assert math.isclose(float(terms.total), want, rel_tol=1e-5) and float(terms.count) == 3.0


def test_policy_equal_to_reference_gives_log_2():
    from pallasite.api import Model
    from pallasite.training.preference.data import reference_logps

    cfg = ModelConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    model = init_model(cfg, seed=3)
    rows = _pair_batch(seed=1)
    g, s = nnx.split(model)
    rows["ref_logps"] = reference_logps(Model(cfg, s, graphdef=g), rows, batch_size=2)
    terms = jax.jit(lambda b: dpo_terms(model, b))({k: jnp.asarray(v) for k, v in rows.items()})
    np.testing.assert_allclose(float(terms.total) / 3, math.log(2.0), rtol=1e-5)


def _pools():
    p = [Prompt.make([{"role": "user", "content": f"q{i}"}]) for i in range(40)]
    on = [P.Pair(p[i], f"good{i}", f"bad{i}", "onpolicy") for i in range(23)]
    off = [P.Pair(p[i], f"GOOD{i}", f"BAD{i}", "offpolicy") for i in range(40)]
    return on, off


def test_simplemix_ratio_zero_and_one_are_the_pure_streams():
    on, off = _pools()
    for seed in (0, 1):
        assert P.simplemix(on, off, 500, seed, ratio=0.0) == P.pure_stream(off, 500, seed, source="offpolicy")
        assert P.simplemix(on, off, 500, seed, ratio=1.0) == P.pure_stream(on, 500, seed, source="onpolicy")
    mixed = P.simplemix(on, off, 500, 0, ratio=0.5)
    assert mixed != P.pure_stream(off, 500, 0, source="offpolicy")
    # a mixed pair at position k is exactly the pure stream's pair k of its source
    pure_on, pure_off = P.pure_stream(on, 500, 0, source="onpolicy"), P.pure_stream(off, 500, 0, source="offpolicy")
    assert all(m == (pure_on[k] if m.source == "onpolicy" else pure_off[k]) for k, m in enumerate(mixed))


def test_simplemix_onpolicy_fraction_is_binomial():
    on, off = _pools()
    n, r = 4000, 0.5
    sigma = math.sqrt(r * (1 - r) / n)
    for seed in range(3):
        frac = P.onpolicy_fraction(P.simplemix(on, off, n, seed, ratio=r))
        assert abs(frac - r) <= 3 * sigma
        assert abs(frac - 0.6) > 3 * sigma  # negative control: a wrong ratio is rejected
    frac = P.onpolicy_fraction(P.simplemix(on, off, n, 0, ratio=0.2))
    assert abs(frac - 0.2) <= 3 * math.sqrt(0.2 * 0.8 / n)


def test_a_pair_with_chosen_equal_to_rejected_is_refused():
    p = Prompt.make([{"role": "user", "content": "Add 2 and 2."}])
    with pytest.raises(ValueError, match="chosen == rejected"):
        P.Pair(p, "4", "4")
    with pytest.raises(ValueError, match="record 1: .*chosen == rejected"):
        P.pairs_from_records([{"prompt": "a", "chosen": "x", "rejected": "y"}, {"prompt": "b", "chosen": "z", "rejected": "z"}])


def test_onpolicy_pairs_are_best_vs_worst_and_skip_ties():
    p = [Prompt.make([{"role": "user", "content": str(i)}]) for i in range(3)]
    samples = [["a", "b", "c"], ["x", "y", "z"], ["u", "v", "w"]]
    rewards = [[0.0, 1.0, 0.5], [1.0, 1.0, 1.0], [0.2, 0.0, 0.0]]
    got = P.onpolicy_pairs(p, samples, rewards)
    assert [(g.chosen, g.rejected) for g in got] == [("b", "a"), ("u", "w")]
