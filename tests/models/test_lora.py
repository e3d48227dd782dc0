"""LoRA as a params transform (models/lora.py): exact at init, only adapters train, merge == adapted
forward, adapters round-trip through disk, and bad targets are named."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from pallasite.models import lora as L
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import forward, init_model
from pallasite.training import step as step_lib


def _cfg(**kw):
    return ModelConfig(
        vocab_size=61, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32, **kw
    )


IDS = jnp.asarray(np.random.default_rng(0).integers(0, 61, (2, 7)), jnp.int32)


def _perturb(model, seed=1):
    for i, (_, m) in enumerate(L.lora_modules(model)):
        m.lora_b[...] = 0.1 * jax.random.normal(jax.random.key(seed + i), m.lora_b.shape)


@pytest.mark.parametrize("scan", [False, True])
def test_lora_is_exact_at_init_and_merges_to_the_adapted_function(scan):
    cfg = _cfg(scan_layers=scan)
    base = forward(*nnx.split(init_model(cfg, 0)), IDS)[0]
    model = L.apply_lora(
        init_model(cfg, 0), L.LoRAConfig(rank=4, targets=("attn/(q|v)_proj", "down_proj"))
    )
    assert np.array_equal(np.asarray(forward(*nnx.split(model), IDS)[0]), np.asarray(base))  # B = 0
    _, params, other = step_lib.split_model(model)
    names = ["/".join(map(str, k)) for k, _ in nnx.to_flat_state(params)]
    assert names and all(n.endswith(("lora_a", "lora_b")) for n in names)  # nothing else trains
    _perturb(model)
    adapted = forward(*nnx.split(model), IDS)[0]
    assert float(jnp.max(jnp.abs(adapted - base))) > 1e-3
    merged = L.merge_lora(model)
    g_m, s_m = nnx.split(merged)
    assert g_m == nnx.split(init_model(cfg, 0))[0]  # the original structure: exportable as is
    np.testing.assert_allclose(
        np.asarray(forward(g_m, s_m, IDS)[0]), np.asarray(adapted), atol=2e-5
    )


def test_one_train_step_moves_only_the_adapters():
    cfg = _cfg()
    model = L.apply_lora(init_model(cfg, 0), L.LoRAConfig(rank=2))
    graphdef, params, other = step_lib.split_model(model)
    tx = optax.adam(1e-2)
    state = {
        "step": jnp.zeros((), jnp.int32),
        "params": params,
        "opt_state": tx.init(params),
        "other": other,
    }
    T = IDS.shape[1]
    batch = {
        "tokens": IDS,
        "targets": jnp.roll(IDS, -1, 1),
        "positions": jnp.broadcast_to(jnp.arange(T), IDS.shape),
        "segment_ids": jnp.ones_like(IDS),
        "loss_mask": jnp.ones(IDS.shape, jnp.float32),
    }
    from pallasite.registry import LOSS

    new, metrics = jax.jit(
        lambda s, b: step_lib.train_step(
            s, b, graphdef=graphdef, optimizer=tx, schedule=lambda _: 1e-2, loss=LOSS.get("lm")
        )
    )(state, batch)
    for a, b in zip(jax.tree.leaves(state["other"]), jax.tree.leaves(new["other"])):
        assert np.array_equal(np.asarray(a), np.asarray(b))  # frozen base untouched
    moved = [
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new["params"]))
    ]
    assert max(moved) > 0 and np.isfinite(float(metrics["loss"]))


def test_adapters_round_trip_through_disk(tmp_path):
    cfg = _cfg()
    model = L.apply_lora(init_model(cfg, 0), L.LoRAConfig(rank=3, alpha=6.0, targets=("o_proj",)))
    _perturb(model, 7)
    want = forward(*nnx.split(model), IDS)[0]
    L.save_adapters(model, str(tmp_path / "adapter"))
    loaded = L.load_adapters(init_model(cfg, 0), str(tmp_path / "adapter"))
    assert [p for p, _ in L.lora_modules(loaded)] == [
        "layers/0/attn/o_proj",
        "layers/1/attn/o_proj",
    ]
    np.testing.assert_array_equal(np.asarray(forward(*nnx.split(loaded), IDS)[0]), np.asarray(want))
    with pytest.raises(ValueError, match="shape"):
        L.load_adapters(
            init_model(cfg.replace(d_model=32, n_heads=4), 0), str(tmp_path / "adapter")
        )


def test_bad_targets_are_named():
    with pytest.raises(
        ValueError,
        match=r"LoRA target 'attn/qq_proj' matches no module; linear modules are "
        r"layers/0/attn/k_proj, layers/0/attn/o_proj, layers/0/attn/q_proj",
    ):
        L.apply_lora(init_model(_cfg(), 0), L.LoRAConfig(targets=("attn/qq_proj",)))
    with pytest.raises(ValueError, match="not a valid regular expression"):
        L.apply_lora(init_model(_cfg(), 0), L.LoRAConfig(targets=("(",)))
    with pytest.raises(ValueError, match="pattern 'nope' matches no parameter"):
        L.freeze(init_model(_cfg(), 0), ("nope",))


def test_freeze_keeps_only_the_named_parameters_trainable():
    model = L.freeze(init_model(_cfg(), 0), ("layers/1/ffn/",))
    _, params, _ = step_lib.split_model(model)
    names = sorted("/".join(map(str, k)) for k, _ in nnx.to_flat_state(params))
    assert names == [
        "layers/1/ffn/down_proj/kernel",
        "layers/1/ffn/gate_proj/kernel",
        "layers/1/ffn/up_proj/kernel",
    ]
