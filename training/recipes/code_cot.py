"""Code-first vs CoT-first SFT for program synthesis (Liu et al., ICML 2025; recipes.md §1), as the
``code_cot`` data kind with a synthetic generator of {instruction, cot, code} samples.

A spec composes 2–4 operations: 1–3 list -> list steps (reverse, sort, keep even/odd, keep > k,
add k, multiply by k, drop / take the first k, square) and optionally a final reduction (sum, max,
min, count, first). The instruction states the steps in words; the CoT is the plan plus a worked
trace on an example list; the code is ``def f(xs):`` with one line per step. Hidden I/O
tests (5 random lists) decide correctness. Targets (response-only loss, prompt masked):

    code_only    ```python\\n{code}\\n```
    cot_first    {cot}\\n```python\\n{code}\\n```         (the classic order)
    code_first   ```python\\n{code}\\n```\\n{cot}         (the paper's: code, then the explanation)

The three variants see the same specs in the same seeded order with the same tokenizer (trained on
all parts), the same packing into ``data.seq_len`` rows (so the same tokens per step), epochs, LR
and seeds; code_first and cot_first hold exactly the same tokens. Evaluation: greedy decoding,
the first fenced code block (``extract_code``; CoT after it is ignored), run with the hidden tests
in the sandbox (``eval/execution``): pass@1. The paper reports (code_first − cot_first) / cot_first.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

import numpy as np

from pallasite.errors import ConfigError
from pallasite.training.data import DATA_KIND, DataSpec
from pallasite.training.recipes import chat
from pallasite.training.recipes.model_init import (
    InitFields,
    finish_save,
    load_start_model,
    model_hooks,
)

VARIANTS = ("code_only", "cot_first", "code_first")
KS = (1, 2, 3, 4, 5)


def _apply_list(op: str, k: int, xs: list) -> list:
    if op == "reverse":
        return xs[::-1]
    if op == "sort":
        return sorted(xs)
    if op == "keep_even":
        return [x for x in xs if x % 2 == 0]
    if op == "keep_odd":
        return [x for x in xs if x % 2 != 0]
    if op == "keep_gt":
        return [x for x in xs if x > k]
    if op == "add":
        return [x + k for x in xs]
    if op == "mul":
        return [x * k for x in xs]
    if op == "drop":
        return xs[k:]
    if op == "take":
        return xs[:k]
    if op == "square":
        return [x * x for x in xs]
    raise ValueError(op)


LIST_OPS = {  # name -> (uses k, instruction words, code line)
    "reverse": (False, "reverse", "xs = xs[::-1]"),
    "sort": (False, "sort", "xs = sorted(xs)"),
    "keep_even": (False, "keep evens", "xs = [x for x in xs if x % 2 == 0]"),
    "keep_odd": (False, "keep odds", "xs = [x for x in xs if x % 2 != 0]"),
    "keep_gt": (True, "keep x > {k}", "xs = [x for x in xs if x > {k}]"),
    "add": (True, "add {k} to each", "xs = [x + {k} for x in xs]"),
    "mul": (True, "times {k}", "xs = [x * {k} for x in xs]"),
    "drop": (True, "drop first {k}", "xs = xs[{k}:]"),
    "take": (True, "take first {k}", "xs = xs[:{k}]"),
    "square": (False, "square each", "xs = [x * x for x in xs]"),
}
REDUCTIONS = {  # name -> (instruction words, code line, python)
    "sum": ("return the sum", "return sum(xs)", lambda xs: sum(xs)),
    "max": ("return the max or 0", "return max(xs, default=0)", lambda xs: max(xs, default=0)),
    "min": ("return the min or 0", "return min(xs, default=0)", lambda xs: min(xs, default=0)),
    "len": ("return the count", "return len(xs)", lambda xs: len(xs)),
    "first": ("return the first or 0", "return xs[0] if xs else 0", lambda xs: xs[0] if xs else 0),
}


@dataclasses.dataclass(frozen=True)
class Spec:
    steps: tuple  # ((op, k), ...) list -> list steps
    reduction: Optional[str]  # None: return the list
    tests: tuple  # ((input list, expected), ...)
    example: tuple  # the CoT's worked example input

    def run(self, xs: Sequence[int]):
        xs = list(xs)
        for op, k in self.steps:
            xs = _apply_list(op, k, xs)
        return REDUCTIONS[self.reduction][2](xs) if self.reduction else xs

    def trace(self, xs: Sequence[int]) -> list:
        out, cur = [list(xs)], list(xs)
        for op, k in self.steps:
            cur = _apply_list(op, k, cur)
            out.append(cur)
        if self.reduction:
            out.append(REDUCTIONS[self.reduction][2](cur))
        return out


def _words(op, k):
    uses_k, words, _ = LIST_OPS[op]
    return words.format(k=k) if uses_k else words


def instruction(spec: Spec) -> str:
    parts = [_words(op, k) for op, k in spec.steps]
    parts.append(REDUCTIONS[spec.reduction][0] if spec.reduction else "return the list")
    return "Write f(xs) for a list of ints: " + ", then ".join(parts) + "."


def code(spec: Spec) -> str:
    lines = ["def f(xs):"]
    for op, k in spec.steps:
        uses_k, _, line = LIST_OPS[op]
        lines.append("    " + (line.format(k=k) if uses_k else line))
    lines.append("    " + (REDUCTIONS[spec.reduction][1] if spec.reduction else "return xs"))
    return "\n".join(lines)


def cot(spec: Spec) -> str:
    steps = [_words(op, k) for op, k in spec.steps]
    steps.append(REDUCTIONS[spec.reduction][0] if spec.reduction else "return the list")
    plan = "; ".join(steps)
    trace = " -> ".join(str(v) for v in spec.trace(spec.example))
    return f"Plan: {plan}. Example: {trace}."


def fence(code_text: str) -> str:
    return f"```python\n{code_text}\n```"


def response(spec: Spec, variant: str) -> str:
    if variant == "code_only":
        return fence(code(spec))
    if variant == "cot_first":
        return f"{cot(spec)}\n{fence(code(spec))}"
    if variant == "code_first":
        return f"{fence(code(spec))}\n{cot(spec)}"
    raise ConfigError(f"code_cot variant {variant!r}; expected one of {VARIANTS}")


def _random_list(rng, max_len: int = 6) -> tuple:
    return tuple(int(x) for x in rng.integers(-3, 10, size=int(rng.integers(0, max_len + 1))))


def random_spec(rng, min_ops: int = 2, max_ops: int = 4, n_tests: int = 5) -> Spec:
    n = int(rng.integers(min_ops, max_ops + 1))
    reduce = bool(rng.random() < 0.6)
    n_list = n - 1 if reduce else n
    names = list(LIST_OPS)
    steps = []
    for _ in range(n_list):
        op = names[int(rng.integers(len(names)))]
        steps.append((op, int(KS[int(rng.integers(len(KS)))]) if LIST_OPS[op][0] else 0))
    red = list(REDUCTIONS)[int(rng.integers(len(REDUCTIONS)))] if reduce else None
    spec = Spec(tuple(steps), red, (), _random_list(rng, 4))
    tests = tuple((xs, spec.run(xs)) for xs in (_random_list(rng) for _ in range(n_tests)))
    return dataclasses.replace(spec, tests=tests)


def make_specs(n: int, seed: int, **kw) -> list[Spec]:
    """``n`` specs with distinct code (seeded)."""
    rng = np.random.default_rng([seed, 23])
    out, seen = [], set()
    while len(out) < n:
        s = random_spec(rng, **kw)
        key = code(s)
        if key not in seen:
            seen.add(key)
            out.append(s)
    return out


def split_specs(n_train: int, n_test: int, seed: int) -> tuple[list[Spec], list[Spec]]:
    """Disjoint train / test specs (different programs)."""
    specs = make_specs(n_train + n_test, seed)
    return specs[:n_train], specs[n_train:]


_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:\n?```|\Z)", re.S)


def extract_code(text: str) -> Optional[str]:
    """The first fenced code block (an unclosed fence runs to the end); None when there is none."""
    m = _FENCE.search(text)
    return None if m is None else m.group(1)


def test_program(code_text: str, spec: Spec) -> str:
    checks = "\n".join(f"assert f({list(xs)!r}) == {want!r}" for xs, want in spec.tests)
    return f"{code_text}\n\n{checks}\n"


def pass_at_1(
    completions: Sequence[str], specs: Sequence[Spec], *, workers: int = 2, timeout_s: float = 3.0
) -> dict:
    """Greedy pass@1: each completion's first code block run against its spec's hidden tests."""
    from pallasite.eval.execution.sandbox import run_many

    codes = [extract_code(t) for t in completions]
    programs = [test_program(c, s) for c, s in zip(codes, specs) if c is not None]
    results = iter(run_many(programs, workers=workers, timeout_s=timeout_s, memory_mb=512))
    passed = [c is not None and next(results).passed for c in codes]
    return {
        "pass@1": float(np.mean(passed)),
        "extracted": float(np.mean([c is not None for c in codes])),
        "passed": int(sum(passed)),
        "total": len(passed),
    }


def sample_record(spec: Spec, variant: str) -> dict:
    return {
        "messages": [
            {"role": "user", "content": instruction(spec)},
            {"role": "assistant", "content": response(spec, variant)},
        ]
    }


def token_roles(tokenizer, spec: Spec, variant: str) -> list[str]:
    """'code' / 'cot' / 'other' for every token of a response (by character offsets)."""
    text = response(spec, variant)
    c, t = code(spec), cot(spec)
    c0 = text.index(c)
    t0 = text.index(t)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    roles = []
    for a, b in enc["offset_mapping"]:
        if a < c0 + len(c) and b > c0:
            roles.append("code")
        elif a < t0 + len(t) and b > t0:
            roles.append("cot")
        else:
            roles.append("other")
    return roles


# ----------------------------------------------------------------------------- data kind
@dataclasses.dataclass(frozen=True)
class CodeCoTDataConfig(InitFields):
    variant: str = "code_first"  # code_only | cot_first | code_first
    n_train: int = 3000
    n_test: int = 100
    data_seed: int = 0
    max_new_tokens: int = 160  # greedy tokens for pass@1
    chat_template: str = ""


def all_texts(specs: Sequence[Spec]) -> list[str]:
    """Every instruction, CoT and code: the tokenizer's training text (one for all variants)."""
    return [t for s in specs for t in (instruction(s), cot(s), fence(code(s)))]


def build_code_cot(config, workdir: str, kc: CodeCoTDataConfig) -> DataSpec:
    if kc.variant not in VARIANTS:
        raise ConfigError(f"data.kind_config.variant={kc.variant!r}; expected one of {VARIANTS}")
    from pallasite.training.recipes.sft_data import (
        chat_tokenizer,
        encode_records,
        packed_spec_parts,
    )

    train_specs, test_specs = split_specs(kc.n_train, kc.n_test, kc.data_seed)
    loaded = load_start_model(kc)
    tok = chat_tokenizer(config, workdir, all_texts(train_specs), loaded)
    template = chat.chat_template_of(tok, kc.chat_template)
    train_ex = encode_records(
        tok, [sample_record(s, kc.variant) for s in train_specs], template, "code_cot train"
    )
    eval_ex = encode_records(
        tok, [sample_record(s, kc.variant) for s in test_specs], template, "code_cot eval"
    )
    train, eval_batches = packed_spec_parts(config, tok, train_ex, eval_ex)
    hooks = model_hooks(kc, loaded)
    if "model_config" not in hooks:
        from pallasite.training.loop import model_config_for

        hooks["model_config"] = model_config_for(config, tok)

    def finish(cfg, graphdef, state, wd):
        from pallasite.training.preference.sampler import sample_responses
        from pallasite.training.recipes.sft_data import as_model

        model = as_model(cfg, graphdef, state, tok)
        prompts = [[{"role": "user", "content": instruction(s)}] for s in test_specs]
        texts = [
            t[0]
            for t in sample_responses(
                model,
                prompts,
                n=1,
                temperature=0.0,
                max_new_tokens=kc.max_new_tokens,
                chat_template=kc.chat_template,
            )
        ]
        out = {f"code/{k}": v for k, v in pass_at_1(texts, test_specs).items()}
        out.update(finish_save(kc, graphdef, state, wd))
        return out

    summary = (
        f"code_cot data ({kc.variant}): {len(train_ex)} train specs -> {train.num_rows} rows "
        f"({train.num_tokens} response tokens, {train.batches_per_epoch} batches/epoch), "
        f"{len(test_specs)} test"
    )
    return DataSpec(
        tok,
        train,
        eval_batches,
        int(config.data.batch_size) * int(config.data.seq_len),
        summary=summary,
        finish=finish,
        **hooks,
    )


DATA_KIND.register("code_cot", build_code_cot, config=CodeCoTDataConfig)

__all__ = [
    "VARIANTS",
    "Spec",
    "LIST_OPS",
    "REDUCTIONS",
    "instruction",
    "code",
    "cot",
    "fence",
    "response",
    "random_spec",
    "make_specs",
    "split_specs",
    "extract_code",
    "test_program",
    "pass_at_1",
    "sample_record",
    "token_roles",
    "CodeCoTDataConfig",
    "build_code_cot",
    "all_texts",
]
