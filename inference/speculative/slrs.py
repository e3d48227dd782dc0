"""SLRS, string-level rejection sampling (Timor et al., ICML 2025, Alg. 3), for character- or
byte-level drafters.

The proposal for the next target token is ψ(t) = P_q(F(S) = t): S the drafter's continuation
string, F(S) the first target token of S. Verification is Leviathan's: accept t with probability
min(1, p(t)/ψ(t)), else draw from norm(max(0, p − ψ)) over all of V_T (``probs.py``), so the
output is the target's distribution for any ψ that is exactly the distribution t was drawn from.

What is computed, and why it is practical only here:
* A character/byte drafter spells every string one way, so the probability that S starts with the
  string w is a product of the drafter's conditionals along w, ``P(w) = Π_i q(w_i | ctx, w_<i)``
  (with multi-character drafter tokens it is a sum over every drafter tokenisation of w: the
  paper's exponential).
* F is the longest target token whose string is a prefix of S (the lookahead rule that fixes t_1:
  at most the longest token's length in characters). Then ψ(t) = P(t) − Σ_{t' child of t} P(t'),
  the children being the nearest longer tokens that extend t's string (their events are disjoint).
  EOS is a one-"character" token: ψ(EOS_T) = q(EOS_D | ctx).
* ψ over all of V_T (the residual needs it) takes the drafter's conditionals at every proper
  prefix of a multi-character target token — one drafter call per trie node and draft step, all
  at the same positions (the slot convention makes the overwritten entries harmless). A target
  vocabulary whose trie exceeds ``SpeculativeConfig.slrs_max_nodes`` is refused.

Deviations: F is the longest-prefix rule, not the target BPE's own first token (that one needs
every |A|^L drafter string enumerated); ψ is renormalised over the strings F maps (drafter mass on
characters no target token starts with, or on special tokens other than EOS, is dropped; Σψ ≤ 1
before that), which is still the exact law the proposal is drawn from. A round chains K such
proposals: proposal j is ψ given the text of proposals < j, the distribution a fresh Alg. 3 step
uses after accepting them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.errors import ConfigError
from pallasite.inference.speculative import probs as P
from pallasite.inference.speculative.drafter import take_positions
from pallasite.inference.speculative.vocab import PairMap


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlrsTables:
    """The target vocabulary's trie in drafter characters (host-built, int32)."""

    node_chars: jax.Array  # [I, D] drafter ids of each internal trie node's string (proper prefixes)
    node_len: jax.Array  # [I]
    tok_node: jax.Array  # [V_T, L] conditional row (0: the context itself, 1 + i: node i) of each character
    tok_char: jax.Array  # [V_T, L] drafter id of each character of each target token
    tok_len: jax.Array  # [V_T] characters (0: not spelled by the drafter: ψ = 0)
    child: jax.Array  # [E] target tokens that extend a shorter target token ...
    parent: jax.Array  # [E] ... and that nearest shorter token

    @property
    def n_nodes(self) -> int:
        return int(self.node_chars.shape[0])

    @property
    def width(self) -> int:
        return int(self.tok_char.shape[1])


def check_char_drafter(pair: PairMap) -> None:
    """A drafter whose tokens span several characters has many spellings of a string: refuse."""
    multi = [j for j, b in enumerate(pair.drafter.bytes) if b is not None and len(b) > 1 and len(_chars(b)) != 1]
    if multi:
        j = multi[0]
        raise ConfigError(
            f"method='slrs' needs a character- or byte-level drafter (each string one drafter spelling, so psi "
            f"is a product of the drafter's conditionals); {len(multi)} of {len(pair.drafter)} drafter tokens span "
            f"several characters (e.g. id {j} = {pair.drafter.bytes[j]!r}): use method='slem' or 'tli'")


def _chars(b: bytes) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        return "??"


def build_tables(pair: PairMap, *, max_nodes: int) -> SlrsTables:
    """The trie tables of ``pair``'s target vocabulary spelled in the drafter's characters."""
    check_char_drafter(pair)
    tgt, dr = pair.target, pair.drafter
    eos = set(tgt.eos_ids)
    canonical: dict[tuple, int] = {}
    for t in range(len(tgt)):
        n = int(pair.t2d_len[t])
        seq = tuple(int(c) for c in pair.t2d[t, :n])
        if not seq or tgt.byte_fallback[t]:
            continue
        text = tgt.bytes[t]
        if text is None and not (t in eos and seq == (dr.eos_ids[:1] or (-1,))):
            continue
        if text is not None and dr.text_of(seq) != text:
            continue  # truncated or re-spelled: not this token's characters
        canonical.setdefault(seq, t)
    nodes = sorted({s[:i] for s in canonical for i in range(1, len(s))}, key=lambda s: (len(s), s))
    if len(nodes) > max_nodes:
        raise ConfigError(
            f"method='slrs': psi over the target vocabulary takes one drafter call per prefix of a multi-character "
            f"target token at every draft step; this target's vocabulary has {len(nodes)} such prefixes "
            f"(SpeculativeConfig.slrs_max_nodes={max_nodes}). SLRS is practical only for small target vocabularies "
            "(its cost grows with the strings psi sums over, Timor et al. Lemma); use method='slem' or 'tli'")
    row = {(): 0, **{s: 1 + i for i, s in enumerate(nodes)}}
    V, L = len(tgt), max(1, max((len(s) for s in canonical), default=1))
    D = max(1, max((len(s) for s in nodes), default=1))
    node_chars = np.zeros((len(nodes), D), np.int32)
    node_len = np.zeros(len(nodes), np.int32)
    for i, s in enumerate(nodes):
        node_chars[i, :len(s)] = s
        node_len[i] = len(s)
    tok_node = np.zeros((V, L), np.int32)
    tok_char = np.zeros((V, L), np.int32)
    tok_len = np.zeros(V, np.int32)
    child, parent = [], []
    for seq, t in canonical.items():
        tok_len[t] = len(seq)
        tok_char[t, :len(seq)] = seq
        tok_node[t, :len(seq)] = [row[seq[:i]] for i in range(len(seq))]
        for i in range(len(seq) - 1, 0, -1):  # the nearest shorter token on the way to the root
            if seq[:i] in canonical:
                child.append(t)
                parent.append(canonical[seq[:i]])
                break
    a = lambda x: jnp.asarray(np.asarray(x, np.int32))  # noqa: E731
    return SlrsTables(a(node_chars), a(node_len), a(tok_node), a(tok_char), a(tok_len), a(child), a(parent))


def prefix_probs(cond_BNV: jax.Array, tables: SlrsTables) -> jax.Array:
    """[B, V_T] probability that the drafter's string starts with each target token's string, from
    the drafter's conditionals [B, 1 + I, V_D] at the context and at each internal trie node."""
    B, _, V_D = cond_BNV.shape
    flat = cond_BNV.reshape(B, -1)
    idx = tables.tok_node * V_D + tables.tok_char  # [V_T, L]: q(character | its prefix) per token
    per_char = jnp.take(flat, idx, axis=1)  # [B, V_T, L]
    live = jnp.arange(tables.width)[None, :] < tables.tok_len[:, None]
    p_prefix = jnp.prod(jnp.where(live[None], per_char, 1.0), axis=-1)
    return jnp.where(tables.tok_len[None, :] > 0, p_prefix, 0.0)


def psi(cond_BNV: jax.Array, tables: SlrsTables) -> jax.Array:
    """ψ [B, V_T] (not renormalised): S starts with t's string and with no longer token's."""
    p_prefix = prefix_probs(cond_BNV, tables)
    longer = jnp.zeros_like(p_prefix).at[:, tables.parent].add(p_prefix[:, tables.child])
    return jnp.maximum(p_prefix - longer, 0.0)


def normalised(psi_BV: jax.Array) -> jax.Array:
    total = jnp.sum(psi_BV, axis=-1, keepdims=True)
    fallback = jnp.zeros_like(psi_BV).at[:, 0].set(1.0)  # nothing mapped (cannot happen for a full alphabet)
    return jnp.where(total > 1e-30, psi_BV / jnp.maximum(total, 1e-30), fallback)


def draft(call: Callable, warp: Callable, tables: SlrsTables, cache, dl_B, logits_BV, J, K: int, key, fault=""):
    """Draft J target tokens per row by SLRS proposals (static buffers of K).

    ``call(cache, tokens_BT, positions_BT) -> (logits [B, T, V_D], cache)`` is the drafter,
    ``warp(logits_BV) -> probs`` its sampling distribution. Returns (cache, drafts [B, K] target
    ids, ψ [B, K, V_T] each was drawn from, characters fed per draft [B, K]); drafts < J-1 are fed.
    ``fault="psi_prefix"`` (a negative control): the ratio and residual use P(S starts with t), the
    overlapping events (Σ > 1) a misreading of ψ sums, while drafts still come from ψ."""
    B = logits_BV.shape[0]
    V_T = tables.tok_len.shape[0]
    n_nodes, Dn = tables.node_chars.shape

    def conditionals(cache, dl, logits):
        root = warp(logits)[:, None]
        if n_nodes == 0:
            return root
        pos = dl[:, None] + jnp.arange(Dn, dtype=jnp.int32)[None, :]

        def one(i):
            toks = jnp.broadcast_to(tables.node_chars[i], (B, Dn))
            lg, _ = call(cache, toks, pos)  # written at positions >= dl: overwritten before any read
            return warp(lg[:, tables.node_len[i] - 1])

        nodes = jax.lax.map(one, jnp.arange(n_nodes))  # [I, B, V_D]
        return jnp.concatenate([root, jnp.swapaxes(nodes, 0, 1)], axis=1)

    def body(c):
        j, cache, dl, logits, drafts, qv, fed, key = c
        key, sub = jax.random.split(key)
        cond = conditionals(cache, dl, logits)
        q = normalised(psi(cond, tables))
        t = P.draw(sub, q)
        ver = prefix_probs(cond, tables) if fault == "psi_prefix" else q
        n_chars = tables.tok_len[t]
        drafts, qv, fed = drafts.at[:, j].set(t), qv.at[:, j].set(ver), fed.at[:, j].set(n_chars)

        def feed(cl):
            cache, logits = cl
            pos = dl[:, None] + jnp.arange(tables.width, dtype=jnp.int32)[None, :]
            lg, cache = call(cache, tables.tok_char[t], pos)
            return cache, take_positions(lg, jnp.maximum(n_chars - 1, 0))

        cache, logits = jax.lax.cond(j + 1 < J, feed, lambda cl: cl, (cache, logits))
        return j + 1, cache, dl + n_chars, logits, drafts, qv, fed, key

    zeros = jnp.zeros((B, K), jnp.int32)
    init = (jnp.int32(0), cache, dl_B, logits_BV, zeros, jnp.zeros((B, K, V_T), jnp.float32), zeros, key)
    _, cache, _, _, drafts, qv, fed, _ = jax.lax.while_loop(lambda c: c[0] < J, body, init)
    return cache, drafts, qv, fed


def pending_after(tables: SlrsTables, drafts_BK, y_B, n_B, fed: int, M: int):
    """What the drafter must see next: the characters of the last accepted draft when it was never
    fed, then those of the target's own token. -> (pending [B, M], count [B])."""
    last = take_positions(drafts_BK, jnp.maximum(n_B - 1, 0))
    n1 = jnp.where(n_B > fed, tables.tok_len[last], 0)
    n2 = tables.tok_len[y_B]
    a, b = tables.tok_char[last], tables.tok_char[y_B]  # [B, L]
    m = jnp.arange(M, dtype=jnp.int32)[None, :]
    from_a = jnp.take_along_axis(a, jnp.clip(m, 0, a.shape[1] - 1), axis=1)
    from_b = jnp.take_along_axis(b, jnp.clip(m - n1[:, None], 0, b.shape[1] - 1), axis=1)
    pend = jnp.where(m < n1[:, None], from_a, jnp.where(m < (n1 + n2)[:, None], from_b, 0))
    return pend, jnp.minimum(n1 + n2, M)


__all__ = ["SlrsTables", "check_char_drafter", "build_tables", "prefix_probs", "psi", "normalised", "draft",
           "pending_after"]
