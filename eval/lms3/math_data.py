"""Templated math word problems with numeric answers (MAWPS-like), generated here.

Twelve one-operation templates, four each for +, - and * with different wordings (and some
wordings shared across operations: "has ... and ... has" is a subtraction), random names,
objects and single-digit operands -- small enough that SmolLM2-135M can compute them once a
demonstration shows which operation to write. A demonstration's answer is its one-line solution
"a op b = c" (GSM8K-style; MAWPS' ``str(answer)`` alone gives SmolLM2 nothing to imitate);
``extract_number`` reads a completion's last number on its first non-empty line.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import numpy as np

NAMES = (
    "Ava",
    "Ben",
    "Chloe",
    "Dan",
    "Emma",
    "Finn",
    "Grace",
    "Hugo",
    "Ivy",
    "Jack",
    "Kira",
    "Leo",
    "Maya",
    "Noah",
    "Olga",
    "Paul",
    "Rosa",
    "Sam",
    "Tara",
    "Umar",
)
OBJECTS = (
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "books",
    "cookies",
    "stamps",
    "shells",
    "cards",
    "balloons",
)
ITEMS = ("notebook", "toy car", "sandwich", "ticket", "plant", "puzzle")


@dataclasses.dataclass(frozen=True)
class Problem:
    question: str
    answer: int
    solution: str  # "a op b = c"
    template: str


def _add(r):
    return (r.integers(2, 10), r.integers(2, 10)), "+"


def _sub(r):
    b = r.integers(2, 10)
    return (b + r.integers(2, 10), b), "-"


def _mul(r):
    return (r.integers(2, 10), r.integers(2, 10)), "*"


# name -> (operand sampler, wording with {n}, {n2}, {o}, {it}, {a}, {b})
TEMPLATES = {
    "add_gift": (
        _add,
        "{n} has {a} {o}. {n2} gives {n} {b} more {o}. How many {o} does {n} have now?",
    ),
    "add_places": (
        _add,
        "There are {a} {o} on the table and {b} {o} in the bag. How many {o} are there altogether?",
    ),
    "add_age": (_add, "{n} is {a} years old. {n2} is {b} years older than {n}. How old is {n2}?"),
    "add_walk": (
        _add,
        "{n} walked {a} miles in the morning and {b} miles in the evening. "
        "How many miles did {n} walk?",
    ),
    "sub_give": (
        _sub,
        "{n} had {a} {o}. {n} gave {b} of them to {n2}. How many {o} does {n} have left?",
    ),
    "sub_shelf": (
        _sub,
        "A shelf holds {a} books. {b} books are taken away. How many books are left on the shelf?",
    ),
    "sub_spend": (
        _sub,
        "{n} has {a} dollars and spends {b} dollars on a {it}. "
        "How many dollars does {n} have left?",
    ),
    "sub_compare": (
        _sub,
        "{n} has {a} {o} and {n2} has {b} {o}. How many more {o} does {n} have than {n2}?",
    ),
    "mul_boxes": (
        _mul,
        "There are {a} boxes with {b} {o} in each box. How many {o} are there in total?",
    ),
    "mul_price": (_mul, "One {it} costs {a} dollars. How many dollars do {b} of them cost?"),
    "mul_speed": (
        _mul,
        "A train travels {a} miles every hour. How many miles does it travel in {b} hours?",
    ),
    "mul_pages": (_mul, "{n} reads {a} pages every day. How many pages does {n} read in {b} days?"),
}
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def make_problems(n: int, seed: int = 0, exclude: Optional[set] = None) -> list[Problem]:
    """``n`` distinct problems (templates uniform), none of whose text is in ``exclude``."""
    r = np.random.default_rng(seed)
    names = list(TEMPLATES)
    seen = set(exclude or ())
    out: list[Problem] = []
    for _ in range(200 * n + 1000):
        if len(out) == n:
            break
        t = names[r.integers(len(names))]
        sampler, text = TEMPLATES[t]
        (a, b), op = sampler(r)
        n1, n2 = r.choice(NAMES, 2, replace=False)
        q = text.format(n=n1, n2=n2, o=r.choice(OBJECTS), it=r.choice(ITEMS), a=a, b=b)
        if q not in seen:
            seen.add(q)
            c = _OPS[op](int(a), int(b))
            out.append(Problem(q, c, f"{a} {op} {b} = {c}", t))
    if len(out) < n:
        raise ValueError(
            f"make_problems: could only draw {len(out)} distinct problems, asked for {n}"
        )
    return out


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def extract_number(completion: str) -> Optional[float]:
    """The last number on the first non-empty line of ``completion`` (None if there is none)."""
    for line in completion.split("\n"):
        if line.strip():
            nums = _NUMBER.findall(line)
            return float(nums[-1].replace(",", "")) if nums else None
    return None
