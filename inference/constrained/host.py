"""The host half of constrained decoding: one ``HostSession`` per generation, one row state per prompt.

The compiled decode loop calls into the session through ``jax.pure_callback`` with the emitted
tokens so far (``out_BN``, ``n_out_B``, ``done_B``). ``sync`` consumes whatever each row has not
seen yet, so a call repeated for the same state is a no-op (the callbacks stay pure in effect).
``masks`` returns packed bitmasks ``[B, W]`` int32 (``W = ceil(V / 32)``, bit ``i % 32`` of word
``i // 32`` = token ``i`` allowed), computed for all grammar rows at once by llguidance's parallel
executor; ``check`` answers whether each row's proposed token is valid (opportunistic masking);
``kick`` / ``collect`` run sync + masks on a host thread while the device runs the forward pass.
Sessions live in a small registry keyed by an int id that the jitted loop carries as data (so a
new generation reuses the compiled loop).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import threading
import time
from typing import Optional, Sequence

import numpy as np

from pallasite.inference.constrained.constraint import Constraint, ConstraintError, compiled
from pallasite.inference.constrained.rows import FullRow, SpanRow
from pallasite.inference.constrained.vocab import vocab_for


@dataclasses.dataclass
class SessionStats:
    steps: int = 0  # mask-or-check calls (one per decode step)
    mask_calls: int = 0
    mask_rows: int = 0  # grammar rows whose mask was computed
    mask_s: float = 0.0  # host seconds computing masks (sync excluded)
    check_s: float = 0.0  # host seconds validating proposals
    sync_s: float = 0.0  # host seconds consuming emitted tokens
    wait_s: float = 0.0  # overlap mode: seconds the device waited for a mask (the exposed part)
    invalid_proposals: int = 0  # opportunistic mode: rows whose proposal had to be masked

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["mask_ms_per_step"] = 1e3 * self.mask_s / max(self.steps, 1)
        d["host_ms_per_step"] = (
            1e3 * (self.mask_s + self.check_s + self.sync_s) / max(self.steps, 1)
        )
        return d


class HostSession:
    """Row states of one batch (None = unconstrained row) + stats; see the module docstring."""

    def __init__(
        self,
        constraints: Sequence[Optional[Constraint]],
        stop_ids: Optional[Sequence[int]] = None,
        *,
        threads: Optional[int] = None,
    ):
        import llguidance

        tokenizers = {id(c.tokenizer): c.tokenizer for c in constraints if c is not None}
        unbound = [i for i, c in enumerate(constraints) if c is not None and c.tokenizer is None]
        if unbound:
            raise ConstraintError(
                f"constraint(s) of prompt(s) {unbound} have no tokenizer: pass them through "
                "pallasite.generate(model, ...) (which binds the model's tokenizer) or call "
                "Constraint.bind(tokenizer)"
            )
        if len(tokenizers) > 1:
            raise ConstraintError("all constraints of one generation must use the same tokenizer")
        self.vocab = vocab_for(next(iter(tokenizers.values())), stop_ids) if tokenizers else None
        self.rows = []
        for c in constraints:
            if c is None:
                self.rows.append(None)
                continue
            comp = compiled(c, self.vocab)
            self.rows.append(SpanRow(comp, self.vocab) if c.spans else FullRow(comp, self.vocab))
        self.n_rows = len(self.rows)
        self.stats = SessionStats()
        self._executor = llguidance.LLExecutor(threads) if tokenizers else None
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._pending: dict = {}
        self._lock = threading.Lock()
        self._tickets = itertools.count(1)
        self.id = _register(self)

    # ------------------------------------------------------------------ state
    def sync(self, out_BN: np.ndarray, n_out_B: np.ndarray) -> None:
        t0 = time.perf_counter()
        for i, row in enumerate(self.rows):
            if row is None:
                continue
            n = int(n_out_B[i])
            if n < row.consumed:
                raise RuntimeError(
                    f"constrained row {i}: {n} tokens emitted but {row.consumed} already consumed "
                    "(emitted tokens never shrink)"
                )
            for t in out_BN[i, row.consumed : n].tolist():
                row.consume(int(t))
        self.stats.sync_s += time.perf_counter() - t0

    def errors(self) -> dict:
        return {i: r.error for i, r in enumerate(self.rows) if r is not None and r.error}

    # ------------------------------------------------------------------ masks
    def masks(
        self, words_per_row: int, done_B: np.ndarray, which: Optional[np.ndarray] = None
    ) -> np.ndarray:
        """[B, W] int32 bitmasks; rows not in ``which`` (and done / unconstrained rows) allow all."""
        import llguidance.numpy as lln

        t0 = time.perf_counter()
        words = np.full((self.n_rows, words_per_row), -1, np.int32)
        todo = [
            i
            for i, r in enumerate(self.rows)
            if r is not None and not done_B[i] and r.error is None and (which is None or which[i])
        ]
        matchers = [(self.rows[i].mask_matcher(), i) for i in todo]
        matchers = [(m, i) for m, i in matchers if m is not None]
        if matchers:
            w_ll = (self.vocab.n_tokens + 31) // 32
            buf = np.zeros((self.n_rows, w_ll), np.int32)
            lln.fill_next_token_bitmask_par(self._executor, matchers, buf)
            keep = min(w_ll, words_per_row)
            for _, i in matchers:
                words[i, :keep] = buf[i, :keep]
                words[i, keep:] = 0
        for i in todo:
            self.rows[i].patch_mask(words[i])
        self.stats.mask_calls += 1
        self.stats.mask_rows += len(todo)
        self.stats.mask_s += time.perf_counter() - t0
        return words

    def sync_and_masks(self, out_BN, n_out_B, done_B, words_per_row: int) -> np.ndarray:
        self.sync(out_BN, n_out_B)
        self.stats.steps += 1
        return self.masks(words_per_row, done_B)

    def check(self, out_BN, n_out_B, done_B, proposal_B) -> np.ndarray:
        """Sync, then per row: is the proposed token valid? (unconstrained / done rows: True)."""
        self.sync(out_BN, n_out_B)
        self.stats.steps += 1
        t0 = time.perf_counter()
        ok = np.ones(self.n_rows, bool)
        for i, row in enumerate(self.rows):
            if row is not None and not done_B[i] and row.error is None:
                ok[i] = row.valid(int(proposal_B[i]))
        self.stats.invalid_proposals += int((~ok).sum())
        self.stats.check_s += time.perf_counter() - t0
        return ok

    # ------------------------------------------------------------------ overlap
    def kick(self, out_BN, n_out_B, done_B, words_per_row: int) -> int:
        """Start sync + masks on the host thread; returns the ticket ``collect`` waits on."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="pallasite-mask"
            )
        ticket = next(self._tickets)
        args = (np.array(out_BN), np.array(n_out_B), np.array(done_B), words_per_row)
        with self._lock:
            self._pending[ticket] = self._pool.submit(self.sync_and_masks, *args)
        return ticket

    def collect(self, ticket: int) -> np.ndarray:
        with self._lock:
            fut = self._pending.pop(ticket)
        t0 = time.perf_counter()
        words = fut.result()
        self.stats.wait_s += time.perf_counter() - t0
        return words

    # ------------------------------------------------------------------ speculative decoding
    def _walk_drafts(self, out_BN, n_out_B, done_B, draft_BK, upto: int, words_per_row: int, at):
        """Masks of forked rows after consuming each draft prefix of length in ``at`` (<= upto):
        {k: [B, W]}; rows whose draft turned invalid before k allow nothing at k."""
        self.sync(out_BN, n_out_B)
        B = draft_BK.shape[0]
        got = {}
        saved = self.rows
        try:
            forks = [None if r is None else r.fork() for r in saved]
            self.rows = forks
            alive = np.ones(B, bool)
            for k in range(upto + 1):
                if k in at:
                    got[k] = self.masks(words_per_row, np.asarray(done_B) | ~alive)
                    got[k][~alive] = 0
                if k == upto:
                    break
                for i, r in enumerate(forks):
                    if r is None or not alive[i]:
                        continue
                    t = int(draft_BK[i, k])
                    if r.valid(t):
                        r.consume(t)
                    else:
                        alive[i] = False
        finally:
            self.rows = saved
        return got

    def draft_masks(self, out_BN, n_out_B, done_B, draft_BK, words_per_row: int) -> np.ndarray:
        """[B, K+1, W]: the mask at the current position and after each draft prefix (the bonus
        position last). After the first invalid draft token the remaining masks allow nothing."""
        K = draft_BK.shape[1]
        got = self._walk_drafts(out_BN, n_out_B, done_B, draft_BK, K, words_per_row, range(K + 1))
        return np.stack([got[k] for k in range(K + 1)], axis=1)

    def prefix_mask(self, out_BN, n_out_B, done_B, draft_BK, j: int, words_per_row: int) -> np.ndarray:
        """[B, W]: the mask after the first ``j`` draft tokens (what the drafter may draft next)."""
        j = int(j)
        return self._walk_drafts(out_BN, n_out_B, done_B, draft_BK, j, words_per_row, (j,))[j]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        _SESSIONS.pop(self.id, None)


# ----------------------------------------------------------------------------- registry of live sessions

MAX_SESSIONS = 32  # oldest are dropped (a session is a few matchers: kilobytes)
_SESSIONS: "collections.OrderedDict[int, HostSession]" = collections.OrderedDict()
_IDS = itertools.count(1)
_REG_LOCK = threading.Lock()


def _register(session: HostSession) -> int:
    with _REG_LOCK:
        sid = next(_IDS) % (2**31 - 1)
        _SESSIONS[sid] = session
        while len(_SESSIONS) > MAX_SESSIONS:
            _, old = _SESSIONS.popitem(last=False)
            if old._pool is not None:
                old._pool.shutdown(wait=False)
        return sid


def get_session(sid) -> HostSession:
    sid = int(np.asarray(sid))
    try:
        return _SESSIONS[sid]
    except KeyError:
        raise RuntimeError(
            f"constrained-decoding session {sid} is gone (more than {MAX_SESSIONS} "
            "generations were started since)"
        ) from None


__all__ = ["HostSession", "SessionStats", "get_session", "MAX_SESSIONS"]
