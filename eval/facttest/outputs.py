"""Everything FactTest needs from the model for a list of questions, in batched calls.

Per question: the greedy answer (labelled correct iff a gold alias occurs in it, ``is_correct``)
with its token log-probabilities (white-box score); ``m_ve`` answers sampled at T = 1 (vanilla
entropy); ``m_se`` answers sampled at T = 0.7 with the mean log-likelihood of each sampled
continuation (semantic and kernel entropy share these samples); the mean final-normed hidden state
of the question (features of the covariate-shift classifier). Generation stops at the first token
containing '.' or a newline, 15 new tokens at most, and the decoded text is cut there (the
official code cuts greedy / ve answers at '.' only; our demonstrations put one answer per line).
Fixed against the official code: the sampled-answer NLL scores only the generated tokens (it
also scored the prompt and the pad id 1), and an answer without '.' keeps its last character.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional, Sequence

import numpy as np

from pallasite.eval.facttest.qa_data import FEW_SHOT, QAItem, is_correct, prompt_for
from pallasite.eval.model_calls import mean_hidden, stop_ids_for
from pallasite.eval.multi_sample import sample_rows

CUT_CHARS = ".\n"


@dataclasses.dataclass(frozen=True)
class CollectConfig:
    m_ve: int = 5  # official script default (README: 15)
    m_se: int = 10  # official default for se and kle
    temperature_ve: float = 1.0
    temperature_se: float = 0.7
    max_new_tokens: int = 15
    batch_size: int = (
        128  # decode rows per step (questions per prefill = batch_size // rows per question)
    )
    seed: int = 0
    few_shot: Optional[tuple] = FEW_SHOT


@dataclasses.dataclass
class Collected:
    """Per-question model outputs (lists aligned with ``items``); JSON round-trips."""

    items: list
    greedy: list  # answer text
    correct: np.ndarray  # bool
    greedy_logprobs: list  # per answer token (stop token excluded when the answer has text)
    ve_answers: list  # list of m_ve strings per question
    se_answers: list  # list of m_se strings per question
    se_mean_loglik: list  # list of m_se floats per question
    embeddings: np.ndarray  # [N, D]

    def subset(self, idx) -> "Collected":
        idx = list(idx)
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        return Collected(
            pick(self.items),
            pick(self.greedy),
            self.correct[idx],
            pick(self.greedy_logprobs),
            pick(self.ve_answers),
            pick(self.se_answers),
            pick(self.se_mean_loglik),
            self.embeddings[idx],
        )

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["items"] = [dataclasses.asdict(it) for it in self.items]
        d["correct"] = self.correct.tolist()
        d["greedy_logprobs"] = [np.asarray(x).tolist() for x in self.greedy_logprobs]
        d["embeddings"] = self.embeddings.tolist()
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> "Collected":
        d = json.loads(text)
        d["items"] = [QAItem(**{**it, "aliases": tuple(it["aliases"])}) for it in d["items"]]
        d["correct"] = np.asarray(d["correct"], bool)
        d["embeddings"] = np.asarray(d["embeddings"], np.float32)
        return cls(**d)


def _cut(text: str) -> str:
    idx = [i for i in (text.find(c) for c in CUT_CHARS) if i != -1]
    return (text[: min(idx)] if idx else text).strip()


def collect(
    model, items: Sequence[QAItem], cfg: CollectConfig = CollectConfig(), progress=None
) -> Collected:
    """Run every model call FactTest needs for ``items`` (see the module docstring). Greedy, ve and
    se rows of a question decode together from one prefill of its prompt (``sample_rows``)."""
    if model.tokenizer is None:
        raise ValueError("facttest.collect: the model needs a tokenizer")
    say = progress or (lambda msg: None)
    stops = stop_ids_for(model, CUT_CHARS)
    stop_set = set(stops)
    temps = [0.0] + [cfg.temperature_ve] * cfg.m_ve + [cfg.temperature_se] * cfg.m_se
    greedy, greedy_lp, ve_answers, se_answers, se_ll = [], [], [], [], []
    G = max(1, cfg.batch_size // len(temps))
    for lo in range(0, len(items), G):
        chunk = items[lo : lo + G]
        say(
            f"questions {lo}..{lo + len(chunk) - 1} of {len(items)}: "
            f"1 greedy + {cfg.m_ve} ve + {cfg.m_se} se rows each"
        )
        prompts = [model.encode(prompt_for(it.question, cfg.few_shot)) for it in chunk]
        rows = sample_rows(
            model,
            prompts,
            temperatures=temps,
            max_new_tokens=cfg.max_new_tokens,
            stop_tokens=stops,
            seed=cfg.seed * 1_000_003 + lo,
            prompts_per_batch=G,
        )
        for q_rows in rows:
            ids, lp = q_rows[0]
            greedy.append(_cut(model.decode(ids)))
            body = len(ids) - 1 if len(ids) > 1 and ids[-1] in stop_set else len(ids)
            greedy_lp.append(np.asarray(lp[:body]))
            ve_answers.append([_cut(model.decode(i)) for i, _ in q_rows[1 : 1 + cfg.m_ve]])
            se = q_rows[1 + cfg.m_ve :]
            se_answers.append([_cut(model.decode(i)) for i, _ in se])
            se_ll.append([float(np.mean(x)) if len(x) else 0.0 for _, x in se])
    correct = np.asarray([is_correct(a, it.aliases) for a, it in zip(greedy, items)], bool)
    say("question embeddings")
    emb = mean_hidden(model, [model.encode(it.question) for it in items], batch_size=16)
    return Collected(list(items), greedy, correct, greedy_lp, ve_answers, se_answers, se_ll, emb)


def collect_splits(
    model,
    splits: dict,
    cfg: CollectConfig = CollectConfig(),
    *,
    cache_path: Optional[str] = None,
    progress=None,
) -> dict:
    """``collect`` for every split ({name: items}); with ``cache_path`` the outputs are read from /
    written to that JSON file. ``model`` may be a zero-argument callable (loaded only on a miss)."""
    import os

    if cache_path and os.path.exists(cache_path):
        with open(cache_path) as f:
            return {k: Collected.from_json(v) for k, v in json.load(f).items()}
    if callable(model) and not hasattr(model, "config"):
        model = model()
    names = list(splits)
    flat = [it for name in names for it in splits[name]]
    everything = collect(
        model, flat, cfg, progress=progress
    )  # one pass: no half-empty batch per split
    out, lo = {}, 0
    for name in names:
        out[name] = everything.subset(range(lo, lo + len(splits[name])))
        lo += len(splits[name])
    if cache_path:
        os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
        with open(cache_path, "w") as f:
            json.dump({k: v.to_json() for k, v in out.items()}, f)
    return out
