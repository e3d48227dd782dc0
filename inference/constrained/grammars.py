"""Constraint kinds (``pallasite.registry.CONSTRAINT``): source text -> an llguidance grammar.

    lark         llguidance's Lark-like syntax (what CRANE's SynCode grammars are written in,
                 less Lark's terminal priorities, which llguidance does not support)
    ebnf         GBNF / EBNF as llama.cpp writes it (converted by llguidance's gbnf_to_lark)
    json_schema  a JSON Schema (dict or JSON text)
    regex        a regular expression (Rust ``regex`` syntax)

``compile_grammar(kind, source, vocab, name=...)`` returns the grammar string an ``LLMatcher``
takes, after checking it against the vocabulary; a grammar that does not compile raises
``ConstraintError`` naming the constraint and quoting llguidance's message.
``span_grammar(g)`` is ``g`` followed by free text (CRANE spans: the characters a token carries
past the end delimiter belong to the free text after the span).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from pallasite.errors import InputError
from pallasite.registry import CONSTRAINT


class ConstraintError(InputError):
    """A constraint that does not compile, or bad constraint input (the message names it); a
    ``ValueError`` and one of the user errors ``pallasite`` (the CLI) reports in one line."""


def _lark(source: Any) -> str:
    import llguidance

    if not isinstance(source, str):
        raise ConstraintError(
            f"a lark constraint takes the grammar text; got {type(source).__name__}"
        )
    return llguidance.LLMatcher.grammar_from_lark(source)


def _ebnf(source: Any) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    if not isinstance(source, str):
        raise ConstraintError(
            f"an ebnf constraint takes the grammar text; got {type(source).__name__}"
        )
    try:
        lark = any_to_lark(source)
    except Exception as e:  # the converter raises plain exceptions on GBNF syntax errors
        raise ConstraintError(f"GBNF -> Lark conversion failed: {e}") from None
    return llguidance.LLMatcher.grammar_from_lark(lark)


def _json_schema(source: Any) -> str:
    import llguidance

    if isinstance(source, str):
        try:
            source = json.loads(source)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"a json_schema constraint must be JSON; {e}") from None
    if not isinstance(source, (dict, bool)):
        raise ConstraintError(
            f"a JSON schema must be an object (or true/false); got {type(source).__name__}"
        )
    return llguidance.LLMatcher.grammar_from_json_schema(source)


def _regex(source: Any) -> str:
    import llguidance

    if not isinstance(source, str):
        raise ConstraintError(
            f"a regex constraint takes the pattern text; got {type(source).__name__}"
        )
    return llguidance.LLMatcher.grammar_from_regex(source)


for _kind, _fn in (
    ("lark", _lark),
    ("ebnf", _ebnf),
    ("json_schema", _json_schema),
    ("regex", _regex),
):
    CONSTRAINT.register(_kind, _fn)


def to_llguidance(kind: str, source: Any) -> str:
    """The llguidance grammar of ``source`` read as ``kind`` (not yet checked against a vocabulary)."""
    fn: Callable[[Any], str] = CONSTRAINT.get(kind, field="constraint kind")
    return fn(source)


def check_grammar(grammar: str, vocab, *, what: str) -> str:
    """``grammar`` if llguidance compiles it for ``vocab``; else ``ConstraintError`` naming ``what``."""
    import llguidance

    err = llguidance.LLMatcher.validate_grammar(grammar, vocab.ll)
    if err:
        raise ConstraintError(f"{what} does not compile (llguidance): {err.strip()}")
    return grammar


def compile_grammar(kind: str, source: Any, vocab, *, name: str = "") -> str:
    what = f"{kind} constraint {name!r}" if name else f"{kind} constraint"
    try:
        grammar = to_llguidance(kind, source)
    except ConstraintError as e:
        raise ConstraintError(f"{what}: {e}") from None
    return check_grammar(grammar, vocab, what=what)


def span_grammar(grammar: str) -> str:
    """``grammar`` then any text: llguidance composes the two through a named sub-grammar."""
    top = "start: @span FREE_TAIL\nFREE_TAIL: /(.|\\n)*/\n"
    inner = (
        json.loads(grammar)["grammars"]
        if grammar.lstrip().startswith("{")
        else [{"lark_grammar": grammar}]
    )
    if len(inner) != 1:
        raise ConstraintError(
            "a span constraint needs a single grammar (not a list of sub-grammars)"
        )
    return json.dumps({"grammars": [{"lark_grammar": top}, {**inner[0], "name": "span"}]})


__all__ = ["ConstraintError", "to_llguidance", "check_grammar", "compile_grammar", "span_grammar"]
