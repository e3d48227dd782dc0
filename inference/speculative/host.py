"""SLEM's host side: keeping the drafter's tokens in step with the target's text, per row.

Each row holds the target's tokens and bytes (prompt + emitted), the drafter's desired context
``D`` (an anchor — the drafter's BOS when its tokenizer adds one — then tokens whose bytes are the
target's text) and a mirror of what the drafter's cache holds. Called from the compiled loop:

* ``resync`` (start of a round): append the target's new tokens; re-encode the drafter's last
  ``drafter_lookbehind`` tokens' text plus the new text (Timor et al. / transformers' look-behind
  window) and keep the old tokens up to the first difference; roll the cache back to the longest
  common prefix of cache and ``D`` and return the rest to feed (at most ``max_catch_up``).
* ``propose`` (after drafting): the draft's bytes continue the target's text; re-encode them with
  the target's last ``target_lookbehind`` tokens and take the tokens after the window's byte
  boundary (alignment by byte offset; a token straddling the boundary is re-spelled from the
  boundary). A drafted EOS becomes the target's EOS. Candidates never change emitted tokens.

Only bytes matter, so any tokenizer pair works; an unfinished UTF-8 character waits for its bytes.
The ``cb_*`` functions at the end are what the strategy's ``jax.pure_callback`` calls run (the
session's methods, and the drafter-side encoding of the prompts for the token-level methods).
"""

from __future__ import annotations

import itertools
import threading
from typing import Optional

import numpy as np

from pallasite.inference.speculative.vocab import PairMap, is_char_start

_SESSIONS: dict[int, "SlemSession"] = {}
_IDS = itertools.count(1)
_LOCK = threading.Lock()
KEEP_SESSIONS = 32  # sessions of finished generations are dropped oldest first


def common_prefix(a: list, b: list) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Row:
    """One sequence: target tokens/bytes, the drafter's desired context and its cache mirror."""

    def __init__(self, pm: PairMap, target_ids: list[int], anchor: list[int], capacity: int):
        self.pm = pm
        self.t_ids: list[int] = []
        self.t_off: list[int] = [0]
        self.t_bytes = bytearray()
        self.append_target(target_ids)
        self.anchor = list(anchor)
        self.d_ids = list(anchor)
        self.d_off = [0] * (len(anchor) + 1)  # byte offset where each drafter token starts (+ end)
        self.cache: list[int] = []  # drafter tokens at cache positions 0.. (valid prefix)
        self.capacity = capacity
        self.draft: list[int] = []
        self.lag = False  # the drafter's cache is behind D (more to feed than one call takes)
        self.sync_drafter()

    # ------------------------------------------------------------------ target side
    def append_target(self, ids) -> None:
        T = self.pm.target
        for i in ids:
            i = int(i)
            b = T.bytes[i] if 0 <= i < len(T) else None
            self.t_ids.append(i)
            self.t_bytes += b or b""
            self.t_off.append(len(self.t_bytes))

    @property
    def covered(self) -> int:
        """Bytes of the target's text that the drafter's context ``D`` spells."""
        return self.d_off[-1]

    # ------------------------------------------------------------------ drafter side
    def sync_drafter(self, lookbehind: int = 10) -> None:
        """Re-encode the text from ``lookbehind`` drafter tokens back (moved to a character start)."""
        D = self.pm.drafter
        n_anchor = len(self.anchor)
        w = max(n_anchor, len(self.d_ids) - lookbehind)
        while w > n_anchor and not is_char_start(self.t_bytes, self.d_off[w]):
            w -= 1
        start = self.d_off[w]
        new_ids, used = D.encode(bytes(self.t_bytes[start:]))
        keep = common_prefix(new_ids, self.d_ids[w:])
        ids = self.d_ids[: w + keep] + new_ids[keep:]
        off = self.d_off[: w + keep + 1]
        for i in new_ids[keep:]:
            off.append(off[-1] + D.nbytes(i))
        if not ids:  # nothing to condition on: the drafter's EOS (documents start after one) or id 0
            ids, off = [D.eos_ids[0] if D.eos_ids else 0], [0, 0]
        self.d_ids, self.d_off = ids, off

    def resync(self, new_target_ids, *, lookbehind: int, max_feed: int) -> tuple[int, list[int]]:
        """(cache length to roll back to, drafter tokens to feed next)."""
        self.append_target(new_target_ids)
        self.sync_drafter(lookbehind)
        c = min(common_prefix(self.cache, self.d_ids), len(self.d_ids) - 1)
        feed = self.d_ids[c: c + max_feed]
        self.cache = self.d_ids[: c + len(feed)]
        self.lag = len(self.cache) < len(self.d_ids)
        return c, feed

    # ------------------------------------------------------------------ candidates
    def propose(self, drafts: list[int], fed: list[int], *, lookbehind: int, width: int,
                stops: tuple) -> list[int]:
        """Target candidate tokens for the drafted tokens ``drafts`` (``fed`` went into the cache)."""
        self.cache = self.cache + list(fed)
        if self.lag or not drafts:
            return []
        D, T = self.pm.drafter, self.pm.target
        text, eos = bytearray(), False
        for d in drafts:
            if d in D.eos_ids:
                eos = True
                break
            text += D.bytes[d] or b""
        need = bytes(self.t_bytes[self.covered:])  # target bytes the drafter's context lacks (a split char)
        if need:
            if not text.startswith(need):
                return []
            text = text[len(need):]
        tw = max(0, len(self.t_ids) - lookbehind)
        while tw > 0 and not is_char_start(self.t_bytes, self.t_off[tw]):
            tw -= 1
        window = bytes(self.t_bytes[self.t_off[tw]:])
        ids, used = T.encode(window + bytes(text))
        cands: list[int] = []
        at, i = 0, 0
        while i < len(ids) and at < len(window):  # skip the window's own tokens
            at += T.nbytes(ids[i])
            i += 1
        if at > len(window):  # a token straddles the boundary: spell the rest of it on its own
            gap, _ = T.encode((window + bytes(text))[len(window): at])
            cands = gap
        cands += ids[i:]
        if eos and used == len(window) + len(text) and stops:
            cands.append(int(stops[0]))
        return cands[:width]


class SlemSession:
    """The host state of one SLEM generation (rows are created by ``init_rows``)."""

    def __init__(self, pm: PairMap, *, target_lookbehind: int, drafter_lookbehind: int, max_feed: int,
                 width: int, stops: tuple):
        self.pm = pm
        self.target_lookbehind = target_lookbehind
        self.drafter_lookbehind = drafter_lookbehind
        self.max_feed = max_feed
        self.width = width
        self.stops = tuple(int(t) for t in stops)
        self.rows: list[Row] = []
        self.seen: Optional[np.ndarray] = None
        with _LOCK:
            self.id = next(_IDS)
            _SESSIONS[self.id] = self
            for old in sorted(_SESSIONS)[:-KEEP_SESSIONS]:
                _SESSIONS.pop(old, None)

    def anchor(self) -> list[int]:
        D = self.pm.drafter
        return [int(D.bos_id)] if D.adds_bos else []

    def init_rows(self, prompt_BT: np.ndarray, len_B: np.ndarray, width: int, capacity: int):
        """Drafter prompts ([B, width] int32 right-padded, lengths) for the target's prompts."""
        B = prompt_BT.shape[0]
        out = np.zeros((B, width), np.int32)
        lens = np.zeros(B, np.int32)
        self.rows, self.seen = [], np.zeros(B, np.int64)
        for b in range(B):
            row = Row(self.pm, prompt_BT[b, : int(len_B[b])].tolist(), self.anchor(), capacity)
            ids = row.d_ids[-width:]  # a drafter prompt longer than its buffer keeps its end
            row.cache = list(ids)
            if len(ids) < len(row.d_ids):  # the cache now starts later in the text: rebase the row
                cut = len(row.d_ids) - len(ids)
                row.d_ids, row.d_off, row.anchor = ids, row.d_off[cut:], []
            out[b, : len(ids)] = ids
            lens[b] = len(ids)
            self.rows.append(row)
        return out, lens

    def resync(self, out_BN, n_out_B, done_B, M: int):
        B = len(self.rows)
        dlen = np.zeros(B, np.int32)
        feed = np.zeros((B, M), np.int32)
        n_feed = np.zeros(B, np.int32)
        for b, row in enumerate(self.rows):
            new = out_BN[b, self.seen[b]: n_out_B[b]]
            self.seen[b] = n_out_B[b]
            if done_B[b]:
                dlen[b] = max(len(row.cache) - 1, 0)
                feed[b, 0] = row.cache[-1] if row.cache else 0
                n_feed[b] = 1
                continue
            c, ids = row.resync(new, lookbehind=self.drafter_lookbehind, max_feed=M)
            dlen[b], n_feed[b] = c, len(ids)
            feed[b, : len(ids)] = ids
        return dlen, feed, n_feed

    def propose(self, drafts_BK, k_B, fed: int, done_B):
        B = len(self.rows)
        cands = np.zeros((B, self.width), np.int32)
        n = np.zeros(B, np.int32)
        for b, row in enumerate(self.rows):
            d = drafts_BK[b].tolist()
            c = row.propose(d[: int(k_B[b])], d[:fed] if not done_B[b] else [], lookbehind=self.target_lookbehind,
                            width=self.width, stops=self.stops) if not done_B[b] else []
            cands[b, : len(c)] = c
            n[b] = len(c)
        return cands, n


def get_session(sid) -> SlemSession:
    s = _SESSIONS.get(int(sid))
    if s is None:
        raise RuntimeError(f"speculative SLEM session {int(sid)} is gone (more than {KEEP_SESSIONS} "
                           "generations ran at once?)")
    return s


# ----------------------------------------------------------------------------- the compiled loop's callbacks
def cb_encode_prompts(prompt_BT, len_B, *, pair: PairMap, width: int):
    B = prompt_BT.shape[0]
    out = np.zeros((B, width), np.int32)
    lens = np.zeros(B, np.int32)
    anchor = [int(pair.drafter.bos_id)] if pair.drafter.adds_bos else []
    for b in range(B):
        ids = Row(pair, np.asarray(prompt_BT[b, : int(len_B[b])]).tolist(), anchor, 0).d_ids[-width:]
        out[b, : len(ids)] = ids
        lens[b] = len(ids)
    return out, lens


def cb_slem_init(sid, prompt_BT, len_B, *, width: int, capacity: int):
    return get_session(sid).init_rows(np.asarray(prompt_BT), np.asarray(len_B), width, capacity)


def cb_slem_resync(sid, out_BN, n_out_B, done_B, *, M: int):
    return get_session(sid).resync(np.asarray(out_BN), np.asarray(n_out_B), np.asarray(done_B), M)


def cb_slem_propose(sid, drafts_BK, k_B, fed, done_B):
    return get_session(sid).propose(np.asarray(drafts_BK), np.asarray(k_B), int(fed), np.asarray(done_B))


__all__ = ["Row", "SlemSession", "get_session", "common_prefix", "cb_encode_prompts", "cb_slem_init", "cb_slem_resync",
           "cb_slem_propose"]
