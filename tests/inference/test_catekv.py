"""CateKV hybrid cache: exactness limits, selection invariants, classification on planted heads,
bad input, mask save/load, memory accounting. Small geometry (init 8, recent 16, chunks of 4,
tail 8, last_q 8) so everything runs in seconds; the defaults (64/256/8/32/64, B=2048) are the
same code path with other numbers."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallasite.inference.cache import init_dense_cache
from pallasite.inference.cache.catekv import init_catekv_cache, memory_report, pool_offsets
from pallasite.inference.cache.catekv_mask import calibrate_head_mask, load_head_mask, save_head_mask
from pallasite.inference.cache.catekv_select import (
    CateKVConfig,
    chunk_geometry,
    classify_heads,
    kept_indices,
    middle_attention,
)
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import forward, init_model

SMALL = CateKVConfig(budget=40, init_tokens=8, recent_tokens=16, chunk_size=4, last_q=8, tail_tokens=8)
CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
N_PROMPT, N_NEW = 100, 4


@pytest.fixture(scope="module")
def model():
    return nnx.split(init_model(CFG, seed=1))


def _greedy(model, cache, tokens_BT, impl="ref"):
    """Prefill tokens, then greedy-decode N_NEW tokens; returns (all logits [B, 1+N_NEW, V], ids)."""
    gd, st = model
    if impl != "ref":
        gd = nnx.split(init_model(CFG.replace(attention_impl=impl), seed=1))[0]

    @jax.jit
    def run(st, cache, tokens_BT):
        B, T = tokens_BT.shape
        logits, cache, _ = forward(gd, st, tokens_BT, cache=cache)

        def step(carry, i):  # one traced decode step (scan) keeps compile time small
            cache, last = carry
            nxt = jnp.argmax(last, -1)[:, None]
            out, cache, _ = forward(gd, st, nxt, jnp.full((B, 1), T) + i, cache=cache)
            return (cache, out[:, 0]), (out[:, 0], nxt[:, 0])

        (cache, _), (outs, ids) = jax.lax.scan(step, (cache, logits[:, -1]), jnp.arange(N_NEW))
        return jnp.concatenate([logits[:, -1:], jnp.swapaxes(outs, 0, 1)], 1), ids.T, cache

    return run(st, cache, tokens_BT)


def _tokens(B=2, T=N_PROMPT, seed=0):
    return jax.random.randint(jax.random.PRNGKey(seed), (B, T), 0, CFG.vocab_size)


def test_exact_when_every_head_adaptive_or_budget_covers_context(model):
    tokens = _tokens()
    ref_logits, ref_ids, _ = _greedy(model, init_dense_cache(CFG, 2, 128), tokens)
    all_adaptive = np.ones((CFG.n_layers, CFG.n_kv_heads), bool)
    none_adaptive = np.zeros_like(all_adaptive)
    big_budget = CateKVConfig(budget=8 + 16 + 4 * 30, init_tokens=8, recent_tokens=16, chunk_size=4, last_q=8,
                              tail_tokens=8)  # B = 144 >= N = 100
    ragged = np.array([[True, True], [False, False]])  # layer 0 all adaptive, layer 1 all consistent
    for mask, ccfg in ((all_adaptive, SMALL), (none_adaptive, big_budget), (ragged, big_budget)):
        cache = init_catekv_cache(CFG, 2, 128, mask, catekv_cfg=ccfg, max_new_tokens=N_NEW)
        logits, ids, _ = _greedy(model, cache, tokens)
        assert float(np.max(np.abs(logits - ref_logits))) <= 1e-5
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    # negative control: a real sparse cache (B < N, all heads consistent) does change the logits
    cache = init_catekv_cache(CFG, 2, 128, none_adaptive, catekv_cfg=SMALL, max_new_tokens=N_NEW)
    logits, _, _ = _greedy(model, cache, tokens)
    assert float(jnp.max(jnp.abs(logits[:, 1:] - ref_logits[:, 1:]))) > 1e-3


def test_scanned_layers_carry_the_shared_pools():
    """With ``scan_layers`` the pools ride in the scan carry: a ragged mask with B >= N is exact, and
    a real sparse ragged cache gives the same logits as the unscanned (per-layer loop) model."""
    scanned_cfg = CFG.replace(scan_layers=True)
    gd_s, st_s = nnx.split(init_model(scanned_cfg, seed=2))
    tokens = _tokens(seed=4)
    ragged = np.array([[False, True], [False, False]])
    big_budget = CateKVConfig(budget=8 + 16 + 4 * 30, init_tokens=8, recent_tokens=16, chunk_size=4, last_q=8,
                              tail_tokens=8)
    ref_logits, ref_ids, _ = _greedy((gd_s, st_s), init_dense_cache(CFG, 2, 128), tokens)
    logits, ids, _ = _greedy((gd_s, st_s), init_catekv_cache(CFG, 2, 128, ragged, catekv_cfg=big_budget,
                                                             max_new_tokens=N_NEW), tokens)
    assert float(np.max(np.abs(logits - ref_logits))) <= 1e-5
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    # unscanned copy of the same weights: per-layer slices of the stacked parameters
    gd_u, st_u = nnx.split(init_model(CFG, seed=2))
    pure = nnx.to_pure_dict(st_s)
    pure["layers"] = {i: jax.tree.map(lambda a: a[i], pure["layers"]) for i in range(CFG.n_layers)}
    nnx.replace_by_pure_dict(st_u, pure)
    sparse = dict(catekv_cfg=SMALL, max_new_tokens=N_NEW)
    out_s = _greedy((gd_s, st_s), init_catekv_cache(CFG, 2, 128, ragged, **sparse), tokens)[0]
    out_u = _greedy((gd_u, st_u), init_catekv_cache(CFG, 2, 128, ragged, **sparse), tokens)[0]
    np.testing.assert_allclose(np.asarray(out_s), np.asarray(out_u), atol=1e-5)
    assert float(jnp.max(jnp.abs(out_s[:, 1:] - ref_logits[:, 1:]))) > 1e-3  # and it really is sparse


@pytest.mark.slow  # interpret-mode Pallas inside a 2-layer model: ~30 s of compiles
def test_pallas_decode_path_equals_reference_path(model):
    tokens = _tokens(seed=3)
    mask = np.array([[True, True], [False, True]])  # ragged: 2 + 1 adaptive, 0 + 1 consistent heads
    out = {}
    for impl in ("ref", "pallas"):
        cache = init_catekv_cache(CFG, 2, 128, mask, catekv_cfg=SMALL, max_new_tokens=N_NEW)
        out[impl] = _greedy(model, cache, tokens, impl=impl)
    np.testing.assert_allclose(np.asarray(out["pallas"][0]), np.asarray(out["ref"][0]), atol=1e-4)
    np.testing.assert_array_equal(np.asarray(out["pallas"][1]), np.asarray(out["ref"][1]))


def test_rows_with_different_prompt_lengths(model):
    """Right-padded batch: with prompt_len per row, r = 1 decoding equals each row run alone."""
    gd, st = model
    lens = [100, 77]
    tokens = _tokens(seed=5)
    mask = np.zeros((CFG.n_layers, CFG.n_kv_heads), bool)

    @jax.jit
    def prefill_and_step(cache, tokens, nxt, pos):
        _, cache, _ = forward(gd, st, tokens, cache=cache)
        return forward(gd, st, nxt, pos, cache=cache)[0]

    cache = init_catekv_cache(CFG, 2, 128, mask, catekv_cfg=SMALL, max_new_tokens=2, prompt_lengths=lens)
    nxt = jnp.array([[7], [9]])
    step = prefill_and_step(cache, tokens, nxt, jnp.array([[lens[0]], [lens[1]]]))
    for row, n in enumerate(lens):
        single = init_catekv_cache(CFG, 1, 128, mask, catekv_cfg=SMALL, max_new_tokens=2)
        one = prefill_and_step(single, tokens[row:row + 1, :n], nxt[row:row + 1], jnp.array([[n]]))
        np.testing.assert_allclose(np.asarray(step[row]), np.asarray(one[0]), atol=1e-5)
    # negative control: without per-row lengths the short row's "last queries" are pad tokens
    wrong = init_catekv_cache(CFG, 2, 128, mask, catekv_cfg=SMALL, max_new_tokens=2)
    bad = prefill_and_step(wrong, tokens, nxt, jnp.array([[lens[0]], [lens[1]]]))
    assert float(jnp.max(jnp.abs(bad[1] - step[1]))) > 1e-4


def test_selection_invariants_and_sizes(model):
    gd, st = model
    tokens = _tokens(B=1, seed=7)
    mask = np.array([[True, False], [False, True]])
    cache = init_catekv_cache(CFG, 1, 128, mask, catekv_cfg=SMALL, max_new_tokens=N_NEW)
    dense = init_dense_cache(CFG, 1, 128)
    fwd = jax.jit(lambda tokens, pos, cache: forward(gd, st, tokens, pos, cache=cache)[1])
    pos = jnp.arange(N_PROMPT)[None]
    cache, dense = fwd(tokens, pos, cache), fwd(tokens, pos, dense)
    N, C = N_PROMPT, SMALL.chunk_size
    chunk_end, mid_end, n_mid = (int(x) for x in chunk_geometry(jnp.array(N), SMALL))
    assert chunk_end == C * (N // C - SMALL.tail_tokens // C) and N - chunk_end >= SMALL.tail_tokens
    for layer in range(CFG.n_layers):
        c = cache.layer(layer)
        k_full, _, k_sparse, _ = c.views()
        count = int(c.sparse_offset[0]) + N
        assert count == SMALL.budget + (N - chunk_end)  # B + the unchunked tail
        h = int(c.sparse_heads[0])
        kept_k = np.asarray(k_sparse[0, :count, 0])
        full_k = np.asarray(dense.k[layer, 0, h, :N])  # the dense cache is head-major [L, B, K, S, D]
        # recover which positions were kept by matching rows of K (random floats: unique)
        pos = np.array([int(np.argmin(np.abs(full_k - row).sum(-1))) for row in kept_k])
        np.testing.assert_allclose(kept_k, full_k[pos], atol=1e-6)  # two compiled programs: ulp-level
        kept = set(pos.tolist())
        assert set(range(SMALL.init_tokens)) <= kept  # the first init tokens
        assert set(range(chunk_end - SMALL.recent_tokens, N)) <= kept  # recent window + tail
        middle = sorted(p for p in kept if SMALL.init_tokens <= p < mid_end)
        assert len(middle) == SMALL.select_chunks * C
        starts = {p - (p - SMALL.init_tokens) % C for p in middle}
        assert all(all(s + i in kept for i in range(C)) for s in starts)  # whole chunks only
        assert len(starts) == SMALL.select_chunks
        # the adaptive head keeps everything, slot = position
        a = int(c.full_heads[0])
        np.testing.assert_allclose(np.asarray(k_full[0, :N, 0]), np.asarray(dense.k[layer, 0, a, :N]), atol=1e-6)
    # decode appends to both parts
    new_tok = jnp.array([[3]])
    cache2, dense2 = fwd(new_tok, jnp.array([[N]]), cache), fwd(new_tok, jnp.array([[N]]), dense)
    c = cache2.layer(0)  # layer 0: same input as the dense run -> same new K
    k_full, _, k_sparse, _ = c.views()
    slot = N + int(c.sparse_offset[0])
    np.testing.assert_allclose(np.asarray(k_sparse[0, slot, 0]),
                               np.asarray(dense2.k[0, 0, int(c.sparse_heads[0]), N]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(k_full[0, N, 0]), np.asarray(dense2.k[0, 0, int(c.full_heads[0]), N]),
                               atol=1e-6)
    after, before = cache2.layer(1).views()[2], cache.layer(1).views()[2]
    assert float(jnp.abs(after[0, slot, 0]).sum()) > 0 and float(jnp.abs(before[0, slot, 0]).sum()) == 0
    # array sizes match the memory formula
    rep = memory_report(n_layers=CFG.n_layers, n_kv_heads=CFG.n_kv_heads, head_dim=CFG.dh, context=100,
                        new_tokens=28, adaptive_ratio=0.5, catekv_cfg=SMALL, dtype_bytes=4, head_mask_LK=mask)
    assert cache.kv_nbytes() == rep["hybrid_bytes"] - rep["index_bytes"]
    assert rep["full_bytes"] == dense.nbytes()


def test_kept_indices_short_prompt_keeps_everything():
    scores = jnp.zeros((1, 1, 30))
    for n in (20, 45):
        idx, count = kept_indices(scores, jnp.array([n]), SMALL)
        assert int(count[0]) == n
        assert sorted(np.asarray(idx[0, 0, :n]).tolist()) == list(range(n))


def _planted(n_consistent=4, n_adaptive=4, N=200, D=32, seed=0):
    """One layer, G = 1: consistent heads' last queries (and the future query) all hit the same 3
    chunks; each adaptive head's queries hit their own random chunks, the future query a new one."""
    rng = np.random.default_rng(seed)
    K, Q, C = n_consistent + n_adaptive, SMALL.last_q, SMALL.chunk_size
    _, mid_end, n_mid = (int(x) for x in chunk_geometry(jnp.array(N), SMALL))
    k = rng.normal(size=(N, K, D)) * 0.3
    q = rng.normal(size=(N, K, D)) * 0.3
    q_new = rng.normal(size=(K, D)) * 0.3
    kinds = np.array([1] * n_consistent + [0] * n_adaptive)  # 1 = consistent (planted)
    rng.shuffle(kinds)
    for h in range(K):
        if kinds[h]:
            u = rng.normal(size=D)
            u /= np.linalg.norm(u)
            for c in rng.choice(n_mid, 3, replace=False):  # fewer than the 4 chunks the budget keeps
                k[SMALL.init_tokens + c * C + rng.integers(C), h] += 8 * u
            q[N - Q:, h] += 8 * u
            q_new[h] += 8 * u
        else:
            chunks = rng.choice(n_mid, Q + 1, replace=False)
            for i in range(Q + 1):
                u = rng.normal(size=D)
                u /= np.linalg.norm(u)
                k[SMALL.init_tokens + chunks[i] * C + rng.integers(C), h] += 8 * u
                if i < Q:
                    q[N - Q + i, h] += 8 * u
                else:
                    q_new[h] += 8 * u
    f = lambda x: jnp.asarray(x, jnp.float32)[None]
    return f(q), f(k), f(rng.normal(size=(N, K, D))), f(q_new)[:, None], kinds


def test_cv_separates_planted_heads_and_mask_beats_random_and_inverted():
    q, k, v, q_new, kinds = _planted()
    N, K, D = k.shape[1], k.shape[2], k.shape[3]
    A, valid = middle_attention(q[:, -SMALL.last_q:], k, jnp.array([N]), SMALL)
    cv = np.asarray(classify_heads(A, valid, SMALL)[0][0])
    assert cv[kinds == 1].min() > cv[kinds == 0].max(), (cv, kinds)
    # offline mask: r = 0.5 of 8 heads, 3 noisy "samples" -> exactly the 4 planted adaptive heads
    samples = np.stack([cv + 0.01 * i for i in range(3)])[:, None, :]
    mask = calibrate_head_mask(samples, 0.5)[0]
    assert mask.sum() == math.ceil(0.5 * K)
    np.testing.assert_array_equal(mask, kinds == 0)

    cfg1 = ModelConfig(vocab_size=8, d_model=K * D, n_layers=1, n_heads=K, n_kv_heads=K, d_ff=8)
    full = jax.nn.softmax(jnp.einsum("bhd,bshd->bhs", q_new[:, 0], k) * D ** -0.5, -1)
    full_out = jnp.einsum("bhs,bshd->bhd", full, v)

    @jax.jit  # every mask below has 4 adaptive + 4 consistent heads: one compile
    def hybrid_out(layer):
        _, layer = layer.update_and_attend(q, k, v, jnp.arange(N)[None])
        # (re-writing the last prompt token at its own position: the cache contents do not change)
        out, _ = layer.update_and_attend(q_new, k[:, -1:], v[:, -1:], jnp.array([[N - 1]]))
        return out

    def err(m):
        cache = init_catekv_cache(cfg1, 1, 256, m[None], catekv_cfg=SMALL, max_new_tokens=8)
        out = hybrid_out(cache.layer(0))
        return float(jnp.mean(jnp.abs(out[:, 0] - full_out)))

    rng = np.random.default_rng(1)
    e_cate, e_inv = err(mask), err(~mask)
    e_rand = np.mean([err(rng.permutation(mask)) for _ in range(3)])
    assert e_cate < 0.1 * e_rand and e_cate < 0.1 * e_inv, (e_cate, e_rand, e_inv)  # observed 2e-4 vs 0.2 / 0.4


def test_calibration_counts_exact_and_per_layer():
    rng = np.random.default_rng(0)
    cv = rng.random((5, 6, 4))
    m = calibrate_head_mask(cv, 0.4)
    assert m.sum() == math.ceil(0.4 * 24)
    m2 = calibrate_head_mask(cv, 0.5, per_layer=True)
    assert (m2.sum(1) == 2).all()
    with pytest.raises(ValueError, match="fraction"):
        calibrate_head_mask(cv, 40)
    with pytest.raises(ValueError, match="samples"):
        calibrate_head_mask(cv[0], 0.4)


@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
def test_sliding_window_layers(scan):
    """Gemma-style interleave (layer 0 local, window 16 < prompt; layer 1 global): the local layer's
    heads are made adaptive and attend within the window; with the budget covering the context the
    cache is exact against the dense cache, and a real budget still sparsifies the global layer."""
    cfg = CFG.replace(layer_types=("sliding", "full"), sliding_window=16, rope_local_theta=1e4, scan_layers=scan)
    gd, st = nnx.split(init_model(cfg, seed=6))
    tokens = _tokens(seed=7)
    none_adaptive = np.zeros((2, 2), bool)
    ref_logits, ref_ids, _ = _greedy((gd, st), init_dense_cache(cfg, 2, 128), tokens)
    big = CateKVConfig(budget=8 + 16 + 4 * 30, init_tokens=8, recent_tokens=16, chunk_size=4, last_q=8, tail_tokens=8)
    cache = init_catekv_cache(cfg, 2, 128, none_adaptive, catekv_cfg=big, max_new_tokens=N_NEW)
    np.testing.assert_array_equal(np.asarray(cache.full_heads)[0], [0, 1])  # layer 0: both heads adaptive
    assert (np.asarray(cache.sparse_heads)[0] == cfg.n_kv_heads).all()  # ... and none consistent
    logits, ids, _ = _greedy((gd, st), cache, tokens)
    assert float(np.max(np.abs(logits - ref_logits))) <= 1e-5
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(ref_ids))
    sparse = init_catekv_cache(cfg, 2, 128, none_adaptive, catekv_cfg=SMALL, max_new_tokens=N_NEW)
    logits, _, _ = _greedy((gd, st), sparse, tokens)
    assert float(jnp.max(jnp.abs(logits[:, 1:] - ref_logits[:, 1:]))) > 1e-3


def test_bad_inputs_fail_clearly(tmp_path):
    with pytest.raises(ValueError, match="whole number of chunks"):
        CateKVConfig(budget=2050)
    with pytest.raises(ValueError, match="whole number of chunks"):
        CateKVConfig(budget=300)  # less than init + recent
    with pytest.raises(ValueError, match="n_kv_heads"):
        init_catekv_cache(CFG, 1, 128, np.ones((3, 2), bool), catekv_cfg=SMALL)
    mask = np.array([[True, False], [False, False]])
    path = save_head_mask(str(tmp_path), mask, CFG, SMALL)
    np.testing.assert_array_equal(load_head_mask(str(tmp_path), CFG), mask)
    np.testing.assert_array_equal(load_head_mask(path, CFG), mask)
    with pytest.raises(ValueError, match="another model shape"):
        load_head_mask(path, CFG.replace(n_layers=3))
    with pytest.raises(ValueError, match="another model shape"):
        load_head_mask(path, CFG.replace(d_model=64, n_heads=8, n_kv_heads=2))
    with pytest.raises(ValueError, match="n_kv_heads"):
        save_head_mask(str(tmp_path), np.ones((2, 3), bool), CFG)


def test_ideal_ratio_matches_the_tokens_the_selection_keeps():
    """The paper's memory ratio 1/(r + (1−r)·B/N) against the tokens the selection really keeps
    (``kept_indices`` on real chunk scores at N = 8k / 32k: init + B/C-chunk budget + the recent
    window and the unchunked tail): within the tail's share of the budget; the packed layout's
    ratio (``memory_report``, from the cache's array sizes) is at most that, and within 5%."""
    rng = np.random.default_rng(0)
    ccfg = CateKVConfig()
    L, K = 32, 10
    for n in (8192, 32768):
        lengths = jnp.asarray([n], jnp.int32)
        n_slots = (n - ccfg.init_tokens) // ccfg.chunk_size
        n_mid = int(chunk_geometry(lengths, ccfg)[2][0])  # chunk scores are -inf outside the middle
        scores = jnp.where(jnp.arange(n_slots) < n_mid, jnp.asarray(rng.random((1, 1, n_slots)), jnp.float32),
                           -jnp.inf)
        idx, count = kept_indices(scores, lengths, ccfg)
        kept = int(count[0])
        assert len(set(np.asarray(idx[0, 0, :kept]).tolist())) == kept  # distinct positions, all < n
        assert int(np.asarray(idx[0, 0, :kept]).max()) == n - 1
        assert ccfg.budget <= kept <= ccfg.budget + ccfg.tail_tokens + ccfg.chunk_size - 1
        for r in (0.4, 0.3):
            n_adaptive = int(round(r * L * K))
            actual = L * K * n / (n_adaptive * n + (L * K - n_adaptive) * kept)
            rep = memory_report(n_layers=L, n_kv_heads=K, head_dim=128, context=n, adaptive_ratio=r)
            slack = (1 - r) * (kept - ccfg.budget) / n / (r + (1 - r) * ccfg.budget / n)
            assert abs(actual / rep["ideal_ratio"] - 1) <= slack + 1e-9, (n, r, actual, rep["ideal_ratio"])
            assert rep["ratio"] <= actual * (1 + 1e-9) and rep["ratio"] > 0.95 * actual, (n, r, rep, actual)
            assert rep["index_bytes"] < 1e-5 * rep["hybrid_bytes"]
    # a mask with uneven per-layer counts: the pools hold exactly one slot per head
    uneven = np.zeros((2, 8), bool)
    uneven[0, :6] = True
    uneven[1, :1] = True
    rep = memory_report(n_layers=2, n_kv_heads=8, head_dim=64, context=32768, adaptive_ratio=0.4,
                        head_mask_LK=uneven)
    assert rep["adaptive_heads"] == 7 and rep["consistent_heads"] == 9
    P = -(-CateKVConfig().kept_max // 128) * 128  # no new tokens
    assert rep["hybrid_kv_bytes"] == 2 * 64 * 2 * (7 * 32768 + 9 * P)


def _padded_layout_bytes(mask, S, P, D, dtype_bytes=2):
    """KV bytes of the previous layout (every layer padded to the per-layer maxima)."""
    return mask.shape[0] * (mask.sum(1).max() * S + (~mask).sum(1).max() * P) * 2 * D * dtype_bytes


def test_global_mask_on_smollm2_shape_saves_memory():
    """SmolLM2-135M shape (30 layers × 3 KV heads, head dim 64) with the paper's global mask: the
    ragged pools beat the dense cache and sit within a few % of the ideal ratio; the per-layer
    padded layout (max counts in every layer) would cost more than the dense cache."""
    rng = np.random.default_rng(0)
    mask = calibrate_head_mask(rng.random((4, 30, 3)) + np.linspace(0, 1, 30)[None, :, None], 0.4)
    assert mask.sum() == 36 and mask.sum(1).max() == 3 and (~mask).sum(1).max() == 3  # really ragged
    for n, budget in ((1088, 384), (2048, 512), (8192, 2048)):
        ccfg = CateKVConfig(budget=budget)
        rep = memory_report(n_layers=30, n_kv_heads=3, head_dim=64, context=n, adaptive_ratio=0.4, catekv_cfg=ccfg,
                            head_mask_LK=mask)
        P = -(-ccfg.kept_max // 128) * 128
        assert rep["ratio"] > 1.0, rep
        assert _padded_layout_bytes(mask, n, P, 64) > rep["full_bytes"]  # the old layout: worse than dense
        # the only gap to the ideal is the unchunked tail + the 128-slot rounding of the sparse part
        assert rep["ratio_vs_ideal"] > (0.97 if n == 8192 else 0.85), rep


def test_cache_bytes_equal_formula_for_ragged_mask():
    cfg = CFG.replace(n_layers=5, n_kv_heads=4, n_heads=8)
    mask = np.array([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 0]], bool)
    cache = jax.eval_shape(lambda: init_catekv_cache(cfg, 2, 300, mask, catekv_cfg=SMALL, max_new_tokens=20))
    nbytes = lambda leaves: sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in leaves)
    rep = memory_report(n_layers=5, n_kv_heads=4, head_dim=cfg.dh, context=280, new_tokens=20, adaptive_ratio=0.4,
                        catekv_cfg=SMALL, batch=2, dtype_bytes=4, head_mask_LK=mask)
    P = -(-(SMALL.kept_max + 20) // 128) * 128
    assert cache.k_full.shape == (2, 300, 9, cfg.dh) and cache.k_sparse.shape == (2, P, 11, cfg.dh)
    assert nbytes([cache.k_full, cache.v_full, cache.k_sparse, cache.v_sparse]) == rep["hybrid_kv_bytes"] \
        == 2 * 2 * cfg.dh * 4 * (9 * 300 + 11 * P)
    assert nbytes(jax.tree.leaves(cache)) == rep["hybrid_bytes"]
    # every layer's fixed-size window stays inside its pool; the layers' own slots do not overlap
    for counts in (mask.sum(1), (~mask).sum(1)):
        base, total = pool_offsets(counts)
        assert total == counts.sum() and (base + counts.max() <= total).all()
        spans = sorted((b, b + c) for b, c in zip(base, counts) if c)
        assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:]))


def test_engine_with_the_catekv_cache_kind_decodes_like_forward(model, tmp_path):
    """The engine with ``kv_cache="catekv"`` (the config switch: mask file + sub-config; sparse ragged
    mask), prompts of different lengths (right-padded by the engine to a bucket) == each prompt alone,
    prefilled + greedy via forward: same tokens, same per-row selection (kept entries, slot offsets)."""
    import dataclasses

    from pallasite.inference import engine as E
    from pallasite.inference.config import GenerationConfig
    from pallasite.inference.sampling import SamplingParams

    gd, st = model
    mask = np.array([[True, False], [False, False]])
    path = save_head_mask(str(tmp_path / "mask.json"), mask, CFG)
    toks = np.asarray(_tokens(B=1, T=112, seed=11))[0].tolist()
    prompts = [toks, toks[:77][::-1]]  # 77: the engine pads it to 112 (the longest prompt)
    args, spec = SamplingParams.make(2, 0.0)
    gen = GenerationConfig(max_new_tokens=N_NEW, cache_len=128, kv_cache="catekv",
                           kv_cache_config={**dataclasses.asdict(SMALL), "head_mask": path})
    s = E.run_decode(gd, st, CFG, prompts, gen, strategy=E.SamplingStrategy(spec=spec), args=args,
                     key=jax.random.key(0))
    assert type(s.cache).__name__ == "CateKVCache"
    with pytest.raises(ValueError, match="needs a head mask"):
        E.generate_ids(gd, st, CFG, prompts, gen.replace(kv_cache_config=dataclasses.asdict(SMALL)))
    got = E.results(s)
    for row, prompt in enumerate(prompts):
        cache = init_catekv_cache(CFG, 1, 128, mask, catekv_cfg=SMALL, max_new_tokens=N_NEW)
        _, ids, alone = _greedy(model, cache, jnp.asarray([prompt]))
        assert got[row] == np.asarray(ids[0]).tolist(), row
        np.testing.assert_array_equal(np.asarray(s.cache.sparse_offset[:, row]), np.asarray(alone.sparse_offset[:, 0]))
        count = len(prompt) + int(alone.sparse_offset[1, 0])
        np.testing.assert_allclose(np.asarray(s.cache.layer(1).views()[2][row, :count]),
                                   np.asarray(alone.layer(1).views()[2][0, :count]), atol=1e-5)
