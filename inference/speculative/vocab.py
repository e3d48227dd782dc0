"""Token strings of any tokenizer and the vocabulary mapping between two tokenizers.

``TokenText(tok)`` gives every token's exact bytes: byte-level BPE pieces through the GPT-2 byte
alphabet, SentencePiece pieces with the space marker ``▁`` rewritten to a space and ``<0xNN>``
byte-fallback pieces as their byte (flagged), anything else by decoding it alone. Special tokens
have no bytes. Comparing bytes is the "exact string after normalising the space markers" of
Timor et al. / transformers' ``AssistantToTargetTranslator`` (``Ġ`` and ``▁`` both become b" ").

``pair_map(target, drafter)`` (cached per tokenizer pair) builds the tables the strategy uses:
``d2t [V_D]`` drafter id -> target id of the same bytes (-1 outside the intersection; special and
byte-fallback tokens excluded; EOS mapped to EOS), and ``t2d [V_T, L]`` the drafter tokens of each
target token's bytes (its mapped id when it has one, else the drafter's encoding of its text, else
byte tokens) used to keep the drafter's context in step without the host. Several drafter ids may
spell one target token (``n_merged``; e.g. a vocabulary with both ``▁`` and a literal space): the
intersection is one of strings, so TLI's q' of that token is the sum of their q, and ``t2d`` uses
the one the drafter's tokenizer produces.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import weakref
from typing import Optional, Sequence

import numpy as np

from pallasite.errors import ConfigError
from pallasite.models.tokenizer import bos_prefix

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` (printable stand-ins for the 256 bytes)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _decoder_kinds(spec) -> set[str]:
    if not spec:
        return set()
    if spec.get("type") == "Sequence":
        return set().union(*(_decoder_kinds(d) for d in spec.get("decoders", [])))
    kinds = {spec.get("type")}
    if spec.get("type") == "Replace" and "▁" in json.dumps(spec.get("pattern", {}), ensure_ascii=False):
        kinds.add("Metaspace")
    return kinds


def utf8_prefix_len(b: bytes) -> int:
    """Length of the longest prefix of ``b`` that is complete, valid UTF-8."""
    try:
        b.decode("utf-8")
        return len(b)
    except UnicodeDecodeError as e:
        return e.start


def is_char_start(b: bytes, i: int) -> bool:
    """Whether offset ``i`` of ``b`` starts a character (not a UTF-8 continuation byte)."""
    return i >= len(b) or (b[i] & 0xC0) != 0x80


class TokenText:
    """Bytes of every token of an HF fast tokenizer, and byte-exact encoding of continuations."""

    def __init__(self, tok):
        if not hasattr(tok, "backend_tokenizer"):
            raise TypeError("speculative decoding needs a fast (tokenizers-backed) tokenizer; "
                            f"got {type(tok).__name__}")
        self.tok = tok
        self.backend = tok.backend_tokenizer
        self.size = len(tok)
        spec = json.loads(self.backend.to_str())
        kinds = _decoder_kinds(spec.get("decoder"))
        pieces = tok.convert_ids_to_tokens(list(range(self.size)))
        added = {int(i): t for i, t in getattr(tok, "added_tokens_decoder", {}).items()}
        special = set(int(i) for i in tok.all_special_ids) | {i for i, t in added.items() if t.special}
        self.special = np.zeros(self.size, bool)
        self.byte_fallback = np.zeros(self.size, bool)
        byte_map = _gpt2_byte_decoder() if "ByteLevel" in kinds else None
        out: list[Optional[bytes]] = []
        for i, piece in enumerate(pieces):
            if i in special or piece is None:
                self.special[i] = True
                out.append(None)
                continue
            if i in added:  # a user-added (non-special) token: its content is plain text
                out.append(added[i].content.encode("utf-8"))
                continue
            m = _BYTE_PIECE.match(piece) if "ByteFallback" in kinds else None
            if m:
                self.byte_fallback[i] = True
                out.append(bytes([int(m.group(1), 16)]))
            elif byte_map is not None and all(c in byte_map for c in piece):
                out.append(bytes(byte_map[c] for c in piece))
            elif "Metaspace" in kinds:
                out.append(piece.replace("▁", " ").encode("utf-8"))
            else:
                out.append(tok.decode([i], clean_up_tokenization_spaces=False).encode("utf-8"))
        self.bytes = out
        self.eos_ids = tuple(sorted({int(t) for t in ([tok.eos_token_id] if tok.eos_token_id is not None else [])}))
        self.bos_id = tok.bos_token_id
        self.adds_bos = bool(bos_prefix(tok))
        # byte tokens: the id that stands for each single byte (byte-level BPE symbols, <0xNN> pieces)
        self.byte_token = np.full(256, -1, np.int64)
        for i, b in enumerate(out):
            if b is not None and len(b) == 1 and (self.byte_token[b[0]] < 0 or self.byte_fallback[i]):
                self.byte_token[b[0]] = i

    def __len__(self):
        return self.size

    def text_of(self, ids: Sequence[int]) -> bytes:
        """Concatenated bytes (special tokens contribute nothing)."""
        bs = self.bytes
        return b"".join(bs[i] or b"" for i in ids if 0 <= i < self.size)

    def nbytes(self, i: int) -> int:
        b = self.bytes[i] if 0 <= i < self.size else None
        return 0 if b is None else len(b)

    def encode(self, b: bytes) -> tuple[list[int], int]:
        """Token ids for the bytes ``b`` (a continuation: no special tokens added) and how many
        bytes they cover: the complete-UTF-8 prefix goes through the tokenizer, an invalid byte
        through the byte tokens when the vocabulary has them (else encoding stops there)."""
        ids, done = [], 0
        while done < len(b):
            n = utf8_prefix_len(b[done:])
            if n:
                ids += self.backend.encode(b[done:done + n].decode("utf-8"), add_special_tokens=False).ids
                done += n
                continue
            if _incomplete_tail(b[done:]):
                break  # an unfinished character at the end: wait for its other bytes
            byte_id = int(self.byte_token[b[done]])
            if byte_id < 0:
                break
            ids.append(byte_id)
            done += 1
        return ids, done

    def encode_text(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


def _incomplete_tail(b: bytes) -> bool:
    """``b`` is the start of a multi-byte character that more bytes could complete."""
    lead = b[0]
    need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 0
    return need > len(b) and all((c & 0xC0) == 0x80 for c in b[1:])


# ----------------------------------------------------------------------------- the pair mapping
@dataclasses.dataclass(eq=False)
class PairMap:
    """The vocabulary relation of a (target, drafter) tokenizer pair; compared by identity."""

    target: TokenText
    drafter: TokenText
    d2t: np.ndarray  # [V_D] int32: target id of the same bytes, -1 outside the intersection
    t2d: np.ndarray  # [V_T, L] int32 drafter ids of each target token (-1 padded)
    t2d_len: np.ndarray  # [V_T] int32
    n_truncated: int  # target tokens whose drafter encoding was cut to L tokens
    n_unencodable: int  # target text tokens the drafter's tokenizer does not reproduce
    same_vocab: bool
    n_merged: int = 0  # target tokens that several drafter tokens spell (q' sums over them)

    @property
    def intersection(self) -> int:
        return int((self.d2t >= 0).sum())

    def summary(self) -> dict:
        return {"target_vocab": len(self.target), "drafter_vocab": len(self.drafter), "intersection": self.intersection,
                "same_vocab": self.same_vocab, "t2d_width": int(self.t2d.shape[1]), "t2d_truncated": self.n_truncated,
                "unencodable": self.n_unencodable, "merged": self.n_merged}


def _build_pair(target: TokenText, drafter: TokenText, max_len: int) -> PairMap:
    t_index: dict[bytes, int] = {}
    for i, b in enumerate(target.bytes):
        if b is None or target.byte_fallback[i] or not b:
            continue
        t_index.setdefault(b, i)
    # the canonical id for bytes that several target tokens spell: the tokenizer's own choice
    d2t = np.full(len(drafter), -1, np.int32)
    for j, b in enumerate(drafter.bytes):
        if b is None or drafter.byte_fallback[j] or not b:
            continue
        i = t_index.get(b)
        if i is not None:
            d2t[j] = i
    for e in drafter.eos_ids:  # EOS is mapped explicitly (it has no bytes)
        if target.eos_ids:
            d2t[e] = target.eos_ids[0]
    same = len(target) == len(drafter) and all(
        a == b for a, b in zip(target.bytes, drafter.bytes)) and target.eos_ids == drafter.eos_ids
    t2d_lists: list[list[int]] = []
    spellers: dict[int, list[int]] = {}  # target id -> the drafter ids of its bytes
    for j, t in enumerate(d2t):
        if t >= 0 and drafter.bytes[j] is not None:
            spellers.setdefault(int(t), []).append(j)
    bad = 0
    for i, b in enumerate(target.bytes):
        if b is None:
            ids = [drafter.eos_ids[0]] if (i in target.eos_ids and drafter.eos_ids) else []
        elif i in spellers:
            ids = spellers[i][:1]
            if len(spellers[i]) > 1:  # several drafter tokens spell it: the one its tokenizer produces
                own, _ = drafter.encode(b)
                ids = own if len(own) == 1 and own[0] in spellers[i] else ids
        else:
            ids, done = drafter.encode(b)
            if done < len(b) or drafter.text_of(ids) != b[:done]:
                ids = [int(drafter.byte_token[c]) for c in b] if (drafter.byte_token[list(b)] >= 0).all() else ids
                if utf8_prefix_len(b) == len(b):
                    bad += 1
        t2d_lists.append(ids)
    width = max(1, min(max_len, max(len(x) for x in t2d_lists)))
    t2d = np.full((len(target), width), -1, np.int32)
    t2d_len = np.zeros(len(target), np.int32)
    truncated = 0
    for i, ids in enumerate(t2d_lists):
        truncated += len(ids) > width
        ids = ids[:width]
        t2d[i, :len(ids)] = ids
        t2d_len[i] = len(ids)
    merged = sum(len(js) > 1 for js in spellers.values())
    return PairMap(target, drafter, d2t, t2d, t2d_len, truncated, bad, same, merged)


_TEXTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_PAIRS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def token_text(tok) -> TokenText:
    """``TokenText`` of a tokenizer, built once per tokenizer object."""
    if isinstance(tok, TokenText):
        return tok
    got = _TEXTS.get(tok)
    if got is None:
        got = _TEXTS[tok] = TokenText(tok)
    return got


def pair_map(target_tok, drafter_tok, *, max_len: int = 16) -> PairMap:
    """The mapping between two tokenizers (cached per pair and ``max_len``)."""
    t, d = token_text(target_tok), token_text(drafter_tok)
    inner = _PAIRS.setdefault(t, weakref.WeakKeyDictionary())
    by_len = inner.setdefault(d, {})
    if max_len not in by_len:
        by_len[max_len] = _build_pair(t, d, max_len)
    return by_len[max_len]


def check_drafter_can_encode(pm: PairMap, *, tolerance: float = 0.005) -> None:
    """A drafter tokenizer that cannot spell the target's text (it maps characters to an unknown
    token or drops them) cannot follow the target: fail naming the pair and examples."""
    t = pm.target
    text_ids = [i for i, b in enumerate(t.bytes) if b is not None and utf8_prefix_len(b) == len(b)]
    if not text_ids or pm.n_unencodable <= tolerance * len(text_ids):
        return
    examples = []
    for i in text_ids:
        ids, done = pm.drafter.encode(t.bytes[i])
        if done < len(t.bytes[i]) or pm.drafter.text_of(ids) != t.bytes[i]:
            examples.append(t.bytes[i].decode("utf-8"))
            if len(examples) == 5:
                break
    raise ConfigError(
        f"the drafter's tokenizer cannot encode the target's text: {pm.n_unencodable} of {len(text_ids)} target "
        f"tokens do not survive drafter encode/decode (e.g. {examples}); use a drafter whose tokenizer covers "
        "the target's characters (byte-level BPE or byte fallback)")


__all__ = ["TokenText", "PairMap", "token_text", "pair_map", "check_drafter_can_encode", "utf8_prefix_len",
           "is_char_start"]
