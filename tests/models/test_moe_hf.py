"""HF MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): logits parity with PyTorch,
32 identical greedy tokens, export → transformers reload, and config errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite.models import abstract_model, forward, hf, hf_config

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]
IDS = np.array([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 50], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 200, 255]])
N_NEW = 32
_fwd = jax.jit(forward, static_argnums=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("torch")
    from pallasite.testing import make_tiny_hf_model, pt_logits

    out = {}
    for fam in FAMILIES:
        model, path = make_tiny_hf_model(fam, tmp_path_factory.mktemp(fam))
        out[fam] = (model, path, pt_logits(model, IDS))
    return out


def _greedy(cfg, state, ids, n):
    """Argmax loop over a fixed-size buffer (one compile): causal, so later slots don't matter."""
    graphdef = nnx.split(abstract_model(cfg))[0]
    B, T = ids.shape
    buf = jnp.zeros((B, T + n), jnp.int32).at[:, :T].set(ids)
    for t in range(T, T + n):
        logits = _fwd(graphdef, state, buf)[0]
        buf = buf.at[:, t].set(jnp.argmax(logits[:, t - 1], axis=-1).astype(jnp.int32))
    return np.asarray(buf[:, T:])


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_logits_and_greedy_match_pytorch(tiny, family):
    from pallasite.testing import pt_greedy

    torch_model, path, ref = tiny[family]
    cfg, state = hf.import_hf(path)
    assert cfg.ffn == "moe" and cfg.family == family
    graphdef = nnx.split(abstract_model(cfg))[0]
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(_fwd(graphdef, state, IDS)[0])
        np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
        got = _greedy(cfg, state, IDS, N_NEW)
    want = pt_greedy(torch_model, IDS, N_NEW)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_export_reloads_in_transformers(tiny, family, tmp_path):
    import torch
    import transformers

    from pallasite.testing import pt_logits

    torch_model, path, ref = tiny[family]
    cfg, state = hf.import_hf(path)
    hf.export_hf(cfg, state, tmp_path)
    names = json.load(open(os.path.join(path, "config.json")))
    assert names["model_type"] == family
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    np.testing.assert_allclose(pt_logits(reloaded.eval(), IDS), ref, atol=1e-5)  # same weights; torch op order
    # and our own re-import is bit-exact
    cfg2, state2 = hf.import_hf(tmp_path)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(state2)):
        np.testing.assert_array_equal(a, b)


def test_moe_config_errors():
    base = dict(
        model_type="qwen2_moe",
        vocab_size=32,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
    )
    with pytest.raises(ValueError, match="decoder_sparse_step=2"):
        hf_config.config_from_hf({**base, "decoder_sparse_step": 2})
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        hf_config.config_from_hf({**base, "model_type": "mixtral", "num_local_experts": 4, "router_jitter_noise": 0.1})
    with pytest.raises(ValueError, match="clip_qkv=8"):
        hf_config.config_from_hf({**base, "model_type": "olmoe", "clip_qkv": 8})
    cfg = hf_config.config_from_hf({**base, "shared_expert_intermediate_size": 8})
    assert (
        cfg.ffn_config.num_experts == 4
        and cfg.ffn_config.shared_expert_d_ff == 8
        and cfg.ffn_config.norm_topk_prob is False
    )
    assert hf_config.config_from_hf(hf_config.config_to_hf(cfg)) == cfg


def test_placement_permuted_checkpoint_keeps_pytorch_logits(tiny, tmp_path):
    """Occult placement is a params → params permutation: after permuting experts and router
    rows, the exported checkpoint still gives the original PyTorch logits."""
    import torch
    import transformers

    from pallasite.models import occult
    from pallasite.testing import pt_logits

    _, path, ref = tiny["qwen2_moe"]
    cfg, state = hf.import_hf(path)
    placed = occult.apply_placement(state, occult.random_placement(cfg.n_layers, 8, 4, seed=2), num_devices=4)
    hf.export_hf(cfg, placed, tmp_path)
    w0 = hf._Reader(path)("model.layers.0.mlp.experts.0.gate_proj.weight")
    w1 = hf._Reader(str(tmp_path))("model.layers.0.mlp.experts.0.gate_proj.weight")
    assert not np.array_equal(w0, w1)  # the experts really moved on disk
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    np.testing.assert_allclose(pt_logits(reloaded, IDS), ref, atol=1e-5)


def test_non_gated_experts_have_no_hf_layout():
    """The MoLE paper's non-gated MoE experts (MoEConfig.gated=False) cannot be written as a Mixtral / Qwen
    checkpoint (those hold SwiGLU gate/up/down experts): export fails naming the layer and the cause."""
    from pallasite.models import hf_moe
    from pallasite.models.config import ModelConfig
    from pallasite.models.moe import MoEConfig

    cfg = ModelConfig(family="mixtral", d_model=8, d_ff=16, ffn="moe", ffn_config=MoEConfig(num_experts=2, gated=False))
    params = {("router",): np.zeros((8, 2)), ("w_up",): np.zeros((2, 8, 16)), ("w_down",): np.zeros((2, 16, 8))}
    with pytest.raises(ValueError, match=r"layer 0 has non-gated MoE experts"):
        hf_moe._moe_to_hf(cfg, params, "model.layers.0.", 0)
