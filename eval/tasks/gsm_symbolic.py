"""GSM-Symbolic-style task, generated here: symbolic word problems whose answer is an expression.

Like GSM-Symbolic (Mirzadeh et al. 2024) as CRANE uses it (``question_parsed`` / ``answer_parsed``
/ ``variable_types``), each problem is a template whose quantities are variables (``{n}``) and
whose answer is an expression over them (``(n * k - m) // p``). A problem is a chain of 3-5
steps (a start quantity, then buy / lose / multiply / share / pack operations), so the answer is
a nested expression; the chain-of-thought trace writes one ``<< ... >>`` span per step, each
extending the previous one, and ends "The final answer is << ... >>." (the paper's format).
Variable names are drawn per problem (``names="random"``), or are a, b, c, ... in order
(``"positional"``: the answer depends on the operations alone; what a 0.5M-parameter model
trained for minutes can learn). ``make_problems(kind="relations")`` builds multi-hop problems
instead: a chain of people, each count defined from the previous person's, told in shuffled order
(``"relations_restated"``: the same problems, a chain of thought that restates the chain first;
``"relations_many_names"``: those, with the people drawn from 48 names);
``kind="ordinal"`` one person's operations tagged "First, ... Third, ..." and told shuffled.

``equivalent(a, b, types)`` decides expression equivalence with z3 over positive integers (``//``
is floor division, ``%`` its remainder, ``int()`` truncation, as in CRANE's checker), falling back
to 1000 random substitutions with exact rationals when z3 answers unknown or cannot encode the
expression. ``answer_grammar(variables)`` is the answer grammar (CRANE's ``gsm_grammar.lark``,
rewritten for llguidance) with VARIABLE restricted to the problem's variables.
"""

from __future__ import annotations

import ast
import dataclasses
import fractions
import random
import re
from typing import Optional

START, END = "<<", ">>"
NAMES = ("Tom", "Mia", "Ava", "Leo", "Sam", "Zoe", "Max", "Ivy", "Ben", "Eli", "Noa", "Kai")
# kind "relations_many_names": 48 names, NAMES first. With only 12 a small model never learned to
# copy a name (it wrote a plausible one); with many, guessing stops paying (docs/constrained.md)
MANY_NAMES = NAMES + tuple(
    "Ann Bob Cal Dan Eve Fay Gus Hal Ida Jon Kim Lou Meg Ned Oto Pam Quin Ray Sue Ted Uma Val Wes Xia "
    "Yan Zed Amy Bo Cy Di Ed Flo Gia Hu Jo Lia".split()
)
ITEMS = (
    "apples",
    "marbles",
    "stickers",
    "coins",
    "cards",
    "pens",
    "shells",
    "books",
    "eggs",
    "stamps",
)
_VAR_LETTERS = "abcdefghjkmnpqrstuvwxyz"
_RESERVED = {"int", "in", "is", "if", "or", "as", "and", "not", "def", "del", "for"}

# (sentence template, cot template, expression builder, precedence of the result)
_OPS = (
    (
        "{who} buys {v} more {item}.",
        "After buying more, {who} has {span} {item}.",
        lambda q, v: f"{q} + {v}",
        1,
    ),
    (
        "{who} gives {v} {item} to a friend.",
        "After giving some away, {who} has {span} {item}.",
        lambda q, v: f"{q} - {v}",
        1,
    ),
    (
        "{who} loses {v} {item}.",
        "After losing some, {who} has {span} {item}.",
        lambda q, v: f"{q} - {v}",
        1,
    ),
    (
        "Each of the {item} is traded for {v} new ones.",
        "After the trade, {who} has {span} {item}.",
        lambda q, v: f"{q} * {v}",
        2,
    ),
    (
        "{who} shares the {item} equally among {v} friends and keeps one share.",
        "One share is {span} {item}.",
        lambda q, v: f"{q} // {v}",
        2,
    ),
    (
        "{who} packs the {item} into boxes of {v} and keeps the ones left over.",
        "The ones left over are {span} {item}.",
        lambda q, v: f"{q} % {v}",
        2,
    ),
)


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str  # the word problem, variables written as {name}
    variables: tuple  # the problem's variable names (all int)
    answer: str  # gold expression
    steps: tuple  # the expression after each step (the last is the answer)
    cot: str  # chain-of-thought response
    direct: str  # direct response: the answer span only

    @property
    def variable_types(self) -> dict:
        return {v: "int" for v in self.variables}


def _names(rng: random.Random, k: int) -> list:
    out: list = []
    while len(out) < k:
        n = rng.choice(_VAR_LETTERS) + (rng.choice(_VAR_LETTERS + "0123456789") if rng.random() < 0.6 else "")
        if n not in out and n not in _RESERVED:
            out.append(n)
    return out


def _wrap(expr: str, prec: int, need: int) -> str:
    return f"({expr})" if prec < need else expr


def make_problem(rng: random.Random, n_steps: Optional[int] = None, names: str = "random") -> Problem:
    """``names="random"``: variables named per problem; ``"positional"``: a, b, c, ... in order of
    appearance (the answer then depends on the operations alone, not on copying names)."""
    n_ops = n_steps if n_steps is not None else rng.randint(2, 4)
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    if names not in ("random", "positional"):
        raise ValueError(f"names={names!r}; expected random | positional")
    vs = _names(rng, n_ops + 2) if names == "random" else list("abcdefgh"[: n_ops + 2])
    sentences, cot, steps = [], ["Let's think step by step."], []
    if rng.random() < 0.5:
        q, prec = f"{vs[0]} * {vs[1]}", 2
        sentences.append(f"{who} has {{{vs[0]}}} bags with {{{vs[1]}}} {item} each.")
        used = vs[:2]
    else:
        q, prec = vs[0], 3
        sentences.append(f"{who} has {{{vs[0]}}} {item}.")
        used = vs[:1]
    cot.append(f"{who} starts with {START}{q}{END} {item}.")
    steps.append(q)
    rest = vs[len(used) :][:n_ops]
    for v in rest:
        sent, why, build, p = rng.choice(_OPS)
        q = build(_wrap(q, prec, p), v)
        prec = p
        sentences.append(sent.format(who=who, v="{" + v + "}", item=item))
        cot.append(why.format(who=who, span=f"{START}{q}{END}", item=item))
        steps.append(q)
        used.append(v)
    sentences.append(f"How many {item} does {who} have at the end?")
    cot.append(f"The final answer is {START}{q}{END}.")
    return Problem(
        question=" ".join(sentences),
        variables=tuple(used),
        answer=q,
        steps=tuple(steps),
        cot=" ".join(cot),
        direct=f"{START}{q}{END}",
    )


# (sentence template, expression builder, precedence of the result): one person's count from another's
_RELATIONS = (
    ("{who} has {{{v}}} more {item} than {ref}.", lambda q, v: f"{q} + {v}", 1),
    ("{who} has {{{v}}} fewer {item} than {ref}.", lambda q, v: f"{q} - {v}", 1),
    ("{who} has {{{v}}} times as many {item} as {ref}.", lambda q, v: f"{q} * {v}", 2),
    (
        "{who} gets one share when {ref} splits the {item} equally among {{{v}}} friends.",
        lambda q, v: f"{q} // {v}",
        2,
    ),
    (
        "{who} gets the {item} left over when {ref} packs them into boxes of {{{v}}}.",
        lambda q, v: f"{q} % {v}",
        2,
    ),
)


def make_relation_problem(
    rng: random.Random, n_hops: Optional[int] = None, restate: bool = False, names: tuple = NAMES
) -> Problem:
    """A multi-hop problem: a chain of people, each person's count defined from the previous
    one's, told in shuffled order, asking the last person's count. Variables are a, b, c, ... in
    order of appearance in the question, so neither the sentence order nor the names give the
    chain away: the chain of thought resolves it one hop per sentence ("Mia has <<a + c>> pens."),
    the direct answer has to follow every hop before writing the first variable.

    ``restate=True`` (kind ``relations_restated``, the same problems): the chain of thought first
    restates the sentences from the asked person down to the root, each found by the name the
    previous one ends on ("Ivy has {a} more pens than Leo. Leo has {b} times as many pens as
    Tom. Tom has {c} pens."), then writes the spans from the root up ("So Tom has <<c>> pens. So
    Leo has <<c * b>> pens. ..."): every step is one name lookup and a copy. ``names``: the pool
    the people are drawn from (``MANY_NAMES`` for kind ``relations_many_names``)."""
    hops = n_hops if n_hops is not None else rng.randint(2, 4)
    people, item = rng.sample(names, hops + 1), rng.choice(ITEMS)
    # slots: per sentence the variable ids it mentions (ids are renamed by first appearance later)
    root_bags = rng.random() < 0.5
    root = (
        (f"{people[0]} has {{v0}} bags with {{v1}} {item} each.", (0, 1))
        if root_bags
        else (f"{people[0]} has {{v0}} {item}.", (0,))
    )
    relations, var_id = [], len(root[1])
    for i in range(1, hops + 1):
        relations.append((rng.choice(_RELATIONS), var_id, i))
        var_id += 1
    order = list(range(hops + 1))
    rng.shuffle(order)
    sentences_with_ids, hop_of_sentence = [], []
    for k in order:
        hop_of_sentence.append(k)
        if k == 0:
            sentences_with_ids.append(root)
        else:
            (template, _, _), vid, i = relations[k - 1]
            sent = template.format(who=people[i], ref=people[i - 1], item=item, v=f"v{vid}")
            sentences_with_ids.append((sent, (vid,)))
    letter: dict = {}
    for _, ids in sentences_with_ids:
        for vid in ids:
            letter.setdefault(vid, "abcdefgh"[len(letter)])
    names_of = {f"v{vid}": letter[vid] for vid in letter}
    sentences = [sent.format(**{k: "{" + v + "}" for k, v in names_of.items()}) for sent, _ in sentences_with_ids]
    q, prec = (f"{letter[0]} * {letter[1]}", 2) if root_bags else (letter[0], 3)
    steps = [q]
    cot = ["Let's think step by step."]
    if restate:
        by_hop = dict(zip(hop_of_sentence, sentences))
        cot += [by_hop[k] for k in range(hops, -1, -1)]
    so = "So " if restate else ""
    cot.append(f"{so}{people[0]} has {START}{q}{END} {item}.")
    for (_, build, p), vid, i in relations:
        q = build(_wrap(q, prec, p), letter[vid])
        prec = p
        steps.append(q)
        cot.append(f"{so}{people[i]} has {START}{q}{END} {item}.")
    sentences.append(f"How many {item} does {people[-1]} have?")
    cot.append(f"The final answer is {START}{q}{END}.")
    return Problem(
        question=" ".join(sentences),
        variables=tuple(sorted(letter.values())),
        answer=q,
        steps=tuple(steps),
        cot=" ".join(cot),
        direct=f"{START}{q}{END}",
    )


ORDINALS = ("First", "Second", "Third", "Fourth", "Fifth")


def _lower_first(sentence: str) -> str:
    return sentence[0].lower() + sentence[1:] if sentence.startswith("Each") else sentence


def make_ordinal_problem(rng: random.Random, n_steps: Optional[int] = None) -> Problem:
    """A chain of operations told out of order: after the start sentence, each operation
    sentence is tagged with its place ("Third, Tom loses {b} apples.") and the sentences come
    shuffled; variables are a, b, c, ... in order of appearance, so neither the text order nor the
    letters give the order of the operations away. The chain of thought walks the operations in
    order, restating each tagged sentence before its span ("Second, <the sentence>. So Tom has
    <<(a + c) * d>> apples."): every step is a copy of one sentence and one local rewrite. The
    direct answer has to sort the operations and place every parenthesis before its first token."""
    n_ops = n_steps if n_steps is not None else rng.randint(2, 4)
    who, item = rng.choice(NAMES), rng.choice(ITEMS)
    bags = rng.random() < 0.5
    n_start = 2 if bags else 1
    start = f"{who} has {{a}} bags with {{b}} {item} each." if bags else f"{who} has {{a}} {item}."
    ops = [rng.choice(_OPS) for _ in range(n_ops)]
    order = list(range(n_ops))
    rng.shuffle(order)
    # variable ids: the start's, then one per operation; letters by appearance in the question
    letter = {i: "abcdefgh"[i] for i in range(n_start)}
    for k in order:
        letter[n_start + k] = "abcdefgh"[len(letter)]
    op_sentence = [
        f"{ORDINALS[k]}, " + _lower_first(ops[k][0].format(who=who, v="{" + letter[n_start + k] + "}", item=item))
        for k in range(n_ops)
    ]
    sentences = [start] + [op_sentence[k] for k in order]
    sentences.append(f"How many {item} does {who} have at the end?")
    q, prec = ("a * b", 2) if bags else ("a", 3)
    steps = [q]
    cot = ["Let's think step by step.", f"{who} starts with {START}{q}{END} {item}."]
    for k in range(n_ops):
        _, _, build, p = ops[k]
        q = build(_wrap(q, prec, p), letter[n_start + k])
        prec = p
        steps.append(q)
        cot.append(f"{op_sentence[k]} So {who} has {START}{q}{END} {item}.")
    cot.append(f"The final answer is {START}{q}{END}.")
    return Problem(
        question=" ".join(sentences),
        variables=tuple("abcdefgh"[: len(letter)]),
        answer=q,
        steps=tuple(steps),
        cot=" ".join(cot),
        direct=f"{START}{q}{END}",
    )


KINDS = ("steps", "relations", "relations_restated", "relations_many_names", "ordinal")
# the kinds whose chain of thought restates the chain, asked person first, before any span
RESTATING_KINDS = ("relations_restated", "relations_many_names")
# new tokens a trained model needs for a chain of thought of each kind (the ordinal kind restates
# every sentence)
COT_TOKENS = {"steps": 160, "relations": 160, "relations_restated": 320, "relations_many_names": 320, "ordinal": 320}


def make_problems(n: int, seed: int, names: str = "random", kind: str = "steps") -> list:
    """``kind="steps"``: one person, a chain of operations in order (``make_problem``);
    ``"relations"``: a shuffled multi-hop chain of people (``make_relation_problem``), and
    ``"relations_restated"`` the same problems with the restating chain of thought, and
    ``"relations_many_names"`` those problems with people drawn from 48 names (``MANY_NAMES``);
    ``"ordinal"``: one person's operations, tagged with their places and shuffled
    (``make_ordinal_problem``)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {KINDS}")
    rng = random.Random(seed)
    if kind == "relations_many_names":
        return [make_relation_problem(rng, restate=True, names=MANY_NAMES) for _ in range(n)]
    if kind in ("relations", "relations_restated"):
        return [make_relation_problem(rng, restate=kind == "relations_restated") for _ in range(n)]
    if kind == "ordinal":
        return [make_ordinal_problem(rng) for _ in range(n)]
    return [make_problem(rng, names=names) for _ in range(n)]


# ----------------------------------------------------------------------------- prompts

DIRECT_CUE = "Answer with the expression only."
COT_CUE = "Think step by step."


def prompt(p: Problem, cot: bool) -> str:
    return f"Question: {p.question}\n{COT_CUE if cot else DIRECT_CUE}\nAnswer:"


def training_text(p: Problem, cot: bool) -> str:
    return f"{prompt(p, cot)} {p.cot if cot else p.direct}"


# ----------------------------------------------------------------------------- answers


def last_span(text: str) -> Optional[str]:
    """The last ``<< ... >>`` span's inside (CRANE's extraction), or None."""
    e = text.rfind(END)
    s = text.rfind(START, 0, e) if e >= 0 else -1
    if s < 0:
        return None
    return text[s + len(START) : e].strip()


_ALLOWED_BIN = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)


def parses(expr: Optional[str]) -> bool:
    """Is ``expr`` a sentence of the answer grammar (+ - * / // %, unary -, int(), names, numbers)?"""
    if expr is None or "**" in expr:
        return False
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return False

    def ok(n) -> bool:
        if isinstance(n, ast.BinOp):
            return isinstance(n.op, _ALLOWED_BIN) and ok(n.left) and ok(n.right)
        if isinstance(n, ast.UnaryOp):
            return isinstance(n.op, ast.USub) and ok(n.operand)
        if isinstance(n, ast.Call):
            return (
                isinstance(n.func, ast.Name)
                and n.func.id == "int"
                and len(n.args) == 1
                and not n.keywords
                and ok(n.args[0])
            )
        if isinstance(n, ast.Name):
            return n.id != "int"
        return isinstance(n, ast.Constant) and type(n.value) in (int, float)

    return ok(tree)


def variables_in(expr: str) -> set:
    return set(re.findall(r"\b[A-Za-z_]\w*\b", expr)) - {"int"}


def _z3_term(node, env):
    import z3

    if isinstance(node, ast.BinOp):
        a, b = _z3_term(node.left, env), _z3_term(node.right, env)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if isinstance(node.op, ast.Div):
            return a / b
        if isinstance(node.op, ast.FloorDiv):
            return z3.ToReal(z3.ToInt(a / b))  # floor
        if isinstance(node.op, ast.Mod):
            return a - b * z3.ToReal(z3.ToInt(a / b))
    if isinstance(node, ast.UnaryOp):
        return -_z3_term(node.operand, env)
    if isinstance(node, ast.Call):  # int(): truncation toward zero
        x = _z3_term(node.args[0], env)
        return z3.If(x >= 0, z3.ToReal(z3.ToInt(x)), -z3.ToReal(z3.ToInt(-x)))
    if isinstance(node, ast.Name):
        return env[node.id]
    if isinstance(node, ast.Constant):
        return z3.RealVal(str(node.value))
    raise ValueError(f"cannot encode {ast.dump(node)}")


def _evaluate(node, values):
    F = fractions.Fraction
    if isinstance(node, ast.BinOp):
        a, b = _evaluate(node.left, values), _evaluate(node.right, values)
        op = node.op
        if isinstance(op, ast.Add):
            return a + b
        if isinstance(op, ast.Sub):
            return a - b
        if isinstance(op, ast.Mult):
            return a * b
        if isinstance(op, ast.Div):
            return F(a) / F(b)
        if isinstance(op, ast.FloorDiv):
            return F(a) // F(b)
        return F(a) % F(b)
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand, values)
    if isinstance(node, ast.Call):
        return F(int(_evaluate(node.args[0], values)))
    if isinstance(node, ast.Name):
        return values[node.id]
    return F(str(node.value))


def random_equivalent(a: str, b: str, names, trials: int = 1000, seed: int = 0) -> bool:
    """Equal on ``trials`` random positive-integer substitutions (zero divisions skipped)."""
    rng = random.Random(seed)
    ta, tb = ast.parse(a, mode="eval").body, ast.parse(b, mode="eval").body
    for _ in range(trials):
        vals = {n: fractions.Fraction(rng.randint(1, 100)) for n in names}
        try:
            if _evaluate(ta, vals) != _evaluate(tb, vals):
                return False
        except ZeroDivisionError:
            continue
    return True


def equivalent(a: Optional[str], b: str, variable_types: dict, *, timeout_ms: int = 5000) -> bool:
    """Is expression ``a`` equal to ``b`` for every assignment of positive integers to the variables?
    Refuted by random substitution first; proved by z3 (random substitution again if z3 answers
    unknown)."""
    if not parses(a) or not parses(b):
        return False
    names = variables_in(a) | variables_in(b)
    if any(variable_types.get(n) != "int" for n in names):
        return False  # a variable the problem does not declare
    if not random_equivalent(a, b, names, trials=200):
        # a counterexample settles it: z3 on nonlinear // and % can take its whole timeout to
        # answer unknown, so it is asked only to prove what substitution cannot refute
        return False
    import z3

    env = {n: z3.Real(n) for n in names}
    solver = z3.Solver()
    solver.set("timeout", timeout_ms)
    for n, v in env.items():
        solver.add(v >= 1, z3.IsInt(v))
    try:
        solver.add(_z3_term(ast.parse(a, mode="eval").body, env) != _z3_term(ast.parse(b, mode="eval").body, env))
    except (ValueError, z3.Z3Exception):
        return random_equivalent(a, b, names)
    result = solver.check()
    if result == z3.unsat:
        return True
    if result == z3.sat:
        return False
    return random_equivalent(a, b, names)


# ----------------------------------------------------------------------------- grammar


def answer_grammar(variables=None) -> str:
    """The answer span ``<< expr >>`` (CRANE's gsm_grammar.lark in llguidance's syntax). With
    ``variables``, VARIABLE admits only those names (the semantic check CRANE's driver enforces
    by backtracking, here by the grammar)."""
    if variables:
        var = "VARIABLE: " + " | ".join(f'"{v}"' for v in sorted(variables, key=lambda s: (-len(s), s)))
    else:
        var = "VARIABLE: /[a-zA-Z_][a-zA-Z0-9_]*/"
    return "\n".join(
        [
            'start: " "? "<<" expr ">>"',  # the leading space: llguidance ignores " " only between lexemes
            'expr: expr "+" term | expr "-" term | term',
            'term: term "*" factor | term "/" factor | term "//" factor | term "%" factor | factor',
            'factor: "-" factor | "int" "(" expr ")" | primary',
            'primary: NUMBER | VARIABLE | "(" expr ")"',
            var,
            "NUMBER: /[0-9]+(\\.[0-9]+)?/",
            '%ignore " "',
            "",
        ]
    )


__all__ = [
    "Problem",
    "make_problem",
    "make_problems",
    "make_relation_problem",
    "KINDS",
    "RESTATING_KINDS",
    "NAMES",
    "MANY_NAMES",
    "prompt",
    "training_text",
    "last_span",
    "parses",
    "equivalent",
    "random_equivalent",
    "answer_grammar",
    "variables_in",
    "START",
    "END",
    "DIRECT_CUE",
    "COT_CUE",
]
