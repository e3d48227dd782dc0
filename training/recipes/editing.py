"""A synthetic-facts world for knowledge editing (OVERTONE, recipes.md §2): the ``facts`` data kind
pretrains a model on it, the ``edit`` data kind edits facts of that model with CE or OVERTONE.

World (seeded): people ``s`` with a birthplace city and an employer, cities (two-word, multi-token
names) that lie in countries. Sentences (``facts`` pretraining, plain LM loss on every token):

    "{s} was born in {city}, a city in {country}."     the edit template; its tail is the 2nd hop
    "The birthplace of {s} is {city}."                  paraphrase (generality)
    "{s} works for {company}."                          another relation (locality on edited people)
    "{city} is a city in {country}."                    city facts

An edit moves ``s``'s birthplace to a city in another country and trains only "{s} was born in" →
" {new city}" (prompt masked). Measured by greedy generation after the edit (``edit_metrics``):
reliability (the edit prompt yields the new city), generality (the paraphrase does), locality
(unedited people's birthplaces and edited people's employers are what the unedited model said),
portability (the continuation "…, a city in {country}" names the *new* city's country — the two-hop
consequence, never trained in the edit). HTO (``hto``): per fact, the variance across its target
tokens of the first step at which teacher-forced p(y_t) > 0.9 (never: steps + 1).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

import numpy as np

from pallasite.errors import ConfigError
from pallasite.training.data import DATA_KIND, DataSpec
from pallasite.training.recipes import chat
from pallasite.training.recipes.model_init import (
    InitFields,
    finish_save,
    load_start_model,
    model_hooks,
)

FIRST = (
    "Ada",
    "Boris",
    "Cora",
    "Dmitri",
    "Elin",
    "Farid",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Kira",
    "Lior",
    "Mara",
    "Nils",
    "Olga",
    "Pavel",
    "Rhea",
    "Soren",
    "Tess",
    "Umar",
)
LAST = (
    "Achterberg",
    "Brennholt",
    "Castellan",
    "Dravnik",
    "Everwood",
    "Falkirk",
    "Gorunov",
    "Halloran",
    "Istvan",
    "Jorvik",
    "Kestrel",
    "Lindqvist",
    "Morrow",
    "Novak",
    "Ostrander",
    "Pryce",
    "Quillon",
    "Ravensk",
)
CITY_A = ("Port", "San", "New", "Fort", "Lake", "Mount", "East", "Saint")
CITY_B = (
    "Vela",
    "Orin",
    "Tamsk",
    "Brevik",
    "Calder",
    "Myrra",
    "Zolt",
    "Ardent",
    "Quessa",
    "Lunet",
    "Harrow",
    "Pell",
)
COUNTRIES = ("Veloria", "Kastrand", "Ombria", "Teshlan", "Arvania", "Dunmere")
COMPANIES = (
    "Helix Works",
    "Norland Mills",
    "Corvid Labs",
    "Tallow Freight",
    "Brightwater Bank",
    "Ironleaf Foods",
    "Quartz Media",
    "Solent Motors",
)


@dataclasses.dataclass(frozen=True)
class World:
    subjects: tuple
    city_country: tuple  # (city, country) pairs
    born_in: tuple  # city per subject
    works_for: tuple  # company per subject

    @property
    def cities(self):
        return tuple(c for c, _ in self.city_country)

    def country(self, city: str) -> str:
        return dict(self.city_country)[city]


def make_world(
    n_subjects: int = 120, n_cities: int = 16, n_countries: int = 4, seed: int = 0
) -> World:
    rng = np.random.default_rng([seed, 31])
    names = [f"{first} {last}" for first in FIRST for last in LAST]
    if n_subjects > len(names):
        raise ConfigError(f"make_world: at most {len(names)} subjects, got {n_subjects}")
    subjects = tuple(names[i] for i in rng.permutation(len(names))[:n_subjects])
    cities_all = [f"{a} {b}" for a in CITY_A for b in CITY_B]
    cities = [cities_all[i] for i in rng.permutation(len(cities_all))[:n_cities]]
    countries = COUNTRIES[:n_countries]
    city_country = tuple((c, countries[i % n_countries]) for i, c in enumerate(cities))
    born = tuple(cities[int(rng.integers(n_cities))] for _ in subjects)
    works = tuple(COMPANIES[int(rng.integers(len(COMPANIES)))] for _ in subjects)
    return World(subjects, city_country, born, works)


def edit_prompt(s: str) -> str:
    return f"{s} was born in"


def paraphrase_prompt(s: str) -> str:
    return f"The birthplace of {s} is"


def work_prompt(s: str) -> str:
    return f"{s} works for"


def sentences(world: World, city_repeats: int = 4) -> list[str]:
    out = []
    for s, city, comp in zip(world.subjects, world.born_in, world.works_for):
        out += [
            f"{edit_prompt(s)} {city}, a city in {world.country(city)}.",
            f"{paraphrase_prompt(s)} {city}.",
            f"{work_prompt(s)} {comp}.",
        ]
    out += [f"{c} is a city in {k}." for c, k in world.city_country for _ in range(city_repeats)]
    return out


@dataclasses.dataclass(frozen=True)
class Edit:
    subject: str
    old_city: str
    new_city: str
    new_country: str


def choose_edits(world: World, n_edits: int, seed: int) -> list[Edit]:
    """``n_edits`` people, each moved to a city in a different country (seeded)."""
    rng = np.random.default_rng([seed, 47])
    idx = rng.permutation(len(world.subjects))[:n_edits]
    out = []
    for i in idx:
        old = world.born_in[i]
        options = [c for c in world.cities if world.country(c) != world.country(old)]
        new = options[int(rng.integers(len(options)))]
        out.append(Edit(world.subjects[i], old, new, world.country(new)))
    return out


# ----------------------------------------------------------------------------- data kinds
@dataclasses.dataclass(frozen=True)
class FactsDataConfig(InitFields):
    n_subjects: int = 120
    n_cities: int = 16
    n_countries: int = 4
    world_seed: int = 0
    city_repeats: int = 4


@dataclasses.dataclass(frozen=True)
class EditDataConfig(FactsDataConfig):
    n_edits: int = 24
    edit_seed: int = 0
    n_locality: int = 48  # unedited people checked for locality
    eval_tokens: int = 16  # greedy tokens generated per evaluation prompt


def _world(kc: FactsDataConfig) -> World:
    return make_world(kc.n_subjects, kc.n_cities, kc.n_countries, kc.world_seed)


def _text_example(tokenizer, text: str, eos: int):
    ids = np.asarray(list(tokenizer.encode(text, add_special_tokens=False)) + [eos], np.int32)
    return ids, np.ones(len(ids), np.float32)


def _fact_tokenizer(config, workdir, texts, loaded):
    from pallasite.training.recipes.sft_data import chat_tokenizer

    return chat_tokenizer(config, workdir, texts, loaded)


def build_facts(config, workdir: str, kc: FactsDataConfig) -> DataSpec:
    world = _world(kc)
    texts = sentences(world, kc.city_repeats)
    loaded = load_start_model(kc)
    tok = _fact_tokenizer(config, workdir, texts, loaded)
    eos = int(tok.eos_token_id)
    examples = [_text_example(tok, t, eos) for t in texts]
    T, B = int(config.data.seq_len), int(config.data.batch_size)
    pad = int(tok.pad_token_id or 0)
    order = np.random.default_rng([config.seed, 5]).permutation(len(examples))
    train = chat.RowDataset(
        chat.pack_examples(examples, T, pad_id=pad, order=order), batch_size=B, seed=config.seed
    )
    eval_batches = chat.all_batches(chat.pack_examples(examples, T, pad_id=pad), B)[
        : int(config.data.eval_batches)
    ]
    hooks = model_hooks(kc, loaded)
    if "model_config" not in hooks:
        from pallasite.training.loop import model_config_for

        hooks["model_config"] = model_config_for(config, tok)

    def finish(cfg, graphdef, state, wd):
        from pallasite.training.recipes.sft_data import as_model

        model = as_model(cfg, graphdef, state, tok)
        probe = choose_edits(world, min(32, len(world.subjects)), 10_000)
        texts_ = greedy(model, [edit_prompt(e.subject) for e in probe], 16)
        known = [t.startswith(" " + e.old_city + ",") for e, t in zip(probe, texts_)]
        chain = [parse_country(t) == world.country(e.old_city) for e, t in zip(probe, texts_)]
        return {"facts/recall": float(np.mean(known)), "facts/two_hop": float(np.mean(chain))}

    summary = (
        f"facts data: {len(world.subjects)} people, {len(world.cities)} cities, "
        f"{len(texts)} sentences "
        f"-> {train.num_rows} rows ({train.batches_per_epoch} batches/epoch)"
    )
    return DataSpec(tok, train, eval_batches, B * T, summary=summary, finish=finish, **hooks)


def greedy(model, prompts: Sequence[str], max_new_tokens: int) -> list[str]:
    """Greedy continuations (decoded text, stop token excluded) of plain-text prompts."""
    from pallasite.inference.engine import generate_ids
    from pallasite.training.preference.sampler import decode_response, stop_ids

    tok = model.tokenizer
    ids = [list(tok.encode(p, add_special_tokens=False)) for p in prompts]
    stops = stop_ids(model)
    out = generate_ids(
        model.graphdef,
        model.state,
        model.config,
        ids,
        max_new_tokens=int(max_new_tokens),
        temperature=0.0,
        stop_tokens=stops,
    )
    return [decode_response(tok, o, stops) for o in out]


_COUNTRY = re.compile(r", a city in (\w+)")


def parse_country(text: str) -> Optional[str]:
    m = _COUNTRY.search(text)
    return None if m is None else m.group(1)


def edit_rows(tokenizer, edits: Sequence[Edit], seq_len: int) -> dict:
    """One edit per row: prompt tokens masked, the new city's tokens learned."""
    examples = []
    for e in edits:
        p = list(tokenizer.encode(edit_prompt(e.subject), add_special_tokens=False))
        t = list(tokenizer.encode(" " + e.new_city, add_special_tokens=False))
        examples.append(
            (
                np.asarray(p + t, np.int32),
                np.r_[np.zeros(len(p)), np.ones(len(t))].astype(np.float32),
            )
        )
    return chat.pack_examples(
        examples, seq_len, pad_id=int(tokenizer.pad_token_id or 0), max_segments=1
    )


def baseline_outputs(model, world: World, edits: Sequence[Edit], kc: EditDataConfig) -> dict:
    """What the unedited model says on the locality prompts (the reference for locality)."""
    edited = {e.subject for e in edits}
    others = [s for s in world.subjects if s not in edited][: kc.n_locality]
    loc_prompts = [edit_prompt(s) for s in others] + [work_prompt(e.subject) for e in edits]
    return {"prompts": loc_prompts, "outputs": greedy(model, loc_prompts, kc.eval_tokens)}


def edit_metrics(model, edits: Sequence[Edit], baseline: dict, eval_tokens: int = 16) -> dict:
    """reliability, generality, locality, portability of an edited model (greedy generation)."""
    rel = greedy(model, [edit_prompt(e.subject) for e in edits], eval_tokens)
    gen = greedy(model, [paraphrase_prompt(e.subject) for e in edits], eval_tokens)
    loc = greedy(model, baseline["prompts"], eval_tokens)
    return {
        "reliability": float(np.mean([t.startswith(" " + e.new_city) for e, t in zip(edits, rel)])),
        "generality": float(np.mean([t.startswith(" " + e.new_city) for e, t in zip(edits, gen)])),
        "locality": float(np.mean([a == b for a, b in zip(loc, baseline["outputs"])])),
        "portability": float(
            np.mean([parse_country(t) == e.new_country for e, t in zip(edits, rel)])
        ),
    }


def target_token_probs(model_fn, rows: dict):
    """p(y_t) at every learned position of edit rows: float32 [R, T] (0 elsewhere)."""
    import jax
    import jax.numpy as jnp

    logits = model_fn(rows)
    lp = jax.nn.log_softmax(logits, -1)
    p = jnp.exp(jnp.take_along_axis(lp, jnp.asarray(rows["targets"])[..., None], -1)[..., 0])
    return p * jnp.asarray(rows["loss_mask"])


def hto(prob_history: np.ndarray, mask: np.ndarray, threshold: float = 0.9) -> dict:
    """HTO from per-step target probabilities ``prob_history`` [S, R, T] (step 0 = before editing):
    per fact (row), the variance across its target tokens of the first step with p > threshold
    (steps that never cross count as S); returns the mean variance and the mean crossing step."""
    S = prob_history.shape[0]
    crossed = prob_history > threshold
    first = np.where(crossed.any(0), crossed.argmax(0), S).astype(np.float64)  # [R, T]
    variances, steps = [], []
    for r in range(mask.shape[0]):
        f = first[r][mask[r] > 0]
        if len(f):
            variances.append(float(np.var(f)))
            steps.append(float(np.mean(f)))
    return {"hto_variance": float(np.mean(variances)), "hto_mean_step": float(np.mean(steps))}


def build_edit(config, workdir: str, kc: EditDataConfig) -> DataSpec:
    if not kc.init_from:
        raise ConfigError(
            "the edit data kind edits a model trained on the facts world: set "
            "data.kind_config.init_from "
            "(e.g. the workdir of configs/recipes/overtone.py's facts stage, data.kind='facts')"
        )
    loaded = load_start_model(kc)
    world = _world(kc)
    edits = choose_edits(world, kc.n_edits, kc.edit_seed)
    tok = loaded.tokenizer
    rows = edit_rows(tok, edits, int(config.data.seq_len))
    B = int(config.data.batch_size)
    if len(rows["tokens"]) % B:
        raise ConfigError(
            f"edit data: {len(rows['tokens'])} edits must fill whole batches of "
            f"data.batch_size={B} "
            "(use batch_size = n_edits for batch editing)"
        )
    train = chat.RowDataset(rows, batch_size=B, seed=config.seed, shuffle=False)
    baseline = baseline_outputs(loaded, world, edits, kc)
    before = edit_metrics(loaded, edits, baseline, kc.eval_tokens)

    def finish(cfg, graphdef, state, wd):
        from pallasite.training.recipes.sft_data import as_model

        out = {f"before/{k}": v for k, v in before.items()}
        out.update(finish_save(kc, graphdef, state, wd))
        out.update(
            edit_metrics(as_model(cfg, graphdef, state, tok), edits, baseline, kc.eval_tokens)
        )
        return out

    n_loc = len(baseline["prompts"])
    summary = f"edit data: {len(edits)} edits (batch editing), {n_loc} locality prompts"
    spec = DataSpec(
        tok,
        train,
        train.first_batches(1),
        B * int(config.data.seq_len),
        summary=summary,
        finish=finish,
        **model_hooks(kc, loaded),
    )
    spec.edit_rows, spec.edits = rows, edits  # for HTO tracking by callers (benchmarks/recipes.py)
    return spec


DATA_KIND.register("facts", build_facts, config=FactsDataConfig)
DATA_KIND.register("edit", build_edit, config=EditDataConfig)

__all__ = [
    "World",
    "Edit",
    "make_world",
    "sentences",
    "choose_edits",
    "edit_prompt",
    "paraphrase_prompt",
    "work_prompt",
    "FactsDataConfig",
    "EditDataConfig",
    "build_facts",
    "build_edit",
    "greedy",
    "parse_country",
    "edit_rows",
    "baseline_outputs",
    "edit_metrics",
    "target_token_probs",
    "hto",
]
