"""LMS3: demonstration selection by LLM-oriented semantic similarity x inference stability
(Liu, Huang, Wang, Huang, Zhai, Chen; ICML 2025, arXiv 2412.12157; official code Ljyustc/LMS3),
for any ``pallasite.load`` model.

    from pallasite.eval import lms3
    h_pool = lms3.representations(model, lms3.tokenize_questions(model.tokenizer, pool_questions))
    h_test = lms3.representations(model, lms3.tokenize_questions(model.tokenizer, test_questions))
    sim, stab = lms3.sim_stab(h_test, h_pool, lms3.Projections.from_model(model))
    chosen = lms3.select(sim, stab, k=1, lam=0.01, tiebreak_N=lms3.tiebreak_ranks(pool_questions))
    prompt = lms3.build_prompt(test_questions[0], [(pool_q[i], pool_a[i]) for i in chosen[0]])

Modules: ``representation`` (h at position 127), ``weights`` (last-layer W_q, W_k, W_v; GQA
expansion), ``selection`` (Sim, Stab, Score, rejection, baselines, prompt), ``math_data`` (the
templated pool), ``evaluate`` (end to end accuracy per selector).
"""

from pallasite.eval.lms3.evaluate import complete, rejection_rates, run_selectors
from pallasite.eval.lms3.math_data import Problem, extract_number, make_problems
from pallasite.eval.lms3.representation import MAX_LEN, KeyMaskCache, representations, tokenize_questions
from pallasite.eval.lms3.selection import (Projections, build_prompt, resolve_form, select, select_random,
                                        select_similar, sim_stab, tiebreak_ranks, transformed_pool)
from pallasite.eval.lms3.weights import expand_kv, last_layer_qkv

__all__ = [
    "complete", "rejection_rates", "run_selectors", "Problem", "extract_number", "make_problems",
    "MAX_LEN", "KeyMaskCache", "representations", "tokenize_questions", "Projections", "build_prompt",
    "resolve_form", "select", "select_random", "select_similar", "sim_stab", "tiebreak_ranks",
    "transformed_pool", "expand_kv", "last_layer_qkv",
]
