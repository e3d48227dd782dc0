"""A new method plugs in by registering kinds, without editing models/, inference/ or training/.

This file registers an FFN kind, a linear kind and a KV-cache kind of its own (each with a
sub-config) and runs the model forward, ``pallasite.generate`` and the training loop with them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, struct

import pallasite
from pallasite.inference.cache.base import KVCache
from pallasite.models.config import ModelConfig
from pallasite.models.layers import Linear, activation, make_linear
from pallasite.models.transformer import forward, init_model
from pallasite.ops.attention import attention
from pallasite.registry import FFN, KV_CACHE, LINEAR, UnknownKindError


# ----------------------------------------------------------------------------- an FFN kind
@dataclasses.dataclass(frozen=True)
class EmbedMixConfig:
    width_mult: int = 2
    aux_coef: float = 0.01


class EmbedMixFFN(nnx.Module):
    """A non-gated GELU MLP that also mixes in the embedding-layer output (read from the context)."""

    def __init__(self, cfg, *, rngs):
        c = cfg.ffn_config
        self.coef = c.aux_coef
        self.up = make_linear(cfg.d_model, c.width_mult * cfg.d_model, cfg=cfg, axes=("embed", "mlp"), rngs=rngs)
        self.down = make_linear(c.width_mult * cfg.d_model, cfg.d_model, cfg=cfg, axes=("mlp", "embed"), rngs=rngs)
        self.mix = nnx.Param(jnp.full((cfg.d_model,), 0.5), logical_axes=("embed",))

    def __call__(self, x_BTD, ctx):
        y = self.down(activation("gelu")(self.up(x_BTD))) + self.mix[...] * ctx.embed_BTD
        return y, {"embed_mix_l2": self.coef * jnp.mean(jnp.square(self.mix[...]))}


# ----------------------------------------------------------------------------- a linear kind
@dataclasses.dataclass(frozen=True)
class GainConfig:
    init: float = 1.0


class GainLinear(Linear):
    """x @ kernel scaled by one learnable gain (keeps the kernel/bias parameter names)."""

    def __init__(self, in_features, out_features, *, cfg, axes, use_bias=False, init_std=0.02, rngs):
        super().__init__(in_features, out_features, cfg=cfg, axes=axes, use_bias=use_bias, init_std=init_std,
                         rngs=rngs)
        self.gain = nnx.Param(jnp.full((), cfg.linear_config.init), logical_axes=())

    def __call__(self, x):
        return super().__call__(x) * self.gain[...]


# ----------------------------------------------------------------------------- a KV-cache kind
CREATED = []


@dataclasses.dataclass(frozen=True)
class SlotMajorConfig:
    dtype: str = "float32"


@struct.dataclass
class SlotMajorCache(KVCache):
    """Full cache stored slot-major [L, B, S, K, D] (the dense kind is head-major)."""

    k: jax.Array
    v: jax.Array

    @classmethod
    def create(cls, model_cfg, batch_size, max_len, *, config=None, model=None):
        CREATED.append((batch_size, max_len, config))
        shape = (model_cfg.n_layers, batch_size, max_len, model_cfg.n_kv_heads, model_cfg.dh)
        return cls(jnp.zeros(shape, config.dtype), jnp.zeros(shape, config.dtype))

    @property
    def capacity(self):
        return self.k.shape[-3]

    @property
    def batch_size(self):
        return self.k.shape[-4]

    def update_and_attend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, *, sliding_window=None, impl="ref",
                          interpret=None):
        rows = jnp.arange(q_BTHD.shape[0])[:, None]
        k = self.k.at[rows, positions_BT].set(k_BTKD.astype(self.k.dtype), mode="drop")
        v = self.v.at[rows, positions_BT].set(v_BTKD.astype(self.v.dtype), mode="drop")
        out = attention(q_BTHD, k.astype(q_BTHD.dtype), v.astype(q_BTHD.dtype), q_positions_BT=positions_BT,
                        causal=True, sliding_window=sliding_window)
        return out, SlotMajorCache(k, v)


@pytest.fixture(scope="module", autouse=True)
def kinds():
    FFN.register("test_embed_mix", EmbedMixFFN, config=EmbedMixConfig)
    LINEAR.register("test_gain", GainLinear, config=GainConfig)
    KV_CACHE.register("test_slot_major", SlotMajorCache, config=SlotMajorConfig)
    yield
    FFN.unregister("test_embed_mix")
    LINEAR.unregister("test_gain")
    KV_CACHE.unregister("test_slot_major")


def _cfg(**kw):
    return ModelConfig(vocab_size=61, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32, ffn="test_embed_mix",
                       ffn_config={"width_mult": 3}, linear="test_gain", linear_config=GainConfig(init=0.5),
                       kv_cache="test_slot_major", **kw)


def test_config_accepts_exactly_the_registered_kinds():
    cfg = _cfg()
    assert cfg.ffn_config == EmbedMixConfig(width_mult=3) and cfg.kv_cache_config == SlotMajorConfig()
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(UnknownKindError, match="known: dense, moe, mole, test_embed_mix"):
        ModelConfig(ffn="test_embed_mx")
    with pytest.raises(UnknownKindError, match="ModelConfig.linear='typo'.*test_gain"):
        ModelConfig(linear="typo")
    with pytest.raises(ValueError, match="unknown key 'width'"):
        _cfg().replace(ffn_config={"width": 2})


@pytest.mark.parametrize("scan", [False, True])
def test_forward_and_generate_use_the_new_kinds(scan):
    cfg = _cfg(scan_layers=scan)
    model = init_model(cfg, seed=0)
    g, state = nnx.split(model)
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(state)}
    assert any(n.endswith("ffn/mix") for n in names) and any(n.endswith("q_proj/gain") for n in names)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    logits, _, aux = forward(g, state, ids)
    assert logits.shape == (2, 7, cfg.vocab_size) and set(aux) == {"embed_mix_l2"}
    # the gain is used: halving it changes the logits
    dense_like = nnx.split(init_model(cfg.replace(linear_config=GainConfig(init=1.0)), seed=0))
    assert float(jnp.max(jnp.abs(forward(*dense_like, ids)[0] - logits))) > 1e-3

    # pallasite.generate builds the model's cache kind; greedy == argmax over full recomputes
    CREATED.clear()
    prompts = [[3, 9, 4, 1], [7, 2]]
    got = pallasite.generate(pallasite.Model(cfg, state, graphdef=g), prompts, max_new_tokens=6, stop_tokens=())
    assert len(CREATED) == 1 and CREATED[0][2] == SlotMajorConfig()
    for prompt, out in zip(prompts, got):
        seq = list(prompt)
        for _ in range(6):
            seq.append(int(jnp.argmax(forward(g, state, jnp.asarray([seq], jnp.int32))[0][0, -1])))
        assert out == seq[len(prompt):]


def test_training_loop_runs_with_the_new_kinds(tmp_path):
    from pallasite.training.config import load_config
    from pallasite.training.loop import train

    config = load_config("configs/tiny.py", overrides=["--config.train.steps=4", "--config.train.export_hf=false",
                                                       "--config.train.eval_every=4", "--config.train.log_every=1",
                                                       "--config.train.checkpoint_every=4"])
    config.model.update(ffn="test_embed_mix", ffn_config={"width_mult": 2}, linear="test_gain",
                        linear_config={"init": 0.7}, kv_cache="test_slot_major")
    res = train(config, str(tmp_path / "run"))
    assert res["final_step"] == 4 and np.isfinite(res["eval_loss"]) and res["sample"]
    import json

    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train_lines = [m for m in lines if m.get("kind", "train") == "train" and "loss" in m]
    assert train_lines and all("aux/embed_mix_l2" in m for m in train_lines)
    restored = pallasite.load(str(tmp_path / "run"))  # a checkpoint of the new kinds restores
    assert restored.config.ffn == "test_embed_mix" and restored.config.linear_config == GainConfig(init=0.7)
