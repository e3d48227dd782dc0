"""Core transformer invariants: layouts, cache equivalence, masking, config validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite.inference.cache import init_dense_cache
from pallasite.models import ModelConfig, forward, init_model
from pallasite.ops.attention import reference_attention


def _stack_layers(state_list):
    """Non-scan state → scanned layout (stack the per-layer params along a new leading axis)."""
    pure = nnx.to_pure_dict(state_list)
    layers = [pure["layers"][i] for i in sorted(pure["layers"], key=int)]
    pure["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return pure


@pytest.mark.parametrize("overrides", [dict(), dict(qkv_bias=True, qk_norm=True, tie_embeddings=True)])
def test_scan_and_list_layouts_agree(overrides):
    cfg = ModelConfig(**overrides)
    g_list, s_list = nnx.split(init_model(cfg))
    g_scan, s_scan = nnx.split(init_model(cfg.replace(scan_layers=True)))
    nnx.replace_by_pure_dict(s_scan, _stack_layers(s_list))
    tokens = jax.random.randint(jax.random.key(0), (2, 7), 0, cfg.vocab_size)
    a, _, _ = forward(g_list, s_list, tokens)
    b, _, _ = forward(g_scan, s_scan, tokens)
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("scan", [False, True])
def test_incremental_decode_matches_full_forward(scan):
    cfg = ModelConfig(scan_layers=scan, sliding_window=5)
    g, s = nnx.split(init_model(cfg))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    full, _, _ = forward(g, s, tokens)
    cache = init_dense_cache(cfg, batch_size=2, max_len=16)
    step = jax.jit(lambda s, t, p, c: forward(g, s, t, p, cache=c))
    pre, cache, _ = step(s, tokens[:, :4], jnp.broadcast_to(jnp.arange(4), (2, 4)), cache)
    outs = [pre]
    for t in range(4, 9):
        lg, cache, _ = step(s, tokens[:, t:t + 1], jnp.full((2, 1), t), cache)
        outs.append(lg)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5)


def test_packed_segments_do_not_attend_across_documents():
    cfg = ModelConfig()
    g, s = nnx.split(init_model(cfg))
    a = jax.random.randint(jax.random.key(2), (1, 5), 0, cfg.vocab_size)
    b = jax.random.randint(jax.random.key(3), (1, 4), 0, cfg.vocab_size)
    packed = jnp.concatenate([a, b], axis=1)
    positions = jnp.concatenate([jnp.arange(5), jnp.arange(4)])[None]
    segments = jnp.concatenate([jnp.ones(5, jnp.int32), 2 * jnp.ones(4, jnp.int32)])[None]
    lp, _, _ = forward(g, s, packed, positions, segment_ids_BT=segments)
    la, _, _ = forward(g, s, a)
    lb, _, _ = forward(g, s, b)
    np.testing.assert_allclose(lp[:, :5], la, atol=1e-5)
    np.testing.assert_allclose(lp[:, 5:], lb, atol=1e-5)
    # Negative control: without segment ids the second document does see the first.
    lx, _, _ = forward(g, s, packed, positions)
    assert np.abs(np.asarray(lx[:, 5:] - lb)).max() > 1e-3


def test_reference_attention_matches_naive_gqa():
    rng = np.random.default_rng(0)
    B, T, H, K, D = 2, 6, 4, 2, 8
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B, T, K, D)).astype(np.float32)
    v = rng.standard_normal((B, T, K, D)).astype(np.float32)
    out = np.asarray(reference_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)))
    want = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            kk, vv = k[b, :, h // (H // K)], v[b, :, h // (H // K)]
            logits = q[b, :, h] @ kk.T / np.sqrt(D)
            logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
            p = np.exp(logits - logits.max(-1, keepdims=True))
            want[b, :, h] = (p / p.sum(-1, keepdims=True)) @ vv
    np.testing.assert_allclose(out, want, atol=1e-5)


def test_remat_gives_same_gradients():
    cfg = ModelConfig(n_layers=2)
    tokens = jax.random.randint(jax.random.key(4), (2, 6), 0, cfg.vocab_size)
    grads = []
    for remat in ("none", "full"):
        g, s = nnx.split(init_model(cfg.replace(remat=remat)))
        loss = lambda s: forward(g, s, tokens)[0].mean()  # noqa: E731
        grads.append(jax.grad(loss)(s))
    for x, y in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(x, y, atol=1e-6)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(n_heads=6, n_kv_heads=4), "multiple of n_kv_heads"),
        (dict(ffn="sparse"), "ffn='sparse'"),
        (dict(d_model=30, n_heads=4), "not divisible"),
    ],
)
def test_config_errors_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**bad)


def test_config_from_dict_rejects_unknown_keys_and_round_trips():
    cfg = ModelConfig(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown key.*hiden_size"):
        ModelConfig.from_dict({"hiden_size": 3})


def test_method_sub_configs_are_validated_from_mappings():
    from pallasite.models.moe import MoEConfig, moe_config_of
    from pallasite.models.mole import MoLEConfig

    cfg = ModelConfig(ffn="moe", ffn_config={"num_experts": 4})
    assert isinstance(moe_config_of(cfg), MoEConfig) and moe_config_of(cfg).num_experts == 4
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # the sub-config round-trips through JSON
    with pytest.raises(ValueError, match=r"ModelConfig.ffn_config: unknown key 'num_expert'"):
        ModelConfig(ffn="moe", ffn_config={"num_expert": 4})
    with pytest.raises(TypeError, match="must be a MoEConfig"):
        ModelConfig(ffn="moe", ffn_config=3)
    with pytest.raises(TypeError, match="must be a MoEConfig"):  # another kind's sub-config
        ModelConfig(ffn="moe", ffn_config=MoLEConfig())
    with pytest.raises(ValueError, match="takes no options"):
        ModelConfig(ffn="dense", ffn_config={"n_experts": 2})
    assert cfg.replace(ffn="mole").ffn_config == MoLEConfig()  # a new kind starts from its defaults


def test_tied_head_few_rows_layout_equals_the_plain_dot():
    """``Embed.attend`` for 2..FEW_ROWS rows on CPU (E @ x.T, transposed after a barrier) gives the
    logits of x @ E.T, for every leading shape, and its gradient too."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from pallasite.models.config import ModelConfig
    from pallasite.models.layers import FEW_ROWS, Embed

    cfg = ModelConfig(vocab_size=300, d_model=48, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=64)
    emb = Embed(300, 48, cfg=cfg, rngs=nnx.Rngs(params=0))
    table = emb.embedding[...]
    rng = np.random.default_rng(0)
    for shape in ((1, 48), (2, 3, 48), (4, 48), (FEW_ROWS, 48), (FEW_ROWS + 1, 48)):
        x = jnp.asarray(rng.normal(size=shape), jnp.float32)
        got = jax.jit(emb.attend)(x)
        assert got.shape == shape[:-1] + (300,)
        np.testing.assert_allclose(np.asarray(got), np.asarray(x @ table.T), atol=2e-5)
    x = jnp.asarray(rng.normal(size=(3, 48)), jnp.float32)
    g = jax.grad(lambda x: jnp.sum(jnp.sin(emb.attend(x))))(x)
    np.testing.assert_allclose(np.asarray(g), np.asarray(jax.grad(lambda x: jnp.sum(jnp.sin(x @ table.T)))(x)),
                               atol=2e-5)
