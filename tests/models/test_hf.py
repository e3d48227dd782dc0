"""HF checkpoint import/export: PyTorch logits parity, bit-exact round trips, sharding, and
the errors a bad checkpoint or config must raise."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from pallasite.models import abstract_model, forward, hf, hf_config, init_model
from pallasite.models.config import ModelConfig
from pallasite.registry import HF_FFN, HF_MODEL_TYPE

FAMILIES = ["llama", "llama_tied", "llama3_rope", "mistral", "qwen2", "qwen3"]
# Two rows, 12 tokens: longer than mistral's window of 5, ids spread over the vocab.
IDS = np.array([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 50], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 200, 255]])
_fwd = jax.jit(forward, static_argnums=0)


def _logits(cfg, state, ids=IDS):
    graphdef = nnx.split(abstract_model(cfg))[0]
    # Parity is judged in true float32: on GPUs XLA's default f32 matmul uses TF32 (measured
    # ~4e-3 off on an H200), which is a numerics setting, not a mapping error.
    with jax.default_matmul_precision("highest"):
        return np.asarray(_fwd(graphdef, state, ids)[0])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family -> (torch_model, path, torch logits on IDS), built once per module."""
    pytest.importorskip("torch")
    from pallasite.testing import make_tiny_hf_model, pt_logits

    out = {}
    for fam in FAMILIES:
        model, path = make_tiny_hf_model(fam, tmp_path_factory.mktemp(fam))
        out[fam] = (model, path, pt_logits(model, IDS))
    return out


def _read_all(path):
    from safetensors.numpy import load_file

    index = os.path.join(path, hf.SAFETENSORS_INDEX)
    files = (
        sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else [hf.SAFETENSORS_SINGLE]
    )
    out = {}
    for fn in files:
        out.update(load_file(os.path.join(path, fn)))
    return out


# ------------------------------------------------------------------------ parity with PyTorch


@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_pytorch(tiny, family, scan):
    _, path, ref = tiny[family]
    cfg, state = hf.import_hf(path, scan_layers=scan)
    assert cfg.scan_layers == scan and cfg.family == family.split("_")[0].replace("llama3", "llama")
    # The imported state has exactly the structure of a freshly built model.
    assert jax.tree.structure(state) == jax.tree.structure(nnx.split(abstract_model(cfg))[1])
    out = _logits(cfg, state)
    assert np.abs(ref).max() > 1.0  # logits are not all tiny, so 1e-4 is a real tolerance
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def test_negative_controls_features_matter(tiny):
    """The parity tolerance is tight enough to see each family feature: dropping the llama3
    RoPE scaling, Mistral's sliding window, or Qwen2's biases changes the logits by ≫1e-4."""
    _, path, ref = tiny["llama3_rope"]
    cfg, state = hf.import_hf(path)
    assert np.abs(_logits(cfg.replace(rope_scaling=None), state) - ref).max() > 1e-2

    _, path, ref = tiny["mistral"]
    cfg, state = hf.import_hf(path)
    assert cfg.sliding_window == 5
    assert np.abs(_logits(cfg.replace(sliding_window=None), state) - ref).max() > 1e-2

    _, path, ref = tiny["qwen2"]
    cfg, state = hf.import_hf(path)
    zeroed = jax.tree.map_with_path(lambda p, x: x * 0 if "bias" in jax.tree_util.keystr(p) else x, state)
    assert np.abs(_logits(cfg, zeroed) - ref).max() > 1e-2


def test_import_never_imports_torch(tiny):
    _, path, _ = tiny["qwen3"]
    code = (
        "import sys, pallasite.models.hf as h; cfg, st = h.import_hf(sys.argv[1], scan_layers=True); "
        "assert 'torch' not in sys.modules, 'torch was imported'; print(cfg.family)"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "qwen3"


# ------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_bit_exact(tiny, family, tmp_path):
    _, path, _ = tiny[family]
    src = _read_all(path)
    for scan in (False, True):
        cfg, state = hf.import_hf(path, scan_layers=scan)
        out = tmp_path / f"scan{scan}"
        hf.export_hf(cfg, state, out)
        got = _read_all(out)
        assert sorted(got) == sorted(src)
        for k in src:
            assert got[k].dtype == src[k].dtype and got[k].shape == src[k].shape, k
            assert got[k].tobytes() == src[k].tobytes(), k
    # config.json: same ModelConfig back, and transformers' AutoConfig reads the same model.
    transformers = pytest.importorskip("transformers")
    assert hf_config.config_from_hf(json.load(open(out / "config.json"))) == cfg.replace(scan_layers=False)
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
        "attention_bias",
        "mlp_bias",
        "bos_token_id",
        "eos_token_id",
        "max_position_embeddings",
        "hidden_act",
    ):
        if key in a:  # (Qwen2 has no head_dim field; ours is the default hidden/heads)
            assert a[key] == b.get(key), key


def test_round_trip_bfloat16(tiny, tmp_path):
    """A bf16 checkpoint stays bf16 (param_dtype from the file) and round-trips bit-exactly."""
    import ml_dtypes
    from safetensors.numpy import save_file

    _, path, _ = tiny["qwen2"]
    src = {k: v.astype(ml_dtypes.bfloat16) for k, v in _read_all(path).items()}
    bf = tmp_path / "bf16"
    bf.mkdir()
    (bf / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    save_file(src, str(bf / "model.safetensors"), metadata={"format": "pt"})
    cfg, state = hf.import_hf(bf, scan_layers=True)
    assert cfg.param_dtype == "bfloat16"
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(state))
    hf.export_hf(cfg, state, tmp_path / "out")
    got = _read_all(tmp_path / "out")
    assert sorted(got) == sorted(src) and all(got[k].tobytes() == src[k].tobytes() for k in src)
    # dtype= casts on import.
    cfg32, state32 = hf.import_hf(bf, dtype="float32")
    assert cfg32.param_dtype == "float32" and all(x.dtype == np.float32 for x in jax.tree.leaves(state32))


def test_sharded_export_and_import(tiny, tmp_path):
    torch = pytest.importorskip("torch")
    import transformers

    from pallasite.testing import pt_logits

    _, path, ref = tiny["llama"]
    cfg, state = hf.import_hf(path)
    hf.export_hf(cfg, state, tmp_path, max_shard_bytes=100_000)  # ~0.3 MB of f32 -> several shards
    index = json.load(open(tmp_path / hf.SAFETENSORS_INDEX))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (tmp_path / hf.SAFETENSORS_SINGLE).exists()
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in _read_all(path).values())
    # pallasite reads the index back, in the other layout, to the same logits ...
    cfg2, state2 = hf.import_hf(tmp_path, scan_layers=True)
    np.testing.assert_allclose(_logits(cfg2, state2), ref, atol=1e-4, rtol=0)
    # ... and so does transformers.
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    np.testing.assert_allclose(pt_logits(model, IDS), ref, atol=1e-5, rtol=0)


def test_export_from_pallasite_init_loads_in_transformers(tmp_path):
    """The export direction alone: a randomly initialised pallasite Qwen3 (scan layout, explicit
    head_dim, sliding window over all layers) gives the same logits in transformers."""
    torch = pytest.importorskip("torch")
    import transformers

    from pallasite.testing import pt_logits

    cfg = ModelConfig(
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=32,
        d_ff=96,
        qk_norm=True,
        family="qwen3",
        scan_layers=True,
        sliding_window=6,
        rope_theta=1e6,
        norm_eps=1e-6,
        eos_token_id=2,
    )
    model = init_model(cfg, seed=3)
    # Scale up the init so attention is far from uniform (a layout bug must show).
    state = jax.tree.map(lambda x: x * 5.0, nnx.split(model)[1])
    hf.export_hf(cfg, state, tmp_path)
    pt = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager")
    assert type(pt).__name__ == "Qwen3ForCausalLM" and pt.config.layer_types == ["sliding_attention"] * 2
    np.testing.assert_allclose(_logits(cfg, state), pt_logits(pt, IDS), atol=1e-4, rtol=0)


# ------------------------------------------------------------------------ errors


def _rewrite(src_path, dst, edit):
    """Copy an HF folder, applying ``edit(tensors)`` to its safetensors dict."""
    from safetensors.numpy import save_file

    tensors = _read_all(src_path)
    edit(tensors)
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src_path, "config.json")) as f:
        cfg_text = f.read()
    with open(os.path.join(dst, "config.json"), "w") as f:
        f.write(cfg_text)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_misshaped_missing_extra_tensor_errors(tiny, tmp_path):
    _, path, _ = tiny["llama"]
    name = "model.layers.1.self_attn.k_proj.weight"  # [K*Dh, D] = [32, 64]

    def misshape(t):
        t[name] = t[name][:16]

    with pytest.raises(hf.CheckpointMismatchError) as e:
        hf.import_hf(_rewrite(path, tmp_path / "a", misshape))
    assert name in str(e.value) and "(16, 64)" in str(e.value) and "(32, 64)" in str(e.value)

    with pytest.raises(
        hf.CheckpointMismatchError, match=r"missing tensor 'model.layers.0.mlp.up_proj.weight'.*\(128, 64\)"
    ):
        hf.import_hf(_rewrite(path, tmp_path / "b", lambda t: t.pop("model.layers.0.mlp.up_proj.weight")))

    def extra(t):
        t["model.layers.0.self_attn.q_proj.bias"] = np.zeros(64, np.float32)

    with pytest.raises(
        hf.CheckpointMismatchError, match=r"unexpected tensor.*model.layers.0.self_attn.q_proj.bias \(64,\)"
    ):
        hf.import_hf(_rewrite(path, tmp_path / "c", extra))

    # Old exporters' rotary buffers are not weights and are ignored.
    def inv_freq(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    hf.import_hf(_rewrite(path, tmp_path / "d", inv_freq))


def test_tied_head_in_file(tiny, tmp_path):
    _, path, _ = tiny["llama_tied"]

    def same(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()

    hf.import_hf(_rewrite(path, tmp_path / "same", same))  # accepted: it is the embedding

    def different(t):
        t["lm_head.weight"] = t["model.embed_tokens.weight"] + 1

    with pytest.raises(hf.CheckpointMismatchError, match="lm_head.weight differs"):
        hf.import_hf(_rewrite(path, tmp_path / "diff", different))


def test_config_errors_and_old_style_rope():
    with pytest.raises(
        ValueError, match=r"model_type='gpt2' is not a registered.*known: gemma3_text, llama, mistral, mixtral"
    ):
        hf_config.config_from_hf({"model_type": "gpt2"})
    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        hf_config.config_from_hf(
            {**base, "model_type": "llama", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}
        )
    with pytest.raises(ValueError, match="required key 'hidden_size'"):
        hf_config.config_from_hf({k: v for k, v in {**base, "model_type": "llama"}.items() if k != "hidden_size"})
    # Pre-v5 layout: top-level rope_theta, rope_scaling with "type".
    old = hf_config.config_from_hf(
        {
            **base,
            "model_type": "llama",
            "rope_theta": 500000.0,
            "rope_scaling": {
                "type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "eos_token_id": [128001, 128009],
        }
    )
    assert old.rope_theta == 500000.0 and old.rope_scaling_dict["rope_type"] == "llama3"
    assert old.eos_token_id == (128001, 128009) and old.head_dim == 16
    # Qwen2 sliding window: all layers slide -> window; mixed layers -> clear refusal.
    q = {**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32}
    assert hf_config.config_from_hf({**q, "max_window_layers": 0}).sliding_window == 32
    assert hf_config.config_from_hf({**q, "use_sliding_window": False}).sliding_window is None
    with pytest.raises(ValueError, match="mixed sliding/full attention"):
        hf_config.config_from_hf({**q, "max_window_layers": 2})
    # A config a family cannot express is refused on export.
    with pytest.raises(ValueError, match="qwen2 checkpoint cannot express"):
        hf_config.config_to_hf(ModelConfig(family="qwen2", qkv_bias=False))


# ------------------------------------------------------------------------ pallasite.testing helpers


def test_testing_helpers_greedy(tiny):
    """pt_greedy is transformers' greedy generate with EOS off; an argmax loop over pallasite's
    forward (one padded buffer, causal) reproduces it token for token on an imported model."""
    from pallasite.testing import make_tiny_hf_model, pt_greedy

    model, path, _ = tiny["mistral"]  # sliding window 5 < sequence length
    prompt, n = IDS[:, :6], 16
    ref = pt_greedy(model, prompt, n)
    assert ref.shape == (2, n)
    cfg, state = hf.import_hf(path)
    buf = np.zeros((2, 6 + n), np.int32)
    buf[:, :6] = prompt
    for t in range(6, 6 + n):
        buf[:, t] = _logits(cfg, state, buf)[:, t - 1].argmax(-1)
    np.testing.assert_array_equal(buf[:, 6:], ref)
    with pytest.raises(ValueError, match="unknown tiny family 'gpt9'"):
        make_tiny_hf_model("gpt9", "/nonexistent")


def test_registry_hooks_contract(tiny, tmp_path):
    """The hooks MoE/new families use: a model type registered from outside plus an ffn mapping
    that is many-to-one (gate and up fused into one HF tensor, as some checkpoints store them)
    import, export and round-trip through hf.py without edits to it."""
    _, path, ref = tiny["llama"]
    old_dense = HF_FFN.get("dense")

    def to_hf(cfg, ffn, prefix, layer):
        fused = np.concatenate([ffn[("gate_proj", "kernel")], ffn[("up_proj", "kernel")]], axis=1)
        return {
            prefix + "mlp.gate_up_proj.weight": hf.linear_to_hf(fused),
            prefix + "mlp.down_proj.weight": hf.linear_to_hf(ffn[("down_proj", "kernel")]),
        }

    def from_hf(cfg, read, prefix, layer, expected):
        d, f = expected[("gate_proj", "kernel")]
        fused = hf.linear_from_hf(read, prefix + "mlp.gate_up_proj.weight", (d, 2 * f))
        return {
            ("gate_proj", "kernel"): fused[:, :f],
            ("up_proj", "kernel"): fused[:, f:],
            ("down_proj", "kernel"): hf.linear_from_hf(
                read, prefix + "mlp.down_proj.weight", expected[("down_proj", "kernel")]
            ),
        }

    hf_config.register_model_type(
        "fusedllama",
        from_hf=lambda c: hf_config.config_from_hf({**c, "model_type": "llama"}).replace(family="fusedllama"),
        to_hf=lambda cfg: HF_MODEL_TYPE.get("llama").to_hf(cfg),
        architecture="LlamaForCausalLM",
    )
    try:
        cfg, state = hf.import_hf(path)
        HF_FFN.register("dense", (to_hf, from_hf), replace=True)
        fused_cfg = cfg.replace(family="fusedllama")
        hf.export_hf(fused_cfg, state, tmp_path / "fused")
        names = set(_read_all(tmp_path / "fused"))
        assert "model.layers.0.mlp.gate_up_proj.weight" in names and "model.layers.0.mlp.up_proj.weight" not in names
        assert json.load(open(tmp_path / "fused" / "config.json"))["model_type"] == "fusedllama"
        cfg2, state2 = hf.import_hf(tmp_path / "fused", scan_layers=True)
        assert cfg2.family == "fusedllama"
        np.testing.assert_allclose(_logits(cfg2, state2), ref, atol=1e-4, rtol=0)
        # Reads made by a registered mapping get the same named errors.
        with pytest.raises(
            hf.CheckpointMismatchError, match=r"'model.layers.0.mlp.gate_up_proj.weight'.*expected shape \(256, 64\)"
        ):
            hf.import_hf(path, cfg=cfg)  # the plain file has no fused tensor
    finally:
        HF_FFN.register("dense", old_dense, replace=True)
        HF_MODEL_TYPE.unregister("fusedllama")
