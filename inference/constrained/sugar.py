"""User-facing sugar: ``pallasite.generate(..., grammar= | json_schema= | regex=)`` and the CLI flags.

``make_generation_config(config, options, tokenizer)`` is what ``pallasite.generate`` calls: it turns
the sugar keywords into ``GenerationConfig.constraint`` and binds every constraint to the model's
tokenizer. ``add_cli_arguments`` / ``cli_options`` give ``pallasite generate`` its ``--grammar FILE``
(Lark, or GBNF/EBNF by extension or syntax), ``--json-schema FILE`` and ``--regex PATTERN``.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from pallasite.inference.constrained.constraint import Constraint, ConstraintError, bind_all

SUGAR = ("grammar", "json_schema", "regex")
EBNF_SUFFIXES = (".gbnf", ".ebnf", ".bnf")


def grammar_kind(text: str, path: Optional[str] = None) -> str:
    """``lark`` or ``ebnf`` for a grammar text (by file suffix, else by syntax)."""
    if path is not None and path.lower().endswith(EBNF_SUFFIXES):
        return "ebnf"
    if path is not None and path.lower().endswith(".lark"):
        return "lark"
    from llguidance.gbnf_to_lark import is_lark_syntax

    return "lark" if is_lark_syntax(text) else "ebnf"


def sugar_constraint(options: dict) -> Optional[Constraint]:
    """Pop ``grammar`` / ``json_schema`` / ``regex`` from ``options``; the Constraint they ask for."""
    given = {k: options.pop(k) for k in SUGAR if k in options}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    if len(given) > 1 or options.get("constraint") is not None:
        names = sorted(given) + (["constraint"] if options.get("constraint") is not None else [])
        raise ConstraintError(
            f"pass one of grammar=, json_schema=, regex=, constraint=; got {names}"
        )
    ((key, source),) = given.items()
    if isinstance(source, Constraint):
        return source
    if key == "grammar":
        if not isinstance(source, str):
            raise ConstraintError(
                f"grammar= takes the grammar text (Lark or GBNF); got {type(source).__name__}"
            )
        return Constraint(grammar_kind(source), source, name="grammar")
    return Constraint(key, source, name=key)


def make_generation_config(config, options: dict, tokenizer):
    """``GenerationConfig.make(config, **options)`` with the constraint sugar applied and bound."""
    from pallasite.inference.config import GenerationConfig

    options = dict(options)
    sugar = sugar_constraint(options)
    if sugar is not None:
        options["constraint"] = sugar
    gen = GenerationConfig.make(config, **options)
    if gen.constraint is None:
        return gen
    if tokenizer is None:
        raise ConstraintError(
            "constrained generation needs the model's tokenizer (this model has none)"
        )
    return gen.replace(constraint=bind_all(gen.constraint, tokenizer))


# ----------------------------------------------------------------------------- CLI


def add_cli_arguments(parser) -> None:
    parser.add_argument(
        "--grammar",
        default=None,
        metavar="FILE",
        help="constrain the completion to a grammar (Lark; .gbnf/.ebnf files: GBNF)",
    )
    parser.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="constrain the completion to JSON valid under this schema",
    )
    parser.add_argument(
        "--regex",
        default=None,
        metavar="PATTERN",
        help="constrain the completion to a full match of this regular expression",
    )


def _read(path: str, flag: str) -> str:
    if not os.path.isfile(path):
        raise ConstraintError(f"pallasite generate: {flag} {path!r} is not a file")
    with open(path) as f:
        return f.read()


def cli_options(args) -> dict:
    """``{"constraint": Constraint}`` from ``--grammar`` / ``--json-schema`` / ``--regex`` (or ``{}``)."""
    grammar, schema = getattr(args, "grammar", None), getattr(args, "json_schema", None)
    regex = getattr(args, "regex", None)
    given = [
        f for f, v in (("--grammar", grammar), ("--json-schema", schema), ("--regex", regex)) if v
    ]
    if len(given) > 1:
        raise ConstraintError(
            f"pallasite generate: pass one of --grammar, --json-schema, --regex; got {given}"
        )
    if regex:
        return {"constraint": Constraint("regex", regex, name="--regex")}
    if grammar:
        text = _read(grammar, "--grammar")
        return {
            "constraint": Constraint(
                grammar_kind(text, grammar), text, name=os.path.basename(grammar)
            )
        }
    if schema:
        text = _read(schema, "--json-schema")
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            raise ConstraintError(
                f"pallasite generate: --json-schema {schema!r} is not JSON: {e}"
            ) from None
        return {"constraint": Constraint("json_schema", text, name=os.path.basename(schema))}
    return {}


__all__ = [
    "make_generation_config",
    "sugar_constraint",
    "grammar_kind",
    "add_cli_arguments",
    "cli_options",
]
