"""Tokenizers: load any Hugging Face tokenizer folder; train a byte-level BPE from text; rebuild
the tokenizer a GGUF file describes (``GGUFVocab``: byte-level BPE or SentencePiece BPE).

``train_bpe`` builds the GPT-2 style byte-level BPE (Radford et al. 2019; Sennrich et al. 2016)
with the ``tokenizers`` library: ``models.BPE`` over the 256-symbol byte alphabet (so every
string is encodable, no unknown token), ``pre_tokenizers.ByteLevel`` (GPT-2 regex split, no
prefix space) and ``decoders.ByteLevel``; ``BpeTrainer`` learns merges up to ``vocab_size``.
Special tokens come first (ids 0, 1, 2 for the defaults pad/bos/eos). No post-processor adds
bos/eos implicitly: the data pipeline appends eos itself, so what a sequence contains is
decided in one place.

``sentencepiece_bpe_tokenizer`` rebuilds a SentencePiece BPE vocabulary (llama.cpp's ``llama``
tokenizer model, e.g. Gemma 3) with ``tokenizers`` alone: spaces become "▁" (a "▁" is prepended
only with ``add_space_prefix``), BPE merges are derived from the pieces in id order (SentencePiece
merges the pair whose merged piece scores best; a GGUF's normal pieces are stored best first),
unknown characters fall back to ``<0xNN>`` byte pieces, CONTROL pieces are special added tokens and
USER_DEFINED ones plain added tokens (matched whole), whitespace-only pieces stored with real
spaces are respelled with "▁". Same construction as transformers' GGUF converter; the measured
comparison and its divergence classes are in docs/models.md.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterable, Optional, Sequence

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


def bos_prefix(tokenizer) -> list[int]:
    """``[bos id]`` when the tokenizer's own post-processing starts every text with BOS (Gemma,
    Llama: HF ``add_bos_token`` / GGUF ``tokenizer.ggml.add_bos_token``), else ``[]`` (GPT-2-style
    tokenizers such as SmolLM2's, and ``train_bpe``'s). Prompts and perplexity windows follow the
    convention the model was trained with: Gemma scored without its BOS is a different model."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return []
    plain = list(tokenizer.encode("a", add_special_tokens=False))
    full = list(tokenizer.encode("a", add_special_tokens=True))
    return [int(bos)] if len(full) > len(plain) and full[0] == bos else []


def encode_batch(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids for many texts without special tokens (the fast Rust batch path when present)."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(list(texts), add_special_tokens=False)]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]



def prune_bpe(tokenizer, texts: Iterable[str], vocab_size: int):
    """A byte-level BPE with ``tokenizer``'s merges and pre-tokenizer, restricted to its
    ``vocab_size`` most frequent tokens on ``texts`` (vocabulary trimming); returns
    ``(PreTrainedTokenizerFast, kept_ids)`` where ``kept_ids[i]`` is the original id of new token i.

    Kept: every added (special) token, the 256 byte symbols (so every string stays encodable), then
    tokens by frequency, each with its merge ancestors (a token a BPE can only build from its
    parents). A merge survives when both parents and the result are kept, in its original rank, so a
    word whose original tokens are all kept tokenizes exactly as before and any other word falls
    apart into kept pieces. A different tokenizer (other ids, other splits) sharing most strings with
    the original: what a small drafter for a large-vocabulary target uses."""
    import json

    import numpy as np
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise ValueError(f"prune_bpe: needs a BPE tokenizer, got model type {model.get('type')!r}")
    vocab = model["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    parents = {}
    for a, b in merges:
        parents.setdefault(a + b, (a, b))
    by_id = {i: t for t, i in vocab.items()}
    keep: set = {t for t in bytes_to_unicode().values() if t in vocab}
    keep |= {by_id[a["id"]] for a in spec.get("added_tokens", []) if a["id"] in by_id}
    if vocab_size <= len(keep):
        raise ValueError(f"prune_bpe: vocab_size={vocab_size} must exceed the {len(keep)} byte symbols "
                         "and added tokens it always keeps")
    counts = np.zeros(max(vocab.values()) + 1, np.int64)
    for ids in encode_batch(tokenizer, list(texts)):
        np.add.at(counts, np.asarray(ids, np.int64), 1)

    def closure(t, out):
        if t in keep or t in out:
            return
        for parent in parents.get(t, ()):
            closure(parent, out)
        out.append(t)

    for i in np.argsort(-counts, kind="stable"):
        if counts[i] == 0 or len(keep) >= vocab_size:
            break
        add: list = []
        closure(by_id[int(i)], add)
        if len(keep) + len(add) <= vocab_size:
            keep.update(add)
    kept_ids = np.asarray(sorted(vocab[t] for t in keep), np.int64)
    new_id = {by_id[int(old)]: new for new, old in enumerate(kept_ids)}
    model["vocab"] = new_id
    model["merges"] = [[a, b] for a, b in merges if a in new_id and b in new_id and a + b in new_id]
    spec["added_tokens"] = [dict(a, id=new_id[by_id[a["id"]]]) for a in spec.get("added_tokens", [])]
    pp = spec.get("post_processor") or {}
    for special in (pp.get("special_tokens") or {}).values():  # TemplateProcessing's ids
        special["ids"] = [new_id[by_id[i]] for i in special.get("ids", [])]
    names = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   **{k: v for k, v in names.items() if v is not None})
    if getattr(tokenizer, "chat_template", None):
        fast.chat_template = tokenizer.chat_template
    return fast, kept_ids


# ----------------------------------------------------------------- GGUF vocabularies
# gguf token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL = 1, 2, 3
TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 4, 5, 6
SPACE_SYMBOL = "\u2581"  # SentencePiece's "▁"


@dataclasses.dataclass(frozen=True)
class GGUFVocab:
    """What a GGUF's ``tokenizer.ggml.*`` metadata says (ids index ``tokens``)."""

    tokens: tuple
    types: tuple
    merges: Optional[tuple] = None  # "a b" strings (byte-level BPE)
    pre: str = "default"  # tokenizer.ggml.pre
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    unk_id: Optional[int] = None
    pad_id: Optional[int] = None
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool = False
    chat_template: Optional[str] = None

    def token(self, i: Optional[int]) -> Optional[str]:
        return None if i is None else self.tokens[int(i)]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-unicode map (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def byte_level_bpe_tokenizer(v: GGUFVocab, splits: Sequence[str]):
    """Byte-level BPE (llama.cpp's ``gpt2`` model) from the file's tokens and merges; ``splits`` are
    the pre-tokenizer regexes applied in order (each isolates its matches)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    if v.merges is None:
        raise ValueError("GGUF tokenizer: byte-level BPE without tokenizer.ggml.merges "
                         "is not supported")
    byte_alphabet = bytes_to_unicode()
    alphabet = set(byte_alphabet.values())
    vocab = {}
    for i, tok in enumerate(v.tokens):
        # Regular tokens are stored in the byte-level spelling already; respell any that are not
        # (llama.cpp keeps some added tokens raw) so the BPE model can produce them.
        spelled = tok if set(tok) <= alphabet else "".join(byte_alphabet[b]
                                                           for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    merges = [tuple(m.split(" ", 1)) for m in v.merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    user = [(t, False) for t, ty in zip(v.tokens, v.types) if ty == TOKEN_USER_DEFINED]
    return _finish(tok, v, user)


def sentencepiece_pieces(v: GGUFVocab) -> list[str]:
    """The pieces as SentencePiece spells them: whitespace-only pieces that the GGUF stores with
    real spaces (Gemma's "  ", "   ", ...) get their "▁" back."""
    return [SPACE_SYMBOL * len(t) if " " in t and not t.strip() else t for t in v.tokens]


def sentencepiece_merges(pieces: Sequence[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split (left, right) of a piece into
    two pieces, ranked by the merged piece's id (best score first), longer left part first."""
    index = {}
    for i, p in enumerate(pieces):
        index.setdefault(p, i)
    merges = []
    for i, piece in enumerate(pieces):
        if index[piece] != i:
            continue
        for cut in range(len(piece) - 1, 0, -1):  # longer left part first
            left, right = piece[:cut], piece[cut:]
            if left in index and right in index:
                merges.append((left, right))
    return merges


def sentencepiece_bpe_tokenizer(v: GGUFVocab):
    """SentencePiece BPE with byte fallback (llama.cpp's ``llama`` model, Gemma's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    pieces = sentencepiece_pieces(v)
    vocab = {}
    for i, p in enumerate(pieces):
        vocab.setdefault(p, i)
    unk = v.token(v.unk_id)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=sentencepiece_merges(pieces), unk_token=unk,
                               fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend(SPACE_SYMBOL)] if v.add_space_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE_SYMBOL)])
    decode = [decoders.Replace(SPACE_SYMBOL, " "), decoders.ByteFallback(), decoders.Fuse()]
    if v.add_space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    # USER_DEFINED pieces are matched whole, longest first, as SentencePiece's prefix matcher does;
    # the respelled whitespace runs ("▁▁", ...) exist only after normalisation, so they are matched
    # there (a run longer than the longest piece is cut greedily, 31 + rest for Gemma 3).
    user = [(p, p != t) for t, p, ty in zip(v.tokens, pieces, v.types) if ty == TOKEN_USER_DEFINED]
    return _finish(tok, v, user)


def _finish(tok, v: GGUFVocab, user_defined: Sequence[tuple[str, bool]]):
    """Added tokens (CONTROL: special, matched in the raw text; USER_DEFINED ``(piece, matched in
    the normalised text)``: plain), bos/eos post-processing and the transformers wrapper."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    control = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(v.tokens, v.types) if ty == TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=norm) for t, norm in user_defined]
    tok.add_special_tokens(control)
    tok.add_tokens(user)
    bos, eos = v.token(v.bos_id), v.token(v.eos_id)
    add_bos, add_eos = v.add_bos and bos is not None, v.add_eos and eos is not None
    if add_bos or add_eos:
        pre, post = (f"{bos}:0 " if add_bos else ""), (f" {eos}:0" if add_eos else "")
        pre1, post1 = (f"{bos}:1 " if add_bos else ""), (f" {eos}:1" if add_eos else "")
        ends = ((bos, v.bos_id, add_bos), (eos, v.eos_id, add_eos))
        specials = [(t, i) for t, i, on in ends if on]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{pre}$A:0{post}", pair=f"{pre}$A:0{post} {pre1}$B:1{post1}",
            special_tokens=specials)
    kwargs = dict(bos_token=bos, eos_token=eos, pad_token=v.token(v.pad_id),
                  unk_token=v.token(v.unk_id))
    kwargs = {k: val for k, val in kwargs.items() if val is not None}
    if v.chat_template is not None:
        kwargs["chat_template"] = v.chat_template
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


__all__ = ["load_tokenizer", "train_bpe", "prune_bpe", "encode_batch", "DEFAULT_SPECIAL_TOKENS", "GGUFVocab",
           "byte_level_bpe_tokenizer", "sentencepiece_bpe_tokenizer", "sentencepiece_merges",
           "bytes_to_unicode"]
