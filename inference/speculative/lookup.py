"""The ``lookup`` decode strategy: prompt lookup decoding, speculative decoding whose drafts are
copied from the row's own text (no drafter model), lossless, batched in the engine's one loop.

Saxena, "Prompt Lookup Decoding" (2023); transformers' ``prompt_lookup_num_tokens``
(``PromptLookupCandidateGenerator``) and vLLM's n-gram proposer. A round, per row: take the longest
n-gram (``max_ngram`` down to ``min_ngram`` tokens) that ends the row's text (prompt + emitted) and
occurred earlier in it; the draft is the K tokens that followed its most recent occurrence,
continued periodically where the copy runs into the end of the text (in a loop of period p the
text goes on as itself: d_j = text[start + (j mod p)], p = length − start). A row without a match
drafts nothing. One target call verifies the drafts, only as wide as the round's longest draft + 1
(``lookahead.narrow_call``), and the target draws its own token y_j at every position (argmax when
greedy); the row accepts the longest prefix of drafts equal to the y_j and emits y up to the first
mismatch. A draft is a point mass q = δ_d, so this acceptance has probability p(d), Leviathan's
min(1, p/q), and the emitted tokens are distributed exactly as target-only sampling (the G-test
in tests/inference/test_speculative_dist.py, with a negative control that must fail).

Deviations from transformers: the most recent occurrence instead of the first, the periodic
continuation, max_ngram 3 (transformers' max_matching_ngram_size: 2) and K = 3 by default
(transformers' num_output_tokens: 10; on CPU a wide verify is dear, docs/speculative.md); drafts
never run past ``max_new_tokens``; no constraints, logits processors or drafter (each refused with
a ``ConfigError``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from pallasite.errors import ConfigError
from pallasite.inference.sampling import SamplingParams, SamplingSpec
from pallasite.inference.speculative import lookahead as LA
from pallasite.inference.speculative import probs as P
from pallasite.inference.speculative.strategy import SpecStats, emit_verified
from pallasite.registry import DECODE_STRATEGY

# deliberate break for the negative control: the first draft is emitted without the target's test (biased)
FAULTS = ("", "first_draft_free")


@dataclasses.dataclass(frozen=True)
class LookupConfig:
    """Knobs of prompt lookup decoding (``GenerationConfig.strategy_config``).

    num_draft_tokens  K, most tokens copied per round (the verify is at most K + 1 wide)
    max_ngram         longest n-gram ending the text that is looked up
    min_ngram         shortest one (1: a single repeated token is enough to draft)
    """

    num_draft_tokens: int = 3
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self):
        for name in ("num_draft_tokens", "max_ngram", "min_ngram"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"LookupConfig: {name} must be an integer >= 1; got {v!r}")
        if self.min_ngram > self.max_ngram:
            raise ConfigError(f"LookupConfig: min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")


@struct.dataclass
class LookupState:
    """``DecodeState.extra`` of the lookup strategy."""

    prompt_BT: jax.Array  # int32 [B, T]: the right-padded prompts (the emitted tokens are read from out_BN)
    stats: SpecStats


def row_text(prompt_BT: jax.Array, prompt_len_B: jax.Array, out_BN: jax.Array) -> jax.Array:
    """int32 [B, T + N]: each row's prompt followed by its emitted tokens (junk past its length)."""
    N = out_BN.shape[1]
    prompt_BL = jnp.pad(prompt_BT, ((0, 0), (0, N)))
    pos = jnp.arange(prompt_BL.shape[1], dtype=jnp.int32)[None, :]
    from_out = jnp.take_along_axis(out_BN, jnp.clip(pos - prompt_len_B[:, None], 0, N - 1), axis=1)
    return jnp.where(pos < prompt_len_B[:, None], prompt_BL, from_out)


def propose(text_BL: jax.Array, length_B: jax.Array, k: int, max_ngram: int, min_ngram: int):
    """(drafts [B, k] int32, found [B] bool): the k tokens after the most recent earlier occurrence
    of the longest n-gram (max_ngram >= n >= min_ngram) that ends each row's ``text[:length]``,
    continued periodically past the end of the text (module doc)."""
    B, L = text_BL.shape
    start_i = jnp.arange(L, dtype=jnp.int32)[None, :]
    padded = jnp.pad(text_BL, ((0, 0), (0, max_ngram)))
    found = jnp.zeros((B,), bool)
    copy_from = jnp.zeros((B,), jnp.int32)
    for n in range(max_ngram, min_ngram - 1, -1):  # longest first: the first n with a match wins
        suffix = jnp.take_along_axis(text_BL, jnp.clip(length_B[:, None] - n + jnp.arange(n)[None, :], 0, L - 1),
                                     axis=1)
        match = (start_i + n < length_B[:, None]) & (length_B[:, None] > n)  # a token follows; not the suffix itself
        for t in range(n):
            match = match & (padded[:, t:t + L] == suffix[:, t:t + 1])
        last = jnp.max(jnp.where(match, start_i, -1), axis=1)
        take = ~found & (last >= 0)
        copy_from = jnp.where(take, last + n, copy_from)
        found = found | take
    period = jnp.maximum(length_B - copy_from, 1)
    idx = copy_from[:, None] + jnp.arange(k, dtype=jnp.int32)[None, :] % period[:, None]
    return jnp.take_along_axis(text_BL, jnp.clip(idx, 0, L - 1), axis=1), found


@dataclasses.dataclass(frozen=True)
class LookupStrategy:
    spec: SamplingSpec = SamplingSpec()
    k: int = 3
    max_ngram: int = 3
    min_ngram: int = 1
    fault: str = ""

    def _draw(self, ctx, key, logits_BTV):
        """The target's own token [B, T] at every position (its post-warper law; argmax when greedy)."""
        if self.spec.greedy_only:
            return jnp.argmax(logits_BTV, axis=-1).astype(jnp.int32)
        B, T, V = logits_BTV.shape
        p = P.warped_probs(logits_BTV, ctx.args, self.spec).reshape(B * T, V)
        return P.draw(key, p).reshape(B, T)

    def init(self, ctx, s, prefill_logits_BV):
        B = ctx.prompt_BT.shape[0]
        key, k_first = jax.random.split(s.key)
        y0 = self._draw(ctx, k_first, prefill_logits_BV[:, None])[:, 0]
        s = ctx.emit(s.replace(key=key, cache=s.cache.for_appending()), y0[:, None], jnp.ones_like(y0))
        return s.replace(extra=LookupState(ctx.prompt_BT.astype(jnp.int32), SpecStats.start(B)))

    def step(self, ctx, s):
        ex = s.extra
        key, k_draw = jax.random.split(s.key)
        N = s.out_BN.shape[1]
        length = s.prompt_len_B + s.n_out_B
        drafts, found = propose(row_text(ex.prompt_BT, s.prompt_len_B, s.out_BN), length, self.k, self.max_ngram,
                                self.min_ngram)
        active = ~s.done_B
        # never draft past max_new_tokens: the row's last token comes from the target anyway
        n_draft = jnp.where(found & active, jnp.clip(N - s.n_out_B - 1, 0, self.k), 0)
        logits, cache = LA.verify_call(ctx, s, drafts, jnp.max(n_draft) + 1)
        y = self._draw(ctx, k_draw, logits)  # [B, K + 1]
        n = P.exact_match(drafts, n_draft, y)
        if self.fault == "first_draft_free":
            n = jnp.where(n_draft > 0, jnp.maximum(n, 1), n)
            y = y.at[:, 0].set(jnp.where(n_draft > 0, drafts[:, 0], y[:, 0]))
        s = emit_verified(ctx, s.replace(key=key), cache, y, n + 1)
        return s.replace(extra=ex.replace(stats=ex.stats.count_round(active, 0, n_draft, n)))


def build_lookup(gen, n_prompts: int):
    """(LookupStrategy, per-row SamplingParams) for a ``GenerationConfig`` with strategy='lookup'."""
    cfg: LookupConfig = gen.strategy_config or LookupConfig()
    if gen.drafter is not None:
        raise ConfigError("strategy='lookup' copies its drafts from the text itself and takes no drafter; for a "
                          "drafter model leave strategy unset (speculative decoding)")
    if gen.logits_processors:
        raise ConfigError("strategy='lookup' does not take logits_processors (they see one position at a time)")
    if gen.constraint is not None:
        raise ConfigError("strategy='lookup' does not take a constraint; constrained decoding with drafts is "
                          "strategy='speculative' with a drafter (docs/constrained.md)")
    sampling, spec = SamplingParams.make(n_prompts, gen.temperature, gen.top_k, gen.top_p)
    return LookupStrategy(spec=spec, k=cfg.num_draft_tokens, max_ngram=cfg.max_ngram, min_ngram=cfg.min_ngram), sampling


DECODE_STRATEGY.register("lookup", build_lookup, config=LookupConfig, aliases={"k": "num_draft_tokens"})

__all__ = ["LookupConfig", "LookupStrategy", "build_lookup", "propose", "row_text"]
