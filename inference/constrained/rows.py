"""Per-row grammar state on the host: a whole-output grammar (``FullRow``) or CRANE spans (``SpanRow``).

Every row answers three questions about the next token: ``valid(t)`` (would consuming it keep the
output inside the constraint), ``fill_mask(words)`` (the packed set of valid tokens, bit ``i % 32``
of word ``i // 32``) and ``consume(t)``. The mask is exactly ``{t : valid(t)}``; that is what makes
opportunistic masking (propose, check, mask only if invalid) pick the same token as masking always.

``SpanRow`` is CRANE's state machine (Banerjee et al., ICML 2025, §3 / ``CRANE.forward`` in the
official code): free text until the decoded text contains the start delimiter S; then the answer
grammar, whose matcher is reset per span and seeded with S, until the span text contains the end
delimiter E; then free again. Deviations, all about tokens that straddle a delimiter (the official
code loses the characters after S in the token that completes S, and emits E's id for a proposal
that is E plus ``,. \\n``): here boundaries are found by characters. The bytes a token carries past
S are parsed as the span's first characters, the bytes past E are free text (the span grammar is
followed by a free tail), and a free-text token is valid only if what it carries past S parses —
so every terminated span parses. E = None: constrained to the end (FOLIO: S = "Predicates:").
"""

from __future__ import annotations

import numpy as np

FULL_WORD = np.int32(-1)  # all 32 bits set


def set_bits(words: np.ndarray, ids, value: bool) -> None:
    """Set (or clear) the bits of token ``ids`` in the packed row ``words`` in place."""
    ids = np.asarray(ids, np.int64)
    if ids.size == 0:
        return
    view = words.view(np.uint32)
    bits = np.uint32(1) << (ids % 32).astype(np.uint32)
    if value:
        np.bitwise_or.at(view, ids // 32, bits)
    else:
        np.bitwise_and.at(view, ids // 32, ~bits)


def test_bit(words: np.ndarray, i: int) -> bool:
    return bool((int(words.view(np.uint32)[i // 32]) >> (i % 32)) & 1)


def add_forced_prefixes(matcher, vocab, words: np.ndarray) -> None:
    """Where the grammar forces bytes F, llguidance's mask keeps only F's canonical first token; the
    tokens that spell a proper prefix of F are valid too (``validate_tokens`` accepts them): set them,
    so that the mask is exactly the set of valid tokens."""
    forced = matcher.compute_ff_bytes()
    if len(forced) > 1:
        add = [t for t in vocab.ids_proper_prefixes_of(forced) if matcher.validate_tokens([t]) == 1]
        set_bits(words, add, True)


class FullRow:
    """The whole output must be a sentence of the grammar; the stop ids are valid once it accepts."""

    def __init__(self, compiled, vocab):
        import llguidance

        self.compiled, self.vocab = compiled, vocab
        self.matcher = llguidance.LLMatcher(vocab.ll, compiled.grammar, log_level=0)
        self.stops = frozenset(vocab.stop_ids)
        self.consumed = 0
        self.error = None

    # the matcher whose mask is the row's mask (None: every token)
    def mask_matcher(self):
        return self.matcher

    def patch_mask(self, words: np.ndarray) -> None:
        add_forced_prefixes(self.matcher, self.vocab, words)

    def valid(self, t: int) -> bool:
        if t in self.stops:
            return self.matcher.is_accepting()
        if t >= self.vocab.n_tokens:
            return False
        return self.matcher.validate_tokens([t]) == 1

    def consume(self, t: int) -> None:
        self.consumed += 1
        if self.error is None and not self.matcher.consume_token(t):
            self.error = f"token {t} rejected: {self.matcher.get_error()}"

    def fork(self) -> "FullRow":
        """An independent copy (speculative walks over draft tokens)."""
        other = object.__new__(FullRow)
        other.__dict__.update(self.__dict__)
        other.matcher = self.matcher.deep_copy()
        return other

    @property
    def text(self) -> bytes:
        return b""

    def spans(self) -> list:
        return []


class SpanRow:
    """CRANE: free text, then answer-grammar spans delimited by ``start`` / ``end`` (see module doc)."""

    def __init__(self, compiled, vocab):
        import llguidance

        self._llg = llguidance
        self.compiled, self.vocab = compiled, vocab
        self.S = compiled.start
        self.E = compiled.end
        self.stops = frozenset(vocab.stop_ids)
        self.consumed = 0
        self.error = None
        self.free_text = b""  # free text since the last span (only its tail matters for S)
        self.span = None  # bytes of the open span, S included; None in free mode
        self.matcher = None
        self.closed_spans: list[bytes] = []  # S ... E, each
        self.all_text = b""

    # ------------------------------------------------------------------ pure helpers
    def _fresh_matcher(self):
        return self._llg.LLMatcher(self.vocab.ll, self.compiled.span_grammar, log_level=0)

    def _span_ok(self, span: bytes) -> bool:
        """Does a fresh span matcher accept ``span`` (S + what follows) as a prefix?"""
        ids = self.vocab.encode_bytes(span)
        return self._fresh_matcher().validate_tokens(ids) == len(ids)

    def _free_ok(self, tail: bytes, data: bytes) -> bool:
        """Free text ``tail`` followed by ``data``: does every span that ``data`` opens parse?"""
        text = tail + data
        k = text.find(self.S)
        if k < 0:
            return True
        rest = text[k:]  # S and what follows
        if not self._span_ok(rest):
            return False
        if self.E is None:
            return True
        e = rest.find(self.E, len(self.S))
        return e < 0 or self._free_ok(b"", rest[e + len(self.E) :])

    def _tail_key(self, tail: bytes) -> tuple:
        """The proper prefixes of S that ``tail`` ends with: all that a next token's S depends on."""
        return tuple(j for j in range(1, len(self.S)) if tail.endswith(self.S[:j]))

    # ------------------------------------------------------------------ row protocol
    def mask_matcher(self):
        return self.matcher if self.span is not None else None

    def patch_mask(self, words: np.ndarray) -> None:
        """Free mode: clear the tokens whose S-straddle does not parse. Span mode: clear tokens that
        close the span and open one that does not parse (both from small candidate lists)."""
        if self.span is None:
            key = self._tail_key(self.free_text)
            bad = self.compiled.bad_straddlers.get(key)
            if bad is None:
                tail = self.S[: max(key)] if key else b""
                cand = self.compiled.straddle_candidates(key)
                bad = np.array(
                    [t for t in cand if not self._free_ok(tail, self.vocab.token_bytes[t])],
                    np.int64,
                )
                self.compiled.bad_straddlers[key] = bad
            set_bits(words, bad, False)
        else:
            add_forced_prefixes(self.matcher, self.vocab, words)
            if self.E is not None:
                bad = [
                    t
                    for t in self.compiled.ids_with_start
                    if test_bit(words, t) and not self.valid(t)
                ]
                set_bits(words, bad, False)

    def valid(self, t: int) -> bool:
        if t in self.stops:
            return self.span is None or (self.E is None and self.matcher.is_accepting())
        if t >= self.vocab.n_tokens:
            return self.span is None  # ids the tokenizer does not have: free text only
        b = self.vocab.token_bytes[t]
        if self.span is None:
            return self._free_ok(self.free_text, b)
        if self.matcher.validate_tokens([t]) != 1:
            return False
        if self.E is None:
            return True
        body = self.span + b
        e = body.find(self.E, len(self.S))
        return e < 0 or self._free_ok(b"", body[e + len(self.E) :])

    def consume(self, t: int) -> None:
        self.consumed += 1
        if self.error is not None:
            return
        if t in self.stops:
            if self.span is not None and self.E is not None:
                self.error = f"stop token {t} inside an open span"
            return
        b = self.vocab.token_bytes[t] if t < self.vocab.n_tokens else b""
        self.all_text += b
        if self.span is None:
            self._feed_free(b)
            return
        if not self.matcher.consume_token(t):
            self.error = f"token {t} rejected inside a span: {self.matcher.get_error()}"
            return
        self.span += b
        self._maybe_close()

    def _feed_free(self, data: bytes) -> None:
        text = self.free_text + data
        k = text.find(self.S)
        if k < 0:
            self.free_text = text[-max(len(self.S) - 1, 1) :] if len(self.S) > 1 else b""
            return
        rest = text[k:]
        self.matcher = self._fresh_matcher()  # the parser is reset per span, seeded with S
        ids = self.vocab.encode_bytes(rest)
        if not self.matcher.consume_tokens(ids):
            self.error = f"span start {rest!r} rejected: {self.matcher.get_error()}"
            return
        self.span, self.free_text = rest, b""
        self._maybe_close()

    def _maybe_close(self) -> None:
        if self.E is None:
            return
        e = self.span.find(self.E, len(self.S))
        if e < 0:
            return
        leftover = self.span[e + len(self.E) :]
        self.closed_spans.append(self.span[: e + len(self.E)])
        self.span, self.matcher = None, None
        self._feed_free(leftover)

    def fork(self) -> "SpanRow":
        """An independent copy (speculative walks over draft tokens)."""
        other = object.__new__(SpanRow)
        other.__dict__.update(self.__dict__)
        other.closed_spans = list(self.closed_spans)
        other.matcher = None if self.matcher is None else self.matcher.deep_copy()
        return other

    @property
    def text(self) -> bytes:
        return self.all_text

    def spans(self) -> list:
        """Closed spans, then the open one (unterminated) if any, as (bytes, closed)."""
        out = [(s, True) for s in self.closed_spans]
        if self.span is not None:
            out.append((self.span, False))
        return out


__all__ = ["FullRow", "SpanRow", "set_bits", "test_bit", "add_forced_prefixes", "FULL_WORD"]
