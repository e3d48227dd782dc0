"""Preference pairs: on-policy (best vs worst of n samples from π_SFT), off-policy (other models'
responses), and SimpleMix (Li & Khashabi, ICML 2025): each training pair comes from the on-policy
pool with probability r (default 0.5), else from the off-policy pool; training is then plain DPO.

Streams are position-indexed so the mixture is a coordinate-wise choice between the two pure
streams: pair k of ``simplemix`` is ``on[order_on[k]]`` if coin_k else ``off[order_off[k]]``,
where ``order_*`` are seeded concatenated permutations of each pool (``pool_order``) and the coins
come from a separate generator. Hence r = 0 and r = 1 give exactly the pure off-/on-policy
streams (``pure_stream``), bit for bit, and the on-policy fraction is Binomial(n, r).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from pallasite.errors import DataError, InputError
from pallasite.training.preference.rewards import Prompt

SOURCES = ("onpolicy", "offpolicy", "simplemix")


@dataclasses.dataclass(frozen=True)
class Pair:
    prompt: Prompt
    chosen: str
    rejected: str
    source: str = "offpolicy"  # onpolicy | offpolicy
    margin: float = 0.0  # reward(chosen) − reward(rejected), when known

    def __post_init__(self):
        if self.chosen == self.rejected:
            raise DataError(
                f"preference pair for prompt {self.prompt.messages[-1]!r}: chosen == rejected "
                f"({self.chosen!r}); a pair needs two different responses"
            )


def onpolicy_pairs(
    prompts: Sequence[Prompt], samples: Sequence[Sequence[str]], rewards: Sequence[Sequence[float]]
) -> list[Pair]:
    """Best vs worst sample per prompt (first best, last worst); prompts whose samples all score the
    same, or whose best and worst texts are equal, give no pair."""
    out = []
    for p, ss, rs in zip(prompts, samples, rewards):
        rs = np.asarray(rs, np.float64)
        best, worst = int(np.argmax(rs)), int(len(rs) - 1 - np.argmin(rs[::-1]))
        if rs[best] > rs[worst] and ss[best] != ss[worst]:
            out.append(Pair(p, ss[best], ss[worst], "onpolicy", float(rs[best] - rs[worst])))
    return out


def pool_order(pool_size: int, n: int, seed: int, stream: int) -> np.ndarray:
    """n indices into a pool: seeded permutations of ``range(pool_size)`` back to back."""
    if pool_size < 1:
        raise InputError("pool_order: the pool is empty")
    rng = np.random.default_rng([seed, stream])
    reps = -(-n // pool_size)
    return np.concatenate([rng.permutation(pool_size) for _ in range(reps)])[:n]


ON_STREAM, OFF_STREAM, COIN_STREAM = 11, 12, 13


def pure_stream(pool: Sequence[Pair], n: int, seed: int, *, source: str) -> list[Pair]:
    """n pairs from one pool (pure on- or off-policy DPO)."""
    stream = ON_STREAM if source == "onpolicy" else OFF_STREAM
    return [pool[i] for i in pool_order(len(pool), n, seed, stream)]


def simplemix(
    on: Sequence[Pair], off: Sequence[Pair], n: int, seed: int, ratio: float = 0.5
) -> list[Pair]:
    """n pairs, each on-policy with probability ``ratio`` (SimpleMix)."""
    if not 0.0 <= ratio <= 1.0:
        raise InputError(f"simplemix: ratio must lie in [0, 1], got {ratio!r}")
    coins = np.random.default_rng([seed, COIN_STREAM]).random(n) < ratio
    order_on = pool_order(len(on), n, seed, ON_STREAM) if coins.any() else None
    order_off = pool_order(len(off), n, seed, OFF_STREAM) if (~coins).any() else None
    return [on[order_on[k]] if coins[k] else off[order_off[k]] for k in range(n)]


def mixture(
    on: Sequence[Pair], off: Sequence[Pair], n: int, seed: int, source: str, ratio: float = 0.5
) -> list[Pair]:
    """The training stream of ``source`` (onpolicy | offpolicy | simplemix)."""
    if source not in SOURCES:
        raise InputError(f"preference source {source!r}; expected one of {SOURCES}")
    if source == "onpolicy":
        return pure_stream(on, n, seed, source="onpolicy")
    if source == "offpolicy":
        return pure_stream(off, n, seed, source="offpolicy")
    return simplemix(on, off, n, seed, ratio)


def onpolicy_fraction(pairs: Sequence[Pair]) -> float:
    return float(np.mean([p.source == "onpolicy" for p in pairs])) if pairs else float("nan")


def pairs_from_records(records, *, where: str = "off-policy pool") -> list[Pair]:
    """Pairs from ``{"prompt" | "messages", "chosen", "rejected"}`` records (jsonl)."""
    out = []
    for i, r in enumerate(records):
        if "messages" in r:
            msgs = r["messages"]
        elif "prompt" in r:
            msgs = [{"role": "user", "content": str(r["prompt"])}]
        else:
            raise DataError(f"{where} record {i}: expected 'prompt' or 'messages'; got {sorted(r)}")
        for k in ("chosen", "rejected"):
            if k not in r:
                raise DataError(f"{where} record {i}: missing {k!r}")
        try:
            out.append(
                Pair(
                    Prompt.make(msgs, str(r.get("family", "default"))),
                    str(r["chosen"]),
                    str(r["rejected"]),
                )
            )
        except ValueError as e:
            raise DataError(f"{where} record {i}: {e}") from None
    return out


__all__ = [
    "Pair",
    "SOURCES",
    "onpolicy_pairs",
    "pool_order",
    "pure_stream",
    "simplemix",
    "mixture",
    "onpolicy_fraction",
    "pairs_from_records",
]
