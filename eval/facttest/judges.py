"""Entailment judges for semantic entropy and kernel language entropy.

The official code scores answer pairs with DeBERTa-v2-xlarge-MNLI, which cannot be fetched
offline. Two replacements, both returning MNLI-ordered probabilities [contradiction, neutral,
entailment] for (question, premise answer, hypothesis answer) triples:

* ``NormalizedJudge`` (default): entailment iff the answers are equal after ``qa_data.normalize``
  (case, accents, punctuation, articles), else contradiction -- one-hot, so kle sees s in {0, 0.7}.
* ``LMJudge``: the evaluated language model itself is asked whether answer A to the question
  implies answer B; its next-token probabilities of " no" / " maybe" / " yes", renormalised over
  the three, are the NLI probabilities (a weak judge for a 135M model; say which one you used).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pallasite.eval.facttest.qa_data import normalize

LM_JUDGE_PROMPT = (
    "Question: {q}\nAnswer A: {a}\nAnswer B: {b}\n"
    "If answer A is true, is answer B also true? Reply yes, no or maybe.\nReply:"
)


class NormalizedJudge:
    name = "normalized"

    def nli_probs(self, triples: Sequence[tuple[str, str, str]]) -> np.ndarray:
        out = np.zeros((len(triples), 3))
        for i, (_, a, b) in enumerate(triples):
            out[i, 2 if normalize(a) == normalize(b) else 0] = 1.0
        return out


class LMJudge:
    name = "lm"

    def __init__(self, model, prompt: str = LM_JUDGE_PROMPT, batch_size: int = 16):
        if model.tokenizer is None:
            raise ValueError("LMJudge: the model needs a tokenizer")
        self.model, self.prompt, self.batch_size = model, prompt, batch_size
        # first token of each reply word, in MNLI order: contradiction, neutral, entailment
        self.candidates = [model.encode(w)[0] for w in (" no", " maybe", " yes")]
        if len(set(self.candidates)) != 3:
            raise ValueError(f"LMJudge: reply words share a first token: {self.candidates}")

    def nli_probs(self, triples: Sequence[tuple[str, str, str]]) -> np.ndarray:
        from pallasite.eval.model_calls import next_token_logprobs

        if not triples:
            return np.zeros((0, 3))
        prefixes = [self.model.encode(self.prompt.format(q=q, a=a, b=b)) for q, a, b in triples]
        lp = next_token_logprobs(self.model, prefixes, self.candidates, batch_size=self.batch_size)
        p = np.exp(lp - lp.max(-1, keepdims=True))
        return p / p.sum(-1, keepdims=True)


def make_judge(name: str, model=None):
    if name == "normalized":
        return NormalizedJudge()
    if name == "lm":
        if model is None:
            raise ValueError("make_judge('lm') needs the model")
        return LMJudge(model)
    raise ValueError(f"unknown judge {name!r}; expected 'normalized' or 'lm'")
