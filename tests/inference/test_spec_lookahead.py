"""The pieces of confidence-gated drafting (``inference/speculative/lookahead.py``): the top
probability under masks, the compiled verify widths, and that the narrowed target call runs at the
narrowest width that holds what is needed and equals the full call on those positions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.errors import ConfigError
from pallasite.inference.speculative import SpeculativeConfig
from pallasite.inference.speculative.lookahead import narrow_call, top_probability, verify_widths


def test_top_probability_is_the_softmax_max_under_masks():
    z = jnp.array([[1.0, 2.0, 0.5, -jnp.inf], [-jnp.inf] * 4, [3.0, -jnp.inf, -jnp.inf, -jnp.inf]])
    got = np.asarray(top_probability(z))
    want0 = float(jax.nn.softmax(z[0, :3])[1])
    np.testing.assert_allclose(got, [want0, 0.0, 1.0], rtol=1e-6)


def test_verify_widths():
    assert verify_widths(1) == (1, 2)
    assert verify_widths(3) == (1, 2, 3, 4)
    assert verify_widths(8) == (1, 2, 3, 4, 8, 9)
    assert verify_widths(20) == (1, 2, 3, 4, 8, 16, 21)


def test_narrow_call_picks_the_narrowest_width_and_matches_the_full_call():
    B, T, V = 2, 9, 5
    weights = jax.random.normal(jax.random.key(0), (64, V))
    tokens = jax.random.randint(jax.random.key(1), (B, T), 0, 64)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def call(cache, t, p):  # the width shows in the "cache" so the test can see which call ran
        logits = weights[t] + 0.1 * p[..., None]
        return logits, cache + t.shape[1]

    full, _ = call(jnp.zeros((B,), jnp.int32), tokens, positions)
    widths = verify_widths(T - 1)
    run = jax.jit(lambda needed: narrow_call(call, jnp.zeros((B,), jnp.int32), tokens, positions, needed, widths))
    for needed in range(1, T + 1):
        logits, width = run(jnp.int32(needed))
        w = min(x for x in widths if x >= needed)
        assert int(width[0]) == w, (needed, int(width[0]), w)  # exactly one call ran, the narrowest
        np.testing.assert_array_equal(np.asarray(logits[:, :w]), np.asarray(full[:, :w]))
        assert not np.asarray(logits[:, w:]).any()


def test_narrow_call_updates_the_cache_in_place():
    """The narrowed verify must not copy the cache: XLA copies an operand that a ``lax.switch``
    branch writes in place (twice per array a round: 20-25 ms at batch 8 on 2 CPU cores), not a loop
    carry. Counted in the compiled HLO of a decode-like loop (a cache of a shape nothing else has)."""
    import re

    L, B, S, D, T = 5, 3, 37, 16, 4
    tokens = jnp.zeros((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def call(cache, t, p):  # writes this call's entries (like a KV cache) and reads the cache back
        new = jnp.ones((L, B, t.shape[1], D)) * t[None, :, :, None]
        cache = jax.lax.dynamic_update_slice(cache, new, (0, 0, p[0, 0], 0))
        return jnp.sum(cache, axis=(0, 3))[:, :t.shape[1], None], cache

    def decode(cache, needed):
        def body(i, cache):
            _, cache = narrow_call(call, cache, tokens + i, positions + i, needed, verify_widths(T - 1))
            return cache
        return jax.lax.fori_loop(0, 3, body, cache)

    hlo = jax.jit(decode, donate_argnums=0).lower(jnp.zeros((L, B, S, D)), jnp.int32(2)).compile().as_text()
    copies = re.findall(rf"= f32\[{L},{B},{S},{D}\]\S* copy\(", hlo)
    assert not copies, f"{len(copies)} copies of the cache in the compiled narrowed verify"


@pytest.mark.parametrize("tau", [0, -0.1, 1.5, True, "0.5"])
def test_bad_confidence_threshold(tau):
    with pytest.raises(ConfigError, match="confidence_threshold must be a probability in"):
        SpeculativeConfig(confidence_threshold=tau)


def test_bad_confidence_of():
    with pytest.raises(ConfigError, match="confidence_of='draft'; expected one of"):
        SpeculativeConfig(confidence_threshold=0.5, confidence_of="draft")
