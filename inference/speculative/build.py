"""Building the ``speculative`` decode strategy from a ``GenerationConfig`` with a ``drafter``:
the method (``auto`` = sd for a shared vocabulary, else slem when greedy and tli when sampling, as
transformers routes), the vocabulary tables of the pair, the SLEM host session, the constraint
hooks, and the registration under ``DECODE_STRATEGY``; ``stats_of`` reads a finished run's counters.
The strategy itself is ``strategy.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.errors import ConfigError
from pallasite.inference.sampling import SamplingParams
from pallasite.inference.speculative import drafter as D
from pallasite.inference.speculative import slrs as S
from pallasite.inference.speculative.host import SlemSession
from pallasite.inference.speculative.options import SpeculativeConfig, check_method
from pallasite.inference.speculative.strategy import SpecArgs, SpeculativeStrategy
from pallasite.inference.speculative.vocab import check_drafter_can_encode, pair_map
from pallasite.registry import DECODE_STRATEGY


# ----------------------------------------------------------------------------- constraint hooks
def constraint_mask(ctx, s, tokens_BK, vocab_size: int):
    """The ``target_mask`` hook of a constrained generation: the grammar's allowed target tokens at
    the next position and after each draft prefix, from the host session in ``args.constraint``."""
    from pallasite.inference.constrained.strategy import draft_allowed

    return draft_allowed(ctx.args.constraint, s, tokens_BK, vocab_size)


def constraint_draft_mask(ctx, s, tokens_BK, j, vocab_size: int):
    """The ``draft_mask`` hook: the allowed target tokens after the first ``j`` drafts."""
    from pallasite.inference.constrained.strategy import prefix_allowed

    return prefix_allowed(ctx.args.constraint, s, tokens_BK, j, vocab_size)


# ----------------------------------------------------------------------------- building
def _same_vocab(target_tok, drafter_tok) -> bool:
    if target_tok is None or drafter_tok is None:
        return target_tok is drafter_tok
    if target_tok is drafter_tok:
        return True
    return pair_map(target_tok, drafter_tok).same_vocab


def resolve_method(method: str, drafter: D.Drafter, greedy: bool) -> str:
    check_method(method)
    t, d = drafter.target_tokenizer, drafter.tokenizer
    if method == "auto":
        if _same_vocab(t, d):
            return "sd"
        return "slem" if greedy else "tli"
    if method == "sd" and not _same_vocab(t, d):
        pm = pair_map(t, d) if (t is not None and d is not None) else None
        detail = "one model has no tokenizer" if pm is None else (
            f"target {len(pm.target)} tokens, drafter {len(pm.drafter)}, {pm.intersection} shared strings")
        raise ConfigError(f"method='sd' needs the drafter and the target to share one vocabulary; theirs differ "
                          f"({detail}); use method='slem', 'tli' or 'auto'")
    if method != "sd" and (t is None or d is None):
        which = "target" if t is None else "drafter"
        raise ConfigError(f"method={method!r} works on text: the {which} has no tokenizer (pallasite.generate binds "
                          "the target's; with generate_ids pass speculative.Drafter(..., target_tokenizer=...))")
    return method


def build_speculative(gen, n_prompts: int):
    """(SpeculativeStrategy, SpecArgs) for a ``GenerationConfig`` with a ``drafter``."""
    cfg: SpeculativeConfig = gen.strategy_config or SpeculativeConfig()
    if gen.drafter is None:
        raise ConfigError("strategy='speculative' needs a drafter: GenerationConfig(drafter=<a pallasite.Model>)")
    if gen.logits_processors:
        raise ConfigError("speculative decoding does not take logits_processors (they see one position at a "
                          "time); constraints apply through the strategy's target_mask hook")
    drafter = D.Drafter.of(gen.drafter)
    sampling, spec = SamplingParams.make(n_prompts, gen.temperature, gen.top_k, gen.top_p)
    method = resolve_method(gen.method or "auto", drafter, spec.greedy_only)
    kind, kind_cfg = drafter.cache_kind(cfg.drafter_kv_cache, cfg.drafter_kv_cache_config)
    k_init = cfg.num_draft_tokens
    pair, session = None, 0
    if method == "sd":
        V = drafter.config.vocab_size
        d2t = np.arange(V, dtype=np.int32)
        t2d, t2d_len = np.arange(V, dtype=np.int32)[:, None], np.ones(V, np.int32)
    else:
        pair = pair_map(drafter.target_tokenizer, drafter.tokenizer,
                        max_len=16 if method in ("slem", "slrs") else cfg.max_spelling)
        check_drafter_can_encode(pair)
        d2t, t2d, t2d_len = pair.d2t, pair.t2d, pair.t2d_len
        if method == "tli" and pair.intersection == 0:
            raise ConfigError("method='tli': the two vocabularies share no token string; use method='slem'")
    if method == "slrs" and cfg.confidence_threshold is not None:
        raise ConfigError("confidence_threshold applies to sd, tli and slem (SLRS drafts target tokens through psi, "
                          "whose drafter calls do not give one next-token confidence); set it to None for slrs")
    tables = S.build_tables(pair, max_nodes=cfg.slrs_max_nodes) if method == "slrs" else None
    if method == "slem":
        stops = gen.stop_tokens if gen.stop_tokens else pair.target.eos_ids
        sess = SlemSession(pair, target_lookbehind=cfg.target_lookbehind, drafter_lookbehind=cfg.drafter_lookbehind,
                           max_feed=cfg.max_catch_up, width=cfg.target_width, stops=tuple(stops or ()))
        session = sess.id
    from pallasite.inference.constrained.strategy import constraint_session

    constrained = constraint_session(gen, n_prompts)
    strategy = SpeculativeStrategy(
        method=method, drafter_graphdef=drafter.graphdef, drafter_config=drafter.config,
        drafter_cache_kind=kind, drafter_cache_config=kind_cfg, spec=spec, k_max=cfg.k_max, k_init=k_init,
        schedule=cfg.schedule, width=cfg.target_width, catch_up=cfg.max_catch_up,
        len_ratio=float(cfg.drafter_len_ratio), confidence=cfg.confidence_threshold,
        confidence_product=cfg.confidence_of == "prefix",
        pair=pair, drafter_path=drafter.path, target_mask=None if constrained is None else constraint_mask,
        draft_mask=constraint_draft_mask if constrained is not None and cfg.mask_drafts and method in ("sd", "tli")
        else None)
    args = SpecArgs(sampling=sampling, drafter_state=drafter.state, d2t=jnp.asarray(d2t, jnp.int32),
                    t2d=jnp.asarray(t2d, jnp.int32), t2d_len=jnp.asarray(t2d_len, jnp.int32),
                    session=jnp.int32(session), constraint=jnp.int32(0 if constrained is None else constrained.id),
                    slrs=tables)
    return strategy, args


DECODE_STRATEGY.register("speculative", build_speculative, config=SpeculativeConfig,
                         aliases={"k": "num_draft_tokens"})


def stats_of(s) -> dict:
    """Counters of a finished speculative ``DecodeState`` as plain numbers."""
    st = jax.device_get(s.extra.stats)
    n_out = np.asarray(jax.device_get(s.n_out_B))
    drafted, accepted = int(np.sum(st.drafted_B)), int(np.sum(st.accepted_B))
    calls = int(st.target_calls)
    return {"target_calls": calls, "drafter_calls": int(st.drafter_calls), "tokens": int(n_out.sum()),
            "drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / max(drafted, 1),
            "mean_accepted_length": float(n_out.sum() / max(int(np.sum(st.rounds_B)) + len(n_out), 1)),
            "target_calls_per_token": calls / max(float(n_out.max(initial=1)), 1.0)}


__all__ = ["build_speculative", "resolve_method", "stats_of", "constraint_mask", "constraint_draft_mask"]
