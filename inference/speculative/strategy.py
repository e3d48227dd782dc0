"""The ``speculative`` decode strategy: lossless speculative decoding inside the engine's one
compiled loop, batched (every row accepts its own number of tokens), also across vocabularies.

Timor et al., "Accelerating LLM Inference with Lossless Speculative Decoding Algorithms for
Heterogeneous Vocabularies" (ICML 2025). A round: feed the drafter what it has not seen
(catch-up), draft k <= K tokens, verify them with ONE target call of K+1 tokens, emit the accepted
prefix plus one target token, roll both caches back per row (length reset). Methods:
``sd`` shared vocabulary, Leviathan accept / residual / bonus; ``tli`` (Alg. 4) the drafter samples
from q' = q renormalised on V_T ∩ V_D (its logits masked to the intersection, as transformers'
pruned LM head), verified like sd with the residual over all of V_T (q' of a target token sums the
drafter tokens that spell it, where several do); ``slem`` (Alg. 2) the draft's
text is re-tokenised for the target on the host (``host.py``) and the target's own draws are matched
exactly (greedy and sampling); ``slrs`` (Alg. 3) proposes target tokens from ψ, the law of the
first target token of a character-level drafter's string (``slrs.py``), verified like sd. ``auto`` =
sd for a shared vocabulary, else slem when greedy and tli when sampling (transformers' routing).
Draft length: constant or the heuristic schedule (+2 / −1) per row under a static cap; with
``confidence_threshold`` a row also stops where the drafter is unsure, and the verify is only as
wide as the round's drafts (``lookahead.py``, DISCO / transformers' assistant confidence).
A constraint (grammar, JSON schema, regex, CRANE spans: ``inference/constrained``) masks the
target's distribution at the next position and after each draft prefix (host masks per row,
``target_mask``), so the output is distributed as constrained target-only decoding (token-identical
under greedy). With sd / tli the drafter's q is masked the same way at every draft step
(``draft_mask``, ``mask_drafts=True``): q stays the distribution the drafts are drawn from, so the
verification is unchanged and only acceptance rises. SLEM's drafter drafts unconstrained (its
tokens are not the grammar's); invalid drafts are rejected by the verifier.
Deviations: K defaults to 5 (transformers: 20, schedule constant); a row whose drafter buffers
would overflow stops drafting (it decodes one target token per round); no logits processors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from flax import struct

from pallasite.errors import ConfigError
from pallasite.inference.sampling import SamplingParams, SamplingSpec
from pallasite.inference.speculative import drafter as D
from pallasite.inference.speculative import host as H
from pallasite.inference.speculative import lookahead as LA
from pallasite.inference.speculative import probs as P
from pallasite.inference.speculative import slrs as S
from pallasite.inference.speculative.vocab import PairMap
from pallasite.ops.common import round_up

# deliberate breaks for negative controls (unmasked_q: drafts from the grammar-masked q, ratio from the plain q;
# unsure_draft_dropped: with a confidence threshold, a draft is withdrawn for its own probability q(d) < tau;
# unmerged_q: tli's ratio uses the drafted id's own q where several drafter ids spell its target token)
FAULTS = ("", "no_renorm", "raw_q", "residual_intersection", "unmasked_q", "psi_prefix", "unsure_draft_dropped",
          "unmerged_q")


@struct.dataclass
class SpecStats:
    target_calls: jax.Array  # int32 scalar: target forward calls, prefill included
    drafter_calls: jax.Array  # int32 scalar
    rounds_B: jax.Array  # int32 [B]: verification rounds the row took part in
    drafted_B: jax.Array  # int32 [B]: draft tokens proposed (target tokens)
    accepted_B: jax.Array  # int32 [B]: draft tokens accepted

    @classmethod
    def start(cls, B: int) -> "SpecStats":
        """The counters after the prefill (one target call)."""
        zeros = jnp.zeros((B,), jnp.int32)
        return cls(jnp.int32(1), jnp.int32(0), zeros, zeros, zeros)

    def count_round(self, active_B, drafter_calls, drafted_B, accepted_B) -> "SpecStats":
        """One more verification round (one target call); per-row counts only for active rows."""
        a = active_B.astype(jnp.int32)
        return SpecStats(self.target_calls + 1, self.drafter_calls + drafter_calls, self.rounds_B + a,
                         self.drafted_B + a * drafted_B, self.accepted_B + a * accepted_B)


@struct.dataclass
class SpecState:
    """``DecodeState.extra`` of the speculative strategy."""

    cache: Any  # the drafter's KV cache
    dlen_B: jax.Array  # drafter positions that hold verified context (the catch-up is fed from here)
    pend_BM: jax.Array  # drafter tokens to feed next round
    n_pend_B: jax.Array
    k_B: jax.Array  # current draft length
    stats: SpecStats
    d2t_V: jax.Array  # [V_D] target id of each drafter token (-1: outside the intersection)
    t2d_VL: jax.Array  # [V_T, L] drafter tokens of each target token (token-level methods)
    t2d_len_V: jax.Array  # [V_T]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecArgs:
    sampling: SamplingParams
    drafter_state: Any
    d2t: jax.Array  # [V_D] int32 target id of each drafter token (-1: none)
    t2d: jax.Array  # [V_T, L] int32 drafter tokens of each target token
    t2d_len: jax.Array  # [V_T] int32
    session: jax.Array  # int32 scalar, the SLEM host session (0: none)
    constraint: jax.Array  # int32 scalar, the constrained-decoding host session (0: none)
    slrs: Any = None  # SLRS: the target vocabulary's trie in drafter characters (slrs.SlrsTables)


@dataclasses.dataclass(frozen=True)
class SpeculativeStrategy:
    method: str  # sd | tli | slem | slrs (resolved)
    drafter_graphdef: Any
    drafter_config: Any
    drafter_cache_kind: str
    drafter_cache_config: Any
    spec: SamplingSpec = SamplingSpec()
    k_max: int = 5
    k_init: int = 5
    schedule: str = "constant"
    width: int = 5  # SLEM: target tokens per verification
    catch_up: int = 24  # SLEM: drafter tokens per catch-up call
    len_ratio: float = 2.0
    pair: Optional[PairMap] = None
    drafter_path: Optional[str] = None
    target_mask: Any = None  # hook: (ctx, s, tokens_BK, V) -> allowed [B, K+1, V] after each prefix
    draft_mask: Any = None  # hook: (ctx, s, tokens_BK, j, V) -> allowed [B, V] after the first j drafts
    confidence: Optional[float] = None  # draft step j only while the drafter's top probability >= this
    confidence_product: bool = False  # ... while the product of its top probabilities this round >= this
    fault: str = ""

    # ------------------------------------------------------------------ shapes
    def _pend_width(self, args) -> int:
        if self.method == "slem":
            return self.catch_up
        if self.method == "slrs":
            return 2 * args.slrs.width  # an unfed draft's characters + the target token's
        return 1 + int(args.t2d.shape[1])  # an unfed draft + one target token's drafter tokens

    def _draft_span(self, args) -> int:
        """Drafter positions one round may write past its pending tokens."""
        if self.method == "slrs":  # K drafts of up to L characters, the trie's node calls after the last
            return self.k_max * args.slrs.width + int(args.slrs.node_chars.shape[1]) + 1
        return self.k_max + 1

    def _prompt_width(self, T: int) -> int:
        if self.method == "sd":
            return T
        return round_up(int(math.ceil(T * self.len_ratio)) + 1, 16)

    def _drafter_capacity(self, Tp: int, N: int, M: int, span: int) -> int:
        return round_up(Tp + int(math.ceil(N * self.len_ratio)) + M + span + 1, 64)

    # ------------------------------------------------------------------ target side
    def _target_probs(self, ctx, s, logits_BTV, tokens_BK):
        """Post-warper target distributions [B, T, V] after the hook's masks (constraints)."""
        if self.target_mask is not None:
            allowed = self.target_mask(ctx, s, tokens_BK, logits_BTV.shape[-1])
            logits_BTV = jnp.where(allowed, logits_BTV, -jnp.inf)
        return P.warped_probs(logits_BTV, ctx.args.sampling, self.spec)

    def _target_greedy(self, ctx, s, logits_BTV, tokens_BK):
        """The target's greedy token [B, T] at each position (after the hook's masks): the argmax
        of ``_target_probs``'s one-hots, without building them ([B, K+1, V_T] floats a round)."""
        if self.target_mask is not None:
            allowed = self.target_mask(ctx, s, tokens_BK, logits_BTV.shape[-1])
            logits_BTV = jnp.where(allowed, logits_BTV, -jnp.inf)
        return jnp.argmax(logits_BTV.astype(jnp.float32), axis=-1).astype(jnp.int32)

    def _tables(self, args, V_D: int, V_T: int):
        """The mapping tables padded / cut to the models' logit widths (which may exceed the
        tokenizers' sizes): drafter ids that map past V_T and target tokens spelled with drafter
        ids past V_D are dropped."""
        d2t = self._d2t(args, V_D, V_T)
        t2d, n = self._t2d(args, V_T, V_D)
        return d2t, t2d, n

    def _d2t(self, args, V_D: int, V_T: int):
        d2t = args.d2t
        if d2t.shape[0] < V_D:
            d2t = jnp.pad(d2t, (0, V_D - d2t.shape[0]), constant_values=-1)
        d2t = d2t[:V_D]
        return jnp.where(d2t < V_T, d2t, -1)

    def _t2d(self, args, V_T: int, V_D: int):
        t2d, n = args.t2d, args.t2d_len
        if t2d.shape[0] < V_T:
            t2d = jnp.pad(t2d, ((0, V_T - t2d.shape[0]), (0, 0)), constant_values=-1)
            n = jnp.pad(n, (0, V_T - n.shape[0]))
        t2d, n = t2d[:V_T], n[:V_T]
        ok = jnp.all((t2d < V_D) | (jnp.arange(t2d.shape[1])[None, :] >= n[:, None]), axis=-1)
        return t2d, jnp.where(ok, n, 0)

    # ------------------------------------------------------------------ init
    def init(self, ctx, s, prefill_logits_BV):
        B, V_T = prefill_logits_BV.shape
        N = s.out_BN.shape[1]
        key, k_first = jax.random.split(s.key)
        p0 = self._target_probs(ctx, s, prefill_logits_BV[:, None], jnp.zeros((B, 0), jnp.int32))
        y0 = P.draw(k_first, p0[:, 0], self.spec.greedy_only)
        s = ctx.emit(s.replace(key=key, cache=s.cache.for_appending()), y0[:, None], jnp.ones_like(y0))

        cfg = self.drafter_config
        T = ctx.prompt_BT.shape[1]
        Tp = self._prompt_width(T)
        M = self._pend_width(ctx.args)
        Sd = self._drafter_capacity(Tp, N, M, self._draft_span(ctx.args))
        target_len = s.cache.capacity
        if cfg.max_seq_len < target_len:
            raise ConfigError(f"the drafter's context (max_seq_len={cfg.max_seq_len}) is shorter than the target's "
                              f"KV cache ({target_len} positions): it cannot follow this generation; use a drafter "
                              "with a longer context or a smaller cache_len / max_new_tokens")
        if self.method == "sd":
            d_prompt = jnp.where(ctx.prompt_BT < cfg.vocab_size, ctx.prompt_BT, 0)
            d_len = s.prompt_len_B
        else:
            d_prompt, d_len = self._host_prompts(ctx, s, Tp, Sd)
        dcache = D.create_cache(cfg, self.drafter_cache_kind, self.drafter_cache_config, B, Sd, self.drafter_path)
        dcache = D.prefill(self.drafter_graphdef, ctx.args.drafter_state, dcache, d_prompt, d_len)
        zeros = jnp.zeros((B,), jnp.int32)
        stats = SpecStats.start(B)
        d2t, t2d, t2d_len = self._tables(ctx.args, cfg.vocab_size, V_T)
        extra = SpecState(dcache, d_len, jnp.zeros((B, M), jnp.int32), zeros,
                          jnp.full((B,), self.k_init, jnp.int32), stats, d2t, t2d, t2d_len)
        if self.method != "slem":  # (SLEM: the host says what to feed at the start of each round)
            if self.method == "slrs":
                pend, n_pend = S.pending_after(ctx.args.slrs, jnp.zeros((B, 1), jnp.int32), y0, zeros, 0, M)
            else:
                pend, n_pend = self._pending_after(extra, y0, jnp.zeros((B, 1), jnp.int32), zeros, 0, M)
            prev = D.take_positions(d_prompt, jnp.maximum(d_len - 1, 0))
            d_len, pend, n_pend = _refeed_if_empty(d_len, pend, n_pend, prev)
            extra = extra.replace(dlen_B=d_len, pend_BM=pend, n_pend_B=n_pend)
        return s.replace(extra=extra)

    def _host_prompts(self, ctx, s, Tp: int, Sd: int):
        B = ctx.prompt_BT.shape[0]
        shapes = (jax.ShapeDtypeStruct((B, Tp), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
        if self.method == "slem":
            fn = functools.partial(H.cb_slem_init, width=Tp, capacity=Sd)
            return jax.pure_callback(fn, shapes, ctx.args.session, ctx.prompt_BT, s.prompt_len_B)
        fn = functools.partial(H.cb_encode_prompts, pair=self.pair, width=Tp)
        return jax.pure_callback(fn, shapes, ctx.prompt_BT, s.prompt_len_B)

    # ------------------------------------------------------------------ drafting
    def _catch_up(self, ctx, sp):
        """Feed the pending tokens; -> (cache, length after them, first draft logits [B, V_D])."""
        M = sp.pend_BM.shape[1]
        pos = sp.dlen_B[:, None] + jnp.arange(M, dtype=jnp.int32)[None, :]
        last = jnp.maximum(sp.n_pend_B - 1, 0)
        logits, cache = D.call_at(self.drafter_graphdef, ctx.args.drafter_state, sp.cache, sp.pend_BM, pos, last)
        return cache, sp.dlen_B + sp.n_pend_B, logits

    def _draft(self, ctx, cache, dl_B, logits_BV, k_B, key, allowed_V=None, keep_q: bool = True, row_mask=None):
        """Draft up to k_B tokens per row (static buffers of K): (cache, drafts [B, K], verification
        q [B, K, V_D] or None, drafts proposed per row [B], drafts fed to the drafter). Drafts are
        fed at dl, dl+1, ... while some row drafts on. ``row_mask(drafts_BK, j)`` -> allowed
        [B, V_D] narrows step j further (a constraint). With ``confidence`` a row stops before the
        first step whose masked logits' top probability (or, ``confidence_product``, the product of
        this round's top probabilities so far) is below it (``lookahead``)."""
        B, V_D = logits_BV.shape
        K = self.k_max
        args = ctx.args

        def dist(logits, allowed_BV=None):
            plain = logits
            if allowed_BV is not None:
                ok = allowed_BV if allowed_V is None else allowed_BV & allowed_V[None, :]
                ok = ok | ~jnp.any(ok, -1, keepdims=True)  # nothing draftable: the row drafts unconstrained
                logits = jnp.where(ok, logits, -jnp.inf)
            masked = logits if allowed_V is None else jnp.where(allowed_V[None, :], logits, -jnp.inf)
            if not keep_q:  # greedy / SLEM: only the draft itself is needed, not q
                return masked, None, masked
            q = P.warped_probs(masked[:, None], args.sampling, self.spec)[:, 0]
            if self.fault == "no_renorm":  # q on the intersection without renormalising it
                ver = P.warped_probs(logits[:, None], args.sampling, self.spec)[:, 0] * allowed_V[None, :]
            elif self.fault == "raw_q":  # ratio from the raw logits, draft from the processed ones
                ver = P.warped_probs(masked[:, None], args.sampling, self.spec, filters=False)[:, 0]
            elif self.fault == "unmasked_q":
                plain = plain if allowed_V is None else jnp.where(allowed_V[None, :], plain, -jnp.inf)
                ver = P.warped_probs(plain[:, None], args.sampling, self.spec)[:, 0]
            else:
                ver = q
            return q, ver, masked

        J = jnp.max(k_B)

        def body(c):
            j, cache, logits, drafts, qv, key, going_B, sure_B, n_B, fed, _ = c
            key, sub = jax.random.split(key)
            q, ver, masked = dist(logits, None if row_mask is None else row_mask(drafts, j))
            going_B = going_B & (j < k_B)
            dropped = self.fault == "unsure_draft_dropped"
            if self.confidence is not None and not dropped:  # decided before the draw: a stopping time
                sure_B = LA.top_probability(masked) * (sure_B if self.confidence_product else 1.0)
                going_B = going_B & (sure_B >= self.confidence)
            if keep_q:
                d = P.draw(sub, q, self.spec.greedy_only)
            else:  # q is the masked logits: the argmax for greedy rows, else a draw from the warped law
                d = P.draw_from_logits(sub, q, args.sampling, self.spec)
            if dropped:  # negative control: the draw decides whether it is proposed (biases the output)
                going_B = going_B & (jnp.take_along_axis(ver, d[:, None], axis=-1)[:, 0] >= self.confidence)
            drafts = drafts.at[:, j].set(d)
            if keep_q:
                qv = qv.at[:, j].set(ver)
            n_B = n_B + going_B.astype(jnp.int32)
            more = jnp.any(going_B) & (j + 1 < J)  # the next step's logits are wanted by some row

            def feed(cl):
                lg, cache = D.call(self.drafter_graphdef, args.drafter_state, cl[0], d[:, None], (dl_B + j)[:, None])
                return cache, lg[:, 0]

            cache, logits = jax.lax.cond(more, feed, lambda cl: cl, (cache, logits))
            return j + 1, cache, logits, drafts, qv, key, going_B, sure_B, n_B, fed + more.astype(jnp.int32), more

        qv0 = jnp.zeros((B, K, V_D), jnp.float32) if keep_q else jnp.zeros((B, K, 1), jnp.float32)
        zeros = jnp.zeros((B,), jnp.int32)
        # (step, cache, logits, drafts, q, key, row drafts on, its confidence, drafts per row, fed, go on)
        init = (jnp.int32(0), cache, logits_BV, jnp.zeros((B, K), jnp.int32), qv0, key, k_B > 0,
                jnp.ones((B,), jnp.float32), zeros, jnp.int32(0), J > 0)
        _, cache, _, drafts, qv, _, _, _, n_B, fed, _ = jax.lax.while_loop(lambda c: c[-1], body, init)
        return cache, drafts, (qv if keep_q else None), n_B, fed

    def _draft_slrs(self, ctx, cache, dl_B, logits_BV, J, key):
        args = ctx.args

        def call(cache, tokens_BT, positions_BT):
            return D.call(self.drafter_graphdef, args.drafter_state, cache, tokens_BT, positions_BT)

        def warp(logits_BV):
            return P.warped_probs(logits_BV[:, None], args.sampling, self.spec)[:, 0]

        return S.draft(call, warp, args.slrs, cache, dl_B, logits_BV, J, self.k_max, key, fault=self.fault)

    def _round_k(self, s, sp, Sd: int, span: int):
        """Per-row draft length this round: 0 for finished rows and rows whose drafter is full."""
        M = sp.pend_BM.shape[1]
        room = sp.dlen_B + M + span <= Sd
        return jnp.where(~s.done_B & room, sp.k_B, 0)

    def _pending_after(self, sp, y_B, drafts_BK, n_B, fed, M):
        """Token-level methods: what the drafter must see next — the last accepted draft when it
        was never fed (every fed draft and one more accepted), then the target's own token."""
        ids, n_ids = sp.t2d_VL[y_B], sp.t2d_len_V[y_B]
        unfed = n_B > fed
        last_draft = D.take_positions(drafts_BK, jnp.maximum(n_B - 1, 0))
        with_draft = jnp.concatenate([last_draft[:, None], ids], axis=1)
        without = jnp.concatenate([ids, jnp.zeros_like(ids[:, :1])], axis=1)
        pend = jnp.maximum(jnp.where(unfed[:, None], with_draft, without), 0)[:, :M]
        return pend, jnp.minimum(unfed.astype(jnp.int32) + n_ids, M)

    def _schedule(self, k_B, n_B, proposed_B, active_B):
        """The heuristic schedule's next K: +2 when every proposed draft was accepted, else -1; a
        row that proposed nothing (finished, or unsure: ``confidence``) keeps its K."""
        if self.schedule == "constant":
            return k_B
        new = jnp.where(n_B == proposed_B, jnp.minimum(k_B + 2, self.k_max), jnp.maximum(k_B - 1, 1))
        return jnp.where(active_B & (proposed_B > 0), new, k_B)

    # ------------------------------------------------------------------ one round
    def step(self, ctx, s):
        if self.method == "slem":
            return self._step_slem(ctx, s)
        return self._step_token(ctx, s)

    def _verify_logits(self, ctx, s, cand_BK, n_cand_B):
        """The target's logits [B, K+1, V_T] after the last token and the candidates. With
        ``confidence`` the call is only as wide as the longest row's candidates + 1."""
        return LA.verify_call(ctx, s, cand_BK, None if self.confidence is None else jnp.max(n_cand_B) + 1)

    def _merges_spellings(self) -> bool:
        """tli where several drafter tokens spell one target token (``PairMap.n_merged``); the
        negative control ``unmerged_q`` takes the drafted token's own q instead (biased)."""
        return (self.method == "tli" and self.pair is not None and self.pair.n_merged > 0
                and self.fault != "unmerged_q")

    def _verify_sampled(self, ctx, s, logits, cand, drafts, qv, k_B, d2t, k_acc, k_res):
        """Leviathan verification of the drafts (sd / tli / slrs): (accepted length n [B], the
        emitted tokens [B, K+1]: the accepted drafts then the residual or bonus token)."""
        B, K, VT = cand.shape[0], self.k_max, logits.shape[-1]
        p = self._target_probs(ctx, s, logits, cand)  # [B, K+1, V_T]
        p_tok = jnp.take_along_axis(p[:, :K], cand[..., None], axis=-1)[..., 0]
        if self._merges_spellings():  # q' of the proposed target token: all drafter tokens that spell it
            q_tok = jnp.sum(jnp.where(d2t[None, None, :] == cand[..., None], qv, 0.0), axis=-1)
        else:
            q_tok = jnp.take_along_axis(qv, drafts[..., None], axis=-1)[..., 0]
        n = P.leviathan_accept(k_acc, p_tok, q_tok, k_B)
        rejected = n < k_B
        q_at = D.take_positions(qv, jnp.minimum(n, K - 1))  # [B, V_D], the rejected draft's q
        if self.method == "slrs":
            W = min(VT, q_at.shape[1])  # the tables span the tokenizer, the logits the model's width
            qT = jnp.zeros((B, VT), jnp.float32).at[:, :W].set(q_at[:, :W])
            to_T = jnp.arange(VT)
        else:
            to_T = jnp.where(d2t >= 0, d2t, VT)
            qT = jnp.zeros((B, VT), jnp.float32).at[:, to_T].add(q_at, mode="drop")
        p_at = D.take_positions(p, n)
        if self.fault == "residual_intersection":  # resample only among tokens the drafter has
            image = jnp.zeros((VT,), bool).at[to_T].set(True, mode="drop")
            p_at = jnp.where(rejected[:, None] & ~image[None, :], 0.0, p_at)
        y = P.residual_or_bonus(k_res, p_at, qT, rejected, self.spec.greedy_only)
        return n, jnp.concatenate([cand, jnp.zeros_like(cand[:, :1])], axis=1).at[jnp.arange(B), n].set(y)

    def _step_token(self, ctx, s):
        sp = s.extra
        key, k_draft, k_acc, k_res = jax.random.split(s.key, 4)
        active = ~s.done_B
        k_B = self._round_k(s, sp, sp.cache.capacity, self._draft_span(ctx.args))
        dcache, dl, logits0 = self._catch_up(ctx, sp)
        d2t = sp.d2t_V
        greedy = self.spec.greedy_only and not self.fault
        if self.method == "slrs":  # drafts are target tokens already, q = ψ over V_T
            J = jnp.max(k_B)
            dcache, cand, qv, n_chars = self._draft_slrs(ctx, dcache, dl, logits0, J, k_draft)
            drafts, fed = cand, jnp.maximum(J - 1, 0)
            calls = J * (ctx.args.slrs.n_nodes + 1)  # + psi's node calls
        else:
            row_mask = None
            if self.draft_mask is not None:  # draft only what the constraint allows (drafter ids -> target ids)
                to_t = jnp.maximum(d2t, 0)
                V_T = sp.t2d_VL.shape[0]

                def row_mask(drafts_BK, j):
                    return self.draft_mask(ctx, s, jnp.take(to_t, drafts_BK), j, V_T)[:, to_t]

            dcache, drafts, qv, k_B, fed = self._draft(ctx, dcache, dl, logits0, k_B, k_draft, d2t >= 0,
                                                       row_mask=row_mask, keep_q=not greedy)
            cand = jnp.take(jnp.maximum(d2t, 0), drafts)
            calls = fed + 1  # the catch-up call and one call per fed draft
        logits, cache = self._verify_logits(ctx, s, cand, k_B)
        if greedy:
            # every row greedy: p and q are one-hots, so Leviathan's test accepts a draft iff it is the
            # target's argmax and the residual is that argmax: the longest exact match, then y there
            out = self._target_greedy(ctx, s, logits, cand)  # [B, K+1]
            n = P.exact_match(cand, k_B, out)
        else:
            n, out = self._verify_sampled(ctx, s, logits, cand, drafts, qv, k_B, d2t, k_acc, k_res)
        s = emit_verified(ctx, s.replace(key=key), cache, out, n + 1)
        y = D.take_positions(out, n)  # the target's own token after the accepted prefix
        # the drafter: its verified context grows by the accepted drafts it was fed, then the rest
        kept = jnp.minimum(n, fed)
        M = sp.pend_BM.shape[1]
        last_pending = D.take_positions(sp.pend_BM, jnp.maximum(sp.n_pend_B - 1, 0))
        if self.method == "slrs":  # the drafter saw every character of the kept drafts
            tab = ctx.args.slrs
            pend, n_pend = S.pending_after(tab, drafts, y, n, fed, M)
            upto = jnp.cumsum(n_chars, axis=1)
            grown = jnp.where(kept > 0, D.take_positions(upto, jnp.maximum(kept - 1, 0)), 0)
            last_kept = D.take_positions(drafts, jnp.maximum(kept - 1, 0))
            last_char = D.take_positions(tab.tok_char[last_kept], jnp.maximum(tab.tok_len[last_kept] - 1, 0))
            prev = jnp.where(kept > 0, last_char, last_pending)
        else:
            pend, n_pend = self._pending_after(sp, y, drafts, n, fed, M)
            grown = kept
            prev = jnp.where(kept > 0, D.take_positions(drafts, jnp.maximum(kept - 1, 0)), last_pending)
        new_dl, pend, n_pend = _refeed_if_empty(dl + grown, pend, n_pend, prev)
        dcache = dcache.rollback(new_dl)
        keep = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
        stats = sp.stats.count_round(active, calls, k_B, n)
        return s.replace(extra=sp.replace(
            cache=dcache, dlen_B=keep(new_dl, sp.dlen_B), pend_BM=keep(pend, sp.pend_BM),
            n_pend_B=keep(n_pend, sp.n_pend_B), k_B=self._schedule(sp.k_B, n, k_B, active), stats=stats))

    # ------------------------------------------------------------------ SLEM
    def _step_slem(self, ctx, s):
        sp = s.extra
        key, k_draft, k_tgt = jax.random.split(s.key, 3)
        active = ~s.done_B
        B, M = sp.pend_BM.shape
        shapes = (jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B, M), jnp.int32),
                  jax.ShapeDtypeStruct((B,), jnp.int32))
        dlen, pend, n_pend = jax.pure_callback(functools.partial(H.cb_slem_resync, M=M), shapes, ctx.args.session,
                                               s.out_BN, s.n_out_B, s.done_B)
        sp = sp.replace(cache=sp.cache.rollback(dlen), dlen_B=dlen, pend_BM=pend, n_pend_B=n_pend)
        k_B = self._round_k(s, sp, sp.cache.capacity, self._draft_span(ctx.args))
        dcache, dl, logits0 = self._catch_up(ctx, sp)
        dcache, drafts, _, k_B, fed = self._draft(ctx, dcache, dl, logits0, k_B, k_draft, None, keep_q=False)
        W = self.width
        shapes = (jax.ShapeDtypeStruct((B, W), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.int32))
        cand, n_cand = jax.pure_callback(H.cb_slem_propose, shapes, ctx.args.session, drafts, k_B, fed, s.done_B)
        logits, cache = self._verify_logits(ctx, s, cand, n_cand)
        if self.spec.greedy_only:
            drawn = self._target_greedy(ctx, s, logits, cand)  # [B, W+1]
        else:
            p = self._target_probs(ctx, s, logits, cand)  # [B, W+1, V]
            Bp, T1, V = p.shape
            drawn = P.draw(k_tgt, p.reshape(Bp * T1, V)).reshape(Bp, T1)
        n = P.exact_match(cand, n_cand, drawn)
        s = emit_verified(ctx, s.replace(key=key), cache, drawn, n + 1)
        stats = sp.stats.count_round(active, fed + 1, n_cand, n)
        extra = sp.replace(cache=dcache, dlen_B=dl, k_B=self._schedule(sp.k_B, n, n_cand, active), stats=stats)
        return s.replace(extra=extra)


def emit_verified(ctx, s, cache, tokens_BK1, n_new_B):
    """Emit each row's first ``n_new_B`` verified tokens and roll the target's cache back to them."""
    s = ctx.emit(s.replace(cache=cache), tokens_BK1, n_new_B)
    return s.replace(cache=s.cache.rollback(s.next_positions_B))  # valid: positions < next fed


def _refeed_if_empty(dlen_B, pend_BM, n_pend_B, prev_B):
    """A round must feed the drafter at least one token (its logits are the first draft's): when
    nothing is pending, step back one position and feed the last verified token ``prev`` again."""
    empty = n_pend_B == 0
    pend = pend_BM.at[:, 0].set(jnp.where(empty, prev_B, pend_BM[:, 0]))
    return jnp.where(empty, jnp.maximum(dlen_B - 1, 0), dlen_B), pend, jnp.maximum(n_pend_B, 1)


__all__ = ["SpeculativeStrategy", "SpecState", "SpecStats", "SpecArgs", "FAULTS"]
