"""Offline text corpora for evaluation: Debian's ``python3.11-doc`` English prose (the ``.rst.txt``
sources of the Python documentation) or any text files, split by file into calibration and held-out
token streams (first 80% / last 20% of the sorted files; no overlap).

The prose lives under ``$PALLASITE_DATA`` (default ``~/.cache/pallasite``); ``python_doc_dir``
fetches the Debian package there once (``apt-get download python3.11-doc``; ``dpkg -x``).
"""

from __future__ import annotations

import glob
import os
import subprocess
import tempfile

import numpy as np

DOC_SOURCES = "usr/share/doc/python3.11/html/_sources"


def python_doc_dir(cache_root: str | None = None) -> str:
    """Directory of the python3.11-doc ``.rst.txt`` sources, downloading the Debian package once."""
    root = cache_root or os.environ.get("PALLASITE_DATA") or os.path.expanduser("~/.cache/pallasite")
    target = os.path.join(root, "python3.11-doc")
    src = os.path.join(target, DOC_SOURCES)
    if glob.glob(os.path.join(src, "**", "*.rst.txt"), recursive=True):
        return src
    os.makedirs(target, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            subprocess.run(["apt-get", "download", "python3.11-doc"], cwd=tmp, check=True, capture_output=True)
            debs = glob.glob(os.path.join(tmp, "python3.11-doc_*.deb"))
            subprocess.run(["dpkg", "-x", debs[0], target], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError, IndexError) as e:
            raise RuntimeError(
                "Could not fetch Debian's python3.11-doc (apt-get download python3.11-doc; dpkg -x). "
                "Pass --text PATH with English text instead.") from e
    return src


def load_texts(path: str | None) -> list[str]:
    if path is None:
        path = python_doc_dir()
    if os.path.isfile(path):
        return [open(path, encoding="utf-8", errors="replace").read()]
    files = sorted(glob.glob(os.path.join(path, "**", "*.rst.txt"), recursive=True)
                   or glob.glob(os.path.join(path, "**", "*.txt"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no .txt files under {path}")
    return [open(f, encoding="utf-8", errors="replace").read() for f in files]


def token_streams(tokenizer, texts: list[str], max_tokens: int,
                  max_eval_tokens: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(calibration stream, evaluation stream): split by file 80/20, tokenized, capped at
    ``max_tokens`` (calibration) and ``max_eval_tokens`` (evaluation; default the same cap). The
    evaluation windows are the stream's first windows, so a longer cap never changes them."""
    cut = int(len(texts) * 0.8)

    def encode(parts, cap):
        ids = []
        for t in parts:
            ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
            if len(ids) >= cap:
                break
        return np.asarray(ids[:cap], np.int32)

    return encode(texts[:cut], max_tokens), encode(texts[cut:], max_tokens if max_eval_tokens is None else max_eval_tokens)
