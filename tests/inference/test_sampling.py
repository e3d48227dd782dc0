"""Sampling filters and draws: exact masks, HF equivalence, seeds, and a chi-square test of the
sampled distribution with negative controls that must fail."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from pallasite.inference import sampling as S


def _kept(logits):
    return set(np.flatnonzero(np.isfinite(np.asarray(logits))).tolist())


def test_top_k_mask_per_row_and_ties():
    logits = jnp.array([
        [0.1, 3.0, 2.0, 2.0, -1.0, 0.5],   # k=2: ties at the 2nd value are kept (HF semantics)
        [0.1, 3.0, 2.0, 1.9, -1.0, 0.5],   # k=3
        [0.1, 3.0, 2.0, 1.9, -1.0, 0.5],   # k=0: off
        [0.1, 3.0, 2.0, 1.9, -1.0, 0.5],   # k=6=V: off
    ])
    out = S.top_k_mask(logits, jnp.array([2, 3, 0, 6]))
    assert _kept(out[0]) == {1, 2, 3}
    assert _kept(out[1]) == {1, 2, 3}
    assert _kept(out[2]) == set(range(6))
    assert _kept(out[3]) == set(range(6))
    np.testing.assert_array_equal(out[1, [1, 2, 3]], logits[1, [1, 2, 3]])  # kept values untouched


def test_top_p_mask_smallest_set_reaching_p():
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = jnp.log(jnp.asarray(np.tile(probs, (4, 1)), jnp.float32))
    out = S.top_p_mask(logits, jnp.array([0.75, 0.85, 0.3, 1e-6]))
    assert _kept(out[0]) == {1, 3}  # 0.5 + 0.3 >= 0.75
    assert _kept(out[1]) == {1, 3, 2}  # 0.8 < 0.85 -> needs 0.15 too
    assert _kept(out[2]) == {1}  # the top token alone already reaches p
    assert _kept(out[3]) == {1}  # always at least one token
    assert _kept(S.top_p_mask(logits, 1.0)[0]) == {0, 1, 2, 3}  # p=1: off


def test_filters_match_transformers_warpers():
    torch = pytest.importorskip("torch")
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    for temp, k, p in [(0.7, 10, 0.9), (1.3, 3, 0.5), (1.0, 40, 0.99), (0.5, 50, 0.2)]:
        ours = S.filter_logits(jnp.asarray(logits), S.SamplingParams.make(6, temp, k, p)[0],
                               S.SamplingSpec(greedy_only=False, use_top_k=True, use_top_p=True))
        ref = torch.from_numpy(logits)
        for warper in (TemperatureLogitsWarper(temp), TopKLogitsWarper(k), TopPLogitsWarper(p)):
            ref = warper(None, ref)
        ref = ref.numpy()
        np.testing.assert_array_equal(np.isfinite(np.asarray(ours)), np.isfinite(ref), err_msg=f"{temp, k, p}")
        finite = np.isfinite(ref)
        np.testing.assert_allclose(np.asarray(ours)[finite], ref[finite], rtol=1e-6)


def test_greedy_rows_and_seeded_reproducibility():
    logits = jax.random.normal(jax.random.key(1), (8, 30))
    params, spec = S.SamplingParams.make(8, temperature=[0.0, 1.0] * 4, top_k=5)
    a = S.sample(logits, jax.random.key(7), params, spec)
    b = S.sample(logits, jax.random.key(7), params, spec)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a[::2], jnp.argmax(logits[::2], -1))  # temperature 0 rows are greedy
    draws = [S.sample(logits, jax.random.key(s), params, spec)[1::2] for s in range(20)]
    assert len({tuple(np.asarray(d).tolist()) for d in draws}) > 1  # sampled rows do vary with the key
    greedy_params, greedy_spec = S.SamplingParams.make(8)
    assert greedy_spec.greedy_only
    np.testing.assert_array_equal(S.sample(logits, jax.random.key(0), greedy_params, greedy_spec),
                                  jnp.argmax(logits, -1))


def test_bad_sampling_parameters_are_named():
    with pytest.raises(ValueError, match="top_p"):
        S.SamplingParams.make(2, 1.0, None, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        S.SamplingParams.make(2, -1.0)
    with pytest.raises(ValueError, match="2 values"):
        S.SamplingParams.make(2, [1.0, 1.0, 1.0])


# ---------------------------------------------------------------- distribution (chi-square)

LOGITS = np.array([2.0, 1.5, 1.0, 0.3, 0.0, -1.0], np.float32)
N_DRAWS = 40_000


def _expected(temperature, top_k=None, top_p=None):
    """Independent numpy statement of temperature -> top-k -> top-p -> renormalise."""
    z = LOGITS.astype(np.float64) / temperature
    keep = np.ones(z.size, bool)
    if top_k is not None:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    q = np.where(keep, np.exp(z - z.max()), 0.0)
    q /= q.sum()
    if top_p is not None:
        order = np.argsort(-q)
        before = np.cumsum(q[order]) - q[order]
        drop = order[before >= top_p]
        q[drop] = 0.0
        q /= q.sum()
    return q


def _counts(temperature, top_k=None, top_p=None, seed=0):
    params, spec = S.SamplingParams.make(N_DRAWS, temperature, top_k, top_p)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (N_DRAWS, LOGITS.size))
    draws = jax.jit(S.sample, static_argnums=3)(logits, jax.random.key(seed), params, spec)
    return np.bincount(np.asarray(draws), minlength=LOGITS.size)


def _chi2_p(counts, probs):
    support = probs > 0
    if np.any(counts[~support] > 0):
        return 0.0  # a draw outside the expected support rejects outright
    return stats.chisquare(counts[support], probs[support] * counts.sum()).pvalue


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 4, None), (1.3, None, 0.8),
                                                     (0.9, 5, 0.75)])
def test_sampled_distribution_chi_square(temperature, top_k, top_p):
    counts = _counts(temperature, top_k, top_p)
    assert _chi2_p(counts, _expected(temperature, top_k, top_p)) > 1e-3


def test_chi_square_negative_controls_fail():
    # The same test must reject a sampler that ignores the temperature, top-k or top-p.
    assert _chi2_p(_counts(1.0), _expected(0.7)) < 1e-6
    assert _chi2_p(_counts(0.7), _expected(0.7, top_k=4)) < 1e-6
    assert _chi2_p(_counts(1.3), _expected(1.3, top_p=0.8)) < 1e-6
