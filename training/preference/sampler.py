"""n responses per prompt from a model, batched through the inference engine (``generate_ids``).

    texts = sample_responses(model, prompts, n=8, temperature=1.0, max_new_tokens=24, seed=0)
    # texts[i][j]: the j-th sample for prompts[i] (chat-template prompt; end of turn stripped)

``model`` is a ``pallasite.Model`` (config, state, tokenizer) — e.g. the SFT policy. Each prompt
is rendered with the chat template (``add_generation_prompt``), repeated n times and generated
``batch_size`` rows at a time in one jitted prefill + while-loop decode per batch; batch b draws
with ``fold_in(key(seed), b)``. Greedy decoding is ``temperature=0`` (then n copies are equal).
"""

from __future__ import annotations

from typing import Sequence

import jax

from pallasite.errors import InputError
from pallasite.inference.config import GenerationConfig
from pallasite.inference.engine import generate_ids
from pallasite.training.recipes.chat import chat_template_of, prompt_ids


def stop_ids(model) -> tuple:
    cfg, tok = model.config, model.tokenizer
    if cfg.eos_token_id:
        return tuple(int(t) for t in cfg.eos_token_id)
    return () if tok is None or tok.eos_token_id is None else (int(tok.eos_token_id),)


def decode_response(tokenizer, ids: Sequence[int], stops: Sequence[int]) -> str:
    cut = list(ids)
    for i, t in enumerate(cut):
        if t in stops:
            cut = cut[:i]
            break
    return tokenizer.decode(cut, skip_special_tokens=True)


def sample_responses(
    model,
    prompts,
    *,
    n: int = 1,
    temperature: float = 1.0,
    top_p=None,
    max_new_tokens: int = 32,
    seed: int = 0,
    batch_size: int = 256,
    chat_template: str = "",
) -> list[list[str]]:
    """``n`` sampled responses (strings) per prompt (a list of chat messages or a ``Prompt``)."""
    if n < 1:
        raise InputError(f"sample_responses: n must be >= 1, got {n}")
    tok = model.tokenizer
    template = chat_template_of(tok, chat_template)
    msgs = [p.message_dicts if hasattr(p, "message_dicts") else list(p) for p in prompts]
    rows = [prompt_ids(tok, m, template) for m in msgs for _ in range(n)]
    stops = stop_ids(model)
    gen = GenerationConfig(
        max_new_tokens=int(max_new_tokens),
        temperature=float(temperature),
        top_p=top_p,
        stop_tokens=stops,
    )
    out: list[list[int]] = []
    base = jax.random.key(int(seed))
    for b, s in enumerate(range(0, len(rows), batch_size)):
        out.extend(
            generate_ids(
                model.graphdef,
                model.state,
                model.config,
                rows[s : s + batch_size],
                gen,
                key=jax.random.fold_in(base, b),
            )
        )
    texts = [decode_response(tok, ids, stops) for ids in out]
    return [texts[i * n : (i + 1) * n] for i in range(len(msgs))]


__all__ = ["sample_responses", "decode_response", "stop_ids"]
