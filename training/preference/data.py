"""The ``preference`` data kind: DPO batches from on-policy, off-policy or SimpleMix pairs.

    c.data.kind = "preference"; c.train.loss = "dpo"
    c.data.kind_config = ConfigDict(dict(init_from="runs/sft", mix="simplemix", ratio=0.5))

The run starts from the SFT model at ``init_from``, which is also the frozen reference π_ref.
``source="toy"``: the two families of ``tasks.py`` — on-policy pairs are best vs worst of
``n_samples`` samples per training prompt from π_SFT (temperature ``temperature``, seed
``config.seed``) scored by the programmatic reward; off-policy pairs come from other scripted models
judged by the same reward. ``source="jsonl"``: off-policy pairs from ``offpolicy_paths``
(``{"prompt"|"messages", "chosen", "rejected"}``; ``mix="offpolicy"`` only — on-policy pairs need a
reward). ``mix`` picks the stream (``pairs.mixture``: pure on-/off-policy, SimpleMix at ``ratio``);
the stream of ``n_pairs`` (default train.steps × batch) pairs is consumed in order, one epoch.
Each pair is one row (chosen = segment 1, rejected = segment 2) and π_ref's sequence log-probs are
precomputed into ``ref_logps``. ``finish`` reports the greedy reward per family before (π_SFT) and
after DPO, the pool sizes and the stream's on-policy fraction.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.errors import ConfigError
from pallasite.training.data import DATA_KIND, DataSpec
from pallasite.training.losses.sft import sequence_logprobs
from pallasite.training.preference import pairs as pairs_lib
from pallasite.training.preference import tasks
from pallasite.training.preference.rewards import score
from pallasite.training.preference.sampler import sample_responses
from pallasite.training.recipes import chat
from pallasite.training.recipes.model_init import (
    InitFields,
    finish_save,
    load_start_model,
    model_hooks,
)
from pallasite.training.recipes.sft_data import as_model, read_jsonl, toy_reward_report


@dataclasses.dataclass(frozen=True)
class PreferenceDataConfig(InitFields):
    source: str = "toy"  # toy | jsonl
    mix: str = "simplemix"  # onpolicy | offpolicy | simplemix
    ratio: float = 0.5  # SimpleMix: probability that a pair is on-policy
    n_prompts: int = 200  # toy: training prompts per family
    n_samples: int = 8  # on-policy samples per prompt
    temperature: float = 1.0
    max_new_tokens: int = 24
    n_pairs: int = 0  # pairs in the training stream; 0 = train.steps * data.batch_size
    offpolicy_paths: tuple = ()  # jsonl off-policy pairs (source=jsonl)
    eval_prompts: int = 64  # toy: held-out prompts per family for the reward report
    data_seed: int = 0  # toy: the prompt set and the off-policy pool (independent of config.seed)
    chat_template: str = ""
    onpolicy_cache: str = (
        ""  # a JSON file keeping on-policy samples across runs with the same sampling settings
    )


def encode_pair(tokenizer, pair: pairs_lib.Pair, template: str):
    base = pair.prompt.message_dicts
    c_ids, c_mask = chat.encode_example(
        tokenizer, base + [{"role": "assistant", "content": pair.chosen}], template
    )
    r_ids, r_mask = chat.encode_example(
        tokenizer, base + [{"role": "assistant", "content": pair.rejected}], template
    )
    return c_ids, c_mask, r_ids, r_mask


def pair_rows(tokenizer, pairs, template: str, seq_len: int) -> dict:
    pad = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    return chat.pack_pairs(
        [encode_pair(tokenizer, p, template) for p in pairs], seq_len, pad_id=pad
    )


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _ref_logps(graphdef, state, batch):
    return sequence_logprobs(nnx.merge(graphdef, state), batch, 2)[0]


def reference_logps(model, rows: dict, batch_size: int) -> np.ndarray:
    """π_ref's response log-probs [R, 2] (chosen, rejected) of pair rows, batch_size rows a call."""
    keys = chat.ROW_KEYS
    out = []
    n = len(rows["tokens"])
    for s in range(0, n, batch_size):
        b = {k: rows[k][s : s + batch_size] for k in keys}
        short = batch_size - len(b["tokens"])
        if short:  # one compiled shape: pad with empty rows, drop their outputs
            b = {
                k: np.concatenate([v, np.zeros((short, *v.shape[1:]), v.dtype)])
                for k, v in b.items()
            }
        lp = np.asarray(
            _ref_logps(model.graphdef, model.state, {k: jnp.asarray(v) for k, v in b.items()})
        )
        out.append(lp[: batch_size - short])
    return np.concatenate(out).astype(np.float32)


def onpolicy_samples(model, kc: PreferenceDataConfig, seed: int, prompts) -> list[list[str]]:
    """n samples per prompt from π_SFT, through ``kc.onpolicy_cache`` when set (keyed by everything
    that determines them)."""
    key = {
        "init_from": os.path.abspath(kc.init_from),
        "seed": seed,
        "n": kc.n_samples,
        "t": kc.temperature,
        "max_new_tokens": kc.max_new_tokens,
        "prompts": [p.messages[-1] for p in prompts],
    }
    key = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    cache = {}
    if kc.onpolicy_cache and os.path.exists(kc.onpolicy_cache):
        with open(kc.onpolicy_cache) as f:
            cache = json.load(f)
        if key in cache:
            return cache[key]
    samples = sample_responses(
        model,
        prompts,
        n=kc.n_samples,
        temperature=kc.temperature,
        max_new_tokens=kc.max_new_tokens,
        seed=seed,
        chat_template=kc.chat_template,
    )
    if kc.onpolicy_cache:
        cache[key] = samples
        tmp = kc.onpolicy_cache + ".tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f)
        os.replace(tmp, kc.onpolicy_cache)
    return samples


def toy_pools(model, kc: PreferenceDataConfig, seed: int, prompts):
    """(on-policy pairs, off-policy pairs) of the toy families for ``prompts``."""
    on = []
    if kc.mix != "offpolicy":
        samples = onpolicy_samples(model, kc, seed, prompts)
        on = pairs_lib.onpolicy_pairs(prompts, samples, score(tasks.reward, prompts, samples))
    rng = np.random.default_rng([kc.data_seed, 91])
    off = []
    for p in prompts:
        got = tasks.offpolicy_pair(p, rng)
        if got is not None:
            off.append(
                pairs_lib.Pair(
                    p,
                    got[0],
                    got[1],
                    "offpolicy",
                    tasks.reward(p, got[0]) - tasks.reward(p, got[1]),
                )
            )
    return on, off


def build_preference(config, workdir: str, kc: PreferenceDataConfig) -> DataSpec:
    if not kc.init_from:
        raise ConfigError(
            "the preference data kind starts from the SFT model, which is also the frozen "
            "reference: "
            "set data.kind_config.init_from to it (e.g. the workdir of configs/recipes/sft.py)"
        )
    if kc.mix not in pairs_lib.SOURCES:
        raise ConfigError(f"data.kind_config.mix={kc.mix!r}; expected one of {pairs_lib.SOURCES}")
    loaded = load_start_model(kc)
    tok = loaded.tokenizer
    template = chat.chat_template_of(
        tok, kc.chat_template, where=f"the tokenizer of {kc.init_from!r}"
    )
    B, T = int(config.data.batch_size), int(config.data.seq_len)
    n_pairs = int(kc.n_pairs or config.train.steps * B)
    if kc.source == "toy":
        prompts = tasks.make_prompts(kc.n_prompts, kc.data_seed)
        on, off = toy_pools(loaded, kc, config.seed, prompts)
        eval_prompts = tasks.make_prompts(max(kc.eval_prompts // 2, B), kc.data_seed + 500_009)
        _, eval_pairs = toy_pools(
            loaded, dataclasses.replace(kc, mix="offpolicy"), config.seed, eval_prompts
        )
    elif kc.source == "jsonl":
        if kc.mix != "offpolicy":
            raise ConfigError(
                f"data.kind_config.mix={kc.mix!r} with source='jsonl': on-policy pairs need a "
                "programmatic "
                "reward; use mix='offpolicy' (or source='toy')"
            )
        if not kc.offpolicy_paths:
            raise ConfigError("data.kind_config.offpolicy_paths is empty (source='jsonl')")
        on, off = [], pairs_lib.pairs_from_records(read_jsonl(kc.offpolicy_paths))
        eval_pairs = off[: max(B * int(config.data.eval_batches), B)]
    else:
        raise ConfigError(f"data.kind_config.source={kc.source!r}; expected 'toy' or 'jsonl'")
    needs_on = kc.mix == "onpolicy" or (kc.mix == "simplemix" and kc.ratio > 0)
    if needs_on and not on:
        raise ConfigError(
            "no on-policy pairs: every prompt's samples scored the same (raise n_samples or "
            "temperature, "
            "or train the SFT model longer)"
        )
    stream = pairs_lib.mixture(on, off, n_pairs, config.seed, kc.mix, kc.ratio)
    rows = pair_rows(tok, stream, template, T)
    rows["ref_logps"] = reference_logps(loaded, rows, B)
    train = chat.RowDataset(
        rows, batch_size=B, seed=config.seed, shuffle=False
    )  # the stream, in order
    eval_rows = pair_rows(tok, eval_pairs, template, T)
    eval_rows["ref_logps"] = reference_logps(loaded, eval_rows, B)
    eval_batches = chat.all_batches(eval_rows, B, pad_rows=False)[: int(config.data.eval_batches)]
    info = {
        "pairs/onpolicy_pool": len(on),
        "pairs/offpolicy_pool": len(off),
        "pairs/onpolicy_fraction": pairs_lib.onpolicy_fraction(stream),
    }
    if kc.source == "toy":
        info.update(toy_reward_report(loaded, kc.eval_prompts, kc.data_seed, prefix="sft_reward"))

    def finish(cfg, graphdef, state, wd):
        out = dict(info)
        out.update(finish_save(kc, graphdef, state, wd))
        if kc.source == "toy":
            out.update(
                toy_reward_report(
                    as_model(cfg, graphdef, state, tok), kc.eval_prompts, kc.data_seed
                )
            )
        return out

    summary = (
        f"preference data ({kc.source}, {kc.mix}, r={kc.ratio}): pools on {len(on)} / "
        f"off {len(off)} pairs; "
        f"stream {len(stream)} pairs, on-policy fraction {info['pairs/onpolicy_fraction']:.3f}"
    )
    return DataSpec(
        tok, train, eval_batches, B * T, summary=summary, finish=finish, **model_hooks(kc, loaded)
    )


DATA_KIND.register("preference", build_preference, config=PreferenceDataConfig)

__all__ = [
    "PreferenceDataConfig",
    "build_preference",
    "encode_pair",
    "pair_rows",
    "reference_logps",
    "toy_pools",
]
