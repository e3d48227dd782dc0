"""MoLE (Jie et al., ICML 2025): architecture, re-parameterisation equivalence, gradients,
accounting. LUT stores / files / quantization are in test_mole_lut.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from scipy.special import erf

from pallasite.inference import mole_decode as MD
from pallasite.models import mole_lut as ML
from pallasite.models.config import ModelConfig
from pallasite.models.mole import MoLEConfig, activated_ffn_params, lut_bytes_per_token
from pallasite.models.transformer import forward, init_model

V, D, L, N, F = 512, 64, 2, 4, 256


def tiny_cfg(n_experts=N, scan=False, **mole):
    return ModelConfig(vocab_size=V, d_model=D, n_layers=L, n_heads=4, n_kv_heads=2, d_ff=F, ffn="mole",
                       ffn_config=MoLEConfig(n_experts=n_experts, **mole), scan_layers=scan, pad_token_id=0)


@pytest.fixture(scope="module")
def trained_like():
    """A tiny MoLE with non-trivial weights (random init, expert norms perturbed so the
    per-layer norm scale matters), its fp32 LUT and a LUT-mode twin."""
    cfg = tiny_cfg(lut_dtype="float32")
    model = init_model(cfg, seed=0)
    for i, b in enumerate(model.layers):
        b.ffn.expert_norm.scale.set_value(1.0 + 0.5 * jax.random.normal(jax.random.key(10 + i), (D,)))
        b.ffn.experts.up.set_value(b.ffn.experts.up[...] * 5)  # larger pre-activations: GELU non-linear regime
    lut = ML.build_lut(model)
    return cfg, model, lut, ML.to_lut_model(model)


def _numpy_expert_table(model, gelu="erf"):
    """Independent numpy reference: E_lj(RMSNorm_l(Embed[v])) for every v, l, j."""
    emb = np.asarray(model.embed.embedding[...], np.float64)
    out = []
    for b in model.layers:
        s = np.asarray(b.ffn.expert_norm.scale[...], np.float64)
        n = emb / np.sqrt(np.mean(emb ** 2, -1, keepdims=True) + model.cfg.norm_eps) * s
        up, down = np.asarray(b.ffn.experts.up[...], np.float64), np.asarray(b.ffn.experts.down[...], np.float64)
        h = np.einsum("vd,ndf->vnf", n, up)
        if gelu == "erf":
            a = 0.5 * h * (1 + erf(h / np.sqrt(2)))
        else:
            a = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        out.append(np.einsum("vnf,nfd->vnd", a, down))
    return np.stack(out, axis=1)  # [V, L, N, D]


def test_lut_rows_equal_expert_outputs_for_every_vocab_id(trained_like):
    cfg, model, lut, _ = trained_like
    assert lut.shape == (V, L, N, D) and lut.dtype == np.float32
    ref = _numpy_expert_table(model)
    np.testing.assert_allclose(lut, ref, atol=2e-6, rtol=0)
    # negative controls: the tanh GELU, a missing expert norm or a swapped layout must not pass
    assert np.abs(_numpy_expert_table(model, gelu="tanh") - lut).max() > 1e-5
    assert np.abs(np.swapaxes(ref, 1, 2).reshape(ref.shape) - lut).max() > 1e-3
    # the table is the same when built in small vocab chunks (padding of the last chunk)
    np.testing.assert_allclose(ML.build_lut(model, chunk=200), lut, atol=1e-6, rtol=0)


def _tokens(seed, B=3, T=24):
    toks = np.array(jax.random.randint(jax.random.key(seed), (B, T), 0, V))
    toks[0, -5:] = 0  # padding ids are ordinary rows of the table
    return toks


def test_lut_mode_logits_equal_training_mode(trained_like):
    cfg, model, lut, lut_model = trained_like
    toks = _tokens(1)
    g, s = nnx.split(model)
    ref, _, aux = forward(g, s, toks)
    assert aux == {}  # no auxiliary loss of any kind
    gl, sl = nnx.split(lut_model)
    fwd = jax.jit(MD.lut_forward, static_argnums=0)
    out, _, aux_l = fwd(gl, sl, jnp.asarray(lut[toks]), toks)
    assert aux_l == {}
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    # negative control: the [vocab, layer, expert, d] order matters (layers swapped -> wrong)
    bad, _, _ = fwd(gl, sl, jnp.asarray(lut[:, ::-1][toks]), toks)
    assert float(jnp.abs(bad - ref).max()) > 1e-3
    # fp16 LUT (the paper's storage): looser, measured bound
    out16, _, _ = fwd(gl, sl, jnp.asarray(lut.astype(np.float16)[toks]), toks)
    assert float(np.max(np.abs(out16 - ref))) < 5e-3


def test_scan_layout_lut_equivalence():
    cfg = tiny_cfg(scan=True, lut_dtype="float32")
    model = init_model(cfg, seed=3)
    toks = _tokens(2, B=2, T=16)
    g, s = nnx.split(model)
    ref, _, _ = forward(g, s, toks)
    lut_model = ML.to_lut_model(model)
    store = ML.HostLUT.from_model(model)
    served = MD.serve_with_store(lut_model, store)  # host-callback path, scan layout
    gl, sl = nnx.split(served)
    out, _, _ = jax.jit(forward, static_argnums=0)(gl, sl, toks)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=0)
    assert store.stats["gathers"] == 1 and store.stats["tokens"] == toks.size  # one gather serves all layers


def test_greedy_generation_identical_through_engine(trained_like):
    from pallasite.inference.engine import generate_ids

    cfg, model, lut, _ = trained_like
    lut_model = ML.to_lut_model(model)
    store = ML.HostLUT(lut, fingerprint=ML.lut_fingerprint(model))
    served = MD.serve_with_store(lut_model, store)
    prompts = [[5, 17, 300, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
    g, s = nnx.split(model)
    gl, sl = nnx.split(served)
    ref = generate_ids(g, s, cfg, prompts, max_new_tokens=16)
    out = generate_ids(gl, sl, served.cfg, prompts, max_new_tokens=16)
    assert out == ref and len(ref[0]) == 16
    # one host gather per engine step (prefill + 15 decode steps), rows of L·N·d fp32 per token
    assert store.stats["gathers"] == 16
    assert store.stats["bytes_to_device"] == store.stats["tokens"] * L * N * D * 4


def test_context_independence_and_gates(trained_like):
    """The LUT contribution of a token does not depend on its context; the gates do (they read
    the hidden state, not the token)."""
    cfg, model, _, _ = trained_like
    ffn = model.layers[1].ffn
    a, b = _tokens(4, B=1, T=12), _tokens(5, B=1, T=12)
    b[0, 7] = a[0, 7]
    ea, eb = model.embed(jnp.asarray(a)), model.embed(jnp.asarray(b))
    np.testing.assert_array_equal(np.asarray(ffn.expert_outputs(ea))[0, 7], np.asarray(ffn.expert_outputs(eb))[0, 7])
    ua, ub = (jax.random.normal(jax.random.key(s), (1, 12, D)) for s in (0, 1))
    assert float(jnp.abs(ffn.gates(ua)[0, 7] - ffn.gates(ub)[0, 7]).max()) > 1e-3


def test_mole_layer_output_equals_the_papers_equation(trained_like):
    """The whole MoLE FFN, against an independent float64 numpy evaluation of the paper's
    equation: y = FFN_s(u) + Σ_j softmax(u·R_l)_j · E_lj(RMSNorm_l(e)), dense over all N experts,
    with u the post-attention-normed hidden state and e the token's embedding. Negative controls
    (bugs this would catch): routing on e instead of u, top-2 gates, or no router softmax."""
    cfg, model, _, _ = trained_like
    ffn = model.layers[1].ffn
    toks = _tokens(7, B=2, T=10)
    ctx = model.context(jnp.asarray(toks))
    u = jax.random.normal(jax.random.key(3), (2, 10, D)) * 2.0
    y, aux = ffn(u, ctx)
    assert aux == {}
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    gelu = lambda h: 0.5 * h * (1 + erf(h / np.sqrt(2)))  # noqa: E731
    U, E = f64(u), f64(ctx.embed_BTD)
    shared = gelu(U @ f64(ffn.shared.up_proj.kernel[...])) @ f64(ffn.shared.down_proj.kernel[...])
    s = f64(ffn.expert_norm.scale[...])
    n = E / np.sqrt(np.mean(E ** 2, -1, keepdims=True) + cfg.norm_eps) * s
    up, down = f64(ffn.experts.up[...]), f64(ffn.experts.down[...])
    experts = np.einsum("btnf,nfd->btnd", gelu(np.einsum("btd,ndf->btnf", n, up)), down)  # [B, T, N, D]

    def softmax(z):
        z = np.exp(z - z.max(-1, keepdims=True))
        return z / z.sum(-1, keepdims=True)

    R = f64(ffn.router[...])
    want = shared + np.einsum("btn,btnd->btd", softmax(U @ R), experts)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    top2 = softmax(U @ R) * (np.argsort(np.argsort(-(U @ R), -1), -1) < 2)
    for wrong in (softmax(E @ R), top2 / top2.sum(-1, keepdims=True), U @ R):
        bad = shared + np.einsum("btn,btnd->btd", wrong, experts)
        assert np.abs(bad - want).max() > 100 * np.abs(np.asarray(y) - want).max() + 1e-4


def test_gradients_reach_every_expert_and_router_column():
    cfg = tiny_cfg()
    model = init_model(cfg, seed=1)
    toks = _tokens(6, B=2, T=16)
    g, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, rest):
        logits, _, aux = nnx.merge(g, params, rest)(toks[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:]).mean()
        assert aux == {}  # the loss is cross-entropy only
        return ce

    grads = jax.grad(loss_fn)(params, rest)
    for i in range(L):
        gf = grads["layers"][i]["ffn"]
        up, down, router = gf["experts"]["up"][...], gf["experts"]["down"][...], gf["router"][...]
        assert np.all(np.asarray(jnp.abs(up).sum(axis=(1, 2))) > 0), f"layer {i}: an expert's up gets no gradient"
        assert np.all(np.asarray(jnp.abs(down).sum(axis=(1, 2))) > 0), f"layer {i}: an expert's down gets no gradient"
        assert np.all(np.asarray(jnp.abs(router).sum(axis=0)) > 0), f"layer {i}: a router column gets no gradient"
        assert float(jnp.abs(gf["expert_norm"]["scale"][...]).sum()) > 0


def test_device_resident_params_equal_dense_plus_routers(trained_like):
    cfg, model, _, lut_model = trained_like
    dense = init_model(tiny_cfg(n_experts=0), seed=0)
    paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(lut_model, nnx.Param))]
    assert not [p for p in paths if "experts" in p or "expert_norm" in p]
    itemsize = 4
    assert ML.device_param_bytes(lut_model) == ML.device_param_bytes(dense) + L * D * N * itemsize
    assert ML.device_param_bytes(model) > 2 * ML.device_param_bytes(lut_model)  # training holds the experts
    assert activated_ffn_params(cfg) == 2 * D * F + D * N
    assert lut_bytes_per_token(cfg) == L * N * D * 2


def test_config_roundtrip_and_errors(trained_like):
    cfg, _, _, lut_model = trained_like
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg and isinstance(again.ffn_config, MoLEConfig)
    with pytest.raises(ValueError, match="mode='bogus'|mode"):
        MoLEConfig(mode="bogus")
    with pytest.raises(ValueError, match="unknown key"):
        ModelConfig.from_dict({**cfg.to_dict(), "ffn_config": {"n_experts": 4, "top_k": 2}})
    # LUT mode without rows or an attached store fails naming what is missing
    gl, sl = nnx.split(lut_model)
    with pytest.raises(ValueError, match=r"lut_rows has shape \(0,\), expected \(1, 4, 4, 64\)"):
        forward(gl, sl, np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match="not in LUT mode"):
        MD.with_lut_rows(init_model(tiny_cfg(), seed=0), jnp.zeros((1, 4, L, N, D)))
    with pytest.raises(ValueError, match=r"expected \[B, T, 2, 4, 64\]"):
        MD.with_lut_rows(lut_model, jnp.zeros((1, 4, L, N + 1, D)))


def test_dedup_training_path_equals_all_tokens_path():
    """The training-mode speed-up (experts once per distinct id, gathered back) gives the plain
    path's loss and gradients, in both branches: few distinct ids (dedup taken) and all ids
    distinct (more than the cap: the fallback taken)."""
    from pallasite.models.mole import unique_rows

    ids = jnp.asarray([5, 3, 5, 9, 3, 3, 1, 9], jnp.int32)
    n, rep_U, slot_X = unique_rows(ids, 6)
    assert int(n) == 4 and np.array_equal(np.asarray(ids)[np.asarray(rep_U)][np.asarray(slot_X)], np.asarray(ids))
    few = jnp.asarray(np.random.default_rng(0).integers(1, 9, (2, 16)), jnp.int32)  # ≤ 8 distinct ≤ cap 16
    distinct = jnp.arange(1, 33, dtype=jnp.int32).reshape(2, 16)  # 32 distinct > cap 16
    assert int(unique_rows(few.reshape(-1), 16)[0]) <= 16 < int(unique_rows(distinct.reshape(-1), 16)[0])
    results = {}
    for frac in (0.0, 0.5):
        cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, ffn="mole",
                          ffn_config=MoLEConfig(n_experts=3, dedup_fraction=frac))  # small: cond compiles both
        model = init_model(cfg, seed=2)
        g, params = nnx.split(model, nnx.Param)

        def loss_fn(params, toks):
            return jnp.sum(jnp.sin(nnx.merge(g, params)(toks)[0]))

        f = jax.jit(jax.value_and_grad(loss_fn))
        results[frac] = [f(params, t) for t in (few, distinct)]
    for (l0, g0), (l1, g1) in zip(results[0.0], results[0.5]):
        np.testing.assert_allclose(l1, l0, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="dedup_fraction"):
        MoLEConfig(dedup_fraction=1.5)


def test_dedup_runs_per_batch_shard_and_the_sharded_step_matches_one_device(monkeypatch):
    """On an 8-device FSDP mesh the dedup sorts and gathers each shard's own tokens ([G=8,
    X/8] groups: a global dedup would gather the whole batch onto every chip) and the train
    step's loss and gradient norm equal the single-device step's."""
    from pallasite import sharding
    from pallasite.models import mole as M
    from pallasite.training import optim
    from pallasite.training import step as st
    from pallasite.training.config import train_defaults

    seen = []
    unique = M.unique_rows
    monkeypatch.setattr(M, "unique_rows", lambda ids, m: (seen.append(tuple(ids.shape)), unique(ids, m))[1])
    cfg = tiny_cfg(scan=True)
    B, T = 16, 32
    rng = np.random.default_rng(0)
    tok = rng.integers(1, 12, (B, T + 1)).astype(np.int32)  # <= 11 distinct ids per shard: the dedup branch
    batch = dict(tokens=tok[:, :-1], targets=tok[:, 1:], positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
                 segment_ids=np.ones((B, T), np.int32), loss_mask=np.ones((B, T), np.float32))
    opt, sched = optim.make_optimizer(train_defaults().optim, 10)
    metrics = {}
    for shape in ({"data": 1}, {"fsdp": 8}):
        mesh = sharding.make_mesh(shape)
        g, state, shardings = st.init_train_state(cfg, opt, mesh, sharding.DEFAULT_RULES, seed=0)
        step = st.make_train_step(g, opt, sched, shardings, mesh, sharding.DEFAULT_RULES, B)
        with jax.set_mesh(mesh):
            _, m = step(state, st.put_batch(batch, st.batch_shardings(mesh, sharding.DEFAULT_RULES, B)))
        metrics[len(mesh.devices.flat)] = jax.device_get(m)
    assert (B * T,) in seen and (B * T // 8,) in seen, seen  # one group on 1 device, 8 groups on 8
    np.testing.assert_allclose(metrics[8]["loss"], metrics[1]["loss"], rtol=1e-5)
    np.testing.assert_allclose(metrics[8]["grad_norm"], metrics[1]["grad_norm"], rtol=1e-4)


@pytest.mark.parametrize("size", ["cpu", "160m", "410m", "1b"])
def test_expert_configs_equal_activated_params(size):
    """configs/experts: every variant activates the dense FFN's 2·d·D_s parameters per token
    (MoLE: shared FFN + router; MoE: k non-gated experts of width D_s/2, exactly, as in the paper's
    Table 2; the SwiGLU-form ablation within 2%), and MoLE's training-time expert parameters match
    MoE-10E / MoE-34E as in the paper (N=4 ↔ 10E, N=16 ↔ 34E)."""
    from pallasite.configs.experts import paper, quality
    from pallasite.models.config import ModelConfig

    def cfg(kind, **kw):
        d = quality.model_dict(kind, "cpu") if size == "cpu" else paper.model(size, kind, **kw)
        return ModelConfig.from_dict({**d, "vocab_size": d["vocab_size"] or 512})

    dense = cfg("dense")
    D, Ds = dense.d_model, dense.d_ff
    assert activated_ffn_params(dense) == 2 * D * Ds
    for kind, n in (("mole4", 4), ("mole16", 16)):
        c = cfg(kind)
        assert c.ffn == "mole" and c.ffn_config.n_experts == n and c.hidden_act == "gelu_exact"
        assert activated_ffn_params(c) == 2 * D * Ds + D * n
    for kind, e in (("moe10", 10), ("moe34", 34)):
        m = cfg(kind).ffn_config
        assert (m.num_experts, m.top_k) == (e, 2) and m.lb_loss_coef == 0.01 and m.z_loss_coef == 0.001
        assert not m.gated and m.d_expert == Ds // 2 and m.top_k * 2 * D * m.d_expert == 2 * D * Ds
        # training-time expert weights: MoLE-4E = MoE-10E, MoLE-16E = MoE-34E (in units of 2·d·D_s)
        mole_n = {10: 4, 34: 16}[e]
        assert e * 2 * D * m.d_expert == (mole_n + 1) * 2 * D * Ds
        # the SwiGLU-form ablation
        g = cfg(kind + "g").ffn_config if size == "cpu" else cfg(kind, moe_gated=True).ffn_config
        assert g.gated and abs(g.top_k * 3 * D * g.d_expert / (2 * D * Ds) - 1) < 0.02
    glu = cfg("dense_glu")
    assert glu.ffn == "dense" and abs(3 * D * glu.d_ff / (2 * D * Ds) - 1) < 0.02
