"""The ``constrained`` decode strategy: host-computed token masks applied inside the compiled loop.

Each step: forward -> logits processors -> grammar mask -> temperature / top-k / top-p -> draw,
one token per row, every row with its own grammar state (``host.HostSession``). The host is
reached through ``jax.pure_callback`` (the while loop stays compiled); masks travel as packed
int32 bitmasks ``[B, ceil(V/32)]`` and are unpacked on the device.

* ``opportunistic=True`` (default; SynCode / CRANE's ``_get_next_token_grammar``): propose a token
  from the unmasked logits, ask the host whether it is valid, and only for rows where it is not,
  compute the mask and draw again. The redraw reuses the proposal's Gumbel noise, so the result is
  the token always-masking draws — identical under greedy and temperature sampling (with top-k /
  top-p the nucleus of the unmasked logits decides the proposal, as in the official code).
* ``opportunistic=False``: mask every step. With ``overlap=True`` the mask for step t (it needs
  only tokens < t) is computed on a host thread while the device runs step t's forward pass.

``draft_masks(session, s, draft_BK)`` gives a speculative strategy the masks at the current and
each draft position (bonus position last); ``draft_allowed`` unpacks them (the speculative
strategy's constraint hook). A constraint with the default strategy ``sample``
selects this strategy (``GenerationConfig``); any strategy may call these helpers instead.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.inference.config import GenerationConfig
from pallasite.inference.constrained.constraint import per_row
from pallasite.inference.constrained.host import HostSession, get_session
from pallasite.inference.engine import SamplingStrategy
from pallasite.inference.sampling import MASKED, SamplingParams, SamplingSpec, sample
from pallasite.registry import DECODE_STRATEGY


@dataclasses.dataclass(frozen=True)
class ConstrainedConfig:
    opportunistic: bool = True  # propose, check, mask only rows whose proposal is invalid
    overlap: bool = (
        True  # always-mask mode: compute the next mask on a host thread during the forward
    )
    threads: int = 0  # llguidance mask threads (0: its default)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ConstrainedArgs:
    sampling: SamplingParams
    session: jax.Array  # int32 scalar: the host session id


def words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(words_W: jax.Array, vocab_size: int) -> jax.Array:
    """Packed masks ``[..., W]`` -> allowed ``[..., V]`` (bit i % 32 of word i // 32 is token i)."""
    bits = (words_W[..., None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [..., W, 32]
    return bits.reshape(*words_W.shape[:-1], -1)[..., :vocab_size].astype(bool)


def apply_bitmask(logits_BV: jax.Array, words_BW: jax.Array) -> jax.Array:
    """The masked value where the packed mask's bit is 0."""
    return jnp.where(unpack_bitmask(words_BW, logits_BV.shape[-1]), logits_BV, MASKED)


# ----------------------------------------------------------------------------- callbacks


def _host_masks(sid, out_BN, n_out_B, done_B, *, words):
    return get_session(sid).sync_and_masks(
        np.asarray(out_BN), np.asarray(n_out_B), np.asarray(done_B), words
    )


def _host_kick(sid, out_BN, n_out_B, done_B, *, words):
    return np.int32(get_session(sid).kick(out_BN, n_out_B, done_B, words))


def _host_collect(sid, ticket):
    return get_session(sid).collect(int(ticket))


def _host_check(sid, out_BN, n_out_B, done_B, proposal_B):
    return get_session(sid).check(
        np.asarray(out_BN), np.asarray(n_out_B), np.asarray(done_B), np.asarray(proposal_B)
    )


def _host_remask(sid, done_B, valid_B, *, words):
    s = get_session(sid)
    return s.masks(words, np.asarray(done_B), which=~np.asarray(valid_B))


def _host_draft(sid, out_BN, n_out_B, done_B, draft_BK, *, words):
    return get_session(sid).draft_masks(
        np.asarray(out_BN), np.asarray(n_out_B), np.asarray(done_B), np.asarray(draft_BK), words
    )


def _host_prefix(sid, out_BN, n_out_B, done_B, draft_BK, j, *, words):
    return get_session(sid).prefix_mask(
        np.asarray(out_BN), np.asarray(n_out_B), np.asarray(done_B), np.asarray(draft_BK), int(j), words
    )


def _words_struct(B, W):
    return jax.ShapeDtypeStruct((B, W), jnp.int32)


def host_masks(session, s, vocab_size: int) -> jax.Array:
    """[B, W] masks for the next token of every row (after syncing the emitted tokens)."""
    B, W = s.out_BN.shape[0], words_for(vocab_size)
    fn = functools.partial(_host_masks, words=W)
    return jax.pure_callback(fn, _words_struct(B, W), session, s.out_BN, s.n_out_B, s.done_B)


def draft_masks(session, s, draft_BK: jax.Array, vocab_size: int) -> jax.Array:
    """[B, K+1, W] masks at the next position and after each draft prefix (for speculative decoding)."""
    B, K = draft_BK.shape
    W = words_for(vocab_size)
    fn = functools.partial(_host_draft, words=W)
    return jax.pure_callback(
        fn,
        jax.ShapeDtypeStruct((B, K + 1, W), jnp.int32),
        session,
        s.out_BN,
        s.n_out_B,
        s.done_B,
        draft_BK.astype(jnp.int32),
    )


def prefix_allowed(session, s, draft_BK: jax.Array, j: jax.Array, vocab_size: int) -> jax.Array:
    """Allowed tokens ``[B, V]`` after the first ``j`` (traced) tokens of ``draft_BK``: what a
    drafter may propose at draft step ``j``."""
    B, W = draft_BK.shape[0], words_for(vocab_size)
    fn = functools.partial(_host_prefix, words=W)
    words = jax.pure_callback(fn, _words_struct(B, W), session, s.out_BN, s.n_out_B, s.done_B,
                              draft_BK.astype(jnp.int32), jnp.asarray(j, jnp.int32))
    return unpack_bitmask(words, vocab_size)


def draft_allowed(session, s, draft_BK: jax.Array, vocab_size: int) -> jax.Array:
    """Allowed tokens ``[B, K+1, V]`` at the next position and after each draft prefix. Positions
    behind an invalid draft token (where ``draft_masks`` allows nothing) allow everything: a
    verifier never uses them, and a row of -inf logits would turn its softmax into NaN."""
    allowed = unpack_bitmask(draft_masks(session, s, draft_BK, vocab_size), vocab_size)
    return allowed | ~jnp.any(allowed, axis=-1, keepdims=True)


# ----------------------------------------------------------------------------- strategy


@dataclasses.dataclass(frozen=True)
class ConstrainedStrategy:
    """Sampling with a grammar mask per row (see the module docstring)."""

    spec: SamplingSpec = SamplingSpec()
    processors: tuple = ()
    opportunistic: bool = True
    overlap: bool = True

    def _draw(self, logits_BV, sub, args):
        return sample(logits_BV, sub, args.sampling, self.spec)

    def select(self, ctx, s, logits_BV, words_BW=None):
        """Masked draw; ``words_BW`` (always-mask mode) was computed before the forward pass."""
        for proc in self.processors:
            logits_BV = proc(logits_BV, s)
        key, sub = jax.random.split(s.key)
        s = s.replace(key=key)
        V = logits_BV.shape[-1]
        if not self.opportunistic:
            if words_BW is None:
                words_BW = host_masks(ctx.args.session, s, V)
            return self._draw(apply_bitmask(logits_BV, words_BW), sub, ctx.args), s
        proposal_B = self._draw(logits_BV, sub, ctx.args)
        valid_B = jax.pure_callback(
            _host_check,
            jax.ShapeDtypeStruct(proposal_B.shape, jnp.bool_),
            ctx.args.session,
            s.out_BN,
            s.n_out_B,
            s.done_B,
            proposal_B,
        )

        def redraw(_):
            fn = functools.partial(_host_remask, words=words_for(V))
            words = jax.pure_callback(
                fn,
                _words_struct(proposal_B.shape[0], words_for(V)),
                ctx.args.session,
                s.done_B,
                valid_B,
            )
            return jnp.where(
                valid_B, proposal_B, self._draw(apply_bitmask(logits_BV, words), sub, ctx.args)
            )

        tok_B = jax.lax.cond(jnp.all(valid_B), lambda _: proposal_B, redraw, None)
        return tok_B, s

    def init(self, ctx, s, prefill_logits_BV):
        # ``extra`` carries the mask width in its shape: the step needs it before the forward pass
        s = s.replace(extra=jnp.zeros((words_for(prefill_logits_BV.shape[-1]),), jnp.int8))
        tok_B, s = self.select(ctx, s, prefill_logits_BV)
        return ctx.emit(s, tok_B[:, None], jnp.ones_like(tok_B))

    def step(self, ctx, s):
        tokens_B1, positions_B1 = s.last_tokens_B[:, None], s.next_positions_B[:, None]
        words = None
        if not self.opportunistic and self.overlap:
            # the mask of this step needs only the tokens emitted so far: start it on the host now,
            # run the forward pass, then collect (the barrier orders the kick before the forward)
            B, W = s.out_BN.shape[0], s.extra.shape[0]
            kick = functools.partial(_host_kick, words=W)
            ticket = jax.pure_callback(
                kick,
                jax.ShapeDtypeStruct((), jnp.int32),
                ctx.args.session,
                s.out_BN,
                s.n_out_B,
                s.done_B,
            )
            ticket, tokens_B1 = jax.lax.optimization_barrier((ticket, tokens_B1))
            logits_BTV, cache = ctx.model(s.cache, tokens_B1, positions_B1)
            words = jax.pure_callback(_host_collect, _words_struct(B, W), ctx.args.session, ticket)
        else:
            logits_BTV, cache = ctx.model(s.cache, tokens_B1, positions_B1)
        tok_B, s = self.select(ctx, s.replace(cache=cache), logits_BTV[:, -1], words)
        return ctx.emit(s, tok_B[:, None], jnp.ones_like(tok_B))


def constraint_session(gen: GenerationConfig, n_prompts: int, threads=None):
    """The host session of ``gen.constraint`` (one row per prompt), or None when no row has one."""
    rows = per_row(gen.constraint, n_prompts)
    if all(c is None for c in rows):
        return None
    if gen.stop_tokens == ():
        raise ValueError(
            "a constrained generation needs a stop token (the grammar's end); "
            "stop_tokens=() leaves none"
        )
    return HostSession(rows, gen.stop_tokens if gen.stop_tokens else None, threads=threads)


def build_constrained(gen: GenerationConfig, n_prompts: int):
    """(strategy, args) for ``gen``: a ``ConstrainedStrategy`` over a new host session, or plain
    sampling when no prompt has a constraint."""
    sampling, spec = SamplingParams.make(n_prompts, gen.temperature, gen.top_k, gen.top_p)
    cfg = gen.strategy_config or ConstrainedConfig()
    session = constraint_session(gen, n_prompts, threads=cfg.threads or None)
    if session is None:
        return SamplingStrategy(spec=spec, processors=tuple(gen.logits_processors)), sampling
    strategy = ConstrainedStrategy(
        spec=spec,
        processors=tuple(gen.logits_processors),
        opportunistic=cfg.opportunistic,
        overlap=cfg.overlap,
    )
    return strategy, ConstrainedArgs(sampling=sampling, session=jnp.int32(session.id))


DECODE_STRATEGY.register("constrained", build_constrained, config=ConstrainedConfig)


def session_of(args) -> HostSession:
    """The host session behind ``build_constrained``'s args (stats, spans, errors)."""
    return get_session(args.session)


__all__ = [
    "ConstrainedConfig",
    "ConstrainedArgs",
    "ConstrainedStrategy",
    "build_constrained",
    "apply_bitmask",
    "unpack_bitmask",
    "host_masks",
    "draft_masks",
    "draft_allowed",
    "prefix_allowed",
    "constraint_session",
    "session_of",
    "words_for",
]
