"""The ``sft`` data kind: chat examples -> response-only, packed SFT batches (``data.kind="sft"``).

    c.data.kind = "sft"
    c.data.kind_config = ConfigDict(dict(source="jsonl", paths=("train.jsonl",),
                                         init_from="model.gguf", lora_rank=8))

Examples come from jsonl (``{"messages": [...]}`` or ``{"prompt", "response"}``) or from the toy
preference families (``source="preference_toy"``: the SFT stage of the DPO experiment). The
tokenizer is the loaded model's (``init_from``; its chat template is used, and a missing template
is an error naming the tokenizer), else ``config.tokenizer.path``, else a byte-level BPE trained on
the examples with chat special tokens and ``chat.TOY_CHAT_TEMPLATE``. Held-out examples (crc32 of
the prompt text for jsonl, every k-th for generated sources; ``heldout_percent``) give the eval
batches. ``finish`` reports per-family rewards for the toy source and saves LoRA adapters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Optional

import numpy as np

from pallasite.errors import ConfigError, DataError
from pallasite.training.data import DATA_KIND, DataSpec
from pallasite.training.recipes import chat
from pallasite.training.recipes.model_init import (
    InitFields,
    finish_save,
    load_start_model,
    model_hooks,
)

SOURCES = ("jsonl", "preference_toy")


@dataclasses.dataclass(frozen=True)
class SFTDataConfig(InitFields):
    source: str = "jsonl"  # jsonl | preference_toy
    paths: tuple = ()  # jsonl files (source=jsonl)
    eval_paths: tuple = ()  # optional held-out jsonl; default: a hashed split of `paths`
    chat_template: str = ""  # a Jinja template overriding the tokenizer's
    heldout_percent: float = 5.0
    n_examples: int = 2000  # generated sources: examples per family
    data_seed: int = 0  # generated sources: the example set (independent of config.seed)
    eval_prompts: int = 64  # toy source: prompts per family for the reward report


def read_jsonl(paths) -> list[dict]:
    from pallasite.training.data import _expand

    out = []
    for path in _expand(list(paths)):
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    return out


def chat_tokenizer(config, workdir: str, texts, loaded=None, *, vocab_size: Optional[int] = None):
    """The run's chat tokenizer (see the module doc); one trained here goes to workdir/tokenizer."""
    from pallasite.models.tokenizer import load_tokenizer, train_bpe

    if loaded is not None:
        if loaded.tokenizer is None:
            raise ConfigError(f"init_from={loaded.path!r} has no tokenizer; chat data needs one")
        return loaded.tokenizer
    if config.tokenizer.path:
        return load_tokenizer(config.tokenizer.path)
    tok_dir = os.path.join(workdir, "tokenizer")
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        return load_tokenizer(tok_dir)
    tok = train_bpe(
        texts,
        int(vocab_size or config.tokenizer.vocab_size),
        special_tokens=chat.CHAT_SPECIAL_TOKENS,
    )
    tok.chat_template = chat.TOY_CHAT_TEMPLATE
    tok.save_pretrained(tok_dir)
    return load_tokenizer(tok_dir)


def _heldout(messages, percent: float) -> bool:
    key = json.dumps(messages[:-1], sort_keys=True).encode()
    return (zlib.crc32(key) % 100) < percent


def encode_records(
    tokenizer, records, template: str, where: str
) -> list[tuple[np.ndarray, np.ndarray]]:
    return [
        chat.encode_example(
            tokenizer,
            chat.messages_of(r, where=f"{where} record {i}"),
            template,
            where=f"{where} record {i}",
        )
        for i, r in enumerate(records)
    ]


def packed_spec_parts(config, tokenizer, train_examples, eval_examples):
    """(train RowDataset, eval batches) of encoded examples packed into data.seq_len rows."""
    T, B = int(config.data.seq_len), int(config.data.batch_size)
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    order = np.random.default_rng([config.seed, 5]).permutation(len(train_examples))
    rows = chat.pack_examples(train_examples, T, pad_id=pad, order=order)
    train = chat.RowDataset(rows, batch_size=B, seed=config.seed)
    eval_rows = chat.pack_examples(eval_examples, T, pad_id=pad)
    eval_batches = chat.all_batches(eval_rows, B)[: int(config.data.eval_batches)]
    return train, eval_batches


def sft_records(kc: SFTDataConfig) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of the configured source."""
    if kc.source == "preference_toy":
        from pallasite.training.preference import tasks

        records = tasks.sft_examples(kc.n_examples, kc.data_seed)
        every = max(
            int(round(100.0 / max(kc.heldout_percent, 1e-9))), 2
        )  # generated: every k-th is held out
        return (
            [r for i, r in enumerate(records) if i % every],
            [r for i, r in enumerate(records) if not i % every],
        )
    if kc.source != "jsonl":
        raise ConfigError(f"data.kind_config.source={kc.source!r}; expected one of {SOURCES}")
    if not kc.paths:
        raise ConfigError(
            "data.kind_config.paths is empty; the sft data kind needs jsonl files of chat examples"
        )
    records = read_jsonl(kc.paths)
    if kc.eval_paths:
        return records, read_jsonl(kc.eval_paths)
    split = [_heldout(chat.messages_of(r, where="sft record"), kc.heldout_percent) for r in records]
    return [r for r, h in zip(records, split) if not h], [r for r, h in zip(records, split) if h]


def toy_reward_report(
    model, eval_prompts: int, seed: int, prefix: str = "reward", samples: int = 4
) -> dict:
    """Mean reward per toy family on ``eval_prompts`` held-out prompts of each family: greedy
    (``{prefix}/{family}``) and over ``samples`` samples at temperature 1
    (``{prefix}_t1/{family}``)."""
    from pallasite.training.preference import tasks
    from pallasite.training.preference.sampler import sample_responses

    prompts = tasks.make_prompts(eval_prompts, seed + 1_000_003)
    greedy = sample_responses(model, prompts, n=1, temperature=0.0, max_new_tokens=24)
    sampled = (
        sample_responses(
            model, prompts, n=samples, temperature=1.0, max_new_tokens=24, seed=seed + 17
        )
        if samples
        else None
    )
    out = {}
    for fam in tasks.FAMILIES:
        idx = [i for i, p in enumerate(prompts) if p.family == fam]
        out[f"{prefix}/{fam}"] = float(
            np.mean([tasks.reward(prompts[i], greedy[i][0]) for i in idx])
        )
        if sampled is not None:
            out[f"{prefix}_t1/{fam}"] = float(
                np.mean([tasks.reward(prompts[i], t) for i in idx for t in sampled[i]])
            )
    return out


def as_model(cfg, graphdef, state, tokenizer):
    """A ``pallasite.Model`` of a train state (adapters merged) for generation."""
    from flax import nnx

    from pallasite.api import Model
    from pallasite.training.recipes.model_init import trained_model

    g, s = nnx.split(trained_model(graphdef, state))
    return Model(cfg, s, tokenizer, g)


def build_sft(config, workdir: str, kc: SFTDataConfig) -> DataSpec:
    loaded = load_start_model(kc)
    train_records, eval_records = sft_records(kc)
    if not train_records or not eval_records:
        raise ConfigError(
            f"sft data: {len(train_records)} train / {len(eval_records)} eval examples; "
            "both must be non-empty (heldout_percent, eval_paths)"
        )
    texts = [m["content"] for r in train_records for m in chat.messages_of(r)]
    tokenizer = chat_tokenizer(config, workdir, texts, loaded)
    template = chat.chat_template_of(
        tokenizer,
        kc.chat_template,
        where=f"the tokenizer of {kc.init_from!r}" if kc.init_from else "the tokenizer",
    )
    train_ex = encode_records(tokenizer, train_records, template, "sft train")
    eval_ex = encode_records(tokenizer, eval_records, template, "sft eval")
    train, eval_batches = packed_spec_parts(config, tokenizer, train_ex, eval_ex)
    hooks = model_hooks(kc, loaded)
    if "model_config" not in hooks:
        from pallasite.training.loop import model_config_for

        hooks["model_config"] = model_config_for(config, tokenizer)

    def finish(cfg, graphdef, state, wd):
        out = finish_save(kc, graphdef, state, wd)
        if kc.source == "preference_toy":
            out.update(
                toy_reward_report(
                    as_model(cfg, graphdef, state, tokenizer), kc.eval_prompts, kc.data_seed
                )
            )
        return out

    summary = (
        f"sft data ({kc.source}): {len(train_ex)} train examples -> {train.num_rows} packed rows "
        f"({train.num_tokens} response tokens, {train.batches_per_epoch} batches/epoch), "
        f"{len(eval_ex)} eval"
    )
    return DataSpec(
        tokenizer,
        train,
        eval_batches,
        int(config.data.batch_size) * int(config.data.seq_len),
        summary=summary,
        finish=finish,
        **hooks,
    )


DATA_KIND.register("sft", build_sft, config=SFTDataConfig)

__all__ = [
    "SFTDataConfig",
    "build_sft",
    "chat_tokenizer",
    "read_jsonl",
    "encode_records",
    "packed_spec_parts",
    "sft_records",
    "toy_reward_report",
    "as_model",
]
