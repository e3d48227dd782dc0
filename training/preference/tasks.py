"""The two toy prompt families of the SimpleMix complementarity experiment (recipes.md §3).

* ``objective`` — "Add 17 and 8." -> "25"; reward = exact correctness (``exact_answer``). Off-policy
  responses come from another "model" that answers in its own format ("The answer is 25.", right
  with probability 0.6): informative about correctness, but not about *this* policy's own mistakes.
* ``open_ended`` — "Describe the river." -> "the river is calm and wide."; a *hidden* style reward:
  the fraction of the two adjectives that come from a vivid word list (0 for a response of another
  shape). The SFT data use vivid words only ``VIVID_RATE`` of the time, so π_SFT rarely samples
  them; a scripted expert always does, and the off-policy pairs are expert (chosen) vs plain.

The paper's claim (on-policy data helps objective tasks, off-policy data helps open-ended ones,
SimpleMix gets both) is what the experiment tests; a stub cannot produce these trends.
"""

from __future__ import annotations

import re
from typing import Optional

import numpy as np

from pallasite.training.preference.rewards import Prompt, exact_answer

FAMILIES = ("objective", "open_ended")
TOPICS = (
    "river",
    "forest",
    "city",
    "garden",
    "storm",
    "harbor",
    "desert",
    "valley",
    "market",
    "bridge",
    "castle",
    "meadow",
    "island",
    "canyon",
    "village",
    "glacier",
)
PLAIN = (
    "calm",
    "wide",
    "old",
    "small",
    "quiet",
    "large",
    "cold",
    "warm",
    "long",
    "dark",
    "green",
    "busy",
)
VIVID = (
    "radiant",
    "luminous",
    "majestic",
    "shimmering",
    "vibrant",
    "glorious",
    "dazzling",
    "splendid",
)
VIVID_RATE = 0.03
OBJECTIVE_RANGE = (0, 50)
_OPEN = re.compile(r"^the (\w+) is (\w+) and (\w+)\.$")


def objective_prompt(rng) -> Prompt:
    a, b = (int(x) for x in rng.integers(*OBJECTIVE_RANGE, size=2))
    return Prompt.make(
        [{"role": "user", "content": f"Add {a} and {b}."}], "objective", answer=a + b
    )


def open_prompt(rng) -> Prompt:
    topic = TOPICS[int(rng.integers(len(TOPICS)))]
    return Prompt.make(
        [{"role": "user", "content": f"Describe the {topic}."}], "open_ended", topic=topic
    )


def make_prompts(n_per_family: int, seed: int) -> list[Prompt]:
    """``n_per_family`` prompts of each family, interleaved (seeded)."""
    rng = np.random.default_rng([seed, 77])
    out = []
    for _ in range(n_per_family):
        out.append(objective_prompt(rng))
        out.append(open_prompt(rng))
    return out


def style_reward(prompt: Prompt, response: str) -> float:
    m = _OPEN.match(response.strip())
    if m is None or m.group(1) != prompt.info["topic"]:
        return 0.0
    return (float(m.group(2) in VIVID) + float(m.group(3) in VIVID)) / 2.0


_exact = exact_answer("answer")


def reward(prompt: Prompt, response: str) -> float:
    """The programmatic reward of either family (exact answer / hidden style)."""
    if prompt.family == "objective":
        return _exact(prompt, response)
    if prompt.family == "open_ended":
        return style_reward(prompt, response)
    raise ValueError(f"toy reward: unknown family {prompt.family!r}; expected one of {FAMILIES}")


def _adjectives(rng, vivid_rate: float) -> tuple[str, str]:
    words = []
    for _ in range(2):
        pool = VIVID if rng.random() < vivid_rate else PLAIN
        words.append(pool[int(rng.integers(len(pool)))])
    return words[0], words[1]


def sft_response(prompt: Prompt, rng) -> str:
    """What the SFT data say (correct sums; mostly plain descriptions)."""
    if prompt.family == "objective":
        return str(prompt.info["answer"])
    a, b = _adjectives(rng, VIVID_RATE)
    return f"the {prompt.info['topic']} is {a} and {b}."


def expert_response(prompt: Prompt, rng) -> str:
    """The scripted expert of the open-ended family: always vivid."""
    a, b = _adjectives(rng, 1.0)
    return f"the {prompt.info['topic']} is {a} and {b}."


def other_model_answer(prompt: Prompt, rng, p_correct: float = 0.6) -> str:
    """Another model's answer to an objective prompt, in its own format; wrong ones off by 1–10."""
    ans = int(prompt.info["answer"])
    if rng.random() >= p_correct:
        ans += int(rng.choice([-1, 1])) * int(rng.integers(1, 11))
    return f"The answer is {ans}."


def offpolicy_pair(prompt: Prompt, rng) -> Optional[tuple[str, str]]:
    """(chosen, rejected) from other models for one prompt, judged by the reward; None on a tie."""
    if prompt.family == "objective":
        a, b = other_model_answer(prompt, rng), other_model_answer(prompt, rng)
        for _ in range(8):  # re-draw until the judge can tell them apart
            if reward(prompt, a) != reward(prompt, b):
                break
            b = other_model_answer(prompt, rng)
        ra, rb = reward(prompt, a), reward(prompt, b)
        if ra == rb:
            return None
        return (a, b) if ra > rb else (b, a)
    chosen = expert_response(prompt, rng)
    c, d = _adjectives(rng, 0.0)
    return chosen, f"the {prompt.info['topic']} is {c} and {d}."


def sft_examples(n_per_family: int, seed: int) -> list[dict]:
    """SFT records ``{"messages": [user, assistant], "family": ...}`` for both families."""
    rng = np.random.default_rng([seed, 78])
    out = []
    for p in make_prompts(n_per_family, seed):
        out.append(
            {
                "messages": p.message_dicts
                + [{"role": "assistant", "content": sft_response(p, rng)}],
                "family": p.family,
            }
        )
    return out


__all__ = [
    "FAMILIES",
    "TOPICS",
    "PLAIN",
    "VIVID",
    "VIVID_RATE",
    "make_prompts",
    "reward",
    "style_reward",
    "sft_response",
    "expert_response",
    "other_model_answer",
    "offpolicy_pair",
    "sft_examples",
]
