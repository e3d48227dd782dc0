"""Train step: gradient accumulation == big batch, chunked loss == full loss, 1 vs 8 devices,
weight-decay mask, lr schedule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite import sharding as shd
from pallasite.models.config import ModelConfig
from pallasite.registry import LOSS
from pallasite.training import optim
from pallasite.training import step as st
from pallasite.training.config import train_defaults

CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
B, T = 8, 16


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tok = rng.integers(3, CFG.vocab_size, (B, T + 1)).astype(np.int32)
        seg = np.ones((B, T), np.int32)
        seg[:, 10:] = 2  # two packed documents per row
        pos = np.concatenate([np.arange(10), np.arange(T - 10)])[None].repeat(B, 0).astype(np.int32)
        mask = (rng.random((B, T)) > 0.2).astype(np.float32)  # ragged token counts per row
        out.append(dict(tokens=tok[:, :-1], targets=tok[:, 1:], positions=pos, segment_ids=seg, loss_mask=mask))
    return out


def _run(mesh_shape, batches, *, grad_accum=1, loss_chunk=0, steps=None):
    oc = train_defaults().optim
    opt, sched = optim.make_optimizer(oc, 10)
    mesh = shd.make_mesh(mesh_shape)
    rules = shd.DEFAULT_RULES
    graphdef, state, shardings = st.init_train_state(CFG, opt, mesh, rules, seed=0)
    step = st.make_train_step(graphdef, opt, sched, shardings, mesh, rules, B, grad_accum=grad_accum,
                              loss_chunk=loss_chunk)
    bsh = st.batch_shardings(mesh, rules, B)
    losses = []
    with jax.set_mesh(mesh):
        for b in batches:
            state, m = step(state, st.put_batch(b, bsh))
            losses.append(m)
    return jax.device_get(losses), jax.device_get(state["params"])


@pytest.fixture(scope="module")
def reference():
    return _run({"data": 1}, _batches(3))


def _max_param_diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_grad_accumulation_equals_big_batch(reference):
    ref_m, ref_p = reference
    acc_m, acc_p = _run({"data": 1}, _batches(3), grad_accum=2)
    for r, a in zip(ref_m, acc_m):
        np.testing.assert_allclose(a["loss"], r["loss"], rtol=1e-5)
        np.testing.assert_allclose(a["grad_norm"], r["grad_norm"], rtol=1e-4)
        assert a["tokens"] == r["tokens"]
    assert _max_param_diff(acc_p, ref_p) < 1e-5
    # negative control: a different batch gives visibly different parameters
    _, other_p = _run({"data": 1}, _batches(3, seed=1))
    assert _max_param_diff(other_p, ref_p) > 1e-4


def test_chunked_cross_entropy_equals_full(reference):
    ref_m, ref_p = reference
    ch_m, ch_p = _run({"data": 1}, _batches(3), loss_chunk=24)  # 128 tokens -> 6 chunks, padded
    for r, c in zip(ref_m, ch_m):
        np.testing.assert_allclose(c["loss"], r["loss"], rtol=1e-5)
    assert _max_param_diff(ch_p, ref_p) < 1e-5


def test_loss_is_masked_mean_cross_entropy():
    """The step's loss equals an independent numpy computation on the initial parameters."""
    from flax import nnx

    from pallasite.models.transformer import init_model

    b = _batches(1)[0]
    model = init_model(CFG, 0)
    g, p, o = st.split_model(model)
    logits = jax.jit(lambda p, t, pos, seg: nnx.merge(g, p, o)(t, pos, segment_ids_BT=seg)[0])(
        p, jnp.asarray(b["tokens"]), jnp.asarray(b["positions"]), jnp.asarray(b["segment_ids"]))
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    lp = logits - np.log(np.exp(logits - top).sum(-1, keepdims=True)) - top
    nll = -np.take_along_axis(lp, b["targets"][..., None], -1)[..., 0]
    expected = (nll * b["loss_mask"]).sum() / b["loss_mask"].sum()
    lm = LOSS.get("lm")
    loss, terms = jax.jit(lambda p, b: st.loss_value(g, p, o, b, loss=lm))(p, {k: jnp.asarray(v) for k, v in b.items()})
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    assert float(terms.count) == b["loss_mask"].sum() and terms.aux == {}


def test_one_vs_eight_devices_same_losses(reference):
    ref_m, ref_p = reference
    mesh_m, mesh_p = _run({"data": 2, "fsdp": 2, "tensor": 2}, _batches(3))
    for r, m in zip(ref_m, mesh_m):
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-5)
    assert _max_param_diff(mesh_p, ref_p) < 1e-5


def test_weight_decay_mask():
    from pallasite.models.transformer import init_model

    cfg = CFG.replace(qkv_bias=True)
    _, params, _ = st.split_model(init_model(cfg, 0))
    mask = {"/".join(str(getattr(k, "key", "")) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(optim.decay_mask(params))}
    assert not mask["embed/embedding/"] and not mask["final_norm/scale/"]
    assert not mask["layers/0/attn/q_proj/bias/"] and not mask["layers/0/input_norm/scale/"]
    assert mask["layers/0/attn/q_proj/kernel/"] and mask["lm_head/kernel/"] and mask["layers/1/ffn/down_proj/kernel/"]
    full = optim.decay_mask(params, decay_norms=True, decay_biases=True, decay_embeddings=True)
    assert all(jax.tree.leaves(full))


def test_lr_schedule():
    s = optim.lr_schedule(1.0, steps=110, warmup_steps=10, min_lr_ratio=0.1)
    np.testing.assert_allclose([float(s(0)), float(s(4)), float(s(9))], [0.1, 0.5, 1.0], rtol=1e-6)
    np.testing.assert_allclose(float(s(60)), 0.1 + 0.9 * 0.5, rtol=1e-6)  # half-way down the cosine
    np.testing.assert_allclose(float(s(110)), 0.1, rtol=1e-6)
    np.testing.assert_allclose(float(s(500)), 0.1, rtol=1e-6)


@pytest.mark.slow
def test_moe_aux_losses_and_expert_parallel_step():
    """An MoE model trains through the same step: aux losses reach the metrics, and a data×expert
    mesh (shard_map dispatch, found through jax.set_mesh) gives the single-device losses."""
    global CFG
    from pallasite.models.moe import MoEConfig

    saved = CFG
    CFG = saved.replace(ffn="moe", ffn_config=MoEConfig(num_experts=4, top_k=2, d_expert=32))
    try:
        one_m, one_p = _run({"data": 1}, _batches(2))
        ep_m, ep_p = _run({"data": 2, "expert": 4}, _batches(2))
    finally:
        CFG = saved
    for a, b in zip(one_m, ep_m):
        assert a["aux/moe_lb_loss"] > 0 and a["aux/moe_z_loss"] > 0
        np.testing.assert_allclose(a["total_loss"], a["loss"] + a["aux/moe_lb_loss"] + a["aux/moe_z_loss"], rtol=1e-6)
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    assert _max_param_diff(one_p, ep_p) < 1e-5


def test_flash_kernel_runs_per_shard_and_matches_one_device(reference, monkeypatch):
    """With the Pallas kernel (which XLA cannot partition) on a data x fsdp x tensor mesh, the
    kernel sees one device's rows and heads (no gathered whole batch) and the losses equal the
    single-device reference step (the same kernel's math as the jnp reference, to 1e-5)."""
    global CFG
    import pallasite.ops.attention.flash_gpu as flash_gpu

    seen = []
    forward = flash_gpu.forward

    def spy(q, *a, **k):
        seen.append(tuple(q.shape))
        return forward(q, *a, **k)

    monkeypatch.setattr(flash_gpu, "forward", spy)
    saved = CFG
    CFG = saved.replace(attention_impl="pallas")
    try:
        ref_m, _ = reference
        mesh_m, _ = _run({"data": 2, "fsdp": 2, "tensor": 2}, _batches(2))
    finally:
        CFG = saved
    # [B, T, H, D] per device: 8 rows over data x fsdp = 2, 4 heads (2 kv heads) over tensor = 2
    assert seen and set(seen) == {(2, T, 2, CFG.dh)}, seen
    for r, m in zip(ref_m, mesh_m):
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-5)
