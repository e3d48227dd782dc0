"""Fixtures of the speculative-decoding tests: two hand-built tokenizers over one 6-character
alphabet whose merges differ (so concatenations re-tokenise differently), a synthetic corpus, and
tiny models of both vocabularies, briefly trained on it so that drafts are often accepted.

target  (GPT-2 style, 'Ġ' space marker): a b c Ġ . Ċ + ab bc Ġa          (10 ids with <eos>)
drafter (SentencePiece style, '▁'):       a b c ▁ . \\n + ca ▁b ab abc    (11 ids with <eos>)
e.g. "abc" -> target [ab, c], drafter [abc]; "cab ba" -> target [c, ab, Ġ, b, a], drafter [ca, b, ▁b, a].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.transformer import forward, init_model

EOS = 0


def target_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "Ġ": 4, ".": 5, "Ċ": 6, "ab": 7, "bc": 8, "Ġa": 9}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("b", "c"), ("Ġ", "a")]))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    t.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


def drafter_tokenizer(space_twice: bool = False):
    """``space_twice``: the vocabulary also holds a literal " " (id 11) beside "▁", so two drafter
    tokens spell the target's "Ġ" (the normaliser never produces id 11; a model can draft it)."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "a": 1, "b": 2, "c": 3, "▁": 4, ".": 5, "\n": 6, "ca": 7, "▁b": 8, "ab": 9, "abc": 10}
    if space_twice:
        vocab[" "] = 11
    t = Tokenizer(models.BPE(vocab=vocab, merges=[("c", "a"), ("▁", "b"), ("a", "b"), ("ab", "c")]))
    t.normalizer = normalizers.Replace(" ", "▁")
    t.decoder = decoders.Sequence([decoders.Replace("▁", " ")])
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


def char_tokenizer(alphabet="abc .\n"):
    """A character-level drafter tokenizer (SLRS): one token per character + <eos>."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, **{("▁" if ch == " " else ch): i + 1 for i, ch in enumerate(alphabet)}}
    t = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    t.normalizer = normalizers.Replace(" ", "▁")
    t.decoder = decoders.Sequence([decoders.Replace("▁", " ")])
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>")


WORDS = ["abc", "ab", "cab", "bca", "a", "ca", "bb", "cc", "abca", "ba"]


def corpus(n_chars: int, seed: int = 0) -> str:
    """Sentences of a word Markov chain: each word is followed by its successor in one fixed cycle
    through all words with probability 0.8, else by a random word."""
    rng = np.random.default_rng(seed)
    cycle = np.random.default_rng(123).permutation(len(WORDS))
    succ = {int(a): int(b) for a, b in zip(cycle, np.roll(cycle, -1))}
    out, w, n = [], 0, 0
    while n < n_chars:
        w = succ[w] if rng.random() < 0.8 else int(rng.integers(len(WORDS)))
        end = rng.random()
        out.append(WORDS[w] + (". " if end < 0.1 else ".\n" if end < 0.15 else " "))
        n += len(out[-1])
    return "".join(out)


def tiny_config(vocab: int, **kw) -> ModelConfig:
    base = dict(vocab_size=vocab, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, rope_theta=500.0,
                eos_token_id=EOS, max_seq_len=4096)
    return ModelConfig(**{**base, **kw})


def _batches(ids: np.ndarray, seq: int, batch: int, steps: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(ids) - seq - 1, size=batch)
        yield np.stack([ids[s: s + seq + 1] for s in starts])


@functools.lru_cache(maxsize=None)
def trained(which: str, steps: int = 150, seed: int = 0):
    """(cfg, graphdef, state, tokenizer) of a tiny model trained on ``corpus`` ("target"/"drafter"/"char")."""
    tok = {"target": target_tokenizer, "drafter": drafter_tokenizer, "char": char_tokenizer}[which]()
    cfg = tiny_config(len(tok))
    ids = np.asarray(tok.encode(corpus(40_000, seed=1)), np.int32)
    g, state = nnx.split(init_model(cfg, seed=seed))
    params = nnx.to_pure_dict(state)
    opt = optax.adam(3e-3)
    opt_state = opt.init(params)

    def loss_fn(params, batch):
        st = nnx.State(state)
        nnx.replace_by_pure_dict(st, params)
        logits = forward(g, st, batch[:, :-1])[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    @jax.jit
    def update(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        upd, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss

    for batch in _batches(ids, 32, 32, steps, seed):
        params, opt_state, loss = update(params, opt_state, jnp.asarray(batch))
    nnx.replace_by_pure_dict(state, params)
    return cfg, g, state, tok


def random_model(vocab: int, seed: int, scale: float = 1.0, **kw):
    """(cfg, graphdef, state) of a random tiny model; ``scale`` multiplies its logits (peakier)."""
    cfg = tiny_config(vocab, **kw)
    model = init_model(cfg, seed=seed)
    model.final_norm.scale[...] = model.final_norm.scale[...] * scale
    g, st = nnx.split(model)
    return cfg, g, st


def prompts_from(tok, n: int, seed: int = 0, lo: int = 3, hi: int = 12) -> list[list[int]]:
    """``n`` prompts of random corpus text (lengths lo..hi target tokens)."""
    rng = np.random.default_rng(seed)
    text = corpus(200 * n + 1000, seed=seed + 7)
    ids = tok.encode(text)
    out = []
    for _ in range(n):
        L = int(rng.integers(lo, hi + 1))
        s = int(rng.integers(0, len(ids) - L))
        out.append([int(t) for t in ids[s: s + L]])
    return out


def drafter_for(models, method: str):
    """The drafter of ``models = (target, drafter)`` (each ``trained(...)``'s tuple) for ``method``:
    for sd (shared vocabulary) the target itself with noisy weights, for slrs the character-level
    model ``trained("char")``, else the drafter model."""
    from pallasite.inference.speculative import Drafter

    (tc, tg, ts, ttok), (dc, dg, ds, dtok) = models
    if method == "slrs":
        dc, dg, ds, dtok = trained("char")
    if method == "sd":
        noisy = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(1), a.shape, a.dtype), ts)
        return Drafter(tc, tg, noisy, ttok, target_tokenizer=ttok)
    return Drafter(dc, dg, ds, dtok, target_tokenizer=ttok)
