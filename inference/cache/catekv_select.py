"""CateKV token selection and head classification (Jiang et al., "CateKV: On Sequential
Consistency for Long-Context LLM Inference Acceleration", ICML 2025; official code jhy-123/CateKV,
``models/kv_cache.py``), as pure functions over one layer's prompt queries and keys.

For a prompt of N tokens, chunk size C = 8, init = 64, recent = 256: ``chunk_end = C·(⌊N/C⌋ − 32/C)``
(the last ≥ 32 tokens are never chunked); middle keys ``[init, chunk_end − recent)`` in whole chunks.
``middle_attention``: softmax of the last 64 queries over the middle keys only, GQA-averaged.
``classify_heads``: ``τ = v_lo + κ(v_hi − v_lo)`` from the 1−β / β quantiles (κ = 1, β = 0.995),
``s_c = #{q : max_{t∈c} A(q,t) > τ}`` per chunk, ``CV = std(s)/mean(s)`` (unbiased std; mean 0 ->
1e-10): high CV = consistent. ``kept_indices``: a consistent head keeps init + the top
``(B − init − recent)/C`` chunks by ``Σ_q max_{t∈chunk} A`` + ``[chunk_end − recent, N)``.
``CateKVConfig.selection="recent"`` is the StreamingLLM-style baseline (newest middle chunks).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class CateKVConfig:
    budget: int = 2048  # B: tokens kept per consistent head (plus the unchunked tail)
    init_tokens: int = 64
    recent_tokens: int = 256
    chunk_size: int = 8
    last_q: int = 64
    tail_tokens: int = 32  # the last >= 32 tokens are never chunked
    top_threshold: float = 1.0  # κ
    top_fraction: float = 0.995  # β
    adaptive_ratio: Optional[float] = None  # r: fraction of adaptive KV heads (None: the head mask's own)
    selection: str = "catekv"  # catekv | recent (StreamingLLM-style baseline: newest middle chunks)
    head_mask: Optional[str] = None  # serving: the mask file (catekv_mask.save_head_mask), relative to the model

    def __post_init__(self):
        C = self.chunk_size
        for name in ("init_tokens", "recent_tokens", "tail_tokens"):
            if getattr(self, name) % C:
                raise ValueError(f"CateKVConfig: {name}={getattr(self, name)} must be a multiple of chunk_size={C}")
        spare = self.budget - self.init_tokens - self.recent_tokens
        if spare < 0 or spare % C:
            raise ValueError(
                f"CateKVConfig: budget={self.budget} must be init_tokens ({self.init_tokens}) + recent_tokens "
                f"({self.recent_tokens}) + a whole number of chunks of {C}; got {spare} tokens left for chunks")
        if self.adaptive_ratio is not None and not 0.0 <= self.adaptive_ratio <= 1.0:
            raise ValueError(f"CateKVConfig: adaptive_ratio={self.adaptive_ratio} must be in [0, 1]")
        if self.selection not in ("catekv", "recent"):
            raise ValueError(f"CateKVConfig: selection={self.selection!r}; expected 'catekv' or 'recent'")

    @property
    def select_chunks(self) -> int:
        return (self.budget - self.init_tokens - self.recent_tokens) // self.chunk_size

    @property
    def kept_max(self) -> int:
        """Most entries a consistent head keeps after prefill: B + the longest unchunked tail."""
        return self.budget + self.tail_tokens + self.chunk_size - 1


def chunk_geometry(lengths_B, cfg: CateKVConfig):
    """(chunk_end, middle_end, n_middle_chunks) per row, as in the official prefill."""
    C = cfg.chunk_size
    n_chunks = lengths_B // C - cfg.tail_tokens // C
    chunk_end = n_chunks * C
    mid_end = chunk_end - cfg.recent_tokens
    n_mid = jnp.maximum((mid_end - cfg.init_tokens) // C, 0)
    return chunk_end, mid_end, n_mid


def middle_attention(q_last_BQHD, k_BSKD, lengths_B, cfg: CateKVConfig):
    """Softmax of the last queries over the middle keys only, GQA-averaged.

    Returns ``A_BKQM`` (float32, M = n_slots·C covering positions init..init+M, zeros outside
    each row's middle) and ``valid_BM``. q_last: the queries at positions N-Q..N-1 of each row.
    """
    B, Q, H, D = q_last_BQHD.shape
    S, K = k_BSKD.shape[1], k_BSKD.shape[2]
    G = H // K
    C, init = cfg.chunk_size, cfg.init_tokens
    # at least one (then invalid) chunk slot: a prompt shorter than init + one chunk has no middle
    n_slots = max((S - init) // C, 1)
    M = n_slots * C
    k_mid = k_BSKD[:, init:init + M]
    if k_mid.shape[1] < M:
        k_mid = jnp.pad(k_mid, ((0, 0), (0, M - k_mid.shape[1]), (0, 0), (0, 0)))
    _, mid_end, _ = chunk_geometry(lengths_B, cfg)
    valid_BM = (init + jnp.arange(M))[None, :] < mid_end[:, None]
    q = q_last_BQHD.reshape(B, Q, K, G, D).astype(jnp.float32)
    logits = jnp.einsum("bqkgd,bmkd->bkgqm", q, k_mid.astype(jnp.float32)) * (D ** -0.5)
    logits = jnp.where(valid_BM[:, None, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    return jnp.mean(p, axis=2), valid_BM


def _chunk_view(A_BKQM, cfg):
    B, K, Q, M = A_BKQM.shape
    return jnp.max(A_BKQM.reshape(B, K, Q, M // cfg.chunk_size, cfg.chunk_size), axis=-1)  # [B,K,Q,n_slots]


def classify_heads(A_BKQM, valid_BM, cfg: CateKVConfig):
    """Coefficient of variation of per-chunk critical-query counts, per (row, KV head) -> [B, K].

    Also returns the counts ``s_BKN`` (chunks outside the middle are 0)."""
    B, K, Q, M = A_BKQM.shape
    C = cfg.chunk_size
    flat = jnp.where(valid_BM[:, None, None, :], A_BKQM, jnp.nan).reshape(B, K, Q * M)
    v_lo = jnp.nanquantile(flat, 1.0 - cfg.top_fraction, axis=-1)
    v_hi = jnp.nanquantile(flat, cfg.top_fraction, axis=-1)
    tau = jnp.maximum(v_lo + cfg.top_threshold * (v_hi - v_lo), 1e-9)  # [B, K]
    chunk_valid_BN = valid_BM.reshape(B, M // C, C)[..., -1]  # whole chunks only
    hit = _chunk_view(A_BKQM, cfg) > tau[:, :, None, None]
    counts = jnp.sum(hit, axis=2).astype(jnp.float32) * chunk_valid_BN[:, None, :]
    n = jnp.sum(chunk_valid_BN, axis=-1).astype(jnp.float32)[:, None]  # [B, 1]
    mean = jnp.sum(counts, axis=-1) / n
    var = jnp.sum(jnp.where(chunk_valid_BN[:, None, :], (counts - mean[..., None]) ** 2, 0.0), axis=-1) / (n - 1)
    mean = jnp.where(mean == 0, 1e-10, mean)
    return jnp.sqrt(var) / mean, counts


def chunk_scores(A_BKQM, valid_BM, cfg: CateKVConfig):
    """Selection score of each middle chunk, ``Σ_q max_{t∈chunk} A(q,t)`` (-inf outside the middle)."""
    B, K, Q, M = A_BKQM.shape
    chunk_valid_BN = valid_BM.reshape(B, M // cfg.chunk_size, cfg.chunk_size)[..., -1]
    s = jnp.sum(_chunk_view(A_BKQM, cfg), axis=2)
    if cfg.selection == "recent":  # StreamingLLM-style baseline: the newest middle chunks win
        s = jnp.broadcast_to(jnp.arange(s.shape[-1], dtype=jnp.float32), s.shape)
    return jnp.where(chunk_valid_BN[:, None, :], s, -jnp.inf)


def kept_indices(scores_BKN, lengths_B, cfg: CateKVConfig):
    """Token positions a consistent head keeps: init + top chunks + [chunk_end − recent, N).

    Returns ``idx_BKP`` (P = cfg.kept_max; kept positions ascending, then filler) and the
    number of kept entries per row ``count_B``. When the middle has no more chunks than the
    budget allows, every token is kept (B >= N is exact)."""
    B, K, N_slots = scores_BKN.shape
    C, init, recent = cfg.chunk_size, cfg.init_tokens, cfg.recent_tokens
    chunk_end, _, _ = chunk_geometry(lengths_B, cfg)
    n = lengths_B[:, None, None]
    init_pos = jnp.broadcast_to(jnp.arange(init), (B, K, init))
    sel = min(cfg.select_chunks, N_slots)
    top_s, top_c = jax.lax.top_k(scores_BKN, sel)  # [B, K, sel]
    chunk_pos = (init + top_c[..., None] * C + jnp.arange(C)).reshape(B, K, sel * C)
    _, _, n_mid = chunk_geometry(lengths_B, cfg)
    in_middle = (top_s > -jnp.inf) & (top_c < n_mid[:, None, None])  # never a chunk outside the middle
    chunk_ok = jnp.repeat(in_middle, C, axis=-1)
    n_recent = cfg.kept_max - init - cfg.select_chunks * C  # recent + longest tail
    r_start = jnp.maximum(chunk_end - recent, init)[:, None, None]
    recent_pos = jnp.broadcast_to(r_start + jnp.arange(n_recent), (B, K, n_recent))
    pos = jnp.concatenate([init_pos, chunk_pos, recent_pos], axis=-1)
    ok = jnp.concatenate([jnp.ones_like(init_pos, bool), chunk_ok, jnp.ones_like(recent_pos, bool)], axis=-1)
    ok &= pos < n
    big = jnp.iinfo(jnp.int32).max
    pos = jnp.sort(jnp.where(ok, pos, big), axis=-1)  # kept positions first, ascending
    pad = cfg.kept_max - pos.shape[-1]
    if pad > 0:
        pos = jnp.pad(pos, ((0, 0), (0, 0), (0, pad)), constant_values=big)
    # same count for every (real) head of a row: init + selected whole chunks + recent region
    count_B = (jnp.minimum(init, lengths_B) + jnp.minimum(sel, n_mid) * C
               + jnp.clip(lengths_B - r_start[:, 0, 0], 0, n_recent)).astype(jnp.int32)
    return jnp.where(pos == big, 0, pos).astype(jnp.int32), count_B
