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
    loss, margin, chosen, rejected = dpo_loss(
        jnp.array([[-3.0, -5.0]]), jnp.array([[-4.0, -4.0]]), 0.1
    )
    assert math.isclose(float(margin[0]), 0.2, rel_tol=1e-6)
    assert math.isclose(float(loss[0]), math.log1p(math.exp(-0.2)), rel_tol=1e-6)  # 0.598138869...
    assert math.isclose(float(chosen[0]), 0.1, rel_tol=1e-6) and math.isclose(
        float(rejected[0]), -0.1, rel_tol=1e-6
    )


def _pair_batch(V=23, T=24, seed=0):
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(3):
        prompt = rng.integers(3, V, 5)
        c, r = rng.integers(3, V, 4), rng.integers(3, V, 6)
        c_ids, r_ids = np.concatenate([prompt, c]), np.concatenate([prompt, r])
        pairs.append(
            (
                c_ids.astype(np.int32),
                np.r_[np.zeros(5), np.ones(4)].astype(np.float32),
                r_ids.astype(np.int32),
                np.r_[np.zeros(5), np.ones(6)].astype(np.float32),
            )
        )
    return pack_pairs(pairs, T, pad_id=0)


def test_dpo_terms_on_a_model_match_a_manual_masked_sum():
    cfg = ModelConfig(vocab_size=23, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    model = init_model(cfg, seed=0)
    rows = _pair_batch()
    rows["ref_logps"] = np.array([[-20.0, -30.0], [-25.0, -25.0], [-31.0, -22.0]], np.float32)
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    terms = jax.jit(lambda b: dpo_terms(model, b, DPOConfig(beta=0.5)))(batch)
    logits = jax.jit(
        lambda b: model(b["tokens"], b["positions"], segment_ids_BT=b["segment_ids"])[0]
    )(batch)
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    tgt, seg, m = rows["targets"], rows["segment_ids"], rows["loss_mask"]
    want = 0.0
    for b in range(3):
        lp = [
            sum(
                logp[b, t, tgt[b, t]] for t in range(tgt.shape[1]) if seg[b, t] == s and m[b, t] > 0
            )
            for s in (1, 2)
        ]
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
        assert P.simplemix(on, off, 500, seed, ratio=0.0) == P.pure_stream(
            off, 500, seed, source="offpolicy"
        )
        assert P.simplemix(on, off, 500, seed, ratio=1.0) == P.pure_stream(
            on, 500, seed, source="onpolicy"
        )
    mixed = P.simplemix(on, off, 500, 0, ratio=0.5)
    assert mixed != P.pure_stream(off, 500, 0, source="offpolicy")
    # a mixed pair at position k is exactly the pure stream's pair k of its source
    pure_on, pure_off = (
        P.pure_stream(on, 500, 0, source="onpolicy"),
        P.pure_stream(off, 500, 0, source="offpolicy"),
    )
    assert all(
        m == (pure_on[k] if m.source == "onpolicy" else pure_off[k]) for k, m in enumerate(mixed)
    )


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
        P.pairs_from_records(
            [
                {"prompt": "a", "chosen": "x", "rejected": "y"},
                {"prompt": "b", "chosen": "z", "rejected": "z"},
            ]
        )


def test_onpolicy_pairs_are_best_vs_worst_and_skip_ties():
    p = [Prompt.make([{"role": "user", "content": str(i)}]) for i in range(3)]
    samples = [["a", "b", "c"], ["x", "y", "z"], ["u", "v", "w"]]
    rewards = [[0.0, 1.0, 0.5], [1.0, 1.0, 1.0], [0.2, 0.0, 0.0]]
    got = P.onpolicy_pairs(p, samples, rewards)
    assert [(g.chosen, g.rejected) for g in got] == [("b", "a"), ("u", "w")]


def test_ratio_zero_and_one_train_bit_for_bit_like_the_pure_streams():
    """Through the one train step: DPO on SimpleMix(r=0) / SimpleMix(r=1) streams gives exactly the
    losses of pure off-policy / on-policy DPO."""
    import optax

    from pallasite.api import Model
    from pallasite.models.tokenizer import train_bpe
    from pallasite.registry import LOSS
    from pallasite.training import step as step_lib
    from pallasite.training.preference.data import pair_rows, reference_logps
    from pallasite.training.recipes.chat import CHAT_SPECIAL_TOKENS, TOY_CHAT_TEMPLATE

    on, off = _pools()
    tok = train_bpe(
        [f"q{i} good{i} bad{i} GOOD{i} BAD{i}" for i in range(40)] * 3,
        300,
        special_tokens=CHAT_SPECIAL_TOKENS,
    )
    tok.chat_template = TOY_CHAT_TEMPLATE
    cfg = ModelConfig(vocab_size=320, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
    graphdef, params, other = step_lib.split_model(init_model(cfg, seed=0))
    ref = Model(
        cfg,
        nnx.state(nnx.merge(graphdef, params, other)),
        graphdef=nnx.split(init_model(cfg, seed=0))[0],
    )
    tx = optax.adam(1e-2)
    step = jax.jit(
        lambda s, b: step_lib.train_step(
            s,
            b,
            graphdef=graphdef,
            optimizer=tx,
            schedule=lambda _: 1e-2,
            loss=LOSS.get("dpo"),
            loss_config=DPOConfig(),
        )
    )
    B, n = 4, 12

    def losses(stream):
        rows = pair_rows(tok, stream, TOY_CHAT_TEMPLATE, 32)
        rows["ref_logps"] = reference_logps(ref, rows, B)
        state = {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": tx.init(params),
            "other": other,
        }
        state = jax.tree.map(
            jnp.array, state
        )  # fresh buffers (the step donates nothing here, but be safe)
        out = []
        for i in range(0, n, B):
            state, m = step(state, {k: jnp.asarray(v[i : i + B]) for k, v in rows.items()})
            out.append(float(m["loss"]))
        return out

    pure_off = losses(P.pure_stream(off, n, 5, source="offpolicy"))
    assert losses(P.simplemix(on, off, n, 5, ratio=0.0)) == pure_off
    assert losses(P.simplemix(on, off, n, 5, ratio=1.0)) == losses(
        P.pure_stream(on, n, 5, source="onpolicy")
    )
    assert losses(P.simplemix(on, off, n, 5, ratio=0.5)) != pure_off  # the comparison can fail
