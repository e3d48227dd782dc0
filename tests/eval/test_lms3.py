"""LMS3 checks from the brief, on tiny random GQA models (D 64, 4 query / 2 KV heads):
the GQA-expanded W~_k W_q h against the explicit per-head construction, the position-127
representation against Hugging Face's own forward with right padding (fp32), an exhaustive match
with a loop-by-loop numpy reference on a 50-item pool, permutation invariance with ties, and the
lambda limits."""

import numpy as np
import pytest

import pallasite
from pallasite.eval.lms3 import selection as SEL
from pallasite.eval.lms3.representation import representations
from pallasite.eval.lms3.weights import expand_kv, last_layer_qkv

torch = pytest.importorskip("torch")
from pallasite.testing import make_tiny_hf_model  # noqa: E402

EOS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch_model, path = make_tiny_hf_model("llama", tmp_path_factory.mktemp("lms3_llama"), seed=3)
    return torch_model, pallasite.load(path)


def test_expanded_key_times_query_equals_per_head_construction(tiny):
    _, model = tiny
    cfg = model.config
    wq, wk, wv = last_layer_qkv(model)
    assert wq.shape == (cfg.n_heads * cfg.dh, cfg.d_model) and wk.shape == (
        cfg.n_kv_heads * cfg.dh,
        cfg.d_model,
    )
    h = np.random.default_rng(0).normal(size=cfg.d_model)
    q = wq @ h
    group = cfg.n_heads // cfg.n_kv_heads
    explicit = np.concatenate(
        [wk[(i // group) * cfg.dh : (i // group + 1) * cfg.dh] @ q for i in range(cfg.n_heads)]
    )
    np.testing.assert_allclose(
        expand_kv(wk, cfg.n_heads, cfg.n_kv_heads) @ q, explicit, rtol=1e-6, atol=1e-6
    )
    proj = SEL.Projections.from_model(model)
    np.testing.assert_allclose(
        SEL.transformed_pool(h[None], proj, "code")[0], explicit, rtol=1e-6, atol=1e-5
    )
    # kernel layout [in, out] -> torch [out, in]: the HF model's own weights
    attn = tiny[0].model.layers[-1].self_attn
    np.testing.assert_allclose(wq, attn.q_proj.weight.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(wv, attn.v_proj.weight.detach().numpy(), atol=1e-6)


def hf_representation(torch_model, rows, max_len=128):
    """The official get_representation: right-pad with EOS, attention mask, h[-1][:, -1]."""
    ids = np.full((len(rows), max_len), EOS)
    mask = np.zeros((len(rows), max_len), np.int64)
    for i, r in enumerate(rows):
        r = r[:max_len]
        ids[i, : len(r)], mask[i, : len(r)] = r, 1
    with torch.no_grad():
        out = torch_model(
            input_ids=torch.as_tensor(ids),
            attention_mask=torch.as_tensor(mask),
            output_hidden_states=True,
        )
        base = torch_model.model(
            input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask)
        )
    out.last_hidden_state = base.last_hidden_state
    return out.hidden_states[-1][:, -1].float().numpy(), out


def test_representation_matches_hf_right_padding(tiny):
    torch_model, model = tiny
    rng = np.random.default_rng(1)
    rows = [list(rng.integers(3, 256, n)) for n in (1, 7, 30, 64, 127, 128, 200)]
    want, out = hf_representation(torch_model, rows)
    np.testing.assert_allclose(want, out.last_hidden_state[:, -1].numpy(), atol=1e-6)  # post-norm
    got = representations(model, rows, pad_id=EOS, batch_size=4)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    # a different method: the last real token's state is not the representation
    last_real = out.hidden_states[-1][2, len(rows[2]) - 1].numpy()
    assert np.abs(last_real - want[2]).max() > 1e-2


def _reference_select(h_test, h_pool, wq, wk, wv, n_heads, n_kv, k, lam, keys):
    """Loop-by-loop numpy reference of the official LMS3.py, with the per-head construction."""
    dh = wk.shape[0] // n_kv
    g = n_heads // n_kv
    out = []
    for t in h_test:
        sims, scores = [], []
        for x in h_pool:
            q = wq @ x
            y = np.concatenate([wk[(i // g) * dh : (i // g + 1) * dh] @ q for i in range(n_heads)])
            s = float(np.sqrt(((t - y) ** 2).sum()))
            sims.append(s)
            scores.append(s * float(np.linalg.norm(wv @ x)))
        by_score = sorted(range(len(h_pool)), key=lambda j: (scores[j], keys[j]))[:k]
        near = sorted(range(len(h_pool)), key=lambda j: (sims[j], keys[j]))[
            : int(lam * len(h_pool))
        ]
        out.append([j for j in by_score if j in near])
    return out


@pytest.mark.parametrize("k,lam", [(1, 0.02), (1, 0.1), (3, 0.1), (3, 0.5), (4, 1.0)])
def test_exhaustive_match_with_numpy_reference_on_50_item_pool(tiny, k, lam):
    _, model = tiny
    rng = np.random.default_rng(2)
    h_pool = rng.normal(size=(50, 64)).astype(np.float64)
    h_test = rng.normal(size=(12, 64)).astype(np.float64)
    wq, wk, wv = (w.astype(np.float64) for w in last_layer_qkv(model))
    keys = [f"problem {i:03d}" for i in range(50)]
    sim, stab = SEL.sim_stab(h_test, h_pool, SEL.Projections.from_model(model), "code")
    got = SEL.select(sim, stab, k, lam, SEL.tiebreak_ranks(keys))
    assert got == _reference_select(h_test, h_pool, wq, wk, wv, 4, 2, k, lam, keys)
    # the cosine-retrieval baseline is a different selector (a stub that returned it would fail)
    if k == 4 and lam == 1.0:
        assert SEL.select_similar(h_test, h_pool, k) != got


def test_permutation_invariance_with_ties_and_lambda_limits(tiny):
    _, model = tiny
    rng = np.random.default_rng(4)
    base = rng.normal(size=(20, 64))
    h_pool = np.concatenate([base, base[:5]])  # 5 exact duplicates -> tied Sim and Score
    keys = [f"p{i:02d}" for i in range(25)]
    h_test = rng.normal(size=(6, 64))
    proj = SEL.Projections.from_model(model)
    sim, stab = SEL.sim_stab(h_test, h_pool, proj)
    chosen = [[keys[i] for i in c] for c in SEL.select(sim, stab, 3, 0.5, SEL.tiebreak_ranks(keys))]
    for seed in range(5):
        perm = np.random.default_rng(seed).permutation(25)
        sim_p, stab_p = SEL.sim_stab(h_test, h_pool[perm], proj)
        keys_p = [keys[i] for i in perm]
        again = SEL.select(sim_p, stab_p, 3, 0.5, SEL.tiebreak_ranks(keys_p))
        assert [[keys_p[i] for i in c] for c in again] == chosen
    assert all(len(c) == 3 for c in SEL.select(sim, stab, 3, 1.0))  # lambda = 1 never rejects
    assert all(c == [] for c in SEL.select(sim, stab, 3, 0.0))  # lambda -> 0: always zero-shot
    assert all(c == [] for c in SEL.select(sim, stab, 1, 0.99 / 25))  # int(lambda N) = 0
    with pytest.raises(ValueError, match="k="):
        SEL.select(sim, stab, 26, 0.5)


def test_non_square_models_use_the_transposed_form(tmp_path):
    _, path = make_tiny_hf_model("qwen3", tmp_path, seed=0)  # head_dim 32: H*Dh = 128 != D = 64
    model = pallasite.load(path)
    proj = SEL.Projections.from_model(model)
    assert SEL.resolve_form(proj, "auto") == "transposed"
    with pytest.raises(ValueError, match="H\\*Dh == D"):
        SEL.resolve_form(proj, "code")
    h = np.random.default_rng(0).normal(size=(3, 64))
    x = SEL.transformed_pool(h, proj)
    np.testing.assert_allclose(x, h @ proj.w_q.T @ proj.w_k_expanded, rtol=1e-10)
    assert x.shape == (3, 64)


def test_prompt_layout_is_the_official_one():
    p = SEL.build_prompt("Q?", [("D1?", "1 + 1 = 2")])
    assert p == (
        "Here are some examples you can refer to.\n\nQ: D1?\nA: 1 + 1 = 2"
        "\n\n---Now it's your turn!\n"
        "- Take a deep breath\n- Think step by step\n- I will tip $200\n\nQ: Q?\nA: "
    )
    assert SEL.build_prompt("Q?", []) == "Let's think step by step: Q?\nA: "
