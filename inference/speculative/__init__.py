"""Speculative decoding behind the engine's strategy seam, also across vocabularies (SD, SLEM,
TLI, SLRS; Timor et al., ICML 2025): ``pallasite.generate(model, prompts, drafter=other,
method="auto")``. docs/speculative.md has the method, the measurements and the notes."""

from pallasite.inference.speculative.build import build_speculative, stats_of
from pallasite.inference.speculative.drafter import Drafter
from pallasite.inference.speculative.options import METHODS, SpeculativeConfig
from pallasite.inference.speculative.strategy import SpeculativeStrategy
from pallasite.inference.speculative.vocab import PairMap, TokenText, pair_map, token_text


def bind_target(gen, model):
    """``gen`` with its drafter bound to the target ``model``'s tokenizer (``pallasite.generate``)."""
    if gen.drafter is None:
        return gen
    return gen.replace(drafter=Drafter.of(gen.drafter, target=model))


__all__ = ["Drafter", "METHODS", "SpeculativeConfig", "SpeculativeStrategy", "build_speculative", "stats_of",
           "PairMap", "TokenText", "pair_map", "token_text", "bind_target"]
