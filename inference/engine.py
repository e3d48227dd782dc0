"""Generation engine: jitted prefill + decode over a preallocated KV cache, behind one
decode-strategy seam.

    out = generate_ids(graphdef, state, cfg, [[1, 5, 9], [1, 7]], max_new_tokens=32,
                       temperature=0.7, top_p=0.9, seed=0, stop_tokens=(2,))

Layout and conventions
----------------------
* Prompts are right-padded to a bucketed length ``T`` (multiple of 16, at most the cache
  length) and prefilled in one call with positions ``0..T-1`` for every row. Following the
  slot convention of ``inference/cache/dense.py`` (token at position p -> slot p), each row then
  continues from its own length: its next token is fed at position ``len_b`` and overwrites the
  junk its pad tokens left there before that slot is visible (the causal mask is by position).
  So rows of different lengths never see padding, and no attention mask is carried around.
* The cache comes from ``cache_factory(cfg, batch_size, max_len)`` (default
  ``init_dense_cache``); the engine only threads it through the model, so the CateKV and 4-bit
  caches slot in unchanged. It is donated to every jitted call (updated in place).
* Prefill computes the LM head only at each row's last prompt token (not over all T
  positions: for long prompts that would be the largest matmul of the call).
* Decode is ONE compiled ``lax.while_loop`` (``decode_loop``) that stops as soon as every row
  has finished (stop token or ``max_new_tokens``): no host round trip per token. When a
  ``stream`` callback is given, the same jitted body (``decode_step``) is driven from Python one
  step at a time instead, so the callback sees each step's tokens as soon as they exist, may
  run arbitrary host code (tokenizer, printing, UI), and the two paths produce identical tokens
  (same body, same key sequence). We chose this over ``io_callback`` inside the loop: an
  ordered host callback synchronises every step anyway, so it saves nothing, while it would
  tie user code to the device loop (exceptions surface late, calls into jax from the callback
  can deadlock).
* Finished rows stop emitting (the output buffer keeps ``pad_id`` there), their position stops
  advancing; they still ride along in the batched forward (rewriting their own last slot)
  because skipping rows would change shapes.

Decode-strategy seam
--------------------
A strategy is a hashable (static) object with two methods, called inside jit:

* ``init(ctx, s, prefill_logits_BV) -> DecodeState`` — choose the first token(s) from the
  prefill logits (a speculative drafter would prefill its own cache here from
  ``ctx.prompt_BT``, carried in ``s.extra``);
* ``step(ctx, s) -> DecodeState`` — one loop iteration: run ``ctx.model`` on the tokens to
  feed, pick the next token(s), record them with ``ctx.emit``.

``ctx`` holds the model closure ``model(cache, tokens_BT, positions_BT) -> (logits_BTV, cache)``,
``emit(s, tokens_BK, n_new_B)`` (writes up to K tokens per row, applies stop tokens and
``max_new_tokens``, sets ``done``), and the strategy's dynamic arguments ``args`` (a pytree, e.g.
per-row temperatures). ``emit`` accepts several tokens per row per step, which is what
speculative decoding needs; since slots are addressed by position, rolling back rejected
draft tokens is just not advancing the position. ``SamplingStrategy`` (greedy / temperature /
top-k / top-p plus optional logits processors ``proc(logits_BV, s) -> logits_BV`` applied
before the sampling filters, as in HF) is the default; constrained and guided decoding can be
written as logits processors or as strategies that carry their own state in ``s.extra``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from pallasite.inference.cache import init_dense_cache
from pallasite.inference.sampling import SamplingParams, SamplingSpec, sample

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


# ----------------------------------------------------------------------------- model plumbing


def _lm_head(model, h_BTD: jax.Array) -> jax.Array:
    return model.head(h_BTD)


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
    if hasattr(cache, "with_prompt_lengths"):  # caches that select from the prompt (CateKV) need each row's length
        cache = cache.with_prompt_lengths(lengths_B)
    h_BTD, cache, _ = model(tokens_BT, positions_BT, cache=cache, return_hidden=True)
    h_last_B1D = jnp.take_along_axis(h_BTD, (lengths_B - 1)[:, None, None], axis=1)
    logits_BV = _lm_head(model, h_last_B1D)[:, 0]
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


def forward_with_cache(graphdef, state, cache, tokens_BT, positions_BT):
    """One model call over the cache: (float32 logits [B,T,V], cache). For tests and tools."""
    return _forward_with_cache(graphdef, state, cache, tokens_BT, positions_BT)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def _forward_with_cache(graphdef, state, cache, tokens_BT, positions_BT):
    return _model_fn(graphdef, state)(cache, tokens_BT, positions_BT)


# ----------------------------------------------------------------------------- host side


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def prepare_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int, pad_id: int, max_new_tokens: int,
                    cache_len: Optional[int]):
    """Validate and right-pad. Returns (tokens_BT int32, lengths_B int32, cache_len)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of token-id lists; got {type(prompts).__name__}")
    rows = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"prompt {i} must be a non-empty 1-D list of token ids; got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {i} must hold integer token ids; got dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): min {arr.min()}, max {arr.max()}")
        rows.append(arr.astype(np.int32))
    if int(max_new_tokens) < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    lengths = np.array([len(r) for r in rows], np.int32)
    longest = int(lengths.max())
    need = longest + int(max_new_tokens)
    if cache_len is None:
        cache_len = _round_up(need, CACHE_BUCKET)
    cache_len = int(cache_len)
    if longest > cache_len:
        i = int(lengths.argmax())
        raise ValueError(f"prompt {i} has {longest} tokens, longer than the KV cache ({cache_len} positions)")
    if need > cache_len:
        i = int(lengths.argmax())
        raise ValueError(
            f"prompt {i} ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {need} exceeds the KV cache "
            f"length {cache_len}; pass a larger cache_len or fewer max_new_tokens")
    T = min(_round_up(longest, PREFILL_BUCKET), cache_len)
    tokens = np.full((len(rows), T), pad_id, np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    return tokens, lengths, cache_len


def _stop_array(stop_tokens) -> jax.Array:
    stops = [int(t) for t in (stop_tokens or ())]
    # -1 never matches a token id; keeps the array non-empty (shape [1] when there are no stops)
    return jnp.asarray(stops or [-1], jnp.int32)


def run_decode(graphdef, state, cfg, prompts, *, max_new_tokens: int, strategy, args, key, stop_tokens=(),
               stream: Optional[Callable[[list], Any]] = None, cache_len=None, cache_factory=None,
               pad_id: Optional[int] = None) -> DecodeState:
    """Prefill + decode with an explicit strategy; returns the final ``DecodeState``."""
    if pad_id is None:
        pad_id = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    pad_id = int(pad_id)
    tokens_BT, lengths_B, cache_len = prepare_prompts(
        prompts, vocab_size=cfg.vocab_size, pad_id=pad_id, max_new_tokens=max_new_tokens, cache_len=cache_len)
    factory = cache_factory or init_dense_cache
    cache = factory(cfg, tokens_BT.shape[0], cache_len)
    stops = _stop_array(stop_tokens)
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


def generate_ids(graphdef, state, cfg, prompts: list[list[int]], *, max_new_tokens: int, temperature=0.0,
                 top_k=None, top_p=None, seed: int = 0, key: Optional[jax.Array] = None, stop_tokens=(),
                 stream: Optional[Callable[[list], Any]] = None, cache_len: Optional[int] = None,
                 cache_factory: Optional[Callable] = None, logits_processors: tuple = (), strategy=None,
                 strategy_args=None, pad_id: Optional[int] = None) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` new tokens per prompt; returns the new tokens only.

    ``temperature`` / ``top_k`` / ``top_p`` take a scalar or one value per prompt
    (temperature 0 = greedy). ``key`` (a PRNG key) overrides ``seed``. ``stream`` is called once
    per step with a list (one entry per prompt) of that step's new tokens (empty for finished
    rows). ``cache_factory(cfg, batch, max_len)`` builds the KV cache (default dense, in the
    model's compute dtype); ``cache_len`` defaults to the longest prompt + max_new_tokens
    rounded up to a multiple of 64. ``strategy`` / ``strategy_args`` replace the default
    ``SamplingStrategy`` (then the sampling arguments are ignored).
    """
    if strategy is None:
        args, spec = SamplingParams.make(len(prompts), temperature, top_k, top_p)
        strategy = SamplingStrategy(spec=spec, processors=tuple(logits_processors))
    else:
        args = strategy_args
    key = jax.random.key(seed) if key is None else key
    s = run_decode(graphdef, state, cfg, prompts, max_new_tokens=max_new_tokens, strategy=strategy, args=args,
                   key=key, stop_tokens=stop_tokens, stream=stream, cache_len=cache_len,
                   cache_factory=cache_factory, pad_id=pad_id)
    return results(s)


__all__ = [
    "DecodeState", "StepContext", "SamplingStrategy", "emit_tokens", "prefill", "decode_step", "decode_loop",
    "forward_with_cache", "prepare_prompts", "run_decode", "results", "generate_ids",
]
