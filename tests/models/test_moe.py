"""MoE layer: gating conventions vs a naive per-token loop, aux losses, capacity drops,
expert-parallel (8 host devices) == single device for values and gradients, clear errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite import sharding
from pallasite.models.config import ModelConfig
from pallasite.models.moe import MoE, MoEConfig
from pallasite.models.moe_routing import capacity_keep, expert_capacity


def _layer(seed=0, hidden_act="silu", **moe):
    cfg = ModelConfig(d_model=16, d_ff=24, ffn="moe", ffn_config=MoEConfig(**moe), hidden_act=hidden_act)
    return MoE(cfg, rngs=nnx.Rngs(seed))


_apply_jit = jax.jit(lambda st, x, gd: nnx.merge(gd, st)(x), static_argnums=2)


def _apply(layer, x):
    """One compiled call per layer structure (eager NNX compiles every op separately)."""
    gd, st = nnx.split(layer)
    return _apply_jit(st, x, gd)


def _naive(layer, x_BTD):
    """Per-token loop in float64: softmax → top-k → (renormalise) → Σ w·Expert_e (+ shared);
    Expert_e is SwiGLU-form act(x·gate)·(x·up)·down, or act(x·up)·down for non-gated experts."""
    import math

    m = layer.mcfg
    x = np.asarray(x_BTD, np.float64).reshape(-1, x_BTD.shape[-1])
    R = np.asarray(layer.router[...], np.float64)
    wu, wd = (np.asarray(v[...], np.float64) for v in (layer.w_up, layer.w_down))
    wg = None if layer.w_gate is None else np.asarray(layer.w_gate[...], np.float64)
    silu = lambda z: z / (1 + np.exp(-z))
    gelu_exact = np.vectorize(lambda z: 0.5 * z * (1 + math.erf(z / math.sqrt(2))))
    act = {"silu": silu, "gelu_exact": gelu_exact}[layer.cfg.hidden_act]
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        logits = x[n] @ R
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[: m.top_k]
        w = p[top] / (p[top].sum() if m.norm_topk_prob else 1.0)
        for e, we in zip(top, w):
            h = act(x[n] @ wu[e]) if wg is None else act(x[n] @ wg[e]) * (x[n] @ wu[e])
            out[n] += we * (h @ wd[e])
        if layer.shared_expert is not None:
            se = layer.shared_expert
            h = silu(x[n] @ np.asarray(se.gate_proj.kernel[...])) * (x[n] @ np.asarray(se.up_proj.kernel[...]))
            s = h @ np.asarray(se.down_proj.kernel[...])
            g = 1 / (1 + np.exp(-(x[n] @ np.asarray(layer.shared_gate[...])[:, 0])))
            out[n] += g * s
    return out.reshape(x_BTD.shape)


@pytest.mark.parametrize("moe", [
    dict(num_experts=4, top_k=2, norm_topk_prob=True),  # Mixtral
    dict(num_experts=6, top_k=2, norm_topk_prob=False, shared_expert_d_ff=20),  # Qwen2-MoE
    dict(num_experts=8, top_k=3, norm_topk_prob=False),  # OLMoE
    dict(num_experts=10, top_k=2, norm_topk_prob=True, gated=False, hidden_act="gelu_exact"),  # MoLE paper's MoE
])
def test_gating_conventions_match_naive_loop(moe):
    layer = _layer(**moe)
    layer.router[...] = layer.router[...] * 20  # peaked router: a wrong top-k / softmax shows up
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    y, aux = _apply(layer, x)
    np.testing.assert_allclose(y, _naive(layer, x), atol=1e-5)
    assert set(aux) == {"moe_lb_loss", "moe_z_loss"}


def test_non_gated_experts_have_two_matrices_and_differ_from_gated():
    """gated=False: no w_gate, activated expert params 2·D·F (the paper's D_s/2 MLPs); a gated
    layer sharing w_up/w_down gives different outputs (so the naive-loop match above is not vacuous)."""
    plain = _layer(num_experts=4, top_k=2, gated=False, hidden_act="gelu_exact")
    assert plain.w_gate is None
    n_expert = sum(v.size for k, v in nnx.to_flat_state(nnx.state(plain, nnx.Param)) if k[-1] in ("w_up", "w_down"))
    assert n_expert == 4 * 2 * 16 * 24
    gated = _layer(num_experts=4, top_k=2, hidden_act="gelu_exact")
    gated.router[...], gated.w_up[...], gated.w_down[...] = plain.router[...], plain.w_up[...], plain.w_down[...]
    x = jax.random.normal(jax.random.key(9), (2, 5, 16))
    assert float(jnp.abs(_apply(plain, x)[0] - _apply(gated, x)[0]).max()) > 1e-3


def test_aux_losses_are_weighted_switch_and_z_loss():
    layer = _layer(num_experts=4, top_k=2, lb_loss_coef=0.5, z_loss_coef=0.25)
    x = jax.random.normal(jax.random.key(2), (3, 7, 16))
    _, aux = _apply(layer, x)
    logits = np.asarray(x, np.float64).reshape(-1, 16) @ np.asarray(layer.router[...], np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :2]
    f = np.bincount(top.ravel(), minlength=4) / len(p)
    lb = 0.5 * 4 * np.sum(f * p.mean(0))
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(aux["moe_lb_loss"], lb, rtol=1e-5)
    np.testing.assert_allclose(aux["moe_z_loss"], 0.25 * np.mean(lse ** 2), rtol=1e-5)
    _, aux0 = _apply(_layer(num_experts=4, top_k=2, lb_loss_coef=0.0, z_loss_coef=0.0), x)
    assert aux0 == {}


def test_capacity_keep_priority_and_drops():
    # one sequence, 4 tokens, k=2, 2 experts, capacity 3: all first choices first, then by position
    e = jnp.asarray([[[0, 1], [0, 1], [0, 1], [0, 1]]])
    keep = np.asarray(capacity_keep(e, 2, 3))
    assert keep[0, :, 0].tolist() == [True, True, True, False]  # expert 0 full after 3 first choices
    assert keep[0, :, 1].tolist() == [True, True, True, False]
    assert expert_capacity(8, 2, 4, 1.0) == 4
    # a dropped pair contributes nothing: capacity layer == dropless layer with those weights zeroed
    layer = _layer(num_experts=4, top_k=2, capacity_factor=0.5)
    x = jax.random.normal(jax.random.key(3), (2, 8, 16))
    y_cap, _ = _apply(layer, x)
    dropless = _layer(num_experts=4, top_k=2)
    nnx.update(dropless, nnx.state(layer))
    y_full, _ = _apply(dropless, x)
    _, _, _, e_BTK, keep = layer.routing(x)
    assert 0 < int((~keep).sum()) < keep.size  # some but not all pairs dropped
    tok_has_drop = np.asarray((~keep).any(-1))
    diff = np.abs(np.asarray(y_cap - y_full)).max(-1)
    assert np.all(diff[~tok_has_drop] < 1e-6) and np.all(diff[tok_has_drop] > 1e-6)


@pytest.mark.parametrize("impl", ["pallas", "tiles"])
def test_gmm_impls_in_layer_match_ragged_dot(impl):
    layer = _layer(num_experts=4, top_k=2, gmm_impl="ref")
    x = jax.random.normal(jax.random.key(4), (2, 5, 16))
    y_ref, _ = _apply(layer, x)
    other = _layer(num_experts=4, top_k=2, gmm_impl=impl)
    nnx.update(other, nnx.state(layer))
    np.testing.assert_allclose(_apply(other, x)[0], y_ref, atol=1e-5)


@pytest.mark.parametrize("capacity_factor,gated", [(None, True), (0.75, True),
                                                   pytest.param(None, False, marks=pytest.mark.slow)])
def test_expert_parallel_equals_single_device(capacity_factor, gated):
    """8 host devices, E=16 (2 per device), k=4: standard and Occult dispatch, values + grads
    (SwiGLU-form experts; and the non-gated experts of the MoLE paper's baselines)."""
    layer = _layer(num_experts=16, top_k=4, shared_expert_d_ff=8, capacity_factor=capacity_factor, gated=gated)
    gd, st = nnx.split(layer)
    x = jax.random.normal(jax.random.key(5), (8, 6, 16))

    def loss(st, x, gd):
        y, aux = nnx.merge(gd, st)(x)
        return jnp.sum(jnp.sin(y) * jnp.arange(16.0)) + sum(aux.values()), y

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), static_argnums=2)
    (l0, y0), g0 = f(st, x, gd)
    if capacity_factor is not None:
        assert int((~layer.routing(x)[-1]).sum()) > 0, "the capacity case must actually drop pairs"
    mesh = sharding.make_mesh({"expert": 8})
    # (Occult with dropped pairs is also covered, per random routing, in test_occult.py)
    for mode in ("standard", "occult") if capacity_factor is None else ("occult",):
        lay = _layer(num_experts=16, top_k=4, shared_expert_d_ff=8, capacity_factor=capacity_factor, dispatch=mode,
                     gated=gated)
        gd_m, _ = nnx.split(lay)
        with jax.set_mesh(mesh):
            assert "all_to_all" in f.lower(st, x, gd_m).as_text()
            (l1, y1), g1 = f(st, x, gd_m)
        np.testing.assert_allclose(y1, y0, atol=1e-5)
        np.testing.assert_allclose(l1, l0, atol=1e-5, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
            np.testing.assert_allclose(a, b, atol=1e-5)


def test_expert_axis_must_divide_experts():
    layer = _layer(num_experts=12, top_k=2)
    mesh = sharding.make_mesh({"expert": 8})
    with pytest.raises(ValueError, match=r"size 8.*num_experts=12"):
        layer(jnp.ones((8, 2, 16)), mesh=mesh)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="top_k=5"):
        MoEConfig(num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="dispatch='ring'"):
        MoEConfig(dispatch="ring")
    with pytest.raises(ValueError, match="occult_devices=3"):
        MoEConfig(num_experts=8, occult_devices=3)
    cfg = ModelConfig(ffn="moe", ffn_config=MoEConfig(num_experts=4, top_k=1, capacity_factor=1.5))
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # JSON round trip restores the sub-config


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("rows", [1, 10, 100])  # R·k ≤ E: gathered weights; R·E ≤ tiles: all-dense; else tiles
def test_small_batch_expert_paths_equal_grouped_matmul(rows, gated):
    """The decode-sized shortcuts of ``expert_ffn_rows`` (auto) equal the ragged_dot reference
    in values and gradients, empty (−1) slots included."""
    from pallasite.models.layers import activation
    from pallasite.models.moe_experts import _small_batch_path, expert_ffn_rows

    E, D, F, S = 8, 16, 24, 2
    want = {1: "_experts_gathered", 10: "_experts_all_dense", 100: None}[rows]
    path = _small_batch_path(rows, S, E)
    assert (path and path.__name__) == want
    ks = jax.random.split(jax.random.key(rows), 6)
    x = jax.random.normal(ks[0], (rows, D))
    e = jax.random.randint(ks[1], (rows, S), -1, E)  # some empty slots
    w = jax.random.uniform(ks[2], (rows, S))
    ws = [jax.random.normal(k, shp) * 0.3 for k, shp in zip(ks[3:], [(E, D, F), (E, D, F), (E, F, D)])]
    wg = ws[0] if gated else None
    act = activation("silu")

    def loss(impl, x, wg, wu, wd):
        return jnp.sum(jnp.sin(expert_ffn_rows(x, e, w, wg, wu, wd, act=act, gmm_impl=impl)))

    for argnums in [(1, 2, 3, 4) if gated else (1, 3, 4)]:
        ref_v, ref_g = jax.value_and_grad(loss, argnums)("ref", x, wg, ws[1], ws[2])
        got_v, got_g = jax.value_and_grad(loss, argnums)("auto", x, wg, ws[1], ws[2])
        np.testing.assert_allclose(got_v, ref_v, rtol=1e-5, atol=1e-5)
        for a, b in zip(got_g, ref_g):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
