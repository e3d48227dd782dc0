"""Generation engine: cached decode == full recompute, batching with padding, stop tokens,
streaming, seeds, the strategy / cache-factory seams and clear errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite.inference import engine as E
from pallasite.inference.cache import init_dense_cache
from pallasite.inference.config import GenerationConfig
from pallasite.inference.sampling import SamplingParams
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import forward, init_model

CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, rope_theta=500.0)
PROMPTS = [[5, 17, 3], [9, 1, 44, 60, 2, 7, 7, 31, 80], list(range(11, 28))]
N_NEW = 12


@pytest.fixture(scope="module")
def model():
    g, st = nnx.split(init_model(CFG, seed=3))
    return g, st


REF_LEN = 48  # every reference sequence is right-padded to this length: one compile per model


@functools.partial(jax.jit, static_argnums=0)
def _ref_forward(g, st, tokens_BT):
    return forward(g, st, tokens_BT)[0]


def _full_logits(g, st, cfg, seqs):
    """Per-position logits of each sequence recomputed without a cache (the reference).

    Causal attention makes position t independent of the padding after it."""
    toks = np.zeros((len(seqs), REF_LEN), np.int32)
    for i, q in enumerate(seqs):
        toks[i, : len(q)] = q
    logits = np.asarray(_ref_forward(g, st, jnp.asarray(toks)))
    return [logits[i, : len(q)] for i, q in enumerate(seqs)]


@dataclasses.dataclass(frozen=True)
class RecordingGreedy(E.SamplingStrategy):
    """A strategy through the public seam: greedy, and it keeps the logits it chose from."""

    def _record(self, s, logits_BV):
        buf = s.extra if s.extra is not None else jnp.zeros(s.out_BN.shape + logits_BV.shape[-1:], jnp.float32)
        rows = jnp.arange(logits_BV.shape[0])
        idx = jnp.where(s.done_B, s.out_BN.shape[1], s.n_out_B)
        return s.replace(extra=buf.at[rows, idx].set(logits_BV, mode="drop"))

    def init(self, ctx, s, logits_BV):
        return super().init(ctx, self._record(s, logits_BV), logits_BV)

    def step(self, ctx, s):
        logits_BTV, cache = ctx.model(s.cache, s.last_tokens_B[:, None], s.next_positions_B[:, None])
        s = self._record(s.replace(cache=cache), logits_BTV[:, -1])
        tok, s = self.select(ctx, s, logits_BTV[:, -1])
        return ctx.emit(s, tok[:, None], jnp.ones_like(tok))


@pytest.mark.parametrize("variant", ["plain", "scan_qwen3_window"])
def test_cached_decode_equals_full_recompute(variant):
    """Engine loop (prefill of right-padded rows + while-loop decode) vs. recomputing the whole
    sequence without a cache: logits at every generated step agree to 1e-5 (fp32)."""
    cfg = CFG if variant == "plain" else CFG.replace(scan_layers=True, qk_norm=True, qkv_bias=True,
                                                    sliding_window=8, family="qwen3")
    g, st = nnx.split(init_model(cfg, seed=1))
    params, spec = SamplingParams.make(len(PROMPTS))
    s = E.run_decode(g, st, cfg, PROMPTS, GenerationConfig(max_new_tokens=N_NEW), strategy=RecordingGreedy(spec=spec),
                     args=params, key=jax.random.key(0))
    outs, rec = E.results(s), np.asarray(s.extra)
    fulls = _full_logits(g, st, cfg, [p + o for p, o in zip(PROMPTS, outs)])
    for i, prompt in enumerate(PROMPTS):
        assert len(outs[i]) == N_NEW
        full = fulls[i]
        want = full[len(prompt) - 1: len(prompt) - 1 + N_NEW]
        np.testing.assert_allclose(rec[i], want, atol=1e-5, rtol=0, err_msg=f"row {i}")
        np.testing.assert_array_equal(outs[i], want.argmax(-1))


def test_forward_with_cache_padding_convention(model):
    """Lower-level check of the slot convention: right-padded prefill, then per-row positions;
    a row's pad junk is overwritten before it becomes visible."""
    g, st = model
    tokens, lengths, cache_len = E.prepare_prompts(PROMPTS, vocab_size=CFG.vocab_size, pad_id=0,
                                                   max_new_tokens=4, cache_len=None)
    B, T = tokens.shape
    cache = init_dense_cache(CFG, B, cache_len)
    logits, cache = E.forward_with_cache(g, st, cache, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), (B, T)))
    rng = np.random.default_rng(0)
    fed = rng.integers(0, CFG.vocab_size, size=(B, 4))
    refs = _full_logits(g, st, CFG, [p + fed[i].tolist() for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        np.testing.assert_allclose(np.asarray(logits[i, : len(p)]), refs[i][: len(p)], atol=1e-5, rtol=0)
    for t in range(4):
        step_logits, cache = E.forward_with_cache(g, st, cache, jnp.asarray(fed[:, t: t + 1]),
                                                  jnp.asarray(lengths[:, None] + t))
        for i, p in enumerate(PROMPTS):
            np.testing.assert_allclose(np.asarray(step_logits[i, 0]), refs[i][len(p) + t], atol=1e-5, rtol=0)


def test_batched_prompts_equal_each_prompt_alone(model):
    g, st = model
    batched = E.generate_ids(g, st, CFG, PROMPTS, max_new_tokens=N_NEW)
    for i, p in enumerate(PROMPTS):
        assert E.generate_ids(g, st, CFG, [p], max_new_tokens=N_NEW) == [batched[i]], f"row {i}"


def test_stop_tokens_per_row(model):
    g, st = model
    free = E.generate_ids(g, st, CFG, PROMPTS, max_new_tokens=N_NEW)
    stop = free[0][3]  # row 0 stops at its 4th token; other rows stop wherever they emit it
    got = E.generate_ids(g, st, CFG, PROMPTS, max_new_tokens=N_NEW, stop_tokens=(stop,))
    for row_free, row_got in zip(free, got):
        cut = row_free.index(stop) + 1 if stop in row_free else len(row_free)
        assert row_got == row_free[:cut]
    assert got[0][-1] == stop and len(got[0]) <= 4
    # all rows stopping at once ends the loop early: nothing is emitted after the stop token
    s = E.run_decode(g, st, CFG, [PROMPTS[0]], GenerationConfig(max_new_tokens=N_NEW, stop_tokens=(free[0][0],)),
                     strategy=E.SamplingStrategy(), args=SamplingParams.make(1)[0], key=jax.random.key(0))
    assert E.results(s) == [[free[0][0]]]
    assert np.all(np.asarray(s.out_BN)[0, 1:] == 0)  # pad id


def test_streaming_sees_exactly_the_returned_tokens_and_seed(model):
    g, st = model
    kw = dict(max_new_tokens=N_NEW, temperature=1.0, top_k=20, top_p=0.9, seed=4)
    plain = E.generate_ids(g, st, CFG, PROMPTS, **kw)
    stop = plain[1][2]
    plain = E.generate_ids(g, st, CFG, PROMPTS, stop_tokens=(stop,), **kw)
    steps = []
    streamed = E.generate_ids(g, st, CFG, PROMPTS, stop_tokens=(stop,), stream=steps.append, **kw)
    assert streamed == plain  # same body, same key sequence as the while loop
    per_row = [[t for step in steps for t in step[i]] for i in range(len(PROMPTS))]
    assert per_row == plain
    assert all(len(step[1]) == 0 for step in steps[len(plain[1]):])  # finished rows emit nothing
    assert len(steps) == max(len(r) for r in plain)
    # seeds: same seed reproduces, another seed differs, an explicit key equals its seed
    assert E.generate_ids(g, st, CFG, PROMPTS, stop_tokens=(stop,), **kw) == plain
    other = dict(kw, seed=5)
    assert E.generate_ids(g, st, CFG, PROMPTS, stop_tokens=(stop,), **other) != plain
    assert E.generate_ids(g, st, CFG, PROMPTS, stop_tokens=(stop,), key=jax.random.key(4),
                          **{k: v for k, v in kw.items() if k != "seed"}) == plain


def test_logits_processor_and_cache_factory_seams(model):
    g, st = model
    free = E.generate_ids(g, st, CFG, PROMPTS, max_new_tokens=N_NEW)
    banned = free[2][0]

    def ban(logits_BV, s):
        return logits_BV.at[:, banned].set(-jnp.inf)

    calls = []

    def factory(cfg, batch, max_len):
        calls.append((batch, max_len))
        return init_dense_cache(cfg, batch, max_len, dtype=jnp.float32)

    got = E.generate_ids(g, st, CFG, PROMPTS, max_new_tokens=N_NEW, logits_processors=(ban,), cache_factory=factory)
    assert calls == [(3, 64)]  # longest prompt 27 + 12 new tokens, rounded up to a multiple of 64
    assert all(banned not in row for row in got)
    assert got[2][0] != free[2][0]
    assert E.generate_ids(g, st, CFG, PROMPTS, max_new_tokens=N_NEW, cache_factory=factory) == free


def test_single_token_and_errors(model):
    g, st = model
    one = E.generate_ids(g, st, CFG, PROMPTS, max_new_tokens=1)
    assert [len(r) for r in one] == [1, 1, 1]
    with pytest.raises(ValueError, match=r"prompt 0 has 40 tokens, longer than the KV cache \(32"):
        E.generate_ids(g, st, CFG, [list(range(40))], max_new_tokens=4, cache_len=32)
    with pytest.raises(ValueError, match=r"20 tokens\) \+ max_new_tokens \(20\) = 40 exceeds the KV cache length 32"):
        E.generate_ids(g, st, CFG, [[1] * 5, list(range(20))], max_new_tokens=20, cache_len=32)
    with pytest.raises(ValueError, match=r"outside \[0, 97\)"):
        E.generate_ids(g, st, CFG, [[1, 200]], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty"):
        E.generate_ids(g, st, CFG, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        E.generate_ids(g, st, CFG, [[1]], max_new_tokens=0)


def test_prompts_longer_than_the_models_context_fail_naming_both_lengths(model):
    """ModelConfig.max_seq_len bounds prompt + new tokens (positions past it were never trained);
    the error names both lengths, before any compile (the cache may be longer than the context)."""
    from pallasite.errors import InputError

    g, st = model
    cfg = CFG.replace(max_seq_len=64)
    with pytest.raises(InputError, match=r"prompt 1 has 200 tokens, longer than the model's context of 64"):
        E.generate_ids(g, st, cfg, [[1, 2], [3] * 200], max_new_tokens=4)
    with pytest.raises(InputError, match=r"prompt 0 \(62 tokens\) \+ max_new_tokens \(4\) = 66 exceeds the model's "
                                         r"context of 64 tokens .* at most 2 new tokens"):
        E.generate_ids(g, st, cfg, [[3] * 62], max_new_tokens=4, cache_len=128)
    assert len(E.generate_ids(g, st, cfg, [[3] * 62], max_new_tokens=2, stop_tokens=())[0]) == 2
