"""Occult: dispatch exactness (8 host devices), placement permutation, planted clusters,
CT bounds and byte accounting, collaboration pruning, bad placements."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite import sharding
from pallasite.models import occult
from pallasite.models.config import ModelConfig
from pallasite.models.moe import MoEConfig
from pallasite.models.moe_dispatch import dispatch_plan, expert_parallel_ffn
from pallasite.models.moe_experts import expert_ffn_rows
from pallasite.models.moe_routing import prune_routing
from pallasite.models.occult_accounting import check_ct_bounds, communication_stats, communication_times
from pallasite.models.transformer import Block, Transformer

E, K, ND, D, F = 16, 4, 8, 8, 12


def _random_routing(seed, B, T, drop=0.2):
    rng = np.random.default_rng(seed)
    e = np.stack([rng.permutation(E)[:K] for _ in range(B * T)]).reshape(B, T, K)
    w = rng.random((B, T, K)).astype(np.float32)
    keep = rng.random((B, T, K)) > drop
    return jnp.asarray(e, jnp.int32), jnp.asarray(w), jnp.asarray(keep)


@pytest.mark.parametrize("gated", [True, False])
def test_occult_dispatch_equals_standard_and_single_device_for_random_routings(gated):
    """Standard and Occult expert-parallel dispatch == the single-device layer (values and
    gradients), for random routings with drops, gated and non-gated experts. A random expert
    placement — every expert weight permuted and the routing relabelled as permuted router
    columns would relabel it — reproduces the unpermuted layer's output and gradients."""
    ks = jax.random.split(jax.random.key(0), 4)
    wg = jax.random.normal(ks[0], (E, D, F)) * 0.3 if gated else None
    wu = jax.random.normal(ks[1], (E, D, F)) * 0.3
    wd = jax.random.normal(ks[2], (E, F, D)) * 0.3
    x = jax.random.normal(ks[3], (8, 3, D))
    mesh = sharding.make_mesh({"expert": ND})

    def single(x, e, w, keep, wg, wu, wd):
        em = jnp.where(keep, e, -1).reshape(-1, K)
        return expert_ffn_rows(x.reshape(-1, D), em, jnp.where(keep, w, 0).reshape(-1, K), wg, wu, wd,
                               act=jax.nn.silu).reshape(x.shape)

    def ep(mode):
        return lambda x, e, w, keep, wg, wu, wd: expert_parallel_ffn(
            x, e, jnp.where(keep, w, 0), keep, wg, wu, wd, mesh=mesh, mode=mode)

    def loss(f):  # value and gradients w.r.t. x, gate weights, up and down weights
        return jax.jit(jax.value_and_grad(
            lambda x, w, wu, wd, wg, e, keep: jnp.sum(jnp.sin(f(x, e, w, keep, wg, wu, wd))), argnums=(0, 1, 2, 3)))

    f_single, f_std, f_occ = loss(single), loss(ep("standard")), loss(ep("occult"))
    for seed in range(2):  # same shapes: no recompilation across routings
        e, w, keep = _random_routing(seed, 8, 3)
        v0, g0 = f_single(x, w, wu, wd, wg, e, keep)
        for f in (f_std, f_occ):
            v, g = f(x, w, wu, wd, wg, e, keep)
            np.testing.assert_allclose(v, v0, atol=1e-5, rtol=1e-6)
            for a, b in zip(g, g0):
                np.testing.assert_allclose(a, b, atol=1e-5)
    # a random placement: slot i holds original expert perm[i]; the routing names slots
    perm = np.random.default_rng(9).permutation(E)
    slot_of = jnp.asarray(np.argsort(perm))
    e, w, keep = _random_routing(2, 8, 3)
    v0, (gx0, gw0, gu0, gd0) = f_single(x, w, wu, wd, wg, e, keep)
    wg_p = None if wg is None else wg[perm]
    for f in (f_single, f_std, f_occ):
        v, (gx, gw, gu, gd) = f(x, w, wu[perm], wd[perm], wg_p, slot_of[e], keep)
        np.testing.assert_allclose(v, v0, atol=1e-5, rtol=1e-6)
        np.testing.assert_allclose(gx, gx0, atol=1e-5)
        np.testing.assert_allclose(gw, gw0, atol=1e-5)
        np.testing.assert_allclose(gu, gu0[perm], atol=1e-5)  # each slot's gradient is its expert's
        np.testing.assert_allclose(gd, gd0[perm], atol=1e-5)
    # negative controls: permuted weights without relabelled routing, and occult with the gate
    # weights dropped on the expert device, are wrong
    v_bad, _ = f_std(x, w, wu[perm], wd[perm], wg_p, e, keep)
    assert abs(float(v_bad) - float(v0)) > 1e-3
    v_bad, _ = f_occ(x, jnp.ones_like(w), wu, wd, wg, e, keep)
    assert abs(float(v_bad) - float(v0)) > 1e-3


def test_dispatch_rows_match_accounting():
    e, _, keep = _random_routing(1, 8, 8, drop=0.0)
    e_NK = np.asarray(e).reshape(-1, K)
    stats = communication_stats(e_NK, num_experts=E, num_devices=ND, d_model=D)
    n_loc = len(e_NK) // ND
    off = {"standard": 0, "occult": 0}
    for src in range(ND):
        part = jnp.asarray(e_NK[src * n_loc:(src + 1) * n_loc])
        for mode in off:
            *_, rows = dispatch_plan(part, jnp.ones(part.shape, bool), num_devices=ND, experts_per_device=E // ND,
                                     mode=mode)
            off[mode] += int(rows.sum() - rows[src])
    assert off["standard"] == stats["rows_standard"] and off["occult"] == stats["rows_occult"]
    assert stats["rows_occult"] < stats["rows_standard"]
    check_ct_bounds(stats["ct"], K, E, ND)


def test_ct_hand_example_and_bounds():
    # E=8 over 4 devices (2 each), k=3: token 0 → experts {0,1,2} (devices 0,0,1) CT 2; token 1 → {1,3,5} CT 3
    e = np.array([[0, 1, 2], [1, 3, 5]])
    assert communication_times(e, 8, 4) == 2.5
    s = communication_stats(e, num_experts=8, num_devices=4, d_model=2, token_device_N=np.array([0, 3]))
    # token 0 sits on device 0: off-device pairs = {2}; token 1 on device 3: pairs {1,3,5} all off-device
    assert s["rows_standard"] == 1 + 3 and s["rows_occult"] == 1 + 3
    with pytest.raises(AssertionError, match="outside"):
        check_ct_bounds(0.5, 3, 8, 4)


def _planted(seed, n=4096, k=4, e=32, nd=8):
    rng = np.random.default_rng(seed)
    labels = rng.permutation(e).reshape(nd, e // nd)  # hidden clusters of E_loc experts
    c = rng.integers(0, nd, size=n)
    return np.stack([rng.permutation(labels[ci])[:k] for ci in c])


def test_greedy_placement_recovers_planted_clusters():
    e = _planted(0)
    P = occult.coactivation(e, 32)
    assert np.allclose(P, P.T) and P.trace() == e.size
    place = occult.greedy_placement(P[None], 8)
    relabel = np.argsort(place.array()[0])  # original expert → slot
    ct_greedy = communication_times(relabel[e], 32, 8)
    ct_contig = communication_times(e, 32, 8)
    ct_rand = communication_times(np.argsort(occult.random_placement(1, 32, 8, seed=3).array()[0])[e], 32, 8)
    assert ct_greedy == 1.0  # the lower bound ceil(k·N_d/N_e) = 1
    assert ct_contig > 2.5 and ct_rand > 2.5
    # negative control: greedy on a shuffled (uninformative) co-activation matrix does not reach the bound
    rng = np.random.default_rng(1)
    shuffled = occult.greedy_placement(rng.permutation(P.ravel()).reshape(P.shape)[None], 8)
    assert communication_times(np.argsort(shuffled.array()[0])[e], 32, 8) > 2.0


def _tiny_moe_model(scan=False, **moe):
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16, ffn="moe",
                      scan_layers=scan, ffn_config=MoEConfig(num_experts=8, top_k=3, **moe))
    return Transformer(cfg, rngs=nnx.Rngs(0))


_fwd = jax.jit(lambda st, tok, gd: nnx.merge(gd, st)(tok)[0], static_argnums=2)


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "non_gated"])
@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
def test_placement_permutation_leaves_outputs_unchanged(scan, gated):
    """``apply_placement`` permutes every expert weight, the router columns and the router bias
    together: whole-model logits are unchanged (list and scan layouts, gated and non-gated
    experts); moving the experts without the router changes them."""
    model = _tiny_moe_model(scan, gated=gated, router_bias=True)
    gd, st = nnx.split(model)
    # a non-zero router bias, so its permutation matters too
    flat = occult._flat(st)
    for i, p in enumerate(p for p in list(flat) if p[-1] == "router_bias"):
        flat[p] = flat[p].replace(jax.random.normal(jax.random.key(3 + i), flat[p][...].shape))
    st = nnx.from_flat_state(list(flat.items()))
    tok = jax.random.randint(jax.random.key(1), (2, 7), 0, 64)
    place = occult.random_placement(2, 8, 4, seed=5)
    st2 = occult.apply_placement(st, place, num_devices=4)
    before, after = occult._flat(st), occult._flat(st2)
    names = {p[-1] for p in before if p[-2] == "ffn"}
    assert names >= {"w_up", "w_down", "router", "router_bias"} and (("w_gate" in names) == gated)
    for p in before:
        if p[-2] == "ffn":  # every per-expert tensor really moved, the same way
            assert not np.allclose(before[p][...], after[p][...]), p
    perm = place.array()
    up = [p for p in before if p[-1] == "w_up"][0]  # scan: [L, E, D, F]; list: layer 0's [E, D, F]
    for layer in (range(2) if scan else (0,)):
        b, a = before[up][...], after[up][...]
        b, a = (b[layer], a[layer]) if scan else (b, a)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[perm[layer]])
    np.testing.assert_allclose(_fwd(st2, tok, gd), _fwd(st, tok, gd), atol=1e-5)
    # negative control: permuting experts without the router columns changes the outputs
    bad = {p: (v.replace(jnp.flip(v[...], axis=-3)) if p[-1] in ("w_up", "w_down", "w_gate") else v)
           for p, v in flat.items()}
    bad = nnx.from_flat_state(list(bad.items()))
    assert float(jnp.abs(_fwd(bad, tok, gd) - _fwd(st, tok, gd)).max()) > 1e-4


def _reference_routing(model, tokens):
    """Step by step through each layer's modules (no taps): per MoE layer the post-attention-normed
    input, the router softmax and the top-k experts; scanned layers are sliced one at a time."""
    cfg = model.cfg
    if cfg.scan_layers:
        _, blocks_st = nnx.split(model.layers)
        layer_gd = nnx.split(nnx.eval_shape(lambda: Block(cfg.replace(scan_layers=False), rngs=nnx.Rngs(0))))[0]
        blocks = [nnx.merge(layer_gd, jax.tree.map(lambda a, i=i: a[i], blocks_st)) for i in range(cfg.n_layers)]
    else:
        blocks = list(model.layers)
    ctx = model.context(tokens)
    x = ctx.embed_BTD
    out = {"inputs": [], "probs": [], "experts": []}
    for i, blk in enumerate(blocks):
        lctx = ctx.for_layer(i)
        h = x + blk.attn(blk.input_norm(x), lctx)[0]
        u = blk.post_attn_norm(h)
        _, probs, _, e, _ = blk.ffn.routing(u)
        out["inputs"].append(np.asarray(u).reshape(-1, cfg.d_model))
        out["probs"].append(np.asarray(probs))
        out["experts"].append(np.asarray(e).reshape(-1, e.shape[-1]))
        x = h + blk.ffn(u, lctx)[0]
    return out


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "non_gated"])
@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
def test_profile_routing_equals_step_by_step_reference(scan, gated):
    """``profile_routing`` (taps inside the model's own blocks) == a layer-by-layer walk through the
    modules, in both layer layouts and for both expert kinds; two batches are concatenated."""
    model = _tiny_moe_model(scan, gated=gated)
    gd, st = nnx.split(model)
    batches = [jax.random.randint(jax.random.key(s), (2, 6), 0, 64) for s in (7, 8)]
    prof = occult.profile_routing(gd, st, batches)
    refs = [_reference_routing(model, b) for b in batches]
    for key in ("inputs", "probs", "experts"):
        assert len(prof[key]) == 2
        for layer in range(2):
            want = np.concatenate([r[key][layer] for r in refs])
            if key == "experts":
                np.testing.assert_array_equal(prof[key][layer], want)
            else:
                np.testing.assert_allclose(prof[key][layer], want, atol=1e-6)
    # the per-layer inputs really differ (layer 1 sees layer 0's output, not the embedding)
    assert not np.allclose(prof["inputs"][0], prof["inputs"][1])


def test_expert_similarity_and_weights_for_both_expert_kinds():
    """``layer_expert_weights`` and ``expert_similarity`` on gated and non-gated experts: the table
    is the mean cosine similarity of the experts' outputs, computed here expert by expert."""
    x = np.asarray(jax.random.normal(jax.random.key(5), (32, 16)))
    for gated in (True, False):
        _, st = nnx.split(_tiny_moe_model(gated=gated))
        weights = occult.layer_expert_weights(st)
        assert len(weights) == 2 and (weights[0][0] is None) == (not gated)
        assert occult.moe_layer_count(st) == (2, 8, False)
        wg, wu, wd = weights[1]
        sim = occult.expert_similarity(wg, wu, wd, x)
        outs = []
        for e in range(8):
            u = x @ np.asarray(wu[e])
            h = np.asarray(jax.nn.silu(u)) if wg is None else np.asarray(jax.nn.silu(x @ np.asarray(wg[e]))) * u
            y = h @ np.asarray(wd[e])
            outs.append(y / (np.linalg.norm(y, axis=-1, keepdims=True) + 1e-9))
        want = np.einsum("ind,jnd->ij", np.stack(outs), np.stack(outs)) / len(x)
        np.testing.assert_allclose(sim, want, atol=1e-5)
        np.testing.assert_allclose(np.diag(sim), 1.0, atol=1e-5)
    _, st_scan = nnx.split(_tiny_moe_model(scan=True, gated=False))
    assert occult.moe_layer_count(st_scan) == (2, 8, True)


def test_bad_placement_is_rejected():
    _, st = nnx.split(_tiny_moe_model())
    with pytest.raises(ValueError, match="3 MoE layers, the model has 2"):
        occult.apply_placement(st, occult.contiguous_placement(3, 8, 4))
    with pytest.raises(ValueError, match="16 experts, the model has 8"):
        occult.apply_placement(st, occult.contiguous_placement(2, 16, 4))
    with pytest.raises(ValueError, match="4 devices, the expert axis has 2"):
        occult.apply_placement(st, occult.contiguous_placement(2, 8, 4), num_devices=2)
    with pytest.raises(ValueError, match="not a permutation"):
        occult.Placement.from_array([[0, 0, 1, 2]], 2)
    p = occult.random_placement(2, 8, 4, seed=1)
    assert occult.Placement.from_json(p.to_json()) == p


def test_pruning_limits_devices_and_is_identity_at_full_budget():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(64, 16)) * 2, jnp.float32)
    probs = jax.nn.softmax(logits)
    w, e = jax.lax.top_k(probs, 4)
    sim = jnp.asarray(rng.random((16, 16)), jnp.float32)
    for kind in ("score", "similarity"):
        w8, e8 = prune_routing(probs, w, e, num_devices=8, max_devices=8, kind=kind, similarity_EE=sim)
        assert np.array_equal(e8, e) and np.array_equal(w8, w)
        for nd in (2,):
            wp, ep = prune_routing(probs, w, e, num_devices=8, max_devices=nd, kind=kind, similarity_EE=sim)
            dev = np.asarray(ep) // 2
            assert max(len(set(r)) for r in dev) <= nd
            assert all(len(set(r)) == 4 for r in np.asarray(ep))  # k distinct experts
            assert communication_times(np.asarray(ep), 16, 8) <= nd
    # score pruning keeps the highest-probability experts of the allowed devices
    wp, ep = prune_routing(probs, w, e, num_devices=8, max_devices=2, kind="score")
    np.testing.assert_allclose(wp, jnp.take_along_axis(probs, ep, 1))
    with pytest.raises(ValueError, match="max_devices=1 devices × 2 experts each < top_k=4"):
        prune_routing(probs, w, e, num_devices=8, max_devices=1, kind="score")
    # N_d' = 1 with 4 experts per device: every token stays on one device
    wp, ep = prune_routing(probs, w, e, num_devices=4, max_devices=1, kind="similarity", similarity_EE=sim)
    assert communication_times(np.asarray(ep), 16, 4) == 1.0


def test_pruned_layer_with_full_budget_equals_unpruned_and_profiling():
    model = _tiny_moe_model()
    gd, st = nnx.split(model)
    tok = jax.random.randint(jax.random.key(2), (2, 6), 0, 64)
    full = _tiny_moe_model(occult_devices=4, occult_max_devices=4)
    gd_full, _ = nnx.split(full)
    np.testing.assert_array_equal(_fwd(st, tok, gd_full), _fwd(st, tok, gd))
    pruned = _tiny_moe_model(occult_devices=2, occult_max_devices=1)
    gd_p, _ = nnx.split(pruned)
    assert float(jnp.abs(_fwd(st, tok, gd_p) - _fwd(st, tok, gd)).max()) > 1e-5
    prof = occult.profile_routing(gd_p, st, [tok])
    for e in prof["experts"]:
        assert e.shape == (12, 3) and communication_times(e, 8, 2) == 1.0
    with pytest.raises(ValueError, match="occult_max_devices=1"):
        MoEConfig(num_experts=8, top_k=3, occult_devices=4, occult_max_devices=1)
    assert prof["inputs"][0].shape == (12, 16) and prof["probs"][1].shape == (12, 8)


def test_moe_only_finetune_freezes_everything_else():
    from pallasite.models import occult_finetune as ft

    cfg = ModelConfig(vocab_size=256, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16, ffn="moe",
                      ffn_config=MoEConfig(num_experts=4, top_k=2, occult_devices=2, occult_max_devices=1))
    base = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)))
    data = np.frombuffer(b"def f(x):\n    return x + 1\n" * 40, np.uint8)
    gd, params, rest, losses = ft.train(cfg, steps=2, batch=2, seq_len=16, state=base, trainable="moe", data=data)
    after = occult._flat(nnx.state(nnx.merge(gd, params, rest)))
    before = occult._flat(base)
    changed = {"/".join(map(str, p)) for p in before if not np.array_equal(before[p][...], after[p][...])}
    assert changed and all("ffn" in c for c in changed), changed
    assert any(c.endswith("router") for c in changed) and any(c.endswith("w_gate") for c in changed)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_pruned_gates_follow_the_family_convention(norm_topk_prob):
    """Mixtral / Qwen3-MoE renormalise after pruning (weights sum to 1); Qwen2-MoE / OLMoE keep
    the raw softmax probabilities of the kept experts."""
    from pallasite.models.moe import MoE

    cfg = ModelConfig(d_model=16, d_ff=16, ffn="moe", ffn_config=MoEConfig(
        num_experts=8, top_k=3, norm_topk_prob=norm_topk_prob, occult_devices=2, occult_max_devices=1))
    layer = MoE(cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(4), (2, 5, 16))
    logits, probs, w, e, _ = layer.routing(x)
    assert communication_times(np.asarray(e).reshape(-1, 3), 8, 2) == 1.0
    if norm_topk_prob:
        np.testing.assert_allclose(np.asarray(w).sum(-1), 1.0, rtol=1e-6)
    else:
        np.testing.assert_allclose(w.reshape(-1, 3), jnp.take_along_axis(probs, e.reshape(-1, 3), 1), rtol=1e-6)
