"""The ``panels`` linear kind: a float model on the few-row CPU kernel gives the float model's numbers.

* ``to_panels`` then ``from_panels`` gives back the float state bit for bit (stacked layers too);
  the panels model's logits equal the float model's to rounding, through the tied head too (the
  table in ``pack_table`` order, ``PanelEmbed``), and its greedy text is the same.
* Saved as orbax it loads back as a panels model; exported as HF it is written as the float model.
* Speculative decoding (tli, K = 3) and prompt lookup on a panels target (and drafter) give the
  panels target's own greedy tokens.
* A bf16 model on panels gives the bf16 float model's logits to bf16 rounding.
* Bad input: a width that is not a multiple of 16, a non-float kind, a float16 model or one that
  stores another dtype than it computes in: one clear error.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallasite
from pallasite.errors import ConfigError
from pallasite.inference import engine as E
from pallasite.inference.config import GenerationConfig
from pallasite.inference.speculative import Drafter
from pallasite.models.config import ModelConfig
from pallasite.models.panel_linear import from_panels, to_panels, with_panels
from pallasite.models.transformer import forward, init_model

from ..inference import spec_fixtures as F


def _tiny(**kw):
    cfg = ModelConfig(**{**dict(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                                max_seq_len=128), **kw})
    return cfg, nnx.split(init_model(cfg, seed=3))


@pytest.mark.parametrize("scan,tie", [(False, False), (True, False), (False, True)])
def test_round_trip_and_logits(scan, tie):
    """With ``tie`` the logits come from the tied head, ``PanelEmbed.attend`` on the kernel."""
    cfg, (g, st) = _tiny(scan_layers=scan, tie_embeddings=tie)
    pcfg, pst = to_panels(cfg, st)
    assert pcfg.linear == "panels"
    back_cfg, back = from_panels(pcfg, pst)
    assert back_cfg.linear == "float"
    same = jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), nnx.to_pure_dict(st),
                        nnx.to_pure_dict(back))
    assert all(jax.tree.leaves(same))
    moved = jax.tree.map(lambda a, b: bool((np.asarray(a) != np.asarray(b)).any()), nnx.to_pure_dict(st),
                         nnx.to_pure_dict(pst))
    # q, o, gate, up, down reordered per layer (k and v, one panel of 16 columns, are their own
    # packing), and a tied embedding table (six blocks of 16 rows, each transposed)
    assert sum(jax.tree.leaves(moved)) == (5 if scan else 10) + tie
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, size=(3, 11)), jnp.int32)
    want = forward(g, st, ids)[0]
    pg = nnx.split(nnx.eval_shape(lambda: init_model(pcfg)))[0]
    got = forward(pg, pst, ids)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_bfloat16_model():
    """A bf16 model (stored and computed in bf16) on panels: the kernel reads the bf16 weights and
    sums in float32, as the float kind's dot does; logits agree to bf16 rounding."""
    cfg, (g, st) = _tiny(dtype="bfloat16", param_dtype="bfloat16", tie_embeddings=True)
    st = jax.tree.map(lambda a: a.astype(jnp.bfloat16), st)
    pcfg, pst = to_panels(cfg, st)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 96, size=(2, 9)), jnp.int32)
    want = np.asarray(forward(g, st, ids)[0], np.float32)
    pg = nnx.split(nnx.eval_shape(lambda: init_model(pcfg)))[0]
    got = np.asarray(forward(pg, pst, ids)[0], np.float32)
    np.testing.assert_allclose(got, want, rtol=0.02, atol=0.02 * np.abs(want).max())


def test_generate_save_and_export(tmp_path):
    tc, tg, ts, tok = F.trained("target")
    model = pallasite.Model(tc, ts, tok)
    panels = with_panels(model)
    assert with_panels(panels) is panels
    prompts = ["ab cab ca", "bca a"]
    assert pallasite.generate(panels, prompts, max_new_tokens=16) == pallasite.generate(model, prompts,
                                                                                       max_new_tokens=16)
    ids = model.encode("ab cab ca bca")
    panels.save(str(tmp_path / "orbax"), format="orbax")
    loaded = pallasite.load(str(tmp_path / "orbax"))
    assert loaded.config.linear == "panels"
    np.testing.assert_array_equal(np.asarray(loaded.logits(ids)), np.asarray(panels.logits(ids)))
    panels.save(str(tmp_path / "hf"), format="hf")  # written as the float model
    hf = pallasite.load(str(tmp_path / "hf"))
    assert hf.config.linear == "float"
    np.testing.assert_allclose(np.asarray(hf.logits(ids)), np.asarray(model.logits(ids)), rtol=1e-6, atol=1e-6)


def test_speculative_and_lookup_on_panels():
    target, drafter = F.trained("target"), F.trained("drafter")
    tc, tg, ts, tok = target
    pcfg, pst = to_panels(tc, ts)
    pg = nnx.split(nnx.eval_shape(lambda: init_model(pcfg)))[0]
    dc, dg, ds, dtok = drafter
    dpcfg, dpst = to_panels(dc, ds)
    dpg = nnx.split(nnx.eval_shape(lambda: init_model(dpcfg)))[0]
    prompts = F.prompts_from(tok, 16, seed=11)
    base = GenerationConfig(max_new_tokens=32)
    want = E.generate_ids(pg, pst, pcfg, prompts, base)
    spec = base.replace(drafter=Drafter(dpcfg, dpg, dpst, dtok, target_tokenizer=tok), method="tli",
                        strategy_config={"num_draft_tokens": 3})
    assert E.generate_ids(pg, pst, pcfg, prompts, spec) == want
    lookup = base.replace(strategy="lookup", strategy_config={"num_draft_tokens": 3})
    assert E.generate_ids(pg, pst, pcfg, prompts, lookup) == want


def test_bad_input():
    cfg, (g, st) = _tiny(d_ff=72)
    with pytest.raises(ConfigError, match="multiple of 16"):
        to_panels(cfg, st)
    cfg, (g, st) = _tiny()
    with pytest.raises(ConfigError, match="expected 'float'"):
        to_panels(cfg.replace(linear="fp4"), st)
    with pytest.raises(ConfigError, match="expected 'panels'"):
        from_panels(cfg, st)
    with pytest.raises(ConfigError, match="stores float32 and computes in bfloat16"):
        to_panels(cfg.replace(dtype="bfloat16"), st)
    with pytest.raises(ConfigError, match="float32 / bfloat16"):
        to_panels(cfg.replace(dtype="float16", param_dtype="float16"), st)
