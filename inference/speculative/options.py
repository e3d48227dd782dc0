"""Options of the ``speculative`` decode strategy (``GenerationConfig.strategy_config``).

A leaf module (it imports only ``pallasite.errors``) so that ``inference.config`` can validate
``GenerationConfig.method`` without an import cycle.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from pallasite.errors import ConfigError

METHODS = ("auto", "sd", "slem", "tli", "slrs")
SCHEDULES = ("constant", "heuristic")
CONFIDENCE_OF = ("step", "prefix")


def check_method(method: Any, *, field: str = "GenerationConfig.method") -> str:
    if method not in METHODS:
        raise ConfigError(f"{field}={method!r} is not a speculative method; expected one of {', '.join(METHODS)} "
                          "(auto: sd for a shared vocabulary, slem when greedy, tli when sampling)")
    return method


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Knobs of speculative decoding (defaults: transformers' where they exist, see docs).

    num_draft_tokens   K, drafter tokens per round (the start value of the heuristic schedule)
    max_draft_tokens   static cap of K (compiled draft / verify width); None: num_draft_tokens
    schedule           "constant" | "heuristic" (+2 after a fully accepted round, -1 otherwise, >= 1)
    target_lookbehind  SLEM: target tokens re-encoded with the draft text (alignment window)
    drafter_lookbehind SLEM: drafter tokens re-encoded with the target's new text
    max_target_draft   SLEM: most target tokens one round verifies; None: max_draft_tokens
    max_catch_up       SLEM: most drafter tokens fed in one catch-up call (the rest next round)
    drafter_len_ratio  drafter tokens per target token the drafter's buffers are sized for
                       (prompt buffer and cache; a row that would overflow stops drafting)
    drafter_kv_cache   the drafter's cache kind (None: the drafter model's default) + its options
    mask_drafts        with a constraint, sd / tli: the drafter drafts only what the grammar allows
                       (one host call per draft step; False: unconstrained drafts, still lossless)
    slrs_max_nodes     SLRS: most prefixes of multi-character target tokens (drafter calls per draft
                       step that psi takes); a larger target vocabulary is refused
    max_spelling       sd / tli: most drafter tokens one target token is spelled in when the drafter
                       catches up (its catch-up call is 1 + this wide, every round); a longer spelling
                       is cut, which shortens the drafter's context (acceptance only, never the output)
    confidence_threshold  sd / tli / slem: a row drafts its next token only while the drafter's top
                       probability there is >= this (DISCO / transformers' assistant_confidence_threshold;
                       ``lookahead.py``), and the target verifies only as many positions as the round's
                       widest row drafted; None: always K drafts and a (K + 1)-token verify
    confidence_of      "step": the threshold applies to the next draft's top probability;
                       "prefix": to the product of the round's top probabilities so far (the chance
                       that every draft of the round is accepted, SpecDec++'s stopping rule)
    """

    num_draft_tokens: int = 5
    max_draft_tokens: Optional[int] = None
    schedule: str = "constant"
    target_lookbehind: int = 10
    drafter_lookbehind: int = 10
    max_target_draft: Optional[int] = None
    max_catch_up: int = 24
    drafter_len_ratio: float = 2.0
    drafter_kv_cache: Optional[str] = None
    drafter_kv_cache_config: Any = None
    mask_drafts: bool = True
    slrs_max_nodes: int = 256
    max_spelling: int = 16
    confidence_threshold: Optional[float] = None
    confidence_of: str = "step"

    def __post_init__(self):
        def need(ok, msg):
            if not ok:
                raise ConfigError(f"SpeculativeConfig: {msg}")

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.num_draft_tokens) and self.num_draft_tokens >= 1,
             f"num_draft_tokens must be an integer >= 1; got {self.num_draft_tokens!r}")
        if self.max_draft_tokens is not None:
            need(is_int(self.max_draft_tokens) and self.max_draft_tokens >= self.num_draft_tokens,
                 f"max_draft_tokens must be an integer >= num_draft_tokens ({self.num_draft_tokens}); "
                 f"got {self.max_draft_tokens!r}")
        need(self.schedule in SCHEDULES, f"schedule={self.schedule!r}; expected one of {SCHEDULES}")
        for name in ("target_lookbehind", "drafter_lookbehind", "max_catch_up", "slrs_max_nodes", "max_spelling"):
            v = getattr(self, name)
            need(is_int(v) and v >= 1, f"{name} must be an integer >= 1; got {v!r}")
        if self.max_target_draft is not None:
            need(is_int(self.max_target_draft) and self.max_target_draft >= 1,
                 f"max_target_draft must be an integer >= 1 or None; got {self.max_target_draft!r}")
        need(isinstance(self.mask_drafts, bool), f"mask_drafts must be True or False; got {self.mask_drafts!r}")
        if self.confidence_threshold is not None:
            tau = self.confidence_threshold
            need(isinstance(tau, (int, float)) and not isinstance(tau, bool) and 0.0 < tau <= 1.0,
                 f"confidence_threshold must be a probability in (0, 1] or None; got {tau!r}")
        need(self.confidence_of in CONFIDENCE_OF,
             f"confidence_of={self.confidence_of!r}; expected one of {CONFIDENCE_OF}")
        need(isinstance(self.drafter_len_ratio, (int, float)) and self.drafter_len_ratio > 0,
             f"drafter_len_ratio must be > 0; got {self.drafter_len_ratio!r}")

    @property
    def k_max(self) -> int:
        return self.max_draft_tokens or self.num_draft_tokens

    @property
    def target_width(self) -> int:
        return self.max_target_draft or self.k_max


__all__ = ["METHODS", "SCHEDULES", "SpeculativeConfig", "check_method"]
