"""The reward-function interface: ``reward(prompt, response) -> float`` (programmatic; higher =
better).

A ``Prompt`` carries the chat messages, a family name (for per-family reports) and ``meta``: what
a programmatic reward needs to score a response (the right answer, a topic, hidden tests, …).
``score`` applies a reward to many responses; ``exact_answer`` and ``code_tests`` are reusable
rewards (the latter runs candidates in the sandbox of ``eval/execution``).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Mapping, Sequence

from pallasite.errors import InputError

RewardFn = Callable[["Prompt", str], float]


@dataclasses.dataclass(frozen=True)
class Prompt:
    messages: tuple  # ({"role": "user", "content": ...}, ...) — frozen as tuples of items
    family: str = "default"
    meta: tuple = ()  # sorted (key, value) items

    @staticmethod
    def make(messages: Sequence[Mapping], family: str = "default", **meta) -> "Prompt":
        return Prompt(
            tuple(tuple(sorted(dict(m).items())) for m in messages),
            family,
            tuple(sorted(meta.items())),
        )

    @property
    def message_dicts(self) -> list[dict]:
        return [dict(m) for m in self.messages]

    @property
    def info(self) -> dict:
        return dict(self.meta)


def score(
    reward: RewardFn, prompts: Sequence[Prompt], responses: Sequence[Sequence[str]]
) -> list[list[float]]:
    """rewards[i][j] of responses[i][j] to prompts[i]."""
    if len(prompts) != len(responses):
        raise InputError(f"score: {len(prompts)} prompts but {len(responses)} response lists")
    return [[float(reward(p, r)) for r in rs] for p, rs in zip(prompts, responses)]


_INT = re.compile(r"-?\d+")


def exact_answer(key: str = "answer") -> RewardFn:
    """1.0 when the last integer in the response equals ``prompt.meta[key]``, else 0.0."""

    def reward(prompt: Prompt, response: str) -> float:
        found = _INT.findall(response)
        return float(bool(found) and int(found[-1]) == int(prompt.info[key]))

    return reward


def code_tests(
    extract: Callable[[str], str],
    make_program: Callable[[str, Prompt], str],
    *,
    timeout_s: float = 3.0,
) -> RewardFn:
    """1.0 when the program built from the response's code passes in the sandbox, else 0.0."""
    from pallasite.eval.execution.sandbox import run_python

    def reward(prompt: Prompt, response: str) -> float:
        return float(
            run_python(make_program(extract(response), prompt), timeout_s=timeout_s).passed
        )

    return reward


__all__ = ["Prompt", "RewardFn", "score", "exact_answer", "code_tests"]
