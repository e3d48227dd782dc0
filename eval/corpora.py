"""Offline text corpora for evaluation and calibration: Debian's ``python3.11-doc`` English prose
(the ``.rst.txt`` sources of the Python documentation) or any text files, split by file into
calibration and held-out token streams (first 80% / last 20% of the sorted files; a single text is
split at 80% of its characters; no overlap).

The prose lives under ``$PALLASITE_DATA`` (default ``~/.cache/pallasite``). Nothing is downloaded
at run time: when it is missing, ``python_doc_dir`` fails naming the two commands that fetch it
(``apt-get download python3.11-doc`` and ``dpkg -x``) and the ``--text`` alternative.
"""

from __future__ import annotations

import glob
import os

import numpy as np

DOC_SOURCES = "usr/share/doc/python3.11/html/_sources"


def python_doc_dir(cache_root: str | None = None) -> str:
    """Directory of the python3.11-doc ``.rst.txt`` sources under the data root."""
    root = cache_root or os.environ.get("PALLASITE_DATA") or os.path.expanduser("~/.cache/pallasite")
    target = os.path.join(root, "python3.11-doc")
    src = os.path.join(target, DOC_SOURCES)
    if glob.glob(os.path.join(src, "**", "*.rst.txt"), recursive=True):
        return src
    raise FileNotFoundError(
        f"the python3.11-doc prose is not under {target}. Fetch it once (Debian/Ubuntu):\n"
        f"    apt-get download python3.11-doc && dpkg -x python3.11-doc_*.deb {target}\n"
        "(set PALLASITE_DATA to use another data root), or pass your own English text with "
        "--text FILE|DIR (or --text stdlib for the Python sources, always available).")


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
    if len(texts) == 1:  # one file: split its characters instead of the (single) file
        cut_at = int(len(texts[0]) * 0.8)
        texts = [texts[0][:cut_at], texts[0][cut_at:]]
    cut = int(len(texts) * 0.8)

    def encode(parts, cap):
        if cap <= 0:
            return np.zeros((0,), np.int32)
        ids = []
        for t in parts:
            ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
            if len(ids) >= cap:
                break
        return np.asarray(ids[:cap], np.int32)

    eval_tokens = max_tokens if max_eval_tokens is None else max_eval_tokens
    return encode(texts[:cut], max_tokens), encode(texts[cut:], eval_tokens)
