"""Sharding rules: logical → mesh specs, divisibility fallback, sharded forward == unsharded."""

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from pallasite import sharding
from pallasite.models import ModelConfig, forward, init_model


def test_make_mesh_axes_and_errors():
    mesh = sharding.make_mesh({"data": 2, "fsdp": -1, "tensor": 2})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2, "expert": 1}
    with pytest.raises(ValueError, match="unknown axis name"):
        sharding.make_mesh({"model": 2})
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh({"data": 16})


def test_logical_to_spec_drops_indivisible_and_size_one_axes():
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.DEFAULT_RULES
    assert sharding.logical_to_spec(("embed", "mlp"), (64, 128), mesh, rules) == P("fsdp", "tensor")
    assert sharding.logical_to_spec(("embed", "mlp"), (63, 128), mesh, rules) == P(None, "tensor")
    assert sharding.logical_to_spec(("layers", "embed"), (3, 64), mesh, rules) == P(None, "fsdp")
    with pytest.raises(ValueError, match="no sharding rule"):
        sharding.logical_to_spec(("bogus",), (4,), mesh, rules)
    with pytest.raises(ValueError, match="not a mesh axis"):
        sharding.rules_from_config({"embed": "model"})


def test_sharded_forward_equals_single_device():
    cfg = ModelConfig(scan_layers=True)
    g, s = nnx.split(init_model(cfg))
    tokens = jax.random.randint(jax.random.key(0), (4, 8), 0, cfg.vocab_size)
    want, _, _ = forward(g, s, tokens)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    s_sharded = sharding.shard_state(s, mesh)
    kernel = s_sharded["layers"]["attn"]["q_proj"]["kernel"][...]
    assert kernel.sharding.spec == P(None, "fsdp", "tensor")
    t = jax.device_put(tokens, sharding.batch_sharding(mesh))
    got = jax.jit(lambda s, t: forward(g, s, t)[0])(s_sharded, t)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_shardings_of_abstract_state_match_concrete():
    from pallasite.models import abstract_model

    cfg = ModelConfig(scan_layers=True)
    mesh = sharding.make_mesh({"fsdp": 2, "tensor": 2})
    _, abstract = nnx.split(abstract_model(cfg))
    _, concrete = nnx.split(init_model(cfg))
    specs = lambda s: [x.spec for x in jax.tree.leaves(sharding.state_shardings(s, mesh))]  # noqa: E731
    assert specs(abstract) == specs(concrete)
