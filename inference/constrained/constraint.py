"""``Constraint``: what a generation (or one row of it) must produce, and its compiled form.

    Constraint("lark", grammar_text)                        # the whole completion is a sentence
    Constraint("json_schema", {"type": "object", ...})
    Constraint("lark", answer_grammar, start="<<", end=">>")   # CRANE: only the << ... >> spans

A constraint names a registered kind (``pallasite.registry.CONSTRAINT``: lark | ebnf | json_schema
| regex) and its source; ``start`` (and ``end``) turn it into CRANE spans (free text outside them).
``tokenizer`` binds it to a vocabulary (``pallasite.generate`` binds the model's). ``compiled(c,
vocab)`` compiles once per (constraint, vocabulary) and keeps the small per-grammar tables the span
rows need (tokens that contain S, tokens whose S-straddle does not parse).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import weakref
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from pallasite.inference.constrained.grammars import ConstraintError, compile_grammar, span_grammar
from pallasite.registry import CONSTRAINT, config_from_mapping


@dataclasses.dataclass(frozen=True)
class Constraint:
    kind: str  # lark | ebnf | json_schema | regex (any registered CONSTRAINT kind)
    source: Any  # grammar text, JSON schema (dict or text), or regex
    name: str = ""  # shown in errors (e.g. the grammar's file name)
    start: Optional[str] = None  # CRANE start delimiter; None: the whole completion is constrained
    end: Optional[str] = None  # CRANE end delimiter; None with ``start``: constrained to the end
    tokenizer: Any = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        CONSTRAINT.check(self.kind, field="Constraint.kind")
        if isinstance(self.source, (dict, list)):  # canonical text keeps the constraint hashable
            object.__setattr__(self, "source", json.dumps(self.source, sort_keys=True))
        if not isinstance(self.source, str) or not self.source.strip():
            raise ConstraintError(
                f"Constraint {self.name or self.kind!r}: source must be non-empty text "
                f"(or a dict for json_schema); got {self.source!r:.80}"
            )
        for field in ("start", "end"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str) or not v):
                raise ConstraintError(
                    f"Constraint.{field} must be a non-empty string or None; got {v!r}"
                )
        if self.end is not None and self.start is None:
            raise ConstraintError(
                "Constraint.end needs a start delimiter (spans run from start to end)"
            )

    @property
    def spans(self) -> bool:
        return self.start is not None

    def bind(self, tokenizer) -> "Constraint":
        """This constraint bound to ``tokenizer`` (unchanged when already bound)."""
        return (
            self if self.tokenizer is not None else dataclasses.replace(self, tokenizer=tokenizer)
        )

    def replace(self, **changes) -> "Constraint":
        return dataclasses.replace(self, **changes)


def as_constraint(
    value: Any, *, where: str = "GenerationConfig.constraint"
) -> Optional[Constraint]:
    if value is None or isinstance(value, Constraint):
        return value
    if isinstance(value, Mapping):
        try:
            return config_from_mapping(Constraint, value, where=where)
        except TypeError as e:
            raise ConstraintError(f"{where}: {e}") from None
    raise ConstraintError(
        f"{where} must be a Constraint, a mapping of its fields or None; got {type(value).__name__}"
    )


def normalize(value: Any, *, where: str = "GenerationConfig.constraint"):
    """None | Constraint | tuple (one Constraint-or-None per prompt), validated."""
    if isinstance(value, (list, tuple)):
        return tuple(as_constraint(v, where=f"{where}[{i}]") for i, v in enumerate(value))
    return as_constraint(value, where=where)


def per_row(value, n_rows: int) -> list:
    """The constraint of each of ``n_rows`` prompts."""
    if isinstance(value, tuple):
        if len(value) != n_rows:
            raise ConstraintError(
                f"GenerationConfig.constraint has {len(value)} entries for {n_rows} prompts; "
                "give one constraint (or None) per prompt, or a single one for all"
            )
        return list(value)
    return [value] * n_rows


def bind_all(value, tokenizer):
    """``value`` (as ``normalize`` returns it) with every unbound constraint bound to ``tokenizer``."""
    if isinstance(value, tuple):
        return tuple(None if c is None else c.bind(tokenizer) for c in value)
    return None if value is None else value.bind(tokenizer)


# ----------------------------------------------------------------------------- compiled form


class CompiledConstraint:
    """A constraint compiled for one vocabulary (grammar strings + the span rows' cached tables)."""

    def __init__(self, constraint: Constraint, vocab):
        self.constraint, self.vocab = constraint, vocab
        name = constraint.name
        self.grammar = compile_grammar(constraint.kind, constraint.source, vocab, name=name)
        self.start = constraint.start.encode() if constraint.start else None
        self.end = constraint.end.encode() if constraint.end else None
        if self.start is not None and self.end is not None:
            self.span_grammar = span_grammar(self.grammar)
        else:
            self.span_grammar = self.grammar
        if self.start is not None:
            _check_span_start(self, name or constraint.kind)
        self.bad_straddlers: dict = {}  # free-text tail key -> token ids whose S-straddle fails
        self._candidates: dict = {}
        self.ids_with_start = (
            vocab.ids_containing(self.start) if self.start else np.zeros(0, np.int64)
        )

    def straddle_candidates(self, key: tuple) -> np.ndarray:
        """Tokens that complete S after a free text ending in S[:j] (j in ``key``) or contain S."""
        if key not in self._candidates:
            parts = [self.ids_with_start] + [
                self.vocab.ids_starting_with(self.start[j:]) for j in key
            ]
            self._candidates[key] = (
                np.unique(np.concatenate(parts)) if parts else self.ids_with_start
            )
        return self._candidates[key]


def _check_span_start(c: CompiledConstraint, what: str) -> None:
    """A span's matcher is seeded with the start delimiter (CRANE's grammars begin with ``<<``):
    a grammar that rejects it could never open a span, so say so now rather than at every span."""
    import llguidance

    ids = c.vocab.encode_bytes(c.start)
    if llguidance.LLMatcher(c.vocab.ll, c.span_grammar, log_level=0).validate_tokens(ids) != len(ids):
        raise ConstraintError(
            f"constraint {what!r}: a span grammar must begin with its start delimiter "
            f"{c.start.decode(errors='replace')!r} (each span is parsed from the delimiter on, as "
            "CRANE's grammars begin with '<<'); this grammar rejects it"
        )


_COMPILED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
MAX_COMPILED_PER_VOCAB = 512


def compiled(constraint: Constraint, vocab) -> CompiledConstraint:
    """``CompiledConstraint`` of ``constraint`` for ``vocab``, cached (LRU per vocabulary)."""
    cache = _COMPILED.setdefault(vocab, collections.OrderedDict())
    hit = cache.get(constraint)
    if hit is not None:
        cache.move_to_end(constraint)
        return hit
    c = CompiledConstraint(constraint, vocab)
    cache[constraint] = c
    while len(cache) > MAX_COMPILED_PER_VOCAB:
        cache.popitem(last=False)
    return c


def constraint_kinds() -> Sequence[str]:
    return CONSTRAINT.names()


__all__ = [
    "Constraint",
    "CompiledConstraint",
    "ConstraintError",
    "as_constraint",
    "normalize",
    "per_row",
    "bind_all",
    "compiled",
    "constraint_kinds",
]
