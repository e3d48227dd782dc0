"""The vocabulary as the grammar engine sees it: one llguidance tokenizer per (tokenizer, stop ids).

``vocab_for(tokenizer, stop_ids)`` wraps a fast Hugging Face tokenizer (``llguidance.hf``) or a
plain list of token byte strings (``TokenBytes``, used by tests and by vocabularies read from a
GGUF file) and caches the result: building the llguidance tokenizer costs ~1 s for 49k tokens.
``TokenVocab.token_bytes[i]`` is what token ``i`` adds to the decoded text (special tokens add
nothing, as with ``decode(..., skip_special_tokens=True)``); the span tracker and the masks read it.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class TokenBytes:
    """A vocabulary given as byte strings (id = index); ``encode(text) -> ids`` is greedy longest match."""

    tokens: tuple  # tuple[bytes, ...]
    eos_token_id: int
    special_ids: tuple = ()
    bos_token_id: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(bytes(t) for t in self.tokens))
        if not 0 <= self.eos_token_id < len(self.tokens):
            raise ValueError(
                f"TokenBytes: eos_token_id={self.eos_token_id} outside [0, {len(self.tokens)})"
            )

    def __len__(self):
        return len(self.tokens)

    @functools.cached_property
    def _special(self) -> frozenset:
        return frozenset(self.special_ids)  # membership per token: a tuple scan was O(V x specials)

    @functools.cached_property
    def _lookup(self) -> tuple:
        special = self._special
        lookup = {t: i for i, t in enumerate(self.tokens) if t and i not in special}
        return lookup, max(len(t) for t in lookup)

    def encode(self, text, add_special_tokens: bool = False) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        lookup, longest = self._lookup
        out, i = [], 0
        while i < len(data):
            for n in range(min(longest, len(data) - i), 0, -1):
                j = lookup.get(data[i : i + n])
                if j is not None:
                    out.append(j)
                    i += n
                    break
            else:
                raise ValueError(
                    f"TokenBytes.encode: byte {data[i : i + 1]!r} is not in the vocabulary"
                )
        return out

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        n = len(self.tokens)  # ids past the vocabulary (a model's padded rows) decode to nothing
        return b"".join(
            self.tokens[i]
            for i in ids
            if i < n and not (skip_special_tokens and i in self._special)
        ).decode("utf-8", errors="replace")


class _Wrapped:
    """The duck type ``llguidance.TokenizerWrapper`` reads: tokens, eos/bos ids, special ids, __call__."""

    def __init__(self, tb: TokenBytes):
        self.tokens = list(tb.tokens)
        self.eos_token_id = tb.eos_token_id
        self.bos_token_id = tb.bos_token_id
        self.special_token_ids = list(tb.special_ids)
        self._tb = tb

    def __call__(self, data):
        return self._tb.encode(data)


@dataclasses.dataclass(eq=False)
class TokenVocab:
    """llguidance tokenizer + per-token bytes + the stop ids the masks allow when a grammar accepts."""

    ll: object  # llguidance.LLTokenizer
    token_bytes: list  # list[bytes], one per tokenizer id
    stop_ids: tuple
    source: object  # the tokenizer it was built from

    @property
    def n_tokens(self) -> int:
        return len(self.token_bytes)

    def encode_bytes(self, data: bytes) -> list[int]:
        """Some tokenization of ``data`` (llguidance's: the tokenizer's own for valid UTF-8)."""
        return list(self.ll.tokenize_bytes(data)) if data else []

    def decode(self, ids: Sequence[int]) -> bytes:
        return b"".join(self.token_bytes[i] for i in ids)

    def ids_containing(self, needle: bytes) -> np.ndarray:
        """Ids of the tokens whose bytes contain ``needle`` (sorted)."""
        return np.array([i for i, t in enumerate(self.token_bytes) if t and needle in t], np.int64)

    def ids_starting_with(self, prefix: bytes) -> np.ndarray:
        """Ids of the tokens whose bytes start with ``prefix`` (sorted)."""
        return np.array(
            [i for i, t in enumerate(self.token_bytes) if t and t.startswith(prefix)], np.int64
        )

    @functools.cached_property
    def _ids_by_bytes(self) -> dict:
        out: dict = {}
        for i, t in enumerate(self.token_bytes):
            if t:
                out.setdefault(t, []).append(i)
        return out

    def ids_proper_prefixes_of(self, data: bytes) -> list:
        """Ids of the tokens whose bytes are a non-empty proper prefix of ``data``."""
        by = self._ids_by_bytes
        return [i for k in range(1, len(data)) for i in by.get(data[:k], ())]


_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _stop_ids_of(tokenizer) -> tuple:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(
            "constrained decoding needs the tokenizer's eos id (or explicit stop_tokens); "
            f"{type(tokenizer).__name__} has eos_token_id=None"
        )
    return (int(eos),)


def vocab_for(tokenizer, stop_ids: Optional[Sequence[int]] = None) -> TokenVocab:
    """The cached ``TokenVocab`` of ``tokenizer`` (an HF fast tokenizer or ``TokenBytes``) whose masks
    allow ``stop_ids`` (default: the tokenizer's eos) once the grammar accepts."""
    import llguidance

    stop = tuple(int(t) for t in (stop_ids if stop_ids else _stop_ids_of(tokenizer)))
    per_tok = _CACHE.setdefault(tokenizer, {})
    if stop in per_tok:
        return per_tok[stop]
    if isinstance(tokenizer, TokenBytes):
        ll = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_Wrapped(tokenizer)), eos_token=list(stop)
        )
    else:
        import llguidance.hf

        try:
            ll = llguidance.hf.from_tokenizer(tokenizer, eos_token=list(stop))
        except ValueError as e:
            raise TypeError(
                f"constrained decoding needs a fast Hugging Face tokenizer or a TokenBytes "
                f"vocabulary; got {type(tokenizer).__name__}: {e}"
            ) from None
    n = ll.vocab_size
    token_bytes = [b"" if ll.is_special_token(i) else ll.decode_bytes([i]) for i in range(n)]
    bad = [t for t in stop if not 0 <= t < n]
    if bad:
        raise ValueError(f"stop token id(s) {bad} outside the tokenizer's vocabulary [0, {n})")
    vocab = TokenVocab(ll=ll, token_bytes=token_bytes, stop_ids=stop, source=tokenizer)
    per_tok[stop] = vocab
    return vocab


__all__ = ["TokenBytes", "TokenVocab", "vocab_for"]
