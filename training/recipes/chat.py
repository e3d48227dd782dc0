"""Chat examples -> response-masked token ids -> packed rows with one segment per example.

    ids, mask = encode_example(tokenizer, [{"role": "user", "content": "2+2?"},
                                           {"role": "assistant", "content": "4"}], template)
    rows = pack_examples([(ids, mask), ...], seq_len=128, pad_id=0)      # tokens/targets/... [R, T]
    ds = RowDataset(rows, batch_size=16, seed=0)          # resumable, like PackedDataset

The last message is the response; everything before it is the prompt. The prompt is the chat
template rendered with ``add_generation_prompt=True``; the response is whatever the full render adds
after it (the template must render the prompt as a prefix of the full conversation — checked). The
two parts are tokenised separately, so the boundary never falls inside a BPE merge; the loss mask is
1 exactly on the response tokens (the end-of-turn token included, so the model learns to stop).

Packing keeps examples whole: a row is filled with examples in a seeded order until the next one
does not fit; each example is its own segment (1, 2, …; positions restart at 0; attention never
crosses segments), padding is segment 0 with mask 0. ``RowDataset`` shuffles the fixed rows per
epoch (seeded) and resumes exactly through ``training.data.BatchIterator``.
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional, Sequence

import numpy as np

from pallasite.errors import ConfigError, DataError
from pallasite.training.data import BatchIterator

# A minimal template for tokenizers trained here (special tokens below); ``<|eos|>`` ends a turn.
TOY_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}<|eos|>"
    "{% elif m['role'] == 'system' %}<|system|>{{ m['content'] }}\n"
    "{% else %}<|user|>{{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHAT_SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>")
ROW_KEYS = ("tokens", "targets", "positions", "segment_ids", "loss_mask")


def chat_template_of(tokenizer, override: str = "", *, where: str = "tokenizer") -> str:
    """The template to use: ``override`` if given, else the tokenizer's; an error if neither."""
    template = override or getattr(tokenizer, "chat_template", None)
    if not template:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ConfigError(
            f"chat template missing: {where} {name!r} has no chat_template; set "
            "data.kind_config.chat_template to a Jinja template or use a tokenizer that carries one"
        )
    return template


def messages_of(record: Mapping, *, where: str = "example") -> list[dict]:
    """``{"messages": [...]}`` or ``{"prompt": ..., "response": ...}`` -> a message list ending with
    the assistant's response."""
    if "messages" in record:
        msgs = [dict(m) for m in record["messages"]]
    elif "prompt" in record and "response" in record:
        msgs = [
            {"role": "user", "content": str(record["prompt"])},
            {"role": "assistant", "content": str(record["response"])},
        ]
    else:
        raise DataError(
            f"{where}: expected a 'messages' list or 'prompt' + 'response' fields; "
            f"got {sorted(record)}"
        )
    if len(msgs) < 2 or msgs[-1].get("role") != "assistant":
        raise DataError(
            f"{where}: the last message must be the assistant's response (role 'assistant'); "
            f"got roles {[m.get('role') for m in msgs]}"
        )
    return msgs


def render(tokenizer, messages, template: str, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages,
        chat_template=template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(tokenizer, prompt_messages, template: str) -> list[int]:
    """Token ids of a prompt (messages without the response) ready for generation."""
    return _encode(tokenizer, render(tokenizer, list(prompt_messages), template, True))


def encode_example(
    tokenizer, messages, template: str, *, where: str = "example"
) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], response mask float32 [n]) of one chat example."""
    prompt_text = render(tokenizer, messages[:-1], template, True)
    full_text = render(tokenizer, messages, template, False)
    if not full_text.startswith(prompt_text):
        raise ConfigError(
            f"{where}: the chat template does not render the prompt as a prefix of the full "
            f"conversation (prompt {prompt_text[-40:]!r} vs full "
            f"{full_text[: len(prompt_text)][-40:]!r}); "
            "response-only masking needs that property"
        )
    p_ids = _encode(tokenizer, prompt_text)
    r_ids = _encode(tokenizer, full_text[len(prompt_text) :])
    if not r_ids:
        raise DataError(f"{where}: the response renders to no tokens")
    ids = np.asarray(p_ids + r_ids, np.int32)
    mask = np.concatenate([np.zeros(len(p_ids), np.float32), np.ones(len(r_ids), np.float32)])
    return ids, mask


def _empty_rows(n: int, T: int, pad_id: int) -> dict:
    return {
        "tokens": np.full((n, T), pad_id, np.int32),
        "targets": np.full((n, T), pad_id, np.int32),
        "positions": np.zeros((n, T), np.int32),
        "segment_ids": np.zeros((n, T), np.int32),
        "loss_mask": np.zeros((n, T), np.float32),
    }


def pack_examples(
    examples: Sequence[tuple[np.ndarray, np.ndarray]],
    seq_len: int,
    *,
    pad_id: int,
    order: Optional[Sequence[int]] = None,
    max_segments: int = 0,
) -> dict:
    """Pack (ids, mask) examples into rows of ``seq_len`` (next-token targets; see the module doc).
    An example needs ``len(ids) - 1`` positions; one that cannot fit a row is an error naming it."""
    T = int(seq_len)
    order = range(len(examples)) if order is None else order
    placements, row, fill, seg = [], 0, 0, 0
    for i in order:
        ids, _ = examples[i]
        n = len(ids) - 1
        if n < 1:
            raise DataError(
                f"pack_examples: example {i} has {len(ids)} token(s); needs at least 2"
            )
        if n > T:
            raise DataError(
                f"pack_examples: example {i} needs {n} positions ({len(ids)} tokens), more than "
                f"data.seq_len={T}; raise seq_len or shorten it"
            )
        if fill + n > T or (max_segments and seg >= max_segments):
            row, fill, seg = row + 1, 0, 0
        placements.append((i, row, fill, seg + 1))
        fill, seg = fill + n, seg + 1
    rows = _empty_rows(row + 1 if placements else 0, T, pad_id)
    for i, r, start, s in placements:
        ids, mask = examples[i]
        n = len(ids) - 1
        sl = slice(start, start + n)
        rows["tokens"][r, sl] = ids[:-1]
        rows["targets"][r, sl] = ids[1:]
        rows["positions"][r, sl] = np.arange(n, dtype=np.int32)
        rows["segment_ids"][r, sl] = s
        rows["loss_mask"][r, sl] = mask[1:]
    return rows


def pack_pairs(
    pairs: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    seq_len: int,
    *,
    pad_id: int,
) -> dict:
    """One preference pair per row: (chosen ids, mask) as segment 1, (rejected ids, mask) as 2."""
    rows = _empty_rows(len(pairs), int(seq_len), pad_id)
    for r, (c_ids, c_mask, r_ids, r_mask) in enumerate(pairs):
        one = pack_examples([(c_ids, c_mask), (r_ids, r_mask)], seq_len, pad_id=pad_id)
        if len(one["tokens"]) != 1:
            raise DataError(
                f"pack_pairs: pair {r} (chosen {len(c_ids)} + rejected {len(r_ids)} tokens) "
                f"does not fit "
                f"one row of data.seq_len={seq_len}"
            )
        for k in ROW_KEYS:
            rows[k][r] = one[k][0]
    return rows


class RowDataset:
    """Fixed rows -> seeded, shuffled [B, ...] batches per epoch; ``iterator(state)`` resumes."""

    def __init__(
        self, rows: Mapping[str, np.ndarray], *, batch_size: int, seed: int, shuffle: bool = True
    ):
        self.rows = {k: np.asarray(v) for k, v in rows.items()}
        n = len(next(iter(self.rows.values())))
        self.num_rows, self.batch_size, self.seed, self.shuffle = (
            n,
            int(batch_size),
            int(seed),
            shuffle,
        )
        self.batches_per_epoch = n // self.batch_size
        if self.batches_per_epoch < 1:
            raise ConfigError(
                f"RowDataset: {n} rows give fewer than one batch of {self.batch_size}; "
                "use more examples or a smaller data.batch_size"
            )
        mask = self.rows.get("loss_mask")
        self.num_tokens = int(mask.sum()) if mask is not None else n
        h = hashlib.sha256()
        for k in sorted(self.rows):
            h.update(k.encode())
            h.update(np.ascontiguousarray(self.rows[k]).tobytes())
        h.update(f"{self.batch_size},{self.seed},{self.shuffle}".encode())
        self.fingerprint = h.hexdigest()[:16]

    def epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def batch(self, epoch: int, index: int) -> dict:
        idx = self.epoch_order(epoch)[index * self.batch_size : (index + 1) * self.batch_size]
        return {k: v[idx] for k, v in self.rows.items()}

    def iterator(self, state: Optional[dict] = None) -> BatchIterator:
        it = BatchIterator(self)
        if state is not None:
            it.restore(state)
        return it

    def first_batches(self, n: int) -> list[dict]:
        return [self.batch(0, i) for i in range(min(n, self.batches_per_epoch))]


def all_batches(
    rows: Mapping[str, np.ndarray], batch_size: int, pad_rows: bool = True
) -> list[dict]:
    """Every row in order, in batches of ``batch_size`` — for evaluation sets. A short last batch is
    padded with empty rows when ``pad_rows`` (all-masked rows add nothing to token losses), else
    dropped (pair losses count rows)."""
    rows = {k: np.asarray(v) for k, v in rows.items()}
    n = len(next(iter(rows.values())))
    out = []
    for s in range(0, n, batch_size):
        b = {k: v[s : s + batch_size] for k, v in rows.items()}
        short = batch_size - len(b["tokens"])
        if short and not pad_rows:
            break
        if short:
            b = {
                k: np.concatenate([v, np.zeros((short, *v.shape[1:]), v.dtype)])
                for k, v in b.items()
            }
        out.append(b)
    return out


__all__ = [
    "TOY_CHAT_TEMPLATE",
    "CHAT_SPECIAL_TOKENS",
    "ROW_KEYS",
    "chat_template_of",
    "messages_of",
    "render",
    "prompt_ids",
    "encode_example",
    "pack_examples",
    "pack_pairs",
    "RowDataset",
    "all_batches",
]
