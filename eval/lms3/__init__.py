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


from pallasite.lazy import lazy_exports

_EXPORTS = {
    "complete": "pallasite.eval.lms3.evaluate",
    "rejection_rates": "pallasite.eval.lms3.evaluate",
    "run_selectors": "pallasite.eval.lms3.evaluate",
    "Problem": "pallasite.eval.lms3.math_data",
    "extract_number": "pallasite.eval.lms3.math_data",
    "make_problems": "pallasite.eval.lms3.math_data",
    "MAX_LEN": "pallasite.eval.lms3.representation",
    "KeyMaskCache": "pallasite.eval.lms3.representation",
    "representations": "pallasite.eval.lms3.representation",
    "tokenize_questions": "pallasite.eval.lms3.representation",
    "Projections": "pallasite.eval.lms3.selection",
    "build_prompt": "pallasite.eval.lms3.selection",
    "resolve_form": "pallasite.eval.lms3.selection",
    "select": "pallasite.eval.lms3.selection",
    "select_random": "pallasite.eval.lms3.selection",
    "select_similar": "pallasite.eval.lms3.selection",
    "sim_stab": "pallasite.eval.lms3.selection",
    "tiebreak_ranks": "pallasite.eval.lms3.selection",
    "transformed_pool": "pallasite.eval.lms3.selection",
    "expand_kv": "pallasite.eval.lms3.weights",
    "last_layer_qkv": "pallasite.eval.lms3.weights",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
