"""FOLIO-style task, generated here: natural-language premises and a conclusion, labelled by a solver.

A problem names one or two entities, each possibly through a chain of aliases ("Rex is also
called Buddy. Buddy is also called Max."), states 3-4 premises over unary predicates (rules: "All
cats are furry.", "No cat is wet.", "Everything that is a cat and furry is happy."; facts about an
entity under one of its names: "Max is a cat.", "Max is not wet.", "Max is a cat or a dog.") and
asks whether a conclusion is True, False or Unknown. The gold label is computed by z3 from the gold
formalisation (premises |= conclusion: True; premises |= not conclusion: False; else Unknown).

The model answers as in CRANE's FOLIO setup (Prover9-style program after "Predicates:", the
start delimiter; no end delimiter): reasoning text, then ``Predicates:`` / ``Premises:`` /
``Conclusion:`` sections of formulas with ``{forall}``, ``{exists}``, ``{not}``, ``{and}``, ``{or}``,
``{xor}``, ``{implies}``, ``{iff}`` over canonical entity names. Reasoning helps: the chain of
thought resolves each alias one hop at a time ("Max is buddy. Buddy is rex."), which the program
must use. ``evaluate(program)`` parses the program, runs z3 and returns the label (or None when
it does not parse); ``program_grammar()`` is the llguidance grammar CRANE constrains it with
(CRANE's ``prover9_grammar.lark``, rewritten; comments ``:::`` dropped).
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Optional

START = "Predicates:\n"
LABELS = ("True", "False", "Unknown")
ENTITIES = ("rex", "tom", "ada", "bob", "kim", "lux", "ned", "pia", "sol", "uma")
ALIASES = (
    "buddy",
    "max",
    "coco",
    "duke",
    "echo",
    "fig",
    "gus",
    "hap",
    "iggy",
    "jojo",
    "kip",
    "lulu",
)
# (noun phrase for "is a/an ...", adjective-ish phrase for "is ...", predicate)
NOUNS = (
    ("a cat", "cats", "Cat"),
    ("a dog", "dogs", "Dog"),
    ("a bird", "birds", "Bird"),
    ("a fish", "fish", "Fish"),
    ("a pet", "pets", "Pet"),
    ("a mammal", "mammals", "Mammal"),
)
ADJS = (
    ("furry", "Furry"),
    ("wet", "Wet"),
    ("happy", "Happy"),
    ("loud", "Loud"),
    ("small", "Small"),
    ("fast", "Fast"),
)


@dataclasses.dataclass(frozen=True)
class Problem:
    text: str  # aliases + premises + question
    program: str  # gold formalisation, starting with START
    label: str  # True | False | Unknown
    reasoning: str  # alias resolution, one hop per sentence

    @property
    def cot(self) -> str:
        return f"{self.reasoning}\n{self.program}"


def _name_of(entity: str, depth: int, chain: dict) -> str:
    names = chain[entity]
    return names[min(depth, len(names) - 1)]


def _rule(rng, a, b, negative: bool):
    """'All As are B' / 'No A is B' as (text, formula)."""
    if negative:
        return (
            f"No {a[0][2:]} is {b[0]}.",
            f"{{forall}} x ({a[2]}(x) {{implies}} {{not}} {b[1]}(x))",
        )
    return (f"All {a[1]} are {b[0]}.", f"{{forall}} x ({a[2]}(x) {{implies}} {b[1]}(x))")


def make_problem(rng: random.Random) -> Problem:
    """One problem; its shape aims at a label (a rule applied to a fact, its negation, or neither)
    but the label is always z3's verdict on the gold program."""
    ents = rng.sample(ENTITIES, rng.choice((1, 2)))
    aliases = iter(rng.sample(ALIASES, 2 * len(ents)))
    chain, alias_text = {}, []
    for e in ents:
        names = [e] + [next(aliases) for _ in range(rng.choice((1, 2, 2)))]
        chain[e] = names
        alias_text += [
            f"{a.capitalize()} is also called {b.capitalize()}." for a, b in zip(names, names[1:])
        ]
    nouns, adjs = rng.sample(NOUNS, 3), rng.sample(ADJS, 3)
    e = rng.choice(ents)
    premises, mentioned = [], []

    def fact(ent, text_fn, fol):
        name = _name_of(ent, rng.randint(0, 2), chain)
        mentioned.append(name)
        premises.append((text_fn(name.capitalize()), fol))

    aim = rng.choice(LABELS)
    a, b = nouns[0], adjs[0]
    premises.append(_rule(rng, a, b, negative=(aim == "False")))
    if aim != "Unknown" or rng.random() < 0.5:
        fact(e, lambda n: f"{n} is {a[0]}.", f"{a[2]}({e})")
    # distractors: another rule, another fact (maybe about the other entity)
    c, d = nouns[1], adjs[1]
    if rng.random() < 0.5:
        premises.append(_rule(rng, c, d, negative=rng.random() < 0.5))
    other = rng.choice(ents)
    kind = rng.random()
    if kind < 0.4:
        fact(other, lambda n: f"{n} is {c[0]}.", f"{c[2]}({other})")
    elif kind < 0.7:
        fact(other, lambda n: f"{n} is not {adjs[2][0]}.", f"{{not}} {adjs[2][1]}({other})")
    else:
        fact(
            other,
            lambda n: f"{n} is {c[0]} or {nouns[2][0]}.",
            f"{c[2]}({other}) {{or}} {nouns[2][2]}({other})",
        )
    rng.shuffle(premises)
    target = b if aim != "Unknown" or rng.random() < 0.5 else adjs[2]
    cname = _name_of(e, rng.randint(1, 2), chain)
    mentioned.append(cname)
    concl_nl, concl_fol = f"{cname.capitalize()} is {target[0]}", f"{target[1]}({e})"
    used = sorted({m for _, f in premises for m in re.findall(r"[A-Z]\w*", f)} | {target[1]})
    text = (
        " ".join(alias_text + [t for t, _ in premises])
        + f"\nIs it true, false or unknown that {concl_nl}?"
    )
    program = (
        START
        + "".join(f"{p}(x)\n" for p in used)
        + "Premises:\n"
        + "".join(f + "\n" for _, f in premises)
        + "Conclusion:\n"
        + concl_fol
        + "\n"
    )
    steps = []
    for name in mentioned:
        for names in chain.values():
            if name in names[1:]:
                hops = names[: names.index(name) + 1][::-1]
                steps += [f"{x.capitalize()} is {y}." for x, y in zip(hops, hops[1:])]
    steps = list(dict.fromkeys(steps))  # each hop once, in order of first use
    reasoning = "Let's resolve the names. " + (" ".join(steps) if steps else "No aliases are used.")
    return Problem(text=text, program=program, label=evaluate(program), reasoning=reasoning)


def make_problems(n: int, seed: int, balanced: bool = True) -> list:
    """``n`` problems; ``balanced``: as many of each label as possible (rejection sampling)."""
    rng = random.Random(seed)
    out, per = [], {lab: 0 for lab in LABELS}
    quota = -(-n // 3)
    while len(out) < n:
        p = make_problem(rng)
        if balanced and per[p.label] >= quota:
            continue
        per[p.label] += 1
        out.append(p)
    rng.shuffle(out)
    return out


def prompt(p: Problem) -> str:
    return f"Problem: {p.text}\nAnswer:"


def training_text(p: Problem) -> str:
    return f"{prompt(p)} {p.cot}"


# ----------------------------------------------------------------------------- parsing and solving

_TOKEN = re.compile(
    r"\{forall\}|\{exists\}|\{not\}|\{and\}|\{or\}|\{xor\}|\{implies\}|\{iff\}|[A-Z]\w*|[a-z]\w*"
    r"|[0-9]+|\(|\)|,|\S"
)
_BINARY = (
    ("{iff}", "iff"),
    ("{implies}", "implies"),
    ("{xor}", "xor"),
    ("{or}", "or"),
    ("{and}", "and"),
)


class _Parser:
    def __init__(self, text: str):
        self.toks = _TOKEN.findall(text)
        self.i = 0

    def peek(self):
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want=None):
        t = self.peek()
        if t is None or (want is not None and t != want):
            raise ValueError(f"expected {want or 'a token'} at {self.i}, got {t!r}")
        self.i += 1
        return t

    def formula(self, level=0):
        if self.peek() in ("{forall}", "{exists}"):
            q = self.take()
            var = self.take()
            if not re.fullmatch(r"[a-z]\w*", var):
                raise ValueError(f"bad quantified variable {var!r}")
            self.take("(")
            body = self.formula()
            self.take(")")
            return (q[1:-1], var, body)
        if level == len(_BINARY):
            return self.unary()
        left = self.formula(level + 1)
        op, name = _BINARY[level]
        if self.peek() == op:
            self.take()
            right = self.formula(level)  # right-associative, as the official grammar
            return (name, left, right)
        return left

    def unary(self):
        t = self.peek()
        if t == "{not}":
            self.take()
            return (
                "not",
                self.unary() if self.peek() not in ("{forall}", "{exists}") else self.formula(),
            )
        if t == "(":
            self.take()
            f = self.formula()
            self.take(")")
            return f
        if t is not None and re.fullmatch(r"[A-Z]\w*", t):
            self.take()
            self.take("(")
            args = [self.take()]
            while self.peek() == ",":
                self.take()
                args.append(self.take())
            self.take(")")
            if not all(re.fullmatch(r"[a-z0-9]\w*", a) for a in args):
                raise ValueError(f"bad arguments {args}")
            return ("pred", t, tuple(args))
        raise ValueError(f"unexpected {t!r}")


def parse_formula(text: str):
    p = _Parser(text)
    f = p.formula()
    if p.peek() is not None:
        raise ValueError(f"trailing {p.peek()!r}")
    return f


def parse_program(text: str):
    """(premises, conclusion) formula trees of a program (text from START on), or ValueError."""
    k = text.find(START)
    if k < 0:
        raise ValueError("no 'Predicates:' section")
    body = text[k + len(START) :]
    m = re.match(r"(?s)(.*?)Premises:\n(.*?)Conclusion:\n(.*)", body)
    if not m:
        raise ValueError("missing Premises: / Conclusion: sections")
    decls, prem, concl = m.groups()
    for line in decls.splitlines():
        if line.strip() and not re.fullmatch(
            r"\s*[A-Z]\w*\(\s*[a-z]\w*(\s*,\s*[a-z]\w*)*\s*\)\s*", line
        ):
            raise ValueError(f"bad predicate declaration {line!r}")
    premises = [parse_formula(line) for line in prem.splitlines() if line.strip()]
    concl_lines = [line for line in concl.splitlines() if line.strip()]
    if not premises or len(concl_lines) != 1:
        raise ValueError("need at least one premise and exactly one conclusion")
    return premises, parse_formula(concl_lines[0])


def _to_z3(f, env, preds, obj, bound):
    import z3

    kind = f[0]
    if kind == "pred":
        _, name, args = f
        key = (name, len(args))
        if key not in preds:
            preds[key] = z3.Function(f"{name}_{len(args)}", *([obj] * len(args)), z3.BoolSort())
        terms = [bound[a] if a in bound else env.setdefault(a, z3.Const(a, obj)) for a in args]
        return preds[key](*terms)
    if kind in ("forall", "exists"):
        _, var, body = f
        v = z3.Const(f"{var}_{len(bound)}", obj)
        inner = _to_z3(body, env, preds, obj, {**bound, var: v})
        return z3.ForAll([v], inner) if kind == "forall" else z3.Exists([v], inner)
    if kind == "not":
        return z3.Not(_to_z3(f[1], env, preds, obj, bound))
    a, b = _to_z3(f[1], env, preds, obj, bound), _to_z3(f[2], env, preds, obj, bound)
    return {
        "and": lambda: z3.And(a, b),
        "or": lambda: z3.Or(a, b),
        "xor": lambda: z3.Xor(a, b),
        "implies": lambda: z3.Implies(a, b),
        "iff": lambda: a == b,
    }[kind]()


def label_of(premises, conclusion, timeout_ms: int = 5000) -> str:
    """True / False / Unknown for formula trees, by z3 (two entailment checks)."""
    import z3

    obj = z3.DeclareSort("Obj")
    env, preds = {}, {}
    prem = [_to_z3(p, env, preds, obj, {}) for p in premises]
    concl = _to_z3(conclusion, env, preds, obj, {})

    def entails(goal):
        s = z3.Solver()
        s.set("timeout", timeout_ms)
        s.add(*prem)
        s.add(z3.Not(goal))
        return s.check() == z3.unsat

    if entails(concl):
        return "True"
    if entails(z3.Not(concl)):
        return "False"
    return "Unknown"


def evaluate(text: str) -> Optional[str]:
    """The label a program text (from START on) yields, or None if it does not parse."""
    try:
        premises, conclusion = parse_program(text)
    except ValueError:
        return None
    return label_of(premises, conclusion)


def program_grammar() -> str:
    """The program after (and including) "Predicates:\\n", in llguidance's Lark-like syntax."""
    return "\n".join(
        [
            'start: " "? "Predicates:\\n" decl+ "Premises:\\n" stmt+ "Conclusion:\\n" stmt',
            'decl: PRED "(" NAME ("," NAME)* ")" "\\n"',
            'stmt: formula "\\n"',
            'formula: QUANT NAME "(" formula ")" | iff',
            'iff: imp | imp "{iff}" iff',
            'imp: xor | xor "{implies}" imp',
            'xor: or_ | or_ "{xor}" xor',
            'or_: and_ | and_ "{or}" or_',
            'and_: neg | neg "{and}" and_',
            'neg: "{not}" neg | "{not}" QUANT NAME "(" formula ")" | atom',
            'atom: PRED "(" NAME ("," NAME)* ")" | "(" formula ")"',
            'QUANT: "{forall}" | "{exists}"',
            "PRED: /[A-Z][a-zA-Z0-9]*/",
            "NAME: /[a-z][a-zA-Z0-9_]*/",
            '%ignore " "',
            "",
        ]
    )


__all__ = [
    "Problem",
    "make_problem",
    "make_problems",
    "prompt",
    "training_text",
    "parse_program",
    "label_of",
    "evaluate",
    "program_grammar",
    "START",
    "LABELS",
]
