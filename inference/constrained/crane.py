"""CRANE's four decoding modes side by side (Banerjee et al., "CRANE: Reasoning with constrained LLM
generation", ICML 2025; modes of the official driver ``src/run_gsm_symbolic.sh``):

    unconstrained  answer prompt, free decoding                  (``original``, no CoT)
    constrained    answer prompt, answer grammar from the first   (``itergen`` / ``grammar_strict``:
                   token                                            the SynCode / ITERGEN baseline)
    cot            chain-of-thought prompt, free decoding         (``original`` with CoT)
    crane          chain-of-thought prompt, free until S, the     (``adaptive``)
                   answer grammar until E, free again (per-span
                   reset, opportunistic masking)

``mode_constraint(mode, grammar, start, end)`` is the constraint of a mode (None, the grammar on
the whole completion, or the grammar on S ... E spans); ``generate_modes`` runs the modes a task
asks for over one batch of problems, greedy by default (the paper's T = 0), and returns each
mode's completions with the host session's statistics (mask time, invalid proposals).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

import jax

from pallasite.inference.constrained.constraint import Constraint

MODES = ("unconstrained", "constrained", "cot", "crane")
COT_MODES = ("cot", "crane")


def mode_constraint(
    mode: str, grammar: str, start: str, end: Optional[str], *, name: str = "", kind: str = "lark"
) -> Optional[Constraint]:
    if mode not in MODES:
        raise ValueError(f"CRANE mode {mode!r}; expected one of {MODES}")
    if mode in ("unconstrained", "cot"):
        return None
    if mode == "constrained":
        return Constraint(kind, grammar, name=name)
    return Constraint(kind, grammar, name=name, start=start, end=end)


@dataclasses.dataclass
class ModeResult:
    mode: str
    texts: list
    seconds: float
    steps: int
    stats: Optional[dict] = None  # host session statistics (constrained modes)
    row_errors: Optional[dict] = None


def generate_modes(
    model,
    problems: Sequence,
    *,
    prompt_fn: Callable,
    grammar_fn: Callable,
    start: str,
    end: Optional[str],
    modes: Sequence[str] = MODES,
    max_new_tokens: int = 256,
    opportunistic: bool = True,
    overlap: bool = True,
    batch_size: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
) -> dict:
    """{mode: ModeResult} for ``model`` (a ``pallasite.Model``) on ``problems``.

    ``prompt_fn(problem, cot: bool) -> str``; ``grammar_fn(problem) -> str`` (the answer grammar of
    that problem: CRANE's GSM driver only admits the problem's variables)."""
    from pallasite.inference import engine as E
    from pallasite.inference.constrained.strategy import build_constrained, session_of
    from pallasite.inference.constrained.sugar import make_generation_config

    out = {}
    for mode in modes:
        cot = mode in COT_MODES
        texts, steps, t0, stats_all, errors = [], 0, time.perf_counter(), [], {}
        for lo in range(0, len(problems), batch_size):
            chunk = problems[lo : lo + batch_size]
            prompts = [model.encode(prompt_fn(p, cot)) for p in chunk]
            cons = tuple(mode_constraint(mode, grammar_fn(p), start, end) for p in chunk)
            gen = make_generation_config(
                None,
                dict(
                    max_new_tokens=max_new_tokens,
                    temperature=temperature,
                    seed=seed,
                    stop_tokens=(int(model.tokenizer.eos_token_id),),
                    constraint=cons if any(c is not None for c in cons) else None,
                    strategy_config=(
                        {"opportunistic": opportunistic, "overlap": overlap}
                        if any(c is not None for c in cons)
                        else None
                    ),
                ),
                model.tokenizer,
            )
            strategy, args = build_constrained(gen, len(prompts))
            s = E.run_decode(
                model.graphdef,
                model.state,
                model.config,
                prompts,
                gen,
                strategy=strategy,
                args=args,
                key=jax.random.key(seed),
                model=model,
            )
            ids = E.results(s)
            steps += max(len(r) for r in ids)
            texts += [model.decode(r) for r in ids]
            if hasattr(args, "session"):
                sess = session_of(args)
                stats_all.append(sess.stats.as_dict())
                errors.update({lo + i: e for i, e in sess.errors().items()})
                sess.close()
        stats = None
        if stats_all:
            keys = [k for k in stats_all[0] if not k.endswith("_per_step")]
            stats = {k: sum(s[k] for s in stats_all) for k in keys}
            stats["mask_ms_per_step"] = 1e3 * stats["mask_s"] / max(stats["steps"], 1)
            stats["host_ms_per_step"] = (
                1e3
                * (stats["mask_s"] + stats["check_s"] + stats["sync_s"])
                / max(stats["steps"], 1)
            )
        out[mode] = ModeResult(mode, texts, time.perf_counter() - t0, steps, stats, errors or None)
    return out


__all__ = ["MODES", "COT_MODES", "mode_constraint", "generate_modes", "ModeResult"]
