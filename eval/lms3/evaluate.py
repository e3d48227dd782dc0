"""LMS3 end to end: select demonstrations for each test problem from a pool, prompt the model in
the official layout, decode greedily, and score exact numeric answers -- LMS3 against random
and similarity-retrieval (cosine on the same representations) selectors and zero-shot.

    result = run_selectors(model, pool, test, ks=(1, 4), lam=0.01, seed=0)

Completions are greedy, at most ``max_new_tokens``, stopped at the first newline; identical
prompts (e.g. every rejected LMS3 choice is the zero-shot prompt) are decoded once.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pallasite.eval.lms3 import selection as SEL
from pallasite.eval.lms3.math_data import Problem, extract_number
from pallasite.eval.lms3.representation import representations, tokenize_questions
from pallasite.eval.model_calls import stop_ids_for
from pallasite.eval.multi_sample import sample_rows

SELECTORS = ("lms3", "random", "similar")


def complete(
    model, prompts: Sequence[str], *, max_new_tokens: int = 10, prompts_per_batch: int = 8
) -> list[str]:
    """Greedy completions (cut at the first newline) of distinct prompts, longest first."""
    uniq = list(dict.fromkeys(prompts))
    stops = stop_ids_for(model, "\n")
    ids = [model.encode(p) for p in uniq]
    order = np.argsort([-len(i) for i in ids], kind="stable")
    rows = sample_rows(
        model,
        [ids[i] for i in order],
        temperatures=[0.0],
        max_new_tokens=max_new_tokens,
        stop_tokens=stops,
        prompts_per_batch=prompts_per_batch,
        length_bucket=64,
    )
    text = {}
    for j, i in enumerate(order):
        text[uniq[i]] = model.decode(rows[j][0][0]).split("\n")[0]
    return [text[p] for p in prompts]


def rejection_rates(sim, stab, lams: Sequence[float], k: int, tiebreak) -> list[dict]:
    """Fraction of test problems left zero-shot, and demonstrations kept on average, per lambda."""
    out = []
    for lam in lams:
        kept = SEL.select(sim, stab, k, lam, tiebreak)
        out.append(
            {
                "lambda": float(lam),
                "k": k,
                "zero_shot_rate": float(np.mean([len(c) == 0 for c in kept])),
                "mean_kept": float(np.mean([len(c) for c in kept])),
            }
        )
    return out


def run_selectors(
    model,
    pool: Sequence[Problem],
    test: Sequence[Problem],
    *,
    ks: Sequence[int] = (1, 4),
    lam: float = 0.01,
    seed: int = 0,
    selectors: Sequence[str] = SELECTORS,
    form: str = "auto",
    max_new_tokens: int = 10,
    prompts_per_batch: int = 8,
    lams_for_rate: Sequence[float] = (0.0, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
) -> dict:
    """Accuracy per (selector, k), zero-shot accuracy, and the rejection rate as lambda varies."""
    unknown = sorted(set(selectors) - set(SELECTORS))
    if unknown:
        raise ValueError(
            f"run_selectors: unknown selector(s) {unknown}; expected some of {SELECTORS}"
        )
    tok = model.tokenizer
    if tok is None:
        raise ValueError("LMS3 run_selectors: the model needs a tokenizer")
    h_pool = representations(model, tokenize_questions(tok, [p.question for p in pool]))
    h_test = representations(model, tokenize_questions(tok, [p.question for p in test]))
    proj = SEL.Projections.from_model(model)
    used_form = SEL.resolve_form(proj, form)
    sim, stab = SEL.sim_stab(h_test, h_pool, proj, used_form)
    tb = SEL.tiebreak_ranks([p.question for p in pool])
    rng = np.random.default_rng(seed)
    choices = {}
    for k in ks:
        for name in selectors:
            if name == "lms3":
                choices[f"lms3_k{k}"] = SEL.select(sim, stab, k, lam, tb)
            elif name == "random":
                choices[f"random_k{k}"] = SEL.select_random(len(test), len(pool), k, rng)
            else:
                choices[f"similar_k{k}"] = SEL.select_similar(h_test, h_pool, k, tb)
    choices["zero_shot"] = [[] for _ in test]
    prompts = {
        name: [
            SEL.build_prompt(t.question, [(pool[i].question, pool[i].solution) for i in c])
            for t, c in zip(test, ch)
        ]
        for name, ch in choices.items()
    }
    flat = [p for ps in prompts.values() for p in ps]
    done = dict(
        zip(
            flat,
            complete(
                model, flat, max_new_tokens=max_new_tokens, prompts_per_batch=prompts_per_batch
            ),
        )
    )
    accuracy, rejected = {}, {}
    for name, ps in prompts.items():
        hits = [extract_number(done[p]) == float(t.answer) for p, t in zip(ps, test)]
        accuracy[name] = float(np.mean(hits))
        rejected[name] = float(np.mean([len(c) == 0 for c in choices[name]]))

    def match_rate(ch, key):
        """Mean over test problems with demonstrations of the share whose key matches (nan: none)."""
        rates = [np.mean([key(pool[i]) == key(t) for i in c]) for t, c in zip(test, ch) if c]
        return float(np.mean(rates)) if rates else float("nan")

    def op(p):
        return p.template.split("_")[0]

    shown = {name: ch for name, ch in choices.items() if name != "zero_shot"}
    same_template = {name: match_rate(ch, lambda p: p.template) for name, ch in shown.items()}
    same_op = {name: match_rate(ch, op) for name, ch in shown.items()}
    distinct = {
        name: len({i for c in ch for i in c}) for name, ch in choices.items() if name != "zero_shot"
    }
    x_norm = np.linalg.norm(SEL.transformed_pool(h_pool, proj, used_form), axis=1)
    diagnostics = {  # why Sim may rank the pool the same way for every test problem
        "h_test_norm_mean": float(np.linalg.norm(h_test, axis=1).mean()),
        "transformed_pool_norm_mean": float(x_norm.mean()),
        "transformed_pool_norm_std": float(x_norm.std()),
        "stab_cv": float(stab.std() / stab.mean()),
        "sim_rank_corr_across_tests": (
            float(np.mean(np.corrcoef(np.argsort(np.argsort(sim, 1), 1))))
            if len(test) > 1
            else float("nan")
        ),
    }
    return {
        "diagnostics": diagnostics,
        "same_operation_rate": same_op,
        "distinct_demos": distinct,
        "n_pool": len(pool),
        "n_test": len(test),
        "lambda": lam,
        "form": used_form,
        "seed": seed,
        "accuracy": accuracy,
        "zero_shot_rate": rejected,
        "same_template_rate": same_template,
        "rejection": [r for k in ks for r in rejection_rates(sim, stab, lams_for_rate, k, tb)],
        "distinct_prompts": len(done),
    }
