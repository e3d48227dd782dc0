"""Generation engine: jitted prefill + ONE compiled ``while_loop`` decode over a preallocated KV
cache, behind the decode-strategy seam.

    out = generate_ids(graphdef, state, cfg, [[1, 5, 9], [1, 7]], GenerationConfig(max_new_tokens=32))

Prompts are right-padded to a bucketed length and prefilled at positions ``0..T-1``; each row then
continues from its own length, overwriting its pad junk before it becomes visible (the KV-cache
slot convention), so rows never see padding. The LM head runs only at each row's last prompt
token. The loop exits when every row is done (stop token or ``max_new_tokens``); with ``stream``
the same jitted body is driven from Python one step at a time (identical tokens).
A strategy (registered in ``pallasite.registry.DECODE_STRATEGY``; built from the
``GenerationConfig``) is a hashable object with ``init(ctx, s, prefill_logits_BV)`` and
``step(ctx, s)``, called inside jit; ``ctx.emit(s, tokens_BK, n_new_B)`` appends up to K tokens per
row (stop tokens and ``max_new_tokens`` applied), so speculative decoding plugs in unchanged.
docs/inference.md has the design notes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from pallasite.errors import InputError
from pallasite.inference.config import GenerationConfig, cache_kind
from pallasite.inference.sampling import SamplingParams, SamplingSpec, sample
from pallasite.ops.common import round_up
from pallasite.registry import DECODE_STRATEGY, KV_CACHE

PREFILL_BUCKET = 16  # prompt lengths are padded up to a multiple of this (fewer recompiles)
CACHE_BUCKET = 64  # default cache length is rounded up to a multiple of this


# ----------------------------------------------------------------------------- state


@struct.dataclass
class DecodeState:
    """Everything the decode loop carries. Shapes: B rows, N = max_new_tokens."""

    cache: Any
    prompt_len_B: jax.Array  # int32, prompt length per row
    last_tokens_B: jax.Array  # int32, last emitted token per row (fed at the next step)
    out_BN: jax.Array  # int32, emitted tokens, pad_id where nothing was emitted
    n_out_B: jax.Array  # int32, number of emitted tokens per row
    done_B: jax.Array  # bool, row finished (stop token or N tokens)
    key: jax.Array  # PRNG key, split once per selection
    extra: Any = None  # strategy-owned carry

    @property
    def next_positions_B(self) -> jax.Array:
        """Position at which ``last_tokens_B`` is fed: prompt_len + emitted - 1."""
        return self.prompt_len_B + self.n_out_B - 1


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a strategy sees inside jit (built per trace, never stored)."""

    model: Callable  # (cache, tokens_BT, positions_BT) -> (logits_BTV float32, cache)
    emit: Callable  # (state, tokens_BK, n_new_B) -> state
    args: Any  # the strategy's dynamic arguments (pytree)
    prompt_BT: Optional[jax.Array] = None  # only during init (prefill)


def emit_tokens(s: DecodeState, tokens_BK: jax.Array, n_new_B: jax.Array, stop_tokens_S: jax.Array) -> DecodeState:
    """Append up to K tokens per row (the first ``n_new_B``), in order, stopping a row at its
    first stop token or when its buffer is full. Finished rows ignore new tokens."""
    B, N = s.out_BN.shape
    rows = jnp.arange(B)
    out, n_out, done, last = s.out_BN, s.n_out_B, s.done_B, s.last_tokens_B
    for j in range(tokens_BK.shape[1]):  # K is static and small (1 for plain sampling)
        tok = tokens_BK[:, j].astype(jnp.int32)
        take = ~done & (j < n_new_B)
        out = out.at[rows, jnp.where(take, n_out, N)].set(tok, mode="drop")
        n_out = n_out + take.astype(jnp.int32)
        last = jnp.where(take, tok, last)
        hit_stop = jnp.any(tok[:, None] == stop_tokens_S[None, :], axis=-1)
        done = done | (take & hit_stop) | (n_out >= N)
    return s.replace(out_BN=out, n_out_B=n_out, done_B=done, last_tokens_B=last)


# ----------------------------------------------------------------------------- strategies


@dataclasses.dataclass(frozen=True)
class SamplingStrategy:
    """One token per step: logits processors, then temperature / top-k / top-p, then draw.

    ``args`` is a ``SamplingParams`` (per-row values); ``spec`` says which filters are compiled.
    ``processors`` are hashable callables ``proc(logits_BV, s: DecodeState) -> logits_BV``.
    """

    spec: SamplingSpec = SamplingSpec()
    processors: tuple = ()

    def select(self, ctx: StepContext, s: DecodeState, logits_BV: jax.Array):
        for proc in self.processors:
            logits_BV = proc(logits_BV, s)
        key, sub = jax.random.split(s.key)
        return sample(logits_BV, sub, ctx.args, self.spec), s.replace(key=key)

    def init(self, ctx: StepContext, s: DecodeState, prefill_logits_BV: jax.Array) -> DecodeState:
        tok_B, s = self.select(ctx, s, prefill_logits_BV)
        return ctx.emit(s, tok_B[:, None], jnp.ones_like(tok_B))

    def step(self, ctx: StepContext, s: DecodeState) -> DecodeState:
        logits_BTV, cache = ctx.model(s.cache, s.last_tokens_B[:, None], s.next_positions_B[:, None])
        tok_B, s = self.select(ctx, s.replace(cache=cache), logits_BTV[:, -1])
        return ctx.emit(s, tok_B[:, None], jnp.ones_like(tok_B))


def build_sampling(gen: GenerationConfig, n_prompts: int):
    """The ``"sample"`` strategy: (SamplingStrategy, per-row SamplingParams) from the config."""
    args, spec = SamplingParams.make(n_prompts, gen.temperature, gen.top_k, gen.top_p)
    return SamplingStrategy(spec=spec, processors=tuple(gen.logits_processors)), args


DECODE_STRATEGY.register("sample", build_sampling)


# ----------------------------------------------------------------------------- model plumbing


def _model_fn(graphdef, state):
    def model(cache, tokens_BT, positions_BT):
        m = nnx.merge(graphdef, state)
        logits, cache, _ = m(tokens_BT, positions_BT, cache=cache)
        return logits, cache

    return model


def _context(graphdef, state, stop_tokens_S, args, prompt_BT=None) -> StepContext:
    emit = functools.partial(emit_tokens, stop_tokens_S=stop_tokens_S)
    return StepContext(model=_model_fn(graphdef, state), emit=emit, args=args, prompt_BT=prompt_BT)


@functools.partial(jax.jit, static_argnames=("graphdef", "strategy", "max_new_tokens"), donate_argnames=("cache",))
def prefill(graphdef, state, cache, tokens_BT, lengths_B, key, stop_tokens_S, pad_id, args, *, strategy,
            max_new_tokens: int) -> DecodeState:
    """Run the right-padded prompts through the model (filling the cache), take the logits at
    each row's last prompt token and let the strategy emit the first token(s)."""
    B, T = tokens_BT.shape
    positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    model = nnx.merge(graphdef, state)
    cache = cache.with_prompt_lengths(lengths_B)  # caches that select from the prompt (CateKV) need it
    h_BTD, cache, _ = model(tokens_BT, positions_BT, cache=cache, return_hidden=True)
    h_last_B1D = jnp.take_along_axis(h_BTD, (lengths_B - 1)[:, None, None], axis=1)
    logits_BV = model.head(h_last_B1D)[:, 0]
    s = DecodeState(
        cache=cache,
        prompt_len_B=lengths_B.astype(jnp.int32),
        last_tokens_B=jnp.full((B,), pad_id, jnp.int32),
        out_BN=jnp.full((B, max_new_tokens), pad_id, jnp.int32),
        n_out_B=jnp.zeros((B,), jnp.int32),
        done_B=jnp.zeros((B,), bool),
        key=key,
    )
    ctx = _context(graphdef, state, stop_tokens_S, args, prompt_BT=tokens_BT)
    return strategy.init(ctx, s, logits_BV)


@functools.partial(jax.jit, static_argnames=("graphdef", "strategy"), donate_argnames=("s",))
def decode_step(graphdef, state, s: DecodeState, stop_tokens_S, args, *, strategy) -> DecodeState:
    """One strategy step (used by the streaming path)."""
    return strategy.step(_context(graphdef, state, stop_tokens_S, args), s)


@functools.partial(jax.jit, static_argnames=("graphdef", "strategy"), donate_argnames=("s",))
def decode_loop(graphdef, state, s: DecodeState, stop_tokens_S, args, *, strategy) -> DecodeState:
    """All remaining steps in one compiled while loop; exits when every row is done."""
    ctx = _context(graphdef, state, stop_tokens_S, args)
    return jax.lax.while_loop(lambda c: ~jnp.all(c.done_B), lambda c: strategy.step(ctx, c), s)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def forward_with_cache(graphdef, state, cache, tokens_BT, positions_BT):
    """One model call over the cache: (float32 logits [B,T,V], cache). For tests and tools."""
    return _model_fn(graphdef, state)(cache, tokens_BT, positions_BT)


# ----------------------------------------------------------------------------- host side

def prepare_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int, pad_id: int, max_new_tokens: int,
                    cache_len: Optional[int], max_seq_len: Optional[int] = None):
    """Validate and right-pad. Returns (tokens_BT int32, lengths_B int32, cache_len).

    A prompt, or a prompt plus ``max_new_tokens``, longer than the model's context ``max_seq_len``
    (positions past it were never trained) or than the KV cache is an ``InputError`` naming both
    lengths."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise InputError(f"prompts must be a non-empty list of token-id lists; got {type(prompts).__name__}")
    rows = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.size == 0:
            raise InputError(f"prompt {i} must be a non-empty 1-D list of token ids; got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"prompt {i} must hold integer token ids; got dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise InputError(f"prompt {i} has token ids outside [0, {vocab_size}): min {arr.min()}, max {arr.max()}")
        rows.append(arr.astype(np.int32))
    if int(max_new_tokens) < 1:
        raise InputError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    lengths = np.array([len(r) for r in rows], np.int32)
    longest = int(lengths.max())
    i = int(lengths.argmax())
    need = longest + int(max_new_tokens)
    if max_seq_len is not None:
        if longest > max_seq_len:
            raise InputError(f"prompt {i} has {longest} tokens, longer than the model's context "
                             f"of {max_seq_len} tokens (ModelConfig.max_seq_len); shorten it to "
                             f"at most {max_seq_len - 1}")
        if need > max_seq_len:
            raise InputError(
                f"prompt {i} ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} "
                f"exceeds the model's context of {max_seq_len} tokens (ModelConfig.max_seq_len); ask for at most "
                f"{max_seq_len - longest} new tokens or shorten the prompt")
    if cache_len is None:
        cache_len = round_up(need, CACHE_BUCKET)
    cache_len = int(cache_len)
    if longest > cache_len:
        raise InputError(f"prompt {i} has {longest} tokens, longer than the KV cache ({cache_len} positions)")
    if need > cache_len:
        raise InputError(
            f"prompt {i} ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the KV cache "
            f"length {cache_len}; pass a larger cache_len or fewer max_new_tokens")
    T = min(round_up(longest, PREFILL_BUCKET), cache_len)
    tokens = np.full((len(rows), T), pad_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, lengths, cache_len


def _stop_array(stop_tokens) -> jax.Array:
    stops = [int(t) for t in (stop_tokens or ())]
    # -1 never matches a token id; keeps the array non-empty (shape [1] when there are no stops)
    return jnp.asarray(stops or [-1], jnp.int32)


def make_cache_factory(cfg, gen: GenerationConfig, model=None) -> Callable:
    """``factory(cfg, batch, max_len)`` building the generation's KV cache kind (see ``cache_kind``)."""
    kind, config = cache_kind(cfg, gen)
    cls = KV_CACHE.get(kind)
    return lambda c, batch, max_len: cls.create(c, batch, max_len, config=config, model=model)


def run_decode(graphdef, state, cfg, prompts, gen: GenerationConfig, *, strategy, args, key,
               stream: Optional[Callable[[list], Any]] = None, cache_factory: Optional[Callable] = None,
               model=None) -> DecodeState:
    """Prefill + decode with an explicit strategy; returns the final ``DecodeState``. ``gen`` gives
    ``max_new_tokens``, ``stop_tokens`` (None: the model's eos ids), ``cache_len``, ``pad_id`` and the
    cache kind."""
    pad_id = gen.pad_id if gen.pad_id is not None else (cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    pad_id = int(pad_id)
    max_new_tokens = gen.max_new_tokens
    # the cache options are validated before the prompts (a bad option is named first)
    factory = cache_factory or make_cache_factory(cfg, gen, model)
    tokens_BT, lengths_B, cache_len = prepare_prompts(
        prompts, vocab_size=cfg.vocab_size, pad_id=pad_id, max_new_tokens=max_new_tokens,
        cache_len=gen.cache_len, max_seq_len=cfg.max_seq_len)
    cache = factory(cfg, tokens_BT.shape[0], cache_len)
    stops = _stop_array(cfg.eos_token_id if gen.stop_tokens is None else gen.stop_tokens)
    s = prefill(graphdef, state, cache, jnp.asarray(tokens_BT), jnp.asarray(lengths_B), key, stops,
                jnp.int32(pad_id), args, strategy=strategy, max_new_tokens=int(max_new_tokens))
    if stream is None:
        return decode_loop(graphdef, state, s, stops, args, strategy=strategy)
    seen = np.zeros(len(lengths_B), np.int64)

    def report(s):
        n_out, out = jax.device_get((s.n_out_B, s.out_BN))
        stream([out[i, seen[i]: n_out[i]].tolist() for i in range(len(seen))])
        seen[:] = n_out
        return bool(np.all(jax.device_get(s.done_B)))

    finished = report(s)
    while not finished:
        s = decode_step(graphdef, state, s, stops, args, strategy=strategy)
        finished = report(s)
    return s


def results(s: DecodeState) -> list[list[int]]:
    """Emitted tokens per row (stop token included when hit, no padding)."""
    out, n_out = jax.device_get((s.out_BN, s.n_out_B))
    return [out[i, : n_out[i]].tolist() for i in range(out.shape[0])]


def generate_ids(graphdef, state, cfg, prompts: list[list[int]], gen: Optional[GenerationConfig] = None, *,
                 key: Optional[jax.Array] = None, stream: Optional[Callable[[list], Any]] = None,
                 cache_factory: Optional[Callable] = None, model=None, **options) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` new tokens per prompt; returns the new tokens only.

    ``gen`` (a ``GenerationConfig``) and/or its fields as keyword ``options``. ``key`` (a PRNG key)
    overrides ``gen.seed``. ``stream`` is called once per step with a list (one entry per prompt) of
    that step's new tokens. ``cache_factory(cfg, batch, max_len)`` replaces the configured cache
    kind (tools and tests); ``model`` (a ``pallasite.Model``) lets cache kinds find its artifacts.
    """
    gen = GenerationConfig.make(gen, **options)
    strategy, args = DECODE_STRATEGY.get(gen.strategy)(gen, len(prompts))
    key = jax.random.key(gen.seed) if key is None else key
    s = run_decode(graphdef, state, cfg, prompts, gen, strategy=strategy, args=args, key=key, stream=stream,
                   cache_factory=cache_factory, model=model)
    return results(s)


__all__ = [
    "DecodeState", "StepContext", "SamplingStrategy", "emit_tokens", "prefill", "decode_step", "decode_loop",
    "forward_with_cache", "prepare_prompts", "run_decode", "results", "generate_ids",
]
