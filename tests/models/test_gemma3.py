"""Gemma 3 (text) as a config of the one transformer, against transformers' ``Gemma3ForCausalLM``
built tiny and random: 6 layers (5 local : 1 global), a window of 5 shorter than the sequences,
head_dim 32 != d/heads, query_pre_attn_scalar 24 != head_dim, RoPE bases 10k / 1M.

Logits <= 1e-4 in both layer layouts, negative controls (each Gemma feature switched off moves the
logits > 1e-2), HF -> pallasite -> HF bit-exact, 32 greedy tokens equal to ``generate`` through
the engine's dense cache (reference and Pallas attention), and the configs Gemma 3 can carry but
pallasite does not implement are refused by name.
"""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from pallasite.models import abstract_model, forward, hf, hf_config, init_model
from pallasite.models.config import ModelConfig

IDS = np.array(
    [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 50], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 200, 255]]
)
PROMPTS = [[2, 17, 200, 43, 9], [2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 99], [2, 250]]
N_NEW = 32
_fwd = jax.jit(forward, static_argnums=0)


def _logits(cfg, state, ids=IDS):
    with jax.default_matmul_precision("highest"):  # true f32 on GPUs too
        return np.asarray(_fwd(nnx.split(abstract_model(cfg))[0], state, ids)[0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(torch model, HF folder, torch logits on IDS)."""
    pytest.importorskip("torch")
    from pallasite.testing import make_tiny_hf_model, pt_logits

    model, path = make_tiny_hf_model("gemma3", tmp_path_factory.mktemp("gemma3"))
    return model, path, pt_logits(model, IDS)


def _read_all(path):
    from safetensors.numpy import load_file

    return load_file(os.path.join(path, hf.SAFETENSORS_SINGLE))


@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
def test_logits_match_transformers(tiny, scan):
    model, path, ref = tiny
    assert model.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    cfg, state = hf.import_hf(path, scan_layers=scan)
    assert cfg.family == "gemma3_text" and cfg.scan_layers == scan and cfg.mixed_layers
    assert (
        cfg.layer_types == ("sliding",) * 5 + ("full",) and cfg.sliding_window == 5 < IDS.shape[1]
    )
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar, cfg.dh) == (
        1e6,
        1e4,
        24.0,
        32,
    )
    assert (
        cfg.tie_embeddings and cfg.norm_unit_offset and cfg.sandwich_norm and cfg.scale_embeddings
    )
    assert jax.tree.structure(state) == jax.tree.structure(nnx.split(abstract_model(cfg))[1])
    assert np.abs(ref).max() > 1.0
    out = _logits(cfg, state)
    print(
        f"tiny Gemma 3 ({'scan' if scan else 'list'}): "
        f"max |logits - transformers| = {np.abs(out - ref).max():.1e}"
    )
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "change",
    [
        "norm_plus_one",
        "embedding_scale",
        "one_rope_base",
        "no_window",
        "query_scale",
        "window_on_every_layer",
    ],
)
def test_negative_controls(tiny, change):
    """Each Gemma feature is visible through the 1e-4 tolerance: switching it off moves the logits
    by more than 1e-2 (the same weights, the same transformers reference)."""
    _, path, ref = tiny
    cfg, state = hf.import_hf(path)
    broken = {
        "norm_plus_one": dict(norm_unit_offset=False),
        "embedding_scale": dict(scale_embeddings=False),
        "one_rope_base": dict(rope_local_theta=cfg.rope_theta),
        "no_window": dict(layer_types=("full",) * 6, rope_local_theta=None),
        "query_scale": dict(query_pre_attn_scalar=None),
        "window_on_every_layer": dict(layer_types=("sliding",) * 6),
    }[change]
    assert np.abs(_logits(cfg.replace(**broken), state) - ref).max() > 1e-2


def test_round_trip_bit_exact(tiny, tmp_path):
    transformers = pytest.importorskip("transformers")
    _, path, _ = tiny
    src = _read_all(path)
    assert "lm_head.weight" not in src and "model.layers.0.pre_feedforward_layernorm.weight" in src
    for scan in (False, True):
        cfg, state = hf.import_hf(path, scan_layers=scan)
        out = tmp_path / f"scan{scan}"
        hf.export_hf(cfg, state, out)
        got = _read_all(out)
        assert sorted(got) == sorted(src)
        for k in src:
            assert got[k].dtype == src[k].dtype and got[k].tobytes() == src[k].tobytes(), k
    assert hf_config.config_from_hf(json.load(open(out / "config.json"))) == cfg.replace(
        scan_layers=False
    )
    a = transformers.AutoConfig.from_pretrained(path).to_dict()
    b = transformers.AutoConfig.from_pretrained(out).to_dict()
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
        "sliding_window",
        "layer_types",
        "query_pre_attn_scalar",
        "hidden_activation",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
        "max_position_embeddings",
        "final_logit_softcapping",
        "attn_logit_softcapping",
    ):
        assert a[key] == b[key], key


def test_export_from_pallasite_init_loads_in_transformers(tmp_path):
    """The export direction alone: a randomly initialised pallasite Gemma 3 (scan layout, its own
    layer pattern and window) gives the same logits in transformers."""
    torch = pytest.importorskip("torch")
    import transformers

    from pallasite.models.config import GEMMA3_FLAGS
    from pallasite.testing import pt_logits

    cfg = ModelConfig(
        vocab_size=256,
        d_model=64,
        n_layers=3,
        n_heads=2,
        n_kv_heads=1,
        head_dim=32,
        d_ff=96,
        **GEMMA3_FLAGS,
        hidden_act="gelu",
        tie_embeddings=True,
        layer_types=("sliding", "full", "sliding"),
        sliding_window=4,
        rope_theta=1e6,
        rope_local_theta=1e4,
        query_pre_attn_scalar=16.0,
        norm_eps=1e-6,
        scan_layers=True,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    state = jax.tree.map(
        lambda x: x + 0.3 * jax.numpy.sign(x), nnx.split(init_model(cfg, seed=3))[1]
    )
    state = jax.tree.map(lambda x: x * 5.0, state)  # far from uniform attention, norms far from 1
    hf.export_hf(cfg, state, tmp_path)
    pt = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, attn_implementation="eager"
    )
    assert type(pt).__name__ == "Gemma3ForCausalLM"
    assert pt.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    np.testing.assert_allclose(_logits(cfg, state), pt_logits(pt, IDS), atol=1e-4, rtol=0)


@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
def test_greedy_tokens_match_transformers(tiny, scan):
    """32 greedy tokens through the engine (dense cache, right-padded prompts of different lengths,
    past the window) equal transformers' ``generate`` run per prompt."""
    from pallasite.inference.engine import generate_ids
    from pallasite.testing import pt_greedy

    model, path, _ = tiny
    model.generation_config.eos_token_id = None  # exactly N_NEW tokens on both sides
    cfg, state = hf.import_hf(path, scan_layers=scan)
    ours = generate_ids(
        nnx.split(abstract_model(cfg))[0], state, cfg, PROMPTS, max_new_tokens=N_NEW, stop_tokens=()
    )
    for i, prompt in enumerate(PROMPTS):
        theirs = pt_greedy(model, np.asarray([prompt]), N_NEW)[0].tolist()
        assert ours[i] == theirs, (
            f"prompt {i}: first difference at token "
            f"{next(j for j, (a, b) in enumerate(zip(ours[i], theirs)) if a != b)}"
        )


@pytest.mark.slow  # interpret-mode Pallas kernels: ~50 s of compiles on 2 cores
def test_pallas_attention_matches_reference(tiny):
    """attention_impl="pallas" (flash prefill + decode kernel, interpret mode on CPU) with the
    per-layer windows: the scan layout picks the window under lax.cond; logits and 8 greedy tokens
    equal the reference path's."""
    from pallasite.inference.engine import generate_ids

    _, path, ref = tiny
    cfg, state = hf.import_hf(path, scan_layers=True)
    pallas = cfg.replace(attention_impl="pallas")
    np.testing.assert_allclose(_logits(pallas, state), ref, atol=1e-4, rtol=0)
    graphdef = nnx.split(abstract_model(cfg))[0]
    want = generate_ids(graphdef, state, cfg, PROMPTS[:2], max_new_tokens=8, stop_tokens=())
    got = generate_ids(
        nnx.split(abstract_model(pallas))[0],
        state,
        pallas,
        PROMPTS[:2],
        max_new_tokens=8,
        stop_tokens=(),
    )
    assert got == want


def test_unsupported_gemma_configs_are_refused(tiny):
    _, path, _ = tiny
    base = json.load(open(os.path.join(path, "config.json")))
    for key, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0)):
        with pytest.raises(ValueError, match=f"{key}={value} is not supported"):
            hf_config.config_from_hf({**base, key: value})
    with pytest.raises(ValueError, match="use_bidirectional_attention=True is not supported"):
        hf_config.config_from_hf({**base, "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="layer_types must be 6 of"):
        hf_config.config_from_hf({**base, "layer_types": ["chunked_attention"] * 6})
    loc = {
        **base,
        "rope_parameters": {
            **base["rope_parameters"],
            "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
        },
    }
    with pytest.raises(ValueError, match="RoPE scaling of the sliding layers"):
        hf_config.config_from_hf(loc)
    # Older config.json layout: rope_theta / rope_local_base_freq / sliding_window_pattern.
    old = {k: v for k, v in base.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=3)
    c = hf_config.config_from_hf(old)
    assert c.layer_types == ("sliding", "sliding", "full") * 2 and (
        c.rope_theta,
        c.rope_local_theta,
    ) == (1e6, 1e4)
    with pytest.raises(
        ValueError, match="layer_types has 'sliding' layers but sliding_window is None"
    ):
        ModelConfig(layer_types=("sliding", "full"), n_layers=2)
    with pytest.raises(ValueError, match="layer_types has 3 entries for n_layers=2"):
        ModelConfig(layer_types=("full",) * 3, n_layers=2)
