"""The benchmark baselines measure what they say: offloaded MoE paths compute the resident MoE,
refusals are refusals, the torch/jax precision switch sets both sides, random weights are random."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.benchmarks import decode as D
from pallasite.benchmarks import experts as X
from pallasite.inference import mole_decode as MD
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import init_model


def _moe_with_fp16_experts():
    """The quick MoE of the experts benchmark with its expert weights rounded to fp16 (what the
    offloaded paths store and move), so offloaded == resident up to float32 compute order."""
    model = init_model(X.make_cfg("quick", "moe"), seed=0)
    for blk in model.layers:
        f = blk.ffn
        for w in (f.w_gate, f.w_up, f.w_down):
            if w is not None:
                w[...] = w[...].astype(jnp.float16).astype(w[...].dtype)
    return model


@pytest.mark.parametrize("batch", [1, 3])
def test_offloaded_moe_paths_equal_the_resident_moe(batch):
    model = _moe_with_fp16_experts()
    ffn = model.layers[1].ffn
    x = jax.random.normal(jax.random.key(0), (batch, 1, model.cfg.d_model), jnp.float32)
    want = np.asarray(ffn(x)[0])
    m = X.moe_config_of(model.cfg)
    host = X.HostMemoryMoE(ffn, m.top_k, m.norm_topk_prob, model.cfg.hidden_act, jnp.float32,
                           MD.host_memory_sharding())
    assert all(a[...].dtype == np.float16 for a in host.w)  # the same dtype as the MoLE LUT
    assert host.w[0][...].sharding.memory_kind == MD.HOST_MEMORY_KIND  # in the host memory space
    got_host = np.asarray(jax.jit(lambda x: host(x)[0])(x))
    stats = {"buffer_bytes": 0, "unique_bytes": 0, "unique_experts": 0, "calls": 0}
    gate = None if ffn.w_gate is None else ffn.w_gate[...]
    slots = min(m.num_experts, batch * m.top_k)
    hx = X.HostExperts(gate, ffn.w_up[...], ffn.w_down[...], slots, stats)
    cb = X.OffloadedMoE(ffn, hx, m.top_k, m.norm_topk_prob, model.cfg.hidden_act, jnp.float32)
    got_cb = np.asarray(jax.jit(lambda x: cb(x)[0])(x))
    assert np.all(np.isfinite(want)) and np.abs(want).max() > 1e-4
    np.testing.assert_allclose(got_host, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got_cb, want, rtol=1e-4, atol=1e-6)
    assert stats["calls"] == 1 and stats["buffer_bytes"] == hx.expert_bytes * hx.slots


def test_decode_refuses_llamacpp_without_its_gguf_and_layers_without_the_shape(capsys):
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32)
    args = D.argparse.Namespace(llamacpp="on", quick=True, llamacpp_prompt_len=None)
    with pytest.raises(SystemExit, match="needs the GGUF"):
        D._maybe_llamacpp(args, cfg, None, "random weights", False, 4, 1, ["float32"], lambda: 1.0)
    args.llamacpp = "auto"  # auto: no table, and the output says why
    out = D._maybe_llamacpp(args, cfg, None, "random weights", False, 4, 1, ["float32"],
                            lambda: 1.0)
    assert out["llamacpp"].startswith("left out") and "LEFT OUT" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--layers applies to --model llama3-8b-shape only"):
        D.main(["--layers", "2", "--no-torch"])


def test_llama3_shape_random_state_is_bf16_random_with_unit_norms():
    small = {"vocab_size": 128, "d_model": 64, "n_layers": 1, "n_heads": 4, "n_kv_heads": 2,
             "d_ff": 96}
    cfg = ModelConfig(**{**D.LLAMA3_8B, **small}).replace(dtype="bfloat16", param_dtype="bfloat16")
    leaves = jax.tree.leaves(D.random_state(cfg))
    assert leaves and all(a.dtype == jnp.bfloat16 for a in leaves)
    mats = [np.asarray(a, np.float32) for a in leaves if a.ndim >= 2]
    vecs = [np.asarray(a, np.float32) for a in leaves if a.ndim < 2]
    assert all(0.01 < m.std() < 0.03 for m in mats) and all(np.all(v == 1) for v in vecs)
    # untied: the embedding is gathered, not read whole, so it is not counted per step
    emb = cfg.vocab_size * cfg.d_model * 2
    assert D.weight_bytes_per_step(cfg, D.random_state(cfg)) == sum(a.nbytes for a in leaves) - emb


def test_train_matmul_precision_is_set_on_both_sides():
    torch = pytest.importorskip("torch")
    from pallasite.benchmarks import train as TR

    before = (jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision())
    try:
        TR.set_matmul_precision("tf32")
        assert jax.config.jax_default_matmul_precision == "tensorfloat32"
        assert torch.get_float32_matmul_precision() == "high"
        TR.set_matmul_precision("highest")
        assert jax.config.jax_default_matmul_precision == "highest"
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        jax.config.update("jax_default_matmul_precision", before[0])
        torch.set_float32_matmul_precision(before[1])


def test_f32_copy_of_the_gguf_holds_the_same_weights(smollm2, tmp_path):
    """The llama.cpp parity row's F32 copy: every tensor of the Q4_1 / Q8_0 GGUF dequantised, the
    metadata kept, so pallasite imports the same config, weights and tokenizer from it (llama.cpp
    then runs plain F32 dots on the very weights pallasite uses)."""
    import gguf as gguf_pkg

    from pallasite.models import gguf

    src = gguf.smollm2_gguf_path()
    D.write_f32_copy(src, tmp_path / "f32.gguf")
    types = {t.tensor_type.name for t in gguf_pkg.GGUFReader(str(tmp_path / "f32.gguf")).tensors}
    assert types == {"F32"}, types
    cfg, state, tok = gguf.import_gguf(tmp_path / "f32.gguf")
    cfg0, state0, tok0 = smollm2
    assert cfg == cfg0
    flat, flat0 = jax.tree.leaves_with_path(state), dict(jax.tree.leaves_with_path(state0))
    assert len(flat) == len(flat0)
    for path, leaf in flat:
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(flat0[path]), err_msg=str(path))
    text = "def fib(n):\n    return n"
    assert tok.encode(text) == tok0.encode(text)
