"""The CRANE tasks: z3 equivalence (floor //, counterexamples, the random fallback), FOLIO labels by
z3, and the answer grammars accepting every gold answer / program (and rejecting what they must)."""

import random

from pallasite.eval.tasks import folio, traces
from pallasite.eval.tasks import gsm_symbolic as G
from pallasite.inference.constrained import Constraint, HostSession, TokenBytes

BYTES = TokenBytes(
    tuple(bytes([i]) for i in range(256)) + (b"<eos>",), eos_token_id=256, special_ids=(256,)
)
INT = {v: "int" for v in "abcdxy"}


def _accepts(grammar: str, text: str) -> bool:
    """Does the grammar accept ``text`` exactly (byte vocabulary, then eos)?"""
    row = HostSession([Constraint("lark", grammar, tokenizer=BYTES)], (256,)).rows[0]
    for b in text.encode():
        if not row.valid(b):
            return False
        row.consume(b)
    return row.valid(256)


def test_z3_equivalence_with_floor_semantics():
    assert G.equivalent("(a * b - c) // d", "(b*a - c)//d", INT)
    assert G.equivalent("a // b * b + a % b", "a", INT)  # floor division identity
    assert G.equivalent("int(a / b)", "a // b", INT)  # positive operands: trunc == floor
    assert not G.equivalent("int((a - b) / c)", "(a - b) // c", INT)  # negative: trunc != floor
    assert not G.equivalent("a * b - c // d", "(a * b - c) // d", INT)
    assert not G.equivalent("a + 1", "a", INT)
    assert not G.equivalent("a + q", "a + q", INT)  # q is not a declared variable
    assert not G.equivalent("a ** 2", "a * a", INT) and not G.equivalent(None, "a", INT)


def test_random_substitution_fallback_and_its_negative_control():
    assert G.random_equivalent("(a + b) * (a - b)", "a * a - b * b", ["a", "b"])
    assert not G.random_equivalent("(a + b) * (a - b)", "a * a - b * b + a // 50", ["a", "b"])


def test_generated_gsm_problems_grammar_and_traces():
    rng = random.Random(0)
    for _ in range(20):
        p = G.make_problem(rng)
        assert G.equivalent(p.answer, p.answer, p.variable_types)
        assert G.last_span(p.cot) == p.answer and G.last_span(p.direct) == p.answer
        grammar = G.answer_grammar(p.variables)
        for step in p.steps:
            assert _accepts(grammar, f"<<{step}>>")
    g = G.answer_grammar(["a", "ab"])
    assert (
        _accepts(g, "<<int(ab // 2) - a>>")
        and not _accepts(g, "<<b>>")
        and not _accepts(g, "<<a ** 2>>")
    )
    assert len(traces.texts("gsm", 3)) == 6


def test_folio_labels_by_z3():
    prog = (
        "Predicates:\nCat(x)\nFurry(x)\nPremises:\n{forall} x (Cat(x) {implies} Furry(x))\nCat(rex)\n"
        "Conclusion:\n"
    )
    assert folio.evaluate(prog + "Furry(rex)\n") == "True"
    assert folio.evaluate(prog + "{not} Furry(rex)\n") == "False"
    assert folio.evaluate(prog + "Furry(tom)\n") == "Unknown"
    assert folio.evaluate(prog.replace("Cat(rex)", "Cat(rex") + "Furry(rex)\n") is None
    assert (
        folio.evaluate(
            "Predicates:\nP(x)\nPremises:\n{exists} x (P(x))\nConclusion:\n"
            "{not} {forall} x ({not} P(x))\n"
        )
        == "True"
    )


def test_folio_problems_are_balanced_and_the_program_grammar_accepts_them():
    ps = folio.make_problems(12, 5)
    assert sorted(p.label for p in ps) == sorted(folio.LABELS * 4)
    g = folio.program_grammar()
    for p in ps[:6]:
        assert folio.evaluate(p.program) == p.label
        assert _accepts(g, p.program)
    assert not _accepts(
        g, "Predicates:\nCat(x)\nPremises:\nCat(rex) {and}\nConclusion:\nCat(rex)\n"
    )
