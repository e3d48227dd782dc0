"""Tokenizers: load any Hugging Face tokenizer folder; train a byte-level BPE from text.

``train_bpe`` builds the GPT-2 style byte-level BPE (Radford et al. 2019; Sennrich et al. 2016)
with the ``tokenizers`` library: ``models.BPE`` over the 256-symbol byte alphabet (so every
string is encodable, no unknown token), ``pre_tokenizers.ByteLevel`` (GPT-2 regex split, no
prefix space) and ``decoders.ByteLevel``; ``BpeTrainer`` learns merges up to ``vocab_size``.
Special tokens come first (ids 0, 1, 2 for the defaults pad/bos/eos). No post-processor adds
bos/eos implicitly: the data pipeline appends eos itself, so what a sequence contains is
decided in one place.
"""

from __future__ import annotations

import os
from typing import Iterable, Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json + merges.txt", "tokenizer.model")
DEFAULT_SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>")


def _has_tokenizer(folder: str) -> bool:
    exists = lambda name: os.path.isfile(os.path.join(folder, name))  # noqa: E731
    return exists("tokenizer.json") or exists("tokenizer.model") or (exists("vocab.json") and exists("merges.txt"))


def load_tokenizer(folder: str):
    """An HF tokenizer from a local folder (never the hub). Missing -> FileNotFoundError naming
    the folder and the files expected there."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"tokenizer folder {folder!r} does not exist; expected a folder with one of "
                                f"{', '.join(TOKENIZER_FILES)}")
    if not _has_tokenizer(folder):
        present = sorted(os.listdir(folder))[:20]
        raise FileNotFoundError(f"no tokenizer in {folder!r}: expected tokenizer.json (or vocab.json + merges.txt, "
                                f"or tokenizer.model); found {present}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    special_tokens: Sequence[str] = DEFAULT_SPECIAL_TOKENS,
    bos_token: str | None = "<|bos|>",
    eos_token: str | None = "<|eos|>",
    pad_token: str | None = "<|pad|>",
    min_frequency: int = 2,
    save_to: str | None = None,
):
    """Train a byte-level BPE; returns a ``transformers.PreTrainedTokenizerFast``.

    ``vocab_size`` counts the special tokens and the 256 byte symbols; it must exceed both.
    Deterministic for the same texts (``tokenizers`` breaks frequency ties by symbol order)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special_tokens = list(special_tokens)
    for name, tok in (("bos_token", bos_token), ("eos_token", eos_token), ("pad_token", pad_token)):
        if tok is not None and tok not in special_tokens:
            raise ValueError(f"train_bpe: {name}={tok!r} is not among special_tokens={special_tokens}")
    floor = 256 + len(special_tokens)
    if vocab_size <= floor:
        raise ValueError(f"train_bpe: vocab_size={vocab_size} must exceed 256 byte symbols + "
                         f"{len(special_tokens)} special tokens = {floor}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token)
    if save_to is not None:
        fast.save_pretrained(save_to)
    return fast


def encode_batch(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids for many texts without special tokens (the fast Rust batch path when present)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


__all__ = ["load_tokenizer", "train_bpe", "encode_batch", "DEFAULT_SPECIAL_TOKENS"]
