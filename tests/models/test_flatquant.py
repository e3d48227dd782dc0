"""FlatQuant W4A4KV4: exact invariance of transforms and folding, deployed model == original with
quantizers off, deployed model == calibration-time fake quantization, error ordering on a block
with injected outliers, calibration loss decreasing, KV4 cache wiring, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite.inference.cache.kv4 import init_kv4_cache
from pallasite.models.config import ModelConfig
from pallasite.models.quantized import (QuantConfig, check_quantizable, fold_layer, kv_transforms, layer_weights)
from pallasite.models.transformer import forward, init_model
from pallasite.training import flatquant as fq
from pallasite.training.quant_baselines import hadamard_transforms, quantize_model

# d 64 = 8×8, d_ff 128 = 8×16, head_dim 16, 4 heads: every factor also has a Hadamard matrix
CFG = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)


@pytest.fixture(scope="module")
def tiny():
    model = init_model(CFG, seed=3)
    graphdef, state = nnx.split(model)
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (4, 12))
    return graphdef, state, state.to_pure_dict(), tokens


def _flatquant_init(pure, tokens, layer=0, seed=0, dtype=jnp.float32):
    w = {k: (None if v is None else jnp.asarray(v, dtype)) for k, v in layer_weights(pure, CFG, layer).items()}
    x = fq.embed_tokens(pure, tokens).astype(dtype)
    _, stats = fq.layer_forward(w, None, x, CFG, collect=True)
    theta, frozen = fq.init_flatquant_params(CFG, {k: np.asarray(v) for k, v in w.items() if v is not None},
                                             stats, fq.CalibConfig(), np.random.default_rng(seed), dtype=dtype)
    # move the transforms away from their init so the test does not rely on orthogonality or s = 1
    key = jax.random.key(seed)
    theta = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(key, a.shape, a.dtype), theta)
    return w, x, theta, frozen


def test_exact_invariance_float64_per_layer(tiny):
    """Quantizers off: transformed layer and folded layer equal the original layer (float64)."""
    _, _, pure, tokens = tiny
    with jax.enable_x64(True):
        w, x, theta, frozen = _flatquant_init(pure, tokens, dtype=jnp.float64)
        to64 = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)  # noqa: E731
        t = fq.resolve(to64(theta), to64(frozen))
        # inverse-transpose from the SVD parametrisation is the true inverse-transpose
        L, R = t["ln"]
        np.testing.assert_allclose(np.asarray(t["ln_inv_t"][0]), np.linalg.inv(np.asarray(L)).T, atol=1e-10)
        ref = fq.layer_forward(w, None, x, CFG)
        out = fq.layer_forward(w, t, x, CFG)  # online transforms, weights transformed in-graph
        assert float(jnp.max(jnp.abs(out - ref))) <= 1e-10
        t64 = fq.to_numpy_f64(t)
        folded = fold_layer({k: (None if v is None else np.asarray(v)) for k, v in w.items()}, t64, CFG,
                            weight_clipping=False)
        out_f = fq.folded_layer_forward(folded, x, CFG, t64["k"], t64["k_inv_t"])
        assert float(jnp.max(jnp.abs(out_f - ref))) <= 1e-10
        # negative control: dropping the c folded into the input RMSNorm breaks equality
        broken = dict(folded, input_norm=np.asarray(w["input_norm"]))
        assert float(jnp.max(jnp.abs(fq.folded_layer_forward(broken, x, CFG, t64["k"], t64["k_inv_t"]) - ref))) > 1e-4
        # the Hadamard baseline's transforms are exact too
        th = jax.tree.map(lambda a: np.asarray(a, np.float64), hadamard_transforms(CFG, seed=1)[0])
        out_h = fq.folded_layer_forward(fold_layer({k: (None if v is None else np.asarray(v)) for k, v in w.items()},
                                                   th, CFG), x, CFG, th["k"], th["k_inv_t"])
        assert float(jnp.max(jnp.abs(out_h - ref))) <= 1e-10


def test_deployed_model_equals_original_with_quantizers_off(tiny):
    """Real Transformer + QuantLinear (online Kronecker factors) + folded weights, float32 logits."""
    graphdef, state, pure, tokens = tiny
    ref, _, _ = forward(graphdef, state, jnp.asarray(tokens))
    resolved = []
    for i in range(CFG.n_layers):
        w, x, theta, frozen = _flatquant_init(pure, tokens, layer=i, seed=i)
        resolved.append(fq.to_numpy_f64(fq.resolve(theta, frozen)))
    qm = quantize_model(CFG, pure, "flatquant", resolved=resolved, w_bits=16, a_bits=16, kv_bits=16)
    assert qm.cfg.linear == "w4a4"
    got, _, _ = forward(qm.graphdef, qm.state, jnp.asarray(tokens))
    assert float(jnp.max(jnp.abs(got - ref))) <= 1e-4
    # the online factors really are non-trivial (so the equality is not vacuous)
    q_left = np.asarray(qm.state["layers"][0]["attn"]["q_proj"]["in_left"][...])
    assert np.abs(q_left - np.eye(q_left.shape[0])).max() > 0.1


def test_kv4_cache_applies_key_transform_after_rope():
    """k·2 and q·½ leave logits unchanged; a cache ignoring q_trans would double them."""
    cfg = CFG.replace(n_layers=1)
    rng = np.random.default_rng(4)
    B, T = 2, 5
    q = jnp.asarray(rng.standard_normal((B, T, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, T, 2, 16)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    eye = jnp.eye(16)[None]
    ident = jax.tree.map(lambda a: a[0], init_kv4_cache(cfg, B, 8))
    scaled = jax.tree.map(lambda a: a[0], init_kv4_cache(cfg, B, 8, dict(
        k_trans=2 * eye, q_trans=0.5 * eye, k_clip=jnp.full((1, 2), 30.0), v_clip=jnp.full((1, 2), 30.0))))
    a, _ = ident.update_and_attend(q, k, v, pos)
    b, _ = scaled.update_and_attend(q, k, v, pos)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)
    wrong = jax.tree.map(lambda a: a[0], init_kv4_cache(cfg, B, 8, dict(
        k_trans=2 * eye, q_trans=eye, k_clip=jnp.full((1, 2), 30.0), v_clip=jnp.full((1, 2), 30.0))))
    c, _ = wrong.update_and_attend(q, k, v, pos)
    assert float(jnp.max(jnp.abs(c - a))) > 1e-2
    # 4-bit storage: codes + one scale and zero per (token, head) vs float32 K/V
    dense_bytes = 2 * B * 8 * 2 * 16 * 4
    assert ident.nbytes() == 2 * B * 2 * 8 * (8 + 4 + 1) and ident.nbytes() < 0.25 * dense_bytes


@pytest.mark.parametrize("method", ["rtn", "hadamard"])
def test_deployed_quantized_layer_matches_fake_quant_layer(tiny, method):
    """Deployed W4A4KV4 layer (packed int4 weights, int GEMM, KV4 cache) == the calibration-time
    fake-quant layer. Float differences of 1e-8 may flip a value sitting exactly on a rounding tie
    (int4 activations × Hadamard weights make exact ties possible, e.g. a KV zero point of 7.5):
    such a token row differs by a quantization step, every other row agrees to float precision."""
    _, _, pure, tokens = tiny
    cfg = CFG.replace(n_layers=1)
    qm = quantize_model(cfg, pure, method, calib_tokens=tokens)
    B, T = tokens.shape
    model = nnx.merge(qm.graphdef, qm.state)
    dep, _, _ = model(jnp.asarray(tokens), cache=qm.init_cache(B, T), return_hidden=True)
    w = {k: (None if v is None else jnp.asarray(v)) for k, v in layer_weights(pure, cfg, 0).items()}
    x = fq.layer_forward(w, jax.tree.map(jnp.asarray, qm.resolved[0]), fq.embed_tokens(pure, tokens), cfg, fq.Bits())
    fake = fq.rms_norm(x, jnp.asarray(pure["final_norm"]["scale"]), cfg.norm_eps)
    fp = fq.rms_norm(fq.layer_forward(w, None, fq.embed_tokens(pure, tokens), cfg),
                     jnp.asarray(pure["final_norm"]["scale"]), cfg.norm_eps)
    row_diff = np.asarray(jnp.max(jnp.abs(dep - fake), axis=-1))
    quant_err = float(jnp.mean(jnp.abs(fake - fp)))
    assert quant_err > 1e-3  # quantization is really on
    assert np.mean(row_diff < 1e-4) >= 0.9, row_diff


CALIB = fq.CalibConfig(nsamples=16, batch=4, epochs=8)  # 32 steps: the paper's recipe, shrunk


def _outlier_block():
    """One d=128 layer whose RMSNorm gains carry 4 channels ×10 (massive activation channels)."""
    cfg = ModelConfig(vocab_size=128, d_model=128, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=256)
    _, state = nnx.split(init_model(cfg, seed=1))
    pure = state.to_pure_dict()
    rng = np.random.default_rng(0)
    ch = rng.choice(cfg.d_model, 4, replace=False)
    for name in ("input_norm", "post_attn_norm"):
        g = np.asarray(pure["layers"][0][name]["scale"]).copy()
        g[ch] *= 10.0
        pure["layers"][0][name]["scale"] = g
    return cfg, pure, rng.integers(0, 128, (16, 32)), rng.integers(0, 128, (8, 32))


def test_error_ordering_flatquant_hadamard_rtn_and_loss_decreases():
    cfg, pure, calib, held_out = _outlier_block()
    w = {k: (None if v is None else jnp.asarray(v)) for k, v in layer_weights(pure, cfg, 0).items()}
    x = fq.embed_tokens(pure, held_out)
    ref = fq.layer_forward(w, None, x, cfg)
    mse = jax.jit(lambda t: jnp.mean((fq.layer_forward(w, t, x, cfg, fq.Bits()) - ref) ** 2))
    e_rtn = float(mse({}))
    e_had = float(np.mean([float(mse(jax.tree.map(jnp.asarray, hadamard_transforms(cfg, s)[0]))) for s in range(2)]))
    resolved, history = fq.calibrate(cfg, pure, calib, CALIB, log=lambda s: None)
    e_flat = float(mse(jax.tree.map(jnp.asarray, resolved[0])))
    assert e_flat < 0.75 * e_had and e_had < 0.6 * e_rtn, (e_flat, e_had, e_rtn)
    h = history[0]
    assert np.mean(h[-3:]) < 0.9 * np.mean(h[:2]), h  # calibration loss decreases on average


def test_bad_inputs_fail_clearly(tiny):
    _, _, pure, tokens = tiny
    with pytest.raises(ValueError, match="family='gpt2'"):
        check_quantizable(CFG.replace(family="gpt2"))
    with pytest.raises(ValueError, match="qk_norm"):
        quantize_model(CFG.replace(qk_norm=True), pure, "rtn")
    with pytest.raises(ValueError, match="unknown method"):
        quantize_model(CFG, pure, "awq")
    with pytest.raises(ValueError, match="needs calib_tokens"):
        quantize_model(CFG, pure, "flatquant")
    with pytest.raises(ValueError, match="w_bits=8"):
        QuantConfig(w_bits=8)
    # a singular transform stops and names the layer and the transform
    w, x, theta, frozen = _flatquant_init(pure, tokens)
    theta["down"]["R"]["s"] = theta["down"]["R"]["s"].at[3].set(0.0)
    with pytest.raises(np.linalg.LinAlgError, match=r"layer 5 transform 'down.right'"):
        fq.check_transforms(theta, layer=5)
    # a non-finite calibration loss stops and names the layer (same shapes and CalibConfig as the
    # ordering test, so the calibration step's compilation is shared through the compile cache)
    cfg, bad, calib, _ = _outlier_block()
    k = np.asarray(bad["layers"][0]["ffn"]["up_proj"]["kernel"]).copy()
    k[0, 0] = np.nan
    bad["layers"][0]["ffn"]["up_proj"]["kernel"] = k
    with pytest.raises(FloatingPointError, match="layer 0, epoch 0"):
        fq.calibrate(cfg, bad, calib, CALIB, log=lambda s: None)


@pytest.mark.slow  # the generation engine's compile dominates (~30 s idle, minutes on a loaded machine)
def test_save_load_roundtrip_and_generation(tiny, tmp_path):
    from pallasite.inference.engine import generate_ids
    from pallasite.training.quant_baselines import load_quantized, save_quantized

    _, _, pure, tokens = tiny
    qm = quantize_model(CFG, pure, "hadamard")
    save_quantized(qm, str(tmp_path))
    qm2 = load_quantized(str(tmp_path))
    assert qm2.cfg == qm.cfg
    a = forward(qm.graphdef, qm.state, jnp.asarray(tokens), cache=qm.init_cache(*tokens.shape))[0]
    b = forward(qm2.graphdef, qm2.state, jnp.asarray(tokens), cache=qm2.init_cache(*tokens.shape))[0]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    out = generate_ids(qm2.graphdef, qm2.state, qm2.cfg, [[1, 2, 3]], max_new_tokens=4,
                       cache_factory=lambda _c, bsz, n: qm2.init_cache(bsz, n))
    assert len(out[0]) == 4


@pytest.mark.slow  # two calibrations of a tiny model (~40 s on a loaded 2-core box)
def test_calibration_checkpoint_saves_each_layer_and_resumes(tiny, tmp_path):
    """Each finished layer is on disk at once; a rerun loads it instead of training (identical
    transforms and history) and a different setting refuses the directory."""
    _, _, pure, tokens = tiny
    ccfg = fq.CalibConfig(nsamples=4, batch=4, epochs=1)
    ck = str(tmp_path / "ck")
    res, hist = fq.calibrate(CFG, pure, tokens, ccfg, log=lambda s: None, checkpoint=ck)
    logs = []
    res2, hist2 = fq.calibrate(CFG, pure, tokens, ccfg, log=logs.append, checkpoint=ck)
    assert all("loaded" in m for m in logs) and len(logs) == CFG.n_layers
    assert hist2 == hist
    for a, b in zip(res, res2):
        jax.tree.map(np.testing.assert_array_equal, a, b)  # same structure (tuples stay tuples), same values
    for a, b in zip(res, fq.load_calibration(ck, CFG.n_layers)):
        jax.tree.map(np.testing.assert_array_equal, a, b)
    with pytest.raises(FileNotFoundError, match="layer_002"):
        fq.load_calibration(ck, 3)
    with pytest.raises(ValueError, match="another setting"):
        fq.calibrate(CFG, pure, tokens, fq.CalibConfig(nsamples=4, batch=4, epochs=2), log=lambda s: None,
                     checkpoint=ck)


@pytest.mark.slow  # Hessian collection + GPTQ on every linear (~50 s on a loaded 2-core box)
def test_gptq_lowers_layer_output_error_vs_rtn_on_the_same_transform():
    """Deployed 1-layer model on held-out tokens, Hadamard transforms: GPTQ weights (Hessians of
    the transformed, quantized inputs) beat RTN weights; weight-only (W4A16KV16) by a clear margin."""
    cfg, pure, calib, held_out = _outlier_block()
    B, T = held_out.shape
    w = {k: (None if v is None else jnp.asarray(v)) for k, v in layer_weights(pure, cfg, 0).items()}
    ref = fq.rms_norm(fq.layer_forward(w, None, fq.embed_tokens(pure, held_out), cfg),
                      jnp.asarray(pure["final_norm"]["scale"]), cfg.norm_eps)
    resolved = hadamard_transforms(cfg, 0)

    def err(wq, bits):
        qm = quantize_model(cfg, pure, "hadamard", calib_tokens=calib, resolved=resolved, weight_quantizer=wq,
                            w_bits=4, a_bits=bits, kv_bits=bits)
        model = nnx.merge(qm.graphdef, qm.state)
        h = model(jnp.asarray(held_out), cache=qm.init_cache(B, T), return_hidden=True)[0]
        return float(jnp.mean((h - ref) ** 2))

    e_rtn16, e_gptq16 = err("rtn", 16), err("gptq", 16)
    assert e_gptq16 < 0.8 * e_rtn16, (e_gptq16, e_rtn16)
    e_rtn4, e_gptq4 = err("rtn", 4), err("gptq", 4)
    assert e_gptq4 < e_rtn4, (e_gptq4, e_rtn4)
    with pytest.raises(ValueError, match="weight_quantizer='awq'"):
        quantize_model(cfg, pure, "rtn", weight_quantizer="awq")


@pytest.mark.parametrize("per_linear_clips", [False, True])
def test_shared_input_transform_keeps_logits_equal(tiny, per_linear_clips):
    """q/k/v and gate/up transform their shared input once: logits equal the unshared model's.
    Equal clips (Hadamard) reuse the int4 codes; per-linear clips (FlatQuant) share the transformed
    activations and quantize them per linear. Negative control: a group whose members' factors
    differ is not shared."""
    import pallasite.models.quantized as mq

    _, _, pure, tokens = tiny
    resolved = hadamard_transforms(CFG, 0)
    if per_linear_clips:
        rng = np.random.default_rng(0)
        resolved = [dict(t, lac={n: rng.uniform(1.0, 3.0, 2) for n in fq.LINEARS}) for t in resolved]
    out = {}
    for share in (False, True):
        qm = quantize_model(CFG, pure, "hadamard", resolved=resolved, share_inputs=share)
        assert qm.cfg.linear_config.share_inputs == share and qm.cfg.linear_config.shared_act_clip == (share and not per_linear_clips)
        calls = {"kron_quantize": 0, "kron_transform_ref": 0}
        originals = {name: getattr(mq, name) for name in calls}

        def counting(name):
            def fn(*a, **k):
                calls[name] += 1
                return originals[name](*a, **k)
            return fn
        for name in calls:
            setattr(mq, name, counting(name))
        try:
            out[share] = np.asarray(forward(qm.graphdef, qm.state, jnp.asarray(tokens),
                                            cache=qm.init_cache(*tokens.shape))[0])
        finally:
            for name, fn in originals.items():
                setattr(mq, name, fn)
        # transforms per layer: unshared q, k, v, o, gate, up, down = 7 fused transform+quantize calls;
        # shared: one per group (q/k/v, gate/up) + o + down = 4, as codes (one clip) or as transformed
        # activations quantized per linear (per-linear clips)
        if not share:
            assert calls == {"kron_quantize": 7 * CFG.n_layers, "kron_transform_ref": 0}, calls
        elif per_linear_clips:
            assert calls == {"kron_quantize": 2 * CFG.n_layers, "kron_transform_ref": 2 * CFG.n_layers}, calls
        else:
            assert calls == {"kron_quantize": 4 * CFG.n_layers, "kron_transform_ref": 0}, calls
    np.testing.assert_array_equal(out[True], out[False])
    # negative control: different factors inside a group disable sharing
    folded = [fold_layer(layer_weights(pure, CFG, i), t, CFG) for i, t in enumerate(resolved)]
    folded[1]["online"]["up"] = tuple(np.asarray(a) * 2 for a in folded[1]["online"]["up"])
    assert not mq._groups_share_factors(folded) and mq._groups_share_factors(folded[:1])
