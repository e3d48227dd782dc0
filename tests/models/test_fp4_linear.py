"""The ``fp4`` linear kind: config validation, the layer, training through the one train step,
and an FP4-trained checkpoint served as a float model and as FP4."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import pallasite
from pallasite import sharding as shd
from pallasite.models.config import ModelConfig
from pallasite.models.fp4 import FP4Config, FP4Linear
from pallasite.models.layers import Linear
from pallasite.ops.quant.fp4_gemm import fp4_matmul
from pallasite.registry import LINEAR
from pallasite.training import step as st
from pallasite.training.config import train_defaults
from pallasite.training.optim import make_optimizer

TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64)


@pytest.mark.parametrize(
    "field,value",
    [
        ("alpha", 1.0),
        ("alpha", 0.5),
        ("alpha", 1.2),
        ("k", 0.0),
        ("k", -1.0),
        ("scale", "log2"),
        ("w_grad", "sr"),
        ("w_bits", 6),
        ("a_bits", 16),
        ("impl", "cuda"),
        ("occ", "yes"),
    ],
)
def test_bad_fp4_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"FP4Config.{field}="):
        FP4Config(**{field: value})


def test_registered_linear_kind_and_mapping_config():
    assert LINEAR.get("fp4") is FP4Linear
    conf = LINEAR.make_config("fp4", {"alpha": 0.97, "scale": "pow2"})
    assert conf == FP4Config(alpha=0.97, scale="pow2")
    assert LINEAR.make_config("fp4", None) == FP4Config()
    with pytest.raises(ValueError, match="alhpa"):
        LINEAR.make_config("fp4", {"alhpa": 0.9})
    spec = FP4Config(w_bits=8, occ=False, w_grad="ste").gemm_spec()
    assert (spec.w_fmt, spec.a_fmt, spec.occ_alpha, spec.w_grad) == ("e4m3", "e2m1", None, "ste")


@pytest.mark.parametrize(
    "variant,want",
    [
        ("fp4", FP4Config()),
        ("direct", FP4Config(w_grad="ste", occ=False)),
        ("w4a8", FP4Config(a_bits=8, occ=False)),
        ("w8a4", FP4Config(w_bits=8, w_grad="ste")),
        ("bf16", None),
    ],
)
def test_experiment_config_variants_select_the_paper_rows(variant, want):
    from pallasite.models.config import model_config_from
    from pallasite.training.config import load_config

    config = load_config("pallasite.configs.fp4.quickstart", f"cpu,variant={variant}")
    cfg = model_config_from(config.model)
    assert cfg.linear == ("float" if want is None else "fp4") and cfg.dtype == "bfloat16"
    if want is not None:
        assert LINEAR.make_config("fp4", cfg.linear_config) == want
    with pytest.raises(ValueError, match="variant='w2a2'"):
        load_config("pallasite.configs.fp4.quickstart", "variant=w2a2")


def test_fp4_linear_has_the_float_linear_parameters_and_quantized_forward():
    cfg = ModelConfig(**TINY, linear="fp4", linear_config=FP4Config(alpha=0.97))
    lin = FP4Linear(32, 48, cfg=cfg, axes=("embed", "mlp"), use_bias=True, rngs=nnx.Rngs(0))
    ref = Linear(32, 48, cfg=cfg, axes=("embed", "mlp"), use_bias=True, rngs=nnx.Rngs(0))
    s4, sf = nnx.state(lin, nnx.Param), nnx.state(ref, nnx.Param)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), s4) == jax.tree.map(
        lambda a: (a.shape, a.dtype), sf
    )
    np.testing.assert_array_equal(np.asarray(lin.kernel[...]), np.asarray(ref.kernel[...]))
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 32))
    lin.bias[...] = jnp.arange(48.0) / 48
    want = fp4_matmul(x, lin.kernel[...], FP4Config(alpha=0.97).gemm_spec()) + lin.bias[...]
    np.testing.assert_allclose(np.asarray(lin(x)), np.asarray(want), rtol=1e-6)
    assert not np.allclose(
        np.asarray(lin(x)), np.asarray(x @ lin.kernel[...] + lin.bias[...]), atol=1e-3
    )
    with pytest.raises(ValueError, match="in_features"):
        lin(jnp.ones((2, 31)))


def _batches(n, B=8, T=32, V=64, seed=0):
    """Learnable synthetic sequences: each row counts up by a row-specific stride mod V."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start, stride = rng.integers(0, V, (B, 1)), rng.integers(1, 4, (B, 1))
        tok = ((start + stride * np.arange(T + 1)[None]) % V).astype(np.int32)
        out.append(
            dict(
                tokens=tok[:, :-1],
                targets=tok[:, 1:],
                positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
                segment_ids=np.ones((B, T), np.int32),
                loss_mask=np.ones((B, T), np.float32),
            )
        )
    return out


def _train(cfg, steps, seed=0):
    oc = train_defaults().optim
    oc.lr, oc.warmup_steps = 1e-2, 5
    opt, sched = make_optimizer(oc, steps)
    mesh = shd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    graphdef, state, sh = st.init_train_state(cfg, opt, mesh, shd.DEFAULT_RULES, seed)
    step = st.make_train_step(graphdef, opt, sched, sh, mesh, shd.DEFAULT_RULES, 8)
    losses = []
    with jax.set_mesh(mesh):
        for b in _batches(steps):
            state, m = step(state, st.put_batch(b, st.batch_shardings(mesh, shd.DEFAULT_RULES, 8)))
            losses.append(float(m["loss"]))
    return graphdef, state, losses


def test_fp4_model_trains_and_its_checkpoint_serves_as_float_and_as_fp4(tmp_path):
    cfg = ModelConfig(**TINY, dtype="bfloat16", linear="fp4", linear_config=FP4Config())
    graphdef, state, losses = _train(cfg, 40)
    assert np.isfinite(losses).all() and np.mean(losses[-5:]) < 0.6 * np.mean(losses[:5]), losses
    params = jax.device_get(state["params"])
    ids = _batches(1, seed=3)[0]["tokens"][:2]
    fp4_model = pallasite.Model(config=cfg, state=params)
    fp4_logits = np.asarray(fp4_model.logits(ids))
    # saved as FP4 (orbax: the config keeps linear="fp4" and its FP4Config) it loads as FP4 ...
    fp4_model.save(str(tmp_path / "ckpt"), format="orbax")
    loaded = pallasite.load(str(tmp_path / "ckpt"))
    assert loaded.config.linear == "fp4" and loaded.config.linear_config == cfg.linear_config
    np.testing.assert_array_equal(np.asarray(loaded.logits(ids)), fp4_logits)
    # ... and the master weights are float: the same state serves as a float model, and the HF
    # export (which knows no FP4) loads as one
    float_logits = np.asarray(
        pallasite.Model(config=loaded.config.replace(linear="float"), state=loaded.state).logits(
            ids
        )
    )
    fp4_model.save(str(tmp_path / "hf"), format="hf")
    from_hf = pallasite.load(str(tmp_path / "hf"))
    assert from_hf.config.linear == "float"
    # (the HF folder loads in float32; the model above computes in bf16)
    np.testing.assert_allclose(np.asarray(from_hf.logits(ids)), float_logits, rtol=1e-2, atol=3e-2)
    agree = np.mean(float_logits.argmax(-1) == fp4_logits.argmax(-1))
    assert agree > 0.8, agree  # the same function up to the FP4 quantization noise
    assert not np.allclose(float_logits, fp4_logits, atol=1e-3)


def _moe_cfg(linear, **lc):
    from pallasite.models.moe import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, norm_topk_prob=True, shared_expert_d_ff=8)
    return ModelConfig(
        d_model=16,
        d_ff=24,
        ffn="moe",
        ffn_config=moe,
        linear=linear,
        linear_config=FP4Config(**lc) if linear == "fp4" else None,
    )


def test_moe_experts_run_the_fp4_grouped_gemm():
    """With linear="fp4" the routed experts' GEMMs are FP4 (per token x per expert output
    channel, OCC, DGE) through ``FP4Linear.grouped_matmul``: equal to running every expert on
    every token with ``fp4_matmul`` and mixing with the router's weights."""
    from pallasite.models.moe import MoE

    cfg = _moe_cfg("fp4", alpha=0.9)  # 16 features: α = 0.9 clamps 3 per row
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(2), (2, 5, 16))
    y, _ = layer(x)
    _, _, w_BTK, e_BTK, _ = layer.routing(x)
    spec, x2 = cfg.linear_config.gemm_spec(), x.reshape(10, 16)
    per_expert = []
    for e in range(4):
        h = jax.nn.silu(fp4_matmul(x2, layer.w_gate[...][e], spec)) * fp4_matmul(
            x2, layer.w_up[...][e], spec
        )
        per_expert.append(fp4_matmul(h, layer.w_down[...][e], spec))
    mix = jnp.einsum("nk,nke->ne", w_BTK.reshape(10, 2), jax.nn.one_hot(e_BTK.reshape(10, 2), 4))
    shared = jax.nn.sigmoid(x2 @ layer.shared_gate[...]) * layer.shared_expert(x)[0].reshape(10, 16)
    want = jnp.einsum("ne,end->nd", mix, jnp.stack(per_expert)) + shared
    np.testing.assert_allclose(
        np.asarray(y).reshape(10, 16), np.asarray(want), rtol=1e-4, atol=1e-5
    )
    # negative control: the float layer with the same weights differs
    float_layer = MoE(_moe_cfg("float"), rngs=nnx.Rngs(0))
    diff = np.max(np.abs(np.asarray(float_layer(x)[0]) - np.asarray(y)))
    assert diff > 0.05 * float(np.max(np.abs(np.asarray(y)))), diff
    # gradients reach the expert master weights (DGE / E5M2 backward of fp4_gmm)
    gd, st = nnx.split(layer)
    g = jax.grad(lambda st: jnp.sum(nnx.merge(gd, st)(x)[0] ** 2))(st)
    assert (
        float(jnp.abs(g["w_up"][...]).sum()) > 0 and np.isfinite(np.asarray(g["w_down"][...])).all()
    )


def test_moe_fp4_expert_parallel_forward_equals_single_device():
    from pallasite import sharding
    from pallasite.models.moe import MoE, MoEConfig

    def layer(dispatch):
        moe = MoEConfig(num_experts=8, top_k=2, dispatch=dispatch)
        return MoE(
            ModelConfig(d_model=16, d_ff=24, ffn="moe", ffn_config=moe, linear="fp4"),
            rngs=nnx.Rngs(0),
        )

    x = jax.random.normal(jax.random.PRNGKey(3), (8, 4, 16))
    apply = jax.jit(lambda st, x, gd: nnx.merge(gd, st)(x)[0], static_argnums=2)
    gd, st = nnx.split(layer("standard"))
    y0 = apply(st, x, gd)
    with jax.set_mesh(sharding.make_mesh({"expert": 8})):
        y1 = apply(st, x, gd)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # three short training runs (~3 min on 2 cores)
def test_benchmark_quick_path_reports_the_gaps_and_fp4_beats_direct(capsys):
    """``benchmarks/fp4.py --quick`` (fewer steps): one JSON line with the issue's keys, finite
    losses, and FP4 with DGE + OCC ending below direct FP4 on the same data, seed and steps."""
    import json

    from pallasite.benchmarks import fp4 as bench

    r = bench.main(["--quick", "--steps", "150"])
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "loss_bf16",
        "loss_fp4",
        "loss_fp4_direct",
        "loss_gap_fp4_vs_bf16",
        "loss_gap_direct_vs_bf16",
        "quant_overhead_per_gemm",
    ):
        assert np.isfinite(last[key]), key
        assert last[key] == r[key]
    assert last["loss_fp4"] < last["loss_fp4_direct"]
    np.testing.assert_allclose(last["loss_gap_fp4_vs_bf16"], last["loss_fp4"] - last["loss_bf16"])
    assert last["quant_overhead_per_gemm"] > 0


def test_benchmark_row_names_with_an_lr_factor():
    """``ROW@lrX`` runs any row at X times the peak lr (the fair baseline is each row at its best lr);
    a factor that is not a positive number, or an unknown row, is refused."""
    from pallasite.benchmarks import fp4 as bench

    assert bench.parse_row("fp4@lr0.5") == (bench.ROWS["fp4"], 0.5)
    assert bench.parse_row("bf16") == (None, 1.0) and bench.parse_row("bf16_lr2x") == (None, 2.0)
    assert bench.parse_row("fp4_direct@lr0.25")[0].w_grad == "ste"
    for bad in ("fp4@lr0", "fp4@lrx", "fp4@lr-1", "nope@lr2", "nope"):
        with pytest.raises(KeyError):
            bench.parse_row(bad)
    with pytest.raises(SystemExit, match="ROW@lrX"):
        bench.main(["--rows", "bf16,fp4@lrx", "--steps", "1"])
