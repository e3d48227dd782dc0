"""Corpora, deterministic sequence packing and a resumable batch iterator.

Sources yield ``Document(doc_id, text)`` in a fixed order: ``stdlib`` (the local Python stdlib's
``.py`` files, tests and site-packages excluded; always there), ``text`` (files or globs, one
document per file), ``jsonl`` (one record per line, text in ``data.field``). Held-out split: a
document is eval iff ``crc32(doc_id) % 100 < heldout_percent``; ``max_bytes`` keeps a deterministic
subset spread over the corpus. Packing: ``ids + [eos]`` per document, concatenated per epoch in a
seeded order, cut into rows of ``T + 1`` tokens with stride ``T``; ``segment_ids`` keep attention
inside a document, ``positions`` restart per document, ``loss_mask`` drops targets across a
document boundary; rows are shuffled and grouped into batches of ``B``. ``BatchIterator.state()``
(epoch, batch, seed, data fingerprint) restores exactly the next batch, and refuses other data.
``heldout_batches`` is the fixed eval set the loop and ``pallasite eval`` share. docs/training.md.
Data kinds (``config.data.kind``, default ``"lm"``; options in ``config.data.kind_config``): the
loop asks ``DATA_KIND.get(kind)(config, workdir, kind_config)`` for a ``DataSpec`` (tokenizer,
resumable train dataset, eval batches, optional start model / export / finish hooks); ``lm`` is the
pipeline above, post-training recipes (SFT, preference pairs, edits, code) register their own.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import sysconfig
import zlib
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import numpy as np

from pallasite.errors import ConfigError, DataError, InputError, ResumeError
from pallasite.registry import Registry

_STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__",
                     "lib2to3", "turtledemo"}


@dataclasses.dataclass(frozen=True)
class Document:
    doc_id: str
    text: str


def _is_heldout(doc_id: str, heldout_percent: float) -> bool:
    return (zlib.crc32(doc_id.encode()) % 100) < heldout_percent


def _take_budget(docs: list[Document], max_bytes: int) -> list[Document]:
    """A deterministic spread-out subset: crc32 order until ``max_bytes`` is reached, then
    back in the source order."""
    if not max_bytes:
        return docs
    order = sorted(range(len(docs)), key=lambda i: (zlib.crc32(docs[i].doc_id.encode(), 7), docs[i].doc_id))
    kept, total = set(), 0
    for i in order:
        if total >= max_bytes:
            break
        kept.add(i)
        total += len(docs[i].text.encode())
    return [d for i, d in enumerate(docs) if i in kept]


def stdlib_documents(root: Optional[str] = None) -> list[Document]:
    """All stdlib ``.py`` files (sorted relative paths; ids are the relative paths)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _STDLIB_SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue  # a few stdlib files are latin-1 test fixtures; skipping keeps ids stable
            if text.strip():
                out.append(Document(os.path.relpath(path, root), text))
    out.sort(key=lambda d: d.doc_id)
    if not out:
        raise FileNotFoundError(f"stdlib corpus: no .py files under {root!r}")
    return out


def _expand(paths: Sequence[str]) -> list[str]:
    files = []
    for p in paths:
        matches = sorted(glob.glob(os.path.expanduser(p), recursive=True))
        if not matches:
            raise FileNotFoundError(f"data path {p!r} matches no file")
        files.extend(m for m in matches if os.path.isfile(m))
    return files


def text_documents(paths: Sequence[str]) -> list[Document]:
    docs = []
    for path in _expand(paths):
        with open(path, encoding="utf-8", errors="replace") as f:
            docs.append(Document(path, f.read()))
    return docs


def jsonl_documents(paths: Sequence[str], field: str = "text") -> list[Document]:
    docs = []
    for path in _expand(paths):
        opener = open
        if path.endswith(".gz"):
            import gzip

            opener = gzip.open
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(record, dict) or field not in record:
                    fields = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(f"{path}:{lineno}: jsonl record has no field {field!r} "
                                    f"(the text field; set it with data.field / --field); "
                                    f"fields: {fields}")
                docs.append(Document(f"{path}:{lineno}", str(record[field])))
    return docs


def load_documents(data_cfg) -> tuple[list[Document], list[Document]]:
    """(train_docs, eval_docs) for a ``config.data`` group (see configs.train_defaults)."""
    source = data_cfg.source
    if source == "stdlib":
        docs = stdlib_documents()
    elif source == "text":
        docs = text_documents(list(data_cfg.paths))
    elif source == "jsonl":
        docs = jsonl_documents(list(data_cfg.paths), data_cfg.field)
    else:
        raise ConfigError(f"data.source={source!r}; expected stdlib | text | jsonl")
    if not docs:
        raise ConfigError(f"data.source={source!r} with paths={list(data_cfg.paths)} gave no documents")
    if data_cfg.eval_paths:
        eval_docs = (jsonl_documents(list(data_cfg.eval_paths), data_cfg.field) if source == "jsonl"
                     else text_documents(list(data_cfg.eval_paths)))
        train_docs = docs
    else:
        train_docs = [d for d in docs if not _is_heldout(d.doc_id, data_cfg.heldout_percent)]
        eval_docs = [d for d in docs if _is_heldout(d.doc_id, data_cfg.heldout_percent)]
    train_docs = _take_budget(train_docs, data_cfg.max_train_bytes)
    eval_docs = _take_budget(eval_docs, data_cfg.max_eval_bytes)
    if not train_docs or not eval_docs:
        raise ConfigError(f"data split is empty: {len(train_docs)} train / {len(eval_docs)} eval documents "
                          f"(heldout_percent={data_cfg.heldout_percent})")
    return train_docs, eval_docs


def tokenize_documents(tokenizer, docs: Sequence[Document], eos_id: int, batch: int = 256) -> list[np.ndarray]:
    """``ids + [eos]`` per document (int32)."""
    from pallasite.models.tokenizer import encode_batch

    out = []
    for i in range(0, len(docs), batch):
        for ids in encode_batch(tokenizer, [d.text for d in docs[i:i + batch]]):
            out.append(np.asarray(list(ids) + [eos_id], dtype=np.int32))
    return out


# ----------------------------------------------------------------------------- packing
def pack_stream(doc_tokens: Sequence[np.ndarray], order: np.ndarray, seq_len: int) -> dict[str, np.ndarray]:
    """Pack documents (in ``order``) into rows; returns arrays [R, T] (see module docstring)."""
    T = seq_len
    stream = np.concatenate([doc_tokens[i] for i in order]) if len(order) else np.zeros((0,), np.int32)
    # doc index of every stream token, so segment boundaries are known after chunking
    doc_of = np.repeat(np.arange(len(order), dtype=np.int64), [len(doc_tokens[i]) for i in order])
    n_rows = (len(stream) - 1) // T
    if n_rows <= 0:
        raise ConfigError(f"packing: {len(stream)} tokens cannot fill one row of seq_len={T} (+1 target)")
    idx = np.arange(n_rows)[:, None] * T + np.arange(T + 1)[None, :]  # [R, T+1], stride T
    row_tok, row_doc = stream[idx], doc_of[idx]
    tokens, targets = row_tok[:, :-1], row_tok[:, 1:]
    doc_in, doc_tgt = row_doc[:, :-1], row_doc[:, 1:]
    new_seg = np.concatenate([np.ones((n_rows, 1), bool), doc_in[:, 1:] != doc_in[:, :-1]], axis=1)
    segment_ids = np.cumsum(new_seg, axis=1).astype(np.int32)
    # positions: index minus the index where the current segment started
    col = np.broadcast_to(np.arange(T), (n_rows, T))
    seg_start = np.maximum.accumulate(np.where(new_seg, col, 0), axis=1)
    positions = (col - seg_start).astype(np.int32)
    loss_mask = (doc_in == doc_tgt).astype(np.float32)
    return dict(tokens=tokens.astype(np.int32), targets=targets.astype(np.int32), positions=positions,
                segment_ids=segment_ids, loss_mask=loss_mask)


class PackedDataset:
    """Token documents -> seeded, packed [B, T] batches; ``iterator(state)`` resumes exactly."""

    def __init__(self, doc_tokens: Sequence[np.ndarray], *, seq_len: int, batch_size: int, seed: int,
                 shuffle: bool = True):
        if not doc_tokens:
            raise ValueError("PackedDataset: no documents")
        self.doc_tokens = list(doc_tokens)
        self.seq_len, self.batch_size, self.seed, self.shuffle = int(seq_len), int(batch_size), int(seed), shuffle
        self.num_tokens = int(sum(len(d) for d in self.doc_tokens))
        self.batches_per_epoch = ((self.num_tokens - 1) // self.seq_len) // self.batch_size
        if self.batches_per_epoch < 1:
            raise ConfigError(f"PackedDataset: {self.num_tokens} tokens give fewer than one batch of "
                             f"{self.batch_size} x {self.seq_len}; use more data or a smaller batch")
        h = hashlib.sha256()
        for d in self.doc_tokens:
            h.update(np.asarray(len(d), np.int64).tobytes())
            h.update(d[: min(len(d), 64)].tobytes())
        h.update(f"{self.seq_len},{self.batch_size},{self.seed},{self.shuffle}".encode())
        self.fingerprint = h.hexdigest()[:16]
        self._epoch_cache: tuple[int, dict] | None = None

    def epoch_rows(self, epoch: int) -> dict[str, np.ndarray]:
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1]
        n = len(self.doc_tokens)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(n)
            rows = pack_stream(self.doc_tokens, order, self.seq_len)
            perm = rng.permutation(len(rows["tokens"]))
            rows = {k: v[perm] for k, v in rows.items()}
        else:
            rows = pack_stream(self.doc_tokens, np.arange(n), self.seq_len)
        self._epoch_cache = (epoch, rows)
        return rows

    def batch(self, epoch: int, index: int, rows: Optional[tuple[int, int]] = None) -> dict[str, np.ndarray]:
        """Batch ``index`` of ``epoch``; ``rows=(start, stop)`` takes only those rows of it (a
        process's share in a multi-process run)."""
        epoch_rows = self.epoch_rows(epoch)
        lo, hi = (0, self.batch_size) if rows is None else rows
        if not 0 <= lo <= hi <= self.batch_size:
            raise ValueError(f"PackedDataset.batch: rows {rows} outside the batch of {self.batch_size}")
        base = index * self.batch_size
        return {k: v[base + lo:base + hi] for k, v in epoch_rows.items()}

    def iterator(self, state: Optional[dict] = None) -> "BatchIterator":
        it = BatchIterator(self)
        if state is not None:
            it.restore(state)
        return it

    def first_batches(self, n: int) -> list[dict[str, np.ndarray]]:
        """The first ``n`` batches of epoch 0 (fixed eval set); fewer if the data is smaller."""
        return [self.batch(0, i) for i in range(min(n, self.batches_per_epoch))]


class BatchIterator(Iterator[dict]):
    def __init__(self, dataset: PackedDataset):
        self.dataset = dataset
        self.epoch = 0
        self.index = 0

    def __next__(self) -> dict[str, np.ndarray]:
        return self.dataset.batch(*self.next_position())

    def next_position(self) -> tuple[int, int]:
        """(epoch, batch index) of the next batch, advancing past it (``dataset.batch(*pos,
        rows=...)`` then reads any part of it)."""
        if self.index >= self.dataset.batches_per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        pos = (self.epoch, self.index)
        self.index += 1
        return pos

    def state(self) -> dict:
        """JSON-able position: the *next* batch to be produced."""
        return {"epoch": int(self.epoch), "batch": int(self.index), "seed": self.dataset.seed,
                "fingerprint": self.dataset.fingerprint}

    def restore(self, state: dict) -> None:
        if state.get("fingerprint") != self.dataset.fingerprint or state.get("seed") != self.dataset.seed:
            raise ResumeError(f"data iterator state {state} was saved for different data (fingerprint/seed "
                             f"{state.get('fingerprint')}/{state.get('seed')}, this dataset has "
                             f"{self.dataset.fingerprint}/{self.dataset.seed}); the data order would change")
        self.epoch, self.index = int(state["epoch"]), int(state["batch"])


def heldout_batches(data_cfg, tokenizer, eval_docs: Sequence[Document]) -> list[dict]:
    """The fixed evaluation set of a run: the held-out documents tokenized with ``eos``, packed in
    source order (no shuffling) into ``data.seq_len`` rows, the first ``data.eval_batches`` batches
    of ``data.batch_size`` rows. The training loop and ``pallasite eval --data heldout`` use it."""
    eos = int(tokenizer.eos_token_id)
    ds = PackedDataset(tokenize_documents(tokenizer, eval_docs, eos), seq_len=data_cfg.seq_len,
                       batch_size=data_cfg.batch_size, seed=0, shuffle=False)
    return ds.first_batches(data_cfg.eval_batches)


def describe_heldout(data_cfg, eval_docs: Sequence[Document], batches: Sequence[dict]) -> str:
    """One line saying which documents and windows an evaluation used, so numbers are comparable."""
    if data_cfg.eval_paths:
        split = f"the eval_paths files ({len(eval_docs)} documents)"
    else:
        unit = "files" if data_cfg.source in ("stdlib", "text") else "lines"
        split = (f"the {data_cfg.source} held-out split ({data_cfg.heldout_percent}% of {unit} by "
                 f"crc32 of the path: {len(eval_docs)} documents")
        split += f", {data_cfg.max_eval_bytes:,}-byte budget)" if data_cfg.max_eval_bytes else ")"
    n_rows = sum(len(b["tokens"]) for b in batches)
    scored = int(sum(float(b["loss_mask"].sum()) for b in batches))
    return (f"{split}; {n_rows} packed windows of {data_cfg.seq_len} tokens ({len(batches)} "
            f"batches of {data_cfg.batch_size}), {scored:,} scored tokens (targets across a "
            f"document boundary not scored)")


def unigram_entropy(batches: Iterable[dict]) -> float:
    """Entropy (nats/token) of the empirical unigram distribution of the masked targets: the
    cross-entropy of the best context-free predictor fitted *on this very data* — a model whose
    eval loss is below it has learned to use context."""
    counts: dict[int, int] = {}
    for b in batches:
        t = b["targets"][b["loss_mask"] > 0]
        ids, c = np.unique(t, return_counts=True)
        for i, n in zip(ids.tolist(), c.tolist()):
            counts[i] = counts.get(i, 0) + n
    total = sum(counts.values())
    p = np.asarray(list(counts.values()), np.float64) / total
    return float(-(p * np.log(p)).sum())


# ----------------------------------------------------------------------------- data kinds
# kind -> module that registers it (imported on first use; see pallasite.registry)
DATA_KIND = Registry("data_kind", {
    "lm": "pallasite.training.loop",
    "sft": "pallasite.training.recipes.sft_data",
    "code_cot": "pallasite.training.recipes.code_cot",
    "facts": "pallasite.training.recipes.editing",
    "edit": "pallasite.training.recipes.editing",
    "preference": "pallasite.training.preference.data",
})


@dataclasses.dataclass
class DataSpec:
    """What a data kind hands the training loop. ``train`` has ``iterator(state)``,
    ``num_tokens`` and ``batches_per_epoch`` (``PackedDataset``'s protocol); the optional hooks
    replace the loop's defaults: ``model_config`` (else ``config.model`` + tokenizer),
    ``init_state`` / ``abstract_state`` (``(cfg, optimizer, mesh, rules, seed) -> (graphdef,
    state|abstract, shardings)``, else a fresh model), ``export(cfg, graphdef, state) -> (cfg,
    params)`` for the final HF export, and ``finish(cfg, graphdef, state, workdir) -> dict`` whose
    entries join the run's result (e.g. rewards or pass@1 measured after training)."""

    tokenizer: Any
    train: Any
    eval_batches: list
    tokens_per_batch: int
    summary: str = ""
    unigram_entropy: float = float("nan")
    model_config: Any = None
    init_state: Optional[Callable] = None
    abstract_state: Optional[Callable] = None
    export: Optional[Callable] = None
    finish: Optional[Callable] = None


def data_kind_of(data_cfg) -> tuple[str, Any]:
    """(kind, raw sub-config) of a ``config.data`` group (``kind`` absent = ``"lm"``)."""
    kind = data_cfg.get("kind", "lm") if hasattr(data_cfg, "get") else "lm"
    raw = data_cfg.get("kind_config", None) if hasattr(data_cfg, "get") else None
    if hasattr(raw, "to_dict"):
        raw = raw.to_dict()
    return kind, raw


def build_data(config, workdir: str) -> DataSpec:
    """The ``DataSpec`` of ``config.data.kind`` (validated against ``DATA_KIND``)."""
    kind, raw = data_kind_of(config.data)
    builder = DATA_KIND.get(kind, field="config.data.kind")
    kind_config = DATA_KIND.make_config(kind, raw, field="config.data.kind_config")
    spec = builder(config, workdir, kind_config)
    if not isinstance(spec, DataSpec):
        raise TypeError(f"data kind {kind!r} returned {type(spec).__name__}, expected a DataSpec")
    return spec


__all__ = ["Document", "stdlib_documents", "stdlib_texts", "text_documents", "jsonl_documents", "load_documents",
           "tokenize_documents", "pack_stream", "PackedDataset", "BatchIterator", "unigram_entropy",
           "heldout_batches", "describe_heldout", "DATA_KIND", "DataSpec", "data_kind_of", "build_data"]


def stdlib_texts(split: str = "all", heldout_percent: float = 5, max_bytes: int = 0) -> list[str]:
    """Texts of the stdlib corpus: ``split`` = all | train | eval (the same file-level split the
    training loop uses with ``data.heldout_percent``)."""
    docs = stdlib_documents()
    if split == "train":
        docs = [d for d in docs if not _is_heldout(d.doc_id, heldout_percent)]
    elif split == "eval":
        docs = [d for d in docs if _is_heldout(d.doc_id, heldout_percent)]
    elif split != "all":
        raise InputError(f"stdlib_texts: split={split!r}; expected all | train | eval")
    return [d.text for d in _take_budget(docs, max_bytes)]
