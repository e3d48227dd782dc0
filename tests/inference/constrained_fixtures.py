"""Shared pieces of the constrained-decoding tests: a hand vocabulary with delimiter-straddling
tokens, a tiny random model over it, and an independent oracle (the ``lark`` package's LALR parser
over the same grammar) for which tokens keep an output valid."""

import functools

import numpy as np
from flax import nnx

from pallasite.inference.constrained import TokenBytes
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import init_model

TOKENS = (
    b"<eos>",
    b"<",
    b"<<",
    b"<<(",
    b"<(",
    b"<)",
    b"<<)",
    b">",
    b">>",
    b" >>",
    b">>.",
    b">><<",
    b"(",
    b")",
    b"a",
    b"b",
    b"ab",
    b"1",
    b"+",
    b"*",
    b" ",
    b"x",
    b"y",
    b".",
    b"q",
)
EOS = 0
VOCAB = TokenBytes(TOKENS, eos_token_id=EOS, special_ids=(EOS,))
MODEL_VOCAB = 32  # > len(TOKENS): ids the tokenizer does not have exist in the model
ID = {t: i for i, t in enumerate(TOKENS)}

# the answer grammar, for llguidance (constraint) and for lark (oracle): the same language
SPAN_LARK = "\n".join(
    [
        'start: "<<" e ">>"',
        'e: e "+" t | e "*" t | t',
        't: VAR | NUM | "(" e ")"',
        "VAR: /[ab]+/",
        "NUM: /1+/",
        '%ignore " "',
        "",
    ]
)


@functools.lru_cache(maxsize=None)
def _lark():
    import lark

    return lark.Lark(SPAN_LARK, parser="lalr")


@functools.lru_cache(maxsize=200_000)
def parses(text: str) -> bool:
    import lark

    try:
        _lark().parse(text)
        return True
    except lark.exceptions.LarkError:
        return False


_COMPLETIONS = tuple(b + ")" * k + d for b in ("", "a") for k in range(8) for d in (">>", ">"))


@functools.lru_cache(maxsize=200_000)
def viable_span(text: str) -> bool:
    """Is ``text`` (starting with "<<", no ">>" closing it) a prefix of a sentence?"""
    return any(parses(text + c) for c in _COMPLETIONS)


def crane_text_ok(text: str) -> bool:
    """CRANE semantics on a whole output: every S..E span parses, an open span is a viable prefix."""
    i = 0
    while True:
        k = text.find("<<", i)
        if k < 0:
            return True
        e = text.find(">>", k + 2)
        if e < 0:
            return viable_span(text[k:])
        if not parses(text[k : e + 2]):
            return False
        i = e + 2


def full_text_ok(text: str) -> bool:
    """Whole-output grammar: ``text`` is a prefix of a sentence (llguidance's %ignore applies between
    lexemes, not before the first one)."""
    if not text.startswith("<<"):
        return "<<".startswith(text)
    e = text.find(">>", 2)
    if e >= 0:
        return e + 2 == len(text) and parses(text)
    return viable_span(text)


def decode(ids) -> str:
    return b"".join(TOKENS[i] if i < len(TOKENS) and i != EOS else b"" for i in ids).decode()


def oracle_valid(ids, t: int, *, spans: bool) -> bool:
    """Brute force: is token ``t`` valid after ``ids``?"""
    text = decode(ids)
    if t == EOS:
        if spans:
            return crane_text_ok(text) and not _open_span(text)
        return parses(text) and not text.startswith(" ") and not text.endswith(" ")
    if t >= len(TOKENS):
        return spans and not _open_span(text)
    new = text + TOKENS[t].decode()
    return crane_text_ok(new) if spans else full_text_ok(new)


def _open_span(text: str) -> bool:
    i = 0
    while True:
        k = text.find("<<", i)
        if k < 0:
            return False
        e = text.find(">>", k + 2)
        if e < 0:
            return True
        i = e + 2


def tiny_model(seed: int = 0, scale: float = 1.0):
    cfg = ModelConfig(
        vocab_size=MODEL_VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64
    )
    g, st = nnx.split(init_model(cfg, seed=seed))
    if scale != 1.0:
        import jax

        st = jax.tree.map(lambda x: x * scale if np.issubdtype(x.dtype, np.floating) else x, st)
    return cfg, g, st
