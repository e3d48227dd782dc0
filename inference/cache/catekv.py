"""CateKV hybrid KV cache (Jiang et al., ICML 2025; official ``CateKVCache``): adaptive heads keep
every token, consistent heads keep the tokens ``catekv_select.kept_indices`` chose once at prefill
(never refreshed); every decoded token is appended to both parts. Decode attends each part
separately (the Pallas decode kernel reads only the kept entries) and scatters head outputs back.

The paper's mask is global (the top fraction r of all L×K heads), so layers hold different numbers
of adaptive heads. The KV lives in two pools shared by all layers, one slot per head, no padding:
``k_full, v_full [B, S, NA, D]`` (NA = Σ_l a_l) and ``k_sparse, v_sparse [B, P, NC, D]``
(kept entries compacted to the front); layer l reads a fixed-size window of max_l a_l (resp. c_l)
pool slots from its base (static shapes for ``lax.scan`` and the kernel; other layers' slots are
never written and their outputs dropped). The pools ride along the layers (``split_shared``).
KV bytes = 2·B·D·bytes·Σ_l (a_l·S + c_l·P) (``memory_report``); docs/attention.md has the design
notes and measurements. A call with T > 1 tokens is the prefill (after ``for_appending``: an append).
Sliding-window layers (Mistral, Gemma 3's local layers) attend only within their window, so
CateKV's selection has nothing to do there: all their KV heads are made adaptive
(``init_catekv_cache`` ORs them into the mask) and the window mask is applied to prefill and
decode; the paper's method then runs on the global layers.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallasite.inference.cache.base import KVCache
from pallasite.inference.cache.catekv_mask import MASK_FILE, load_head_mask
from pallasite.inference.cache.catekv_select import (
    CateKVConfig,
    chunk_scores,
    classify_heads,
    kept_indices,
    middle_attention,
)
from pallasite.ops.attention import attention, decode_attention
from pallasite.ops.attention.kv_source import dense_source
from pallasite.ops.common import round_up
from pallasite.registry import KV_CACHE


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


# ----------------------------------------------------------------------------- the cache
@struct.dataclass
class CateKVCache(KVCache):
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
    appending: bool = struct.field(pytree_node=False, default=False)  # T > 1 calls append (for_appending)

    @property
    def capacity(self) -> int:
        return self.k_full.shape[1]

    @property
    def batch_size(self) -> int:
        return self.k_full.shape[0]

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

    @classmethod
    def create(cls, model_cfg, batch_size: int, max_len: int, *, config: Optional[CateKVConfig] = None,
               model=None) -> "CateKVCache":
        """The hybrid cache for serving: the head mask comes from ``config.head_mask`` (a file written
        by ``pallasite catekv-calibrate``; a relative path is looked up in the model's folder), by
        default ``catekv_head_mask.json`` in the model's folder."""
        config = config or CateKVConfig()
        folder = getattr(model, "path", None)
        path = config.head_mask
        if path is None:
            if not folder or not os.path.exists(os.path.join(folder, MASK_FILE)):
                where = f"in {folder}" if folder else "(the model has no folder)"
                raise ValueError(f"kv_cache='catekv' needs a head mask: none given and no {MASK_FILE} {where}. "
                                 "Write one with `pallasite catekv-calibrate --model MODEL` or pass "
                                 "kv_cache_config.head_mask (CLI: --catekv.head_mask FILE)")
            path = MASK_FILE
        if not os.path.isabs(path) and folder:
            path = os.path.join(folder, path)
        mask = load_head_mask(path, model_cfg, adaptive_ratio=config.adaptive_ratio)
        return init_catekv_cache(model_cfg, batch_size, max_len, mask, catekv_cfg=config)

    def with_prompt_lengths(self, lengths_B):
        """The cache with each row's prompt length (right-padded prompts: the prefill takes the last
        queries and selects the kept entries per row). ``inference.engine`` calls this before prefill."""
        return self.replace(prompt_len=jnp.broadcast_to(jnp.asarray(lengths_B, jnp.int32), self.prompt_len.shape))

    def for_appending(self):
        """After the prefill: calls of T > 1 tokens append them (speculative verification)."""
        return self.replace(appending=True)

    # -- one layer (a ``layer(i)`` view: per-layer leaves without the L axis) -----------------
    def update_and_attend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, *, sliding_window=None, impl="ref",
                          interpret=None):
        """``sliding_window``: this layer's window (its heads are all adaptive, ``init_catekv_cache``)."""
        if self.full_heads.ndim != 1:
            raise ValueError("CateKVCache.update_and_attend is called on one layer's view "
                             f"(cache.layer(i)); got index tables of shape {self.full_heads.shape}")
        if q_BTHD.shape[1] > 1 and not self.appending:
            return self._prefill(q_BTHD, k_BTKD, v_BTKD, positions_BT, impl=impl, interpret=interpret,
                                 sliding_window=sliding_window)
        return self._decode(q_BTHD, k_BTKD, v_BTKD, positions_BT, impl=impl, interpret=interpret,
                            sliding_window=sliding_window)

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

    def _decode(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, *, impl, interpret, sliding_window=None):
        k_full, v_full, k_sparse, v_sparse = self._write(k_BTKD, v_BTKD, positions_BT, self.sparse_offset)
        new = self.replace(k_full=k_full, v_full=v_full, k_sparse=k_sparse, v_sparse=v_sparse)
        return new.attend(q_BTHD, positions_BT, impl=impl, interpret=interpret, sliding_window=sliding_window), new

    def attend(self, q_BTHD, positions_BT, *, impl="ref", interpret=None, sliding_window=None):
        """Attention of queries at ``positions_BT`` over the current contents (no write):
        adaptive heads over the full part, consistent heads over their kept entries, outputs
        scattered back into head order. ``impl="pallas"`` with T == 1 runs ``decode_attention``.
        ``sliding_window`` masks the full part (a windowed layer has no consistent heads of its
        own: its sparse window holds only neighbours' slots, whose outputs are dropped)."""
        B, T, H, D = q_BTHD.shape
        q_full, q_sparse = self._split_q(q_BTHD)
        G = H // self._K
        k_full, v_full, k_sparse, v_sparse = self.views()
        if impl == "pallas" and T == 1:
            pos = positions_BT[:, 0]

            def part(qp, kc, vc, kv_len, kv_start=None):
                if qp.shape[2] == 0:
                    return jnp.zeros(qp.shape, jnp.float32)
                return decode_attention(qp[:, 0], dense_source(kc, vc), kv_len, kv_start, interpret=interpret)[:, None]

            start = None if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
            o_full = part(q_full, k_full, v_full, pos + 1, start)
            o_sparse = part(q_sparse, k_sparse, v_sparse, pos + self.sparse_offset + 1)
        else:
            def part(qp, kc, vc, k_positions, window=None):
                n = qp.shape[2]
                if n == 0:
                    return jnp.zeros(qp.shape, jnp.float32)
                o = attention(qp.reshape(B, T, n * G, D), kc.astype(qp.dtype), vc.astype(qp.dtype),
                              q_positions_BT=positions_BT, k_positions_BS=k_positions, causal=True,
                              sliding_window=window, impl="ref")
                return o.reshape(B, T, n, G, D)

            S, P = k_full.shape[1], k_sparse.shape[1]
            o_full = part(q_full, k_full, v_full, jnp.broadcast_to(jnp.arange(S), (B, S)), sliding_window)
            # sparse slot s holds "virtual position" s - offset: prefill entries < N, appended ones = p
            o_sparse = part(q_sparse, k_sparse, v_sparse, jnp.arange(P)[None, :] - self.sparse_offset[:, None])
        return self._merge(o_full, o_sparse, q_BTHD.shape).astype(q_BTHD.dtype)

    def _prefill(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, *, impl, interpret, sliding_window=None):
        """Whole-prompt call: attend within the prompt, classify, select, fill both parts."""
        cfg = self.cfg
        B, T, H, D = q_BTHD.shape
        out = attention(q_BTHD, k_BTKD, v_BTKD, q_positions_BT=positions_BT, k_positions_BS=positions_BT,
                        causal=True, sliding_window=sliding_window, impl=impl, interpret=interpret)
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


def init_catekv_cache(model_cfg, batch_size: int, max_len: int, head_mask_LK, *,
                      catekv_cfg: CateKVConfig = CateKVConfig(),
                      max_new_tokens: Optional[int] = None, prompt_lengths=None, dtype=None) -> CateKVCache:
    """Empty hybrid cache: an adaptive pool of ``max_len`` slots for the mask's Σ_l a_l heads and a
    consistent pool of ``round_up(kept_max + max_new_tokens, 128)`` slots for its Σ_l c_l heads
    (default ``max_new_tokens``: ``max_len`` minus the budget, at least 128). Prefill fills it.
    Every KV head of a sliding-window layer is made adaptive (it attends within its window only)."""
    mask = np.asarray(head_mask_LK, bool)
    L, K, D = model_cfg.n_layers, model_cfg.n_kv_heads, model_cfg.dh
    if mask.shape != (L, K):
        raise ValueError(f"init_catekv_cache: head mask shape {mask.shape} does not match the model's "
                         f"(n_layers, n_kv_heads) = {(L, K)}")
    windowed = np.array([w is not None for w in model_cfg.layer_windows], bool)
    mask = mask | windowed[:, None]
    dtype = jnp.dtype(dtype or model_cfg.dtype)
    full, sparse = head_partition(mask)
    full_base, n_full = pool_offsets(mask.sum(1))
    sparse_base, n_sparse = pool_offsets((~mask).sum(1))
    if max_new_tokens is None:
        max_new_tokens = max(max_len - catekv_cfg.budget, 128)
    P = round_up(catekv_cfg.kept_max + max_new_tokens, 128)
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
    P = round_up(catekv_cfg.kept_max + new_tokens, 128)
    per_token = 2 * D * dtype_bytes * batch
    full_bytes = L * K * S * per_token
    hybrid_kv = (n_adaptive * S + n_consistent * P) * per_token
    index_bytes = 4 * (full_idx.size + sparse_idx.size + 2 * L + 2 * L * batch) + 4 * L * batch * K
    r = float(mask.mean())
    ideal_ratio = 1.0 / (r + (1 - r) * catekv_cfg.budget / context)
    hybrid = hybrid_kv + index_bytes
    return {"context": context, "adaptive_ratio": r, "budget": catekv_cfg.budget, "full_bytes": full_bytes,
            "hybrid_bytes": hybrid, "hybrid_kv_bytes": hybrid_kv, "index_bytes": index_bytes,
            "ratio": full_bytes / hybrid, "ideal_ratio": ideal_ratio,
            "ratio_vs_ideal": (full_bytes / hybrid) / ideal_ratio,
            "adaptive_heads": n_adaptive, "consistent_heads": n_consistent,
            "adaptive_window_per_layer": full_idx.shape[1], "consistent_window_per_layer": sparse_idx.shape[1]}


KV_CACHE.register("catekv", CateKVCache, config=CateKVConfig, aliases={"r": "adaptive_ratio"})
