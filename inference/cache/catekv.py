"""CateKV hybrid KV cache (Jiang et al., "CateKV: On Sequential Consistency for Long-Context LLM
Inference Acceleration", ICML 2025; official code github.com/jhy-123/CateKV, ``models/kv_cache.py``
``CateKVCache`` / ``CateKV_dynamic_Cache`` and ``select_headmask/static.py``).

Idea: for some KV heads ("consistent") the tokens that matter to the last prompt queries are the
same few chunks — those heads can keep a small budget B of tokens chosen once after prefill; the
others ("adaptive") keep the full cache. Heads are classified offline by the coefficient of
variation of per-chunk critical counts; the adaptive fraction r is a fraction of heads.

What this module implements, following the official code (names in brackets are theirs):

* **Geometry** for a prompt of N tokens, chunk size C = 8 [chunk_size], init = 64
  [init_tokens], recent = 256 [recent_tokens]: ``chunk_end = C·(⌊N/C⌋ − 32/C)`` (the last ≥ 32
  tokens are never chunked), middle keys ``[init, chunk_end − recent)`` in whole chunks.
* **Middle attention** of the last 64 queries [last_q]: ``A = softmax(q kᵀ/√d)`` over the middle
  keys *only*, averaged over the query heads of each GQA group -> ``A_h ∈ [64, n_mid]``.
* **Classification** (``classify_heads``, [CateKV_dynamic_Cache.prefill_kv_cache]): per KV head
  ``τ = v_lo + κ (v_hi − v_lo)`` with ``v_lo, v_hi`` the ``1−β`` and ``β`` quantiles of A_h
  (linear interpolation, as ``torch.quantile``), clamped at 1e-9; ``s_c = #{q : max_{t∈c} A(q,t) >
  τ}`` per middle chunk; ``CV = std(s)/mean(s)`` with the unbiased std (torch default) and mean 0
  replaced by 1e-10. Defaults κ = 1.0 [top_threshold], β = 0.995 [top_fraction] are
  ``test/eval_acc.py``'s argparse defaults; ``run_headmask.sh`` sweeps κ ∈ {0.984 … 0.998} × β ∈
  {1.0, 0.8}. High CV = consistent, low CV = adaptive.
* **Offline mask** (``calibrate_head_mask``, [static.py]): per calibration sample mark the heads
  with ``CV <= quantile(CV, r)``; sum over samples; keep the ``⌈r·L·K⌉`` most-marked heads as
  adaptive (1 = adaptive, as in the shipped ``head_type_p{100r}.csv``). Deviation: static.py keeps
  every head tied with the cut-off count (``>=``), which can exceed ``⌈r·L·K⌉``; we break ties by
  the mean CV (lower = adaptive) so the count — and so the memory — is exactly ``⌈r·L·K⌉``.
* **Hybrid cache** ([CateKVCache.prefill_kv_cache / update_kv_cache / collect_kv], with
  full_fraction = 1.0 as in ``run_catekv.sh``): adaptive heads keep every token; consistent heads
  keep init + the top ``(B − init − recent)/C`` middle chunks by ``Σ_q max_{t∈chunk} A(q,t)`` (no
  threshold) + ``[chunk_end − recent, N)`` — B plus the 32..39-token unchunked tail. The
  selection happens once, inside the prefill call, and is never refreshed. Every decoded token is
  appended to both parts. Decode attends each part separately (Pallas ``decode_attention`` with
  ``impl="pallas"``: the sparse part reads only its kept entries) and scatters the head outputs
  back into head order.

Layout — ragged per layer, packed across layers. The paper's mask is *global* (the top fraction
r of all L×K heads), so layer l has its own a_l adaptive and c_l = K − a_l consistent heads. A
layout with one [L, ...] array per part must give every layer max_l a_l full slots and max_l c_l
sparse slots; on a model with few KV heads that padding eats the saving (SmolLM2, K = 3, global
mask at r = 0.4: full÷hybrid 0.68 at 1088 tokens, i.e. *more* memory than the dense cache). So
the KV lives in two **pools shared by all layers**, one slot per head, no padding::

    k_full, v_full      [B, S, NA, D]   NA = Σ_l a_l adaptive heads, slot = position (dense convention)
    k_sparse, v_sparse  [B, P, NC, D]   NC = Σ_l c_l consistent heads, kept entries compacted to the front
    full_heads          [L, A] int32    KV head of each slot of the layer's window (K = not this layer's)
    sparse_heads        [L, C] int32    (A = max_l a_l, C = max_l c_l)
    full_base           [L] int32       first pool slot of the layer's adaptive heads (static table)
    sparse_base         [L] int32
    sparse_offset       [L, B] int32    sparse slot of the token at position p is p + offset
    prompt_len          [L, B] int32    prompt length per row (-1: last prefill position + 1)
    cv                  [L, B, K] f32   the CV of every head, measured at prefill

KV bytes = 2·B·D·bytes·Σ_l (a_l·S + c_l·P) exactly (``memory_report``), plus the small tables.
How a layer finds its heads: layer l reads a **fixed-size window** of A (resp. C) consecutive
pool slots starting at its base (``lax.dynamic_slice``: static shapes, so the model's
``lax.scan`` over layers and the Pallas decode kernel see the same shapes at every layer). Its
own a_l heads are the first slots of the window; the rest belong to neighbouring layers — they
are never written (writes scatter to the layer's own slots only) and their outputs are dropped
when heads are scattered back. ``pool_offsets`` places layers in ascending order of their count
so every window fits inside the pool without a tail pad. Why this design rather than per-head-slot
budgets inside per-layer arrays: with a leading layer axis every layer's slice has the same
size, so no per-layer arrangement can be ragged; the pools must be shared. They travel through
the layers beside the activations (``split_shared`` / ``join_shared``; ``models.transformer``
carries them in its scan carry; ``cache.layer(i)`` is one layer's view). Cost: each layer computes
attention for A (resp. C) window slots, so decode *compute* is padded to the per-layer maximum
even though *memory* is not (equal per-layer counts — e.g. ``calibrate_head_mask(per_layer=True)``
or r·K whole — waste nothing).

Calls: a call with T > 1 tokens is the prefill (positions 0..T-1, one call for the whole
prompt, as the official code); T = 1 calls are decode steps. Rows of a batch may have different
prompt lengths (right padding) when ``prompt_len`` is set (``init_catekv_cache(prompt_lengths=)`` or
``with_prompt_lengths``, which ``inference.engine`` calls before its prefill).
Sliding-window models are rejected (CateKV targets full-attention models).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallasite.ops.attention import attention, decode_attention
from pallasite.ops.attention.kv_source import dense_source

_MASK_FORMAT = "pallasite.catekv.head_mask/v1"


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
    adaptive_ratio: float = 0.4  # r: fraction of KV heads that are adaptive
    selection: str = "catekv"  # catekv | recent (StreamingLLM-style baseline: newest middle chunks)

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
        if not 0.0 <= self.adaptive_ratio <= 1.0:
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


# ----------------------------------------------------------------------------- pure functions
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
    n_slots = max((S - init) // C, 0)
    M = n_slots * C
    k_mid = k_BSKD[:, init:init + M]
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
    ok = jnp.concatenate([jnp.ones_like(init_pos, bool), chunk_ok, jnp.ones_like(recent_pos, bool)], axis=-1) & (pos < n)
    big = jnp.iinfo(jnp.int32).max
    pos = jnp.sort(jnp.where(ok, pos, big), axis=-1)  # kept positions first, ascending
    pad = cfg.kept_max - pos.shape[-1]
    if pad > 0:
        pos = jnp.pad(pos, ((0, 0), (0, 0), (0, pad)), constant_values=big)
    # same count for every (real) head of a row: init + selected whole chunks + recent region
    count_B = (jnp.minimum(init, lengths_B) + jnp.minimum(sel, n_mid) * C
               + jnp.clip(lengths_B - r_start[:, 0, 0], 0, n_recent)).astype(jnp.int32)
    return jnp.where(pos == big, 0, pos).astype(jnp.int32), count_B


# ----------------------------------------------------------------------------- head masks
def calibrate_head_mask(cv_SLK, r: float, *, per_layer: bool = False) -> np.ndarray:
    """Offline mask from per-sample CV matrices [samples, L, K] -> bool [L, K] (True = adaptive)."""
    cv = np.asarray(cv_SLK, np.float64)
    if cv.ndim != 3:
        raise ValueError(f"calibrate_head_mask: expected CV of shape [samples, layers, kv_heads], got {cv.shape}")
    if not 0.0 < r <= 1.0:
        raise ValueError(f"calibrate_head_mask: r={r} must be a fraction of heads in (0, 1]")
    S, L, K = cv.shape
    votes = np.zeros((L, K))
    for m in cv:  # static.py: per sample, the r-quantile lowest-CV heads
        thr = np.nanquantile(m, r)
        votes += np.nan_to_num(m, nan=np.inf) <= thr
    mean_cv = np.nanmean(np.where(np.isfinite(cv), cv, np.nan), axis=0)
    mean_cv = np.nan_to_num(mean_cv, nan=np.inf)
    mask = np.zeros((L, K), bool)
    if per_layer:  # round(r·K) per layer (r·K is rarely whole: SmolLM2 has K = 3)
        n_keep = int(round(r * K))
        for layer in range(L):
            order = np.lexsort((mean_cv[layer], -votes[layer]))
            mask[layer, order[:n_keep]] = True
    else:
        n_keep = int(math.ceil(r * L * K))
        order = np.lexsort((mean_cv.ravel(), -votes.ravel()))  # most votes first, then lowest mean CV
        mask.ravel()[order[:n_keep]] = True
    return mask


def _mask_meta(cfg) -> dict:
    return {"n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads, "n_heads": cfg.n_heads,
            "d_model": cfg.d_model, "head_dim": cfg.dh, "vocab_size": cfg.vocab_size}


def save_head_mask(path: str, mask_LK, model_cfg, catekv_cfg: Optional[CateKVConfig] = None,
                   extra: Optional[dict] = None) -> str:
    """Write the mask as JSON (a directory gets ``catekv_head_mask.json``) with the model shape."""
    mask = np.asarray(mask_LK).astype(bool)
    if mask.shape != (model_cfg.n_layers, model_cfg.n_kv_heads):
        raise ValueError(f"save_head_mask: mask shape {mask.shape} != (n_layers, n_kv_heads) = "
                         f"{(model_cfg.n_layers, model_cfg.n_kv_heads)}")
    if os.path.isdir(path):
        path = os.path.join(path, "catekv_head_mask.json")
    doc = {"format": _MASK_FORMAT, "model": _mask_meta(model_cfg), "adaptive_fraction": float(mask.mean()),
           "mask_adaptive": mask.astype(int).tolist(),
           "catekv": None if catekv_cfg is None else dataclasses.asdict(catekv_cfg), "extra": extra or {}}
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def load_head_mask(path: str, model_cfg) -> np.ndarray:
    """Read a mask written by ``save_head_mask``; a mask for another model shape fails clearly."""
    if os.path.isdir(path):
        path = os.path.join(path, "catekv_head_mask.json")
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != _MASK_FORMAT:
        raise ValueError(f"load_head_mask: {path} is not a CateKV head mask (format {doc.get('format')!r}, "
                         f"expected {_MASK_FORMAT!r})")
    want, got = _mask_meta(model_cfg), doc["model"]
    diff = {k: (got.get(k), want[k]) for k in want if got.get(k) != want[k]}
    if diff:
        raise ValueError(f"load_head_mask: {path} was calibrated for another model shape; "
                         f"(mask, model) differ in {diff}")
    mask = np.asarray(doc["mask_adaptive"], bool)
    if mask.shape != (model_cfg.n_layers, model_cfg.n_kv_heads):
        raise ValueError(f"load_head_mask: mask array in {path} has shape {mask.shape}, expected "
                         f"{(model_cfg.n_layers, model_cfg.n_kv_heads)}")
    return mask


def head_partition(mask_LK):
    """Per-layer adaptive / consistent KV-head index tables, padded with K (an unused slot)."""
    mask = np.asarray(mask_LK, bool)
    L, K = mask.shape
    A = int(mask.sum(1).max()) if L else 0
    Cn = int((~mask).sum(1).max()) if L else 0
    full = np.full((L, A), K, np.int32)
    sparse = np.full((L, Cn), K, np.int32)
    for layer in range(L):
        a, c = np.nonzero(mask[layer])[0], np.nonzero(~mask[layer])[0]
        full[layer, :len(a)] = a
        sparse[layer, :len(c)] = c
    return full, sparse


def pool_offsets(counts_L) -> tuple[np.ndarray, int]:
    """Static placement of each layer's heads in a packed pool: (base [L] int32, pool size).

    Layers are placed in ascending order of their head count (stable), so the largest layer comes
    last and a fixed-size window of ``max(counts)`` slots starting at any layer's base stays inside
    the pool: a layer placed before the last one ends at most ``max`` slots before the end. The pool
    therefore holds exactly ``sum(counts)`` slots (no tail pad)."""
    counts = np.asarray(counts_L, np.int64)
    base = np.zeros(len(counts), np.int32)
    at = 0
    for layer in np.argsort(counts, kind="stable"):
        base[layer] = at
        at += int(counts[layer])
    assert len(counts) == 0 or int((base + counts.max()).max()) <= at  # windows stay in the pool
    return base, at


def _round_up(n: int, m: int = 128) -> int:
    return -(-int(n) // m) * m


# ----------------------------------------------------------------------------- the cache
@struct.dataclass
class CateKVCache:
    k_full: Optional[jax.Array]  # [B, S, NA, D] pool of every layer's adaptive heads (None: split off)
    v_full: Optional[jax.Array]
    k_sparse: Optional[jax.Array]  # [B, P, NC, D] pool of every layer's consistent heads
    v_sparse: Optional[jax.Array]
    full_heads: jax.Array  # [L, A] KV head of each adaptive window slot (K = not this layer's)
    sparse_heads: jax.Array  # [L, C]
    full_base: jax.Array  # [L] first pool slot of the layer's adaptive heads
    sparse_base: jax.Array  # [L]
    sparse_offset: jax.Array  # [L, B] sparse slot of the token at position p is p + offset
    prompt_len: jax.Array  # [L, B]
    cv: jax.Array  # [L, B, K]
    cfg: CateKVConfig = struct.field(pytree_node=False, default=CateKVConfig())

    @property
    def capacity(self) -> int:
        return self.k_full.shape[1]

    @property
    def batch_size(self) -> int:
        return self.k_full.shape[0]

    def nbytes(self) -> int:
        return int(sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(self)))

    def kv_nbytes(self) -> int:
        return int(sum(a.size * a.dtype.itemsize for a in (self.k_full, self.v_full, self.k_sparse, self.v_sparse)))

    # -- the pools are shared by all layers: they travel beside the per-layer leaves ----------
    def split_shared(self):
        """(per-layer part: every leaf has the leading layer axis, the pools; see ``models.transformer``)."""
        pools = (self.k_full, self.v_full, self.k_sparse, self.v_sparse)
        return self.replace(k_full=None, v_full=None, k_sparse=None, v_sparse=None), pools

    def join_shared(self, pools):
        k_full, v_full, k_sparse, v_sparse = pools
        return self.replace(k_full=k_full, v_full=v_full, k_sparse=k_sparse, v_sparse=v_sparse)

    def layer(self, i):
        """Layer ``i``'s view (per-layer leaves sliced, pools shared) — what the model hands each layer."""
        per_layer, pools = self.split_shared()
        return jax.tree.map(lambda a: a[i], per_layer).join_shared(pools)

    def with_layer(self, i, layer_cache):
        """Write back a layer view (its per-layer leaves and the updated pools)."""
        per_layer, _ = self.split_shared()
        layer_part, pools = layer_cache.split_shared()
        return jax.tree.map(lambda a, n: a.at[i].set(n), per_layer, layer_part).join_shared(pools)

    def with_prompt_lengths(self, lengths_B):
        """The cache with each row's prompt length (right-padded prompts: the prefill takes the last
        queries and selects the kept entries per row). ``inference.engine`` calls this before prefill."""
        return self.replace(prompt_len=jnp.broadcast_to(jnp.asarray(lengths_B, jnp.int32), self.prompt_len.shape))

    # -- one layer (a ``layer(i)`` view: per-layer leaves without the L axis) -----------------
    def update_and_attend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, *, sliding_window=None, impl="ref",
                          interpret=None):
        if sliding_window is not None:
            raise ValueError("CateKVCache: sliding-window attention is not supported (CateKV targets "
                             f"full-attention models); got sliding_window={sliding_window}")
        if self.full_heads.ndim != 1:
            raise ValueError("CateKVCache.update_and_attend is called on one layer's view "
                             f"(cache.layer(i)); got index tables of shape {self.full_heads.shape}")
        if q_BTHD.shape[1] > 1:
            return self._prefill(q_BTHD, k_BTKD, v_BTKD, positions_BT, impl=impl, interpret=interpret)
        return self._decode(q_BTHD, k_BTKD, v_BTKD, positions_BT, impl=impl, interpret=interpret)

    @property
    def _K(self) -> int:
        return self.cv.shape[-1]

    def _pool_slots(self, heads, base, pool):
        """Pool slot of each window slot; slots that are not this layer's point past the pool (dropped)."""
        n = heads.shape[0]
        return jnp.where(heads < self._K, base + jnp.arange(n, dtype=jnp.int32), pool.shape[2])

    def _window(self, pool, base, n):
        """The layer's ``n`` (= per-layer maximum) consecutive pool slots from ``base``: its own heads
        first, then neighbours' (their outputs are dropped by ``_merge``). Always inside the pool."""
        return jax.lax.dynamic_slice_in_dim(pool, base, n, axis=2)

    def views(self):
        """(k_full, v_full [B, S, A, D], k_sparse, v_sparse [B, P, C, D]): this layer's windows."""
        A, Cn = self.full_heads.shape[-1], self.sparse_heads.shape[-1]
        return (self._window(self.k_full, self.full_base, A), self._window(self.v_full, self.full_base, A),
                self._window(self.k_sparse, self.sparse_base, Cn), self._window(self.v_sparse, self.sparse_base, Cn))

    def _scatter(self, pool, rows_B11, slots_BT1, heads, base, vals_BTnD):
        pool_heads = self._pool_slots(heads, base, pool)[None, None, :]
        return pool.at[rows_B11, slots_BT1, pool_heads].set(vals_BTnD.astype(pool.dtype), mode="drop")

    def _write(self, k_BTKD, v_BTKD, positions_BT, sparse_offset_B):
        B = k_BTKD.shape[0]
        rows = jnp.arange(B)[:, None, None]
        take = functools.partial(jnp.take, axis=2, mode="fill", fill_value=0)
        pos = positions_BT[:, :, None]
        slots = (positions_BT + sparse_offset_B[:, None])[:, :, None]
        fh, sh = self.full_heads, self.sparse_heads
        return (self._scatter(self.k_full, rows, pos, fh, self.full_base, take(k_BTKD, fh)),
                self._scatter(self.v_full, rows, pos, fh, self.full_base, take(v_BTKD, fh)),
                self._scatter(self.k_sparse, rows, slots, sh, self.sparse_base, take(k_BTKD, sh)),
                self._scatter(self.v_sparse, rows, slots, sh, self.sparse_base, take(v_BTKD, sh)))

    def _split_q(self, q_BTHD):
        B, T, H, D = q_BTHD.shape
        q = q_BTHD.reshape(B, T, self._K, H // self._K, D)
        take = functools.partial(jnp.take, axis=2, mode="fill", fill_value=0)
        return take(q, self.full_heads), take(q, self.sparse_heads)  # [B, T, A|C, G, D]

    def _merge(self, o_full, o_sparse, shape):
        B, T, H, D = shape
        out = jnp.zeros((B, T, self._K, H // self._K, D), jnp.float32)
        out = out.at[:, :, self.full_heads].set(o_full.astype(jnp.float32), mode="drop")
        out = out.at[:, :, self.sparse_heads].set(o_sparse.astype(jnp.float32), mode="drop")
        return out.reshape(B, T, H, D)

    def _decode(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, *, impl, interpret):
        k_full, v_full, k_sparse, v_sparse = self._write(k_BTKD, v_BTKD, positions_BT, self.sparse_offset)
        new = self.replace(k_full=k_full, v_full=v_full, k_sparse=k_sparse, v_sparse=v_sparse)
        return new.attend(q_BTHD, positions_BT, impl=impl, interpret=interpret), new

    def attend(self, q_BTHD, positions_BT, *, impl="ref", interpret=None):
        """Attention of queries at ``positions_BT`` over the current contents (no write):
        adaptive heads over the full part, consistent heads over their kept entries, outputs
        scattered back into head order. ``impl="pallas"`` with T == 1 runs ``decode_attention``."""
        B, T, H, D = q_BTHD.shape
        q_full, q_sparse = self._split_q(q_BTHD)
        G = H // self._K
        k_full, v_full, k_sparse, v_sparse = self.views()
        if impl == "pallas" and T == 1:
            pos = positions_BT[:, 0]

            def part(qp, kc, vc, kv_len):
                if qp.shape[2] == 0:
                    return jnp.zeros(qp.shape, jnp.float32)
                return decode_attention(qp[:, 0], dense_source(kc, vc), kv_len, interpret=interpret)[:, None]

            o_full = part(q_full, k_full, v_full, pos + 1)
            o_sparse = part(q_sparse, k_sparse, v_sparse, pos + self.sparse_offset + 1)
        else:
            def part(qp, kc, vc, k_positions):
                n = qp.shape[2]
                if n == 0:
                    return jnp.zeros(qp.shape, jnp.float32)
                o = attention(qp.reshape(B, T, n * G, D), kc.astype(qp.dtype), vc.astype(qp.dtype),
                              q_positions_BT=positions_BT, k_positions_BS=k_positions, causal=True, impl="ref")
                return o.reshape(B, T, n, G, D)

            S, P = k_full.shape[1], k_sparse.shape[1]
            o_full = part(q_full, k_full, v_full, jnp.broadcast_to(jnp.arange(S), (B, S)))
            # sparse slot s holds "virtual position" s - offset: prefill entries < N, appended ones = p
            o_sparse = part(q_sparse, k_sparse, v_sparse, jnp.arange(P)[None, :] - self.sparse_offset[:, None])
        return self._merge(o_full, o_sparse, q_BTHD.shape).astype(q_BTHD.dtype)

    def _prefill(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, *, impl, interpret):
        """Whole-prompt call: attend within the prompt, classify, select, fill both parts."""
        cfg = self.cfg
        B, T, H, D = q_BTHD.shape
        out = attention(q_BTHD, k_BTKD, v_BTKD, q_positions_BT=positions_BT, k_positions_BS=positions_BT,
                        causal=True, impl=impl, interpret=interpret)
        lengths = jnp.where(self.prompt_len >= 0, self.prompt_len, positions_BT[:, -1] + 1).astype(jnp.int32)
        Q = min(cfg.last_q, T)
        q_idx = jnp.clip(lengths[:, None] - Q + jnp.arange(Q), 0, T - 1)
        q_last = jnp.take_along_axis(q_BTHD, q_idx[:, :, None, None], axis=1)
        return out, self.fill(q_last, k_BTKD, v_BTKD, lengths)

    def fill(self, q_last_BQHD, k_BTKD, v_BTKD, lengths_B):
        """Classify + select from one layer's prompt K/V (positions 0..T-1) and its last queries;
        returns the filled layer view. (The prefill's attention itself is not part of this.)"""
        cfg = self.cfg
        B, T = k_BTKD.shape[:2]
        lengths = lengths_B.astype(jnp.int32)
        positions_BT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        A, valid = middle_attention(q_last_BQHD, k_BTKD, lengths, cfg)
        cv, _ = classify_heads(A, valid, cfg)
        scores = chunk_scores(A, valid, cfg)
        take = functools.partial(jnp.take, axis=1, mode="fill", fill_value=-jnp.inf)
        idx_BCP, count_B = kept_indices(take(scores, self.sparse_heads), lengths, cfg)
        # gather kept tokens of each consistent head: [B, C, P] positions -> [B, P, C, D]
        k_sp = jnp.take(k_BTKD, self.sparse_heads, axis=2, mode="fill", fill_value=0)  # [B, T, C, D]
        v_sp = jnp.take(v_BTKD, self.sparse_heads, axis=2, mode="fill", fill_value=0)
        Pk = idx_BCP.shape[-1]
        filler = (jnp.arange(Pk)[None, :] >= count_B[:, None])[:, :, None, None]  # slots past the kept entries

        def gather(x):  # -> [B, Pk, C, D], zeros in unused slots
            return jnp.where(filler, 0, jnp.take_along_axis(x, jnp.swapaxes(idx_BCP, 1, 2)[..., None], axis=1))

        rows = jnp.arange(B)[:, None, None]
        kept_slots = jnp.broadcast_to(jnp.arange(Pk, dtype=jnp.int32), (B, Pk))[:, :, None]
        sh, fh = self.sparse_heads, self.full_heads
        k_sparse = self._scatter(self.k_sparse, rows, kept_slots, sh, self.sparse_base, gather(k_sp))
        v_sparse = self._scatter(self.v_sparse, rows, kept_slots, sh, self.sparse_base, gather(v_sp))
        take_h = functools.partial(jnp.take, axis=2, mode="fill", fill_value=0)
        pos = positions_BT[:, :, None]
        k_full = self._scatter(self.k_full, rows, pos, fh, self.full_base, take_h(k_BTKD, fh))
        v_full = self._scatter(self.v_full, rows, pos, fh, self.full_base, take_h(v_BTKD, fh))
        return self.replace(k_full=k_full, v_full=v_full, k_sparse=k_sparse, v_sparse=v_sparse,
                            sparse_offset=count_B - lengths, cv=cv.astype(jnp.float32))


def init_catekv_cache(model_cfg, batch_size: int, max_len: int, head_mask_LK, *, catekv_cfg: CateKVConfig = CateKVConfig(),
                      max_new_tokens: Optional[int] = None, prompt_lengths=None, dtype=None) -> CateKVCache:
    """Empty hybrid cache: an adaptive pool of ``max_len`` slots for the mask's Σ_l a_l heads and a
    consistent pool of ``round_up(kept_max + max_new_tokens, 128)`` slots for its Σ_l c_l heads
    (default ``max_new_tokens``: ``max_len`` minus the budget, at least 128). Prefill fills it."""
    mask = np.asarray(head_mask_LK, bool)
    L, K, D = model_cfg.n_layers, model_cfg.n_kv_heads, model_cfg.dh
    if mask.shape != (L, K):
        raise ValueError(f"init_catekv_cache: head mask shape {mask.shape} does not match the model's "
                         f"(n_layers, n_kv_heads) = {(L, K)}")
    if model_cfg.sliding_window is not None:
        raise ValueError("init_catekv_cache: CateKV does not support sliding-window models")
    dtype = jnp.dtype(dtype or model_cfg.dtype)
    full, sparse = head_partition(mask)
    full_base, n_full = pool_offsets(mask.sum(1))
    sparse_base, n_sparse = pool_offsets((~mask).sum(1))
    if max_new_tokens is None:
        max_new_tokens = max(max_len - catekv_cfg.budget, 128)
    P = _round_up(catekv_cfg.kept_max + max_new_tokens)
    B = batch_size
    zeros = lambda s: jnp.zeros(s, dtype)
    lens = jnp.full((L, B), -1, jnp.int32) if prompt_lengths is None else jnp.broadcast_to(
        jnp.asarray(prompt_lengths, jnp.int32), (L, B))
    return CateKVCache(
        k_full=zeros((B, max_len, n_full, D)), v_full=zeros((B, max_len, n_full, D)),
        k_sparse=zeros((B, P, n_sparse, D)), v_sparse=zeros((B, P, n_sparse, D)),
        full_heads=jnp.asarray(full), sparse_heads=jnp.asarray(sparse),
        full_base=jnp.asarray(full_base), sparse_base=jnp.asarray(sparse_base),
        sparse_offset=jnp.zeros((L, B), jnp.int32), prompt_len=lens, cv=jnp.zeros((L, B, K), jnp.float32),
        cfg=catekv_cfg)


def catekv_cache_factory(head_mask_LK, catekv_cfg: CateKVConfig = CateKVConfig(), max_new_tokens: Optional[int] = None):
    """``cache_factory(cfg, batch, max_len)`` for ``inference.engine``. Prompts may have any
    lengths: the engine right-pads them and hands the cache each row's length
    (``with_prompt_lengths``) before the prefill."""
    def factory(cfg, batch_size, max_len):
        return init_catekv_cache(cfg, batch_size, max_len, head_mask_LK, catekv_cfg=catekv_cfg,
                                 max_new_tokens=max_new_tokens)
    return factory


# ----------------------------------------------------------------------------- memory accounting
def memory_report(*, n_layers: int, n_kv_heads: int, head_dim: int, context: int, adaptive_ratio: float,
                  catekv_cfg: CateKVConfig = CateKVConfig(), new_tokens: int = 0, batch: int = 1, dtype_bytes: int = 2,
                  head_mask_LK=None) -> dict:
    """Bytes of the full cache vs the hybrid cache (this layout) vs the paper's ideal.

    full   = 2·L·B·K·D·(N+new)·bytes
    ideal  = full · (r + (1−r)·B_budget/N)   (the paper's 1/(r + (1−r)B/N) ratio)
    layout = 2·B·D·bytes·Σ_l (a_l·(N+new) + c_l·P), P = round_up(kept_max + new, 128)
             (the packed pools: exactly one slot per head, no per-layer padding)
             + the int32 tables (head index tables [L, max a_l] / [L, max c_l], two bases [L],
             sparse_offset and prompt_len [L, B], cv [L, B, K] as float32).
    ``head_mask_LK`` defaults to r·K adaptive heads in every layer."""
    L, K, D = n_layers, n_kv_heads, head_dim
    if head_mask_LK is None:
        a = adaptive_ratio * K
        if abs(a - round(a)) > 1e-9:
            raise ValueError(f"memory_report: r·K = {adaptive_ratio}·{K} is not a whole number of heads; "
                             "pass head_mask_LK")
        mask = np.zeros((L, K), bool)
        mask[:, :int(round(a))] = True
    else:
        mask = np.asarray(head_mask_LK, bool)
        if mask.shape != (L, K):
            raise ValueError(f"memory_report: head mask shape {mask.shape} != (n_layers, n_kv_heads) = {(L, K)}")
    full_idx, sparse_idx = head_partition(mask)
    n_adaptive, n_consistent = int(mask.sum()), int((~mask).sum())
    S = context + new_tokens
    P = _round_up(catekv_cfg.kept_max + new_tokens)
    per_token = 2 * D * dtype_bytes * batch
    full_bytes = L * K * S * per_token
    hybrid_kv = (n_adaptive * S + n_consistent * P) * per_token
    index_bytes = 4 * (full_idx.size + sparse_idx.size + 2 * L + 2 * L * batch) + 4 * L * batch * K
    r = float(mask.mean())
    ideal_ratio = 1.0 / (r + (1 - r) * catekv_cfg.budget / context)
    hybrid = hybrid_kv + index_bytes
    return {"context": context, "adaptive_ratio": r, "budget": catekv_cfg.budget, "full_bytes": full_bytes,
            "hybrid_bytes": hybrid, "hybrid_kv_bytes": hybrid_kv, "index_bytes": index_bytes,
            "ratio": full_bytes / hybrid, "ideal_ratio": ideal_ratio, "ratio_vs_ideal": (full_bytes / hybrid) / ideal_ratio,
            "adaptive_heads": n_adaptive, "consistent_heads": n_consistent,
            "adaptive_window_per_layer": full_idx.shape[1], "consistent_window_per_layer": sparse_idx.shape[1]}


__all__ = ["CateKVConfig", "CateKVCache", "chunk_geometry", "middle_attention", "classify_heads", "chunk_scores",
           "kept_indices", "calibrate_head_mask", "save_head_mask", "load_head_mask", "head_partition", "pool_offsets",
           "init_catekv_cache", "catekv_cache_factory", "memory_report"]
