"""Speculative decoding's measuring tools: ``benchmarks/spec_round_cost`` (the cost model's
arithmetic: the acceptance a speed-up needs, the speed-up a measured calls-per-token predicts; its
flags' errors) and ``benchmarks/spec_layer_skip`` (which target blocks a cut drafter keeps)."""

import pytest

from pallasite.benchmarks import spec_feature_heads as H
from pallasite.benchmarks import spec_layer_skip as L
from pallasite.benchmarks import spec_round_cost as R


@pytest.mark.parametrize("K", [1, 3, 8])
@pytest.mark.parametrize("cost", [1.1, 1.5, 2.2])
def test_acceptance_needed_inverts_tokens_per_round(K, cost):
    for speedup in (1.0, 1.3, 1.5):
        a = R.acceptance_needed(cost, K, speedup)
        if speedup * cost > K + 1:
            assert a is None
            continue
        # a is the root to its 3 printed decimals: a little more reaches the speed-up, a little less does not
        assert R.tokens_per_round(min(a + 1e-3, 1.0), K) / cost >= speedup
        assert R.tokens_per_round(a - 1e-3, K) / cost < speedup


def test_tokens_per_round_ends():
    assert R.tokens_per_round(0.0, 3) == 1.0  # every draft rejected: the target's own token
    assert R.tokens_per_round(1.0, 3) == 4.0  # every draft accepted, plus the bonus token
    assert R.tokens_per_round(0.5, 2) == pytest.approx(1.75)


def test_predicted_speedup_is_tokens_per_round_over_cost():
    # 0.5 calls per token = 2 tokens a round; a round of 1.6 target steps -> 1.25x
    assert R.predicted_speedup(0.5, 1.6) == pytest.approx(1.25)
    # the i.i.d. model and the prediction agree: calls per token = 1 / tokens per round
    tpr, cost = R.tokens_per_round(0.6, 3), 1.5
    assert R.predicted_speedup(1 / tpr, cost) == pytest.approx(tpr / cost)


def test_calls_per_token_flag():
    assert R.parse_calls_per_token("1=0.604,8=0.906") == {1: 0.604, 8: 0.906}
    assert R.parse_calls_per_token("") == {}
    for bad in ("1:0.6", "one=0.6", "1=1.5", "1=0", "8"):
        with pytest.raises(SystemExit, match="--calls-per-token"):
            R.parse_calls_per_token(bad)


def test_acceptance_of_places_a_measured_run_on_the_a_axis():
    for K, a in ((1, 0.3), (3, 0.41), (3, 0.66), (5, 0.8)):
        assert R.acceptance_of(1 / R.tokens_per_round(a, K), K) == pytest.approx(a, abs=1e-9)
    assert R.acceptance_of(0.25, 3) == 1.0  # 4 tokens a round at K = 3: every draft accepted


def test_plot_flags():
    assert R.parse_per_batch("1=1.06,8=0.53", "--measured-speedup", upper=None) == {1: 1.06, 8: 0.53}
    with pytest.raises(SystemExit, match="--measured-speedup '1=-1'"):
        R.parse_per_batch("1=-1", "--measured-speedup", upper=None)
    assert R.parse_band("0.43:0.47") == (0.43, 0.47) and R.parse_band("") is None
    for bad in ("0.47:0.43", "0.4", "a:b", "0.2:1.5"):
        with pytest.raises(SystemExit, match="--agreement"):
            R.parse_band(bad)


def test_plot_cost_model_draws_each_batch(tmp_path):
    pytest.importorskip("matplotlib")
    rows = {K: {"round_cost_steps": 1.2 + 0.15 * K} for K in (1, 3)}
    out = {"target": "t", "device": "cpu", "batches": {
        1: {"k": rows, "predicted_speedup": {"speedup": 0.9}}, 8: {"k": rows}}}
    path = tmp_path / "cost.png"
    R.plot_cost_model(out, str(path), {1: 0.6}, {1: 0.85}, (0.43, 0.47), 3)
    from PIL import Image

    w, h = Image.open(path).size
    assert w > 1.8 * h  # two panels side by side


def test_flag_errors_are_one_line():
    with pytest.raises(SystemExit, match="--drafter-shape 'two': expected LAYERSxVOCAB"):
        R.shape_drafter(None, "two")
    with pytest.raises(SystemExit, match="not both"):
        R.main(["--drafter", "x", "--drafter-shape", "2x8192"])
    with pytest.raises(SystemExit, match="--measured-k 5: not among --ks"):
        R.main(["--calls-per-token", "1=0.6", "--measured-k", "5", "--ks", "1,2"])
    with pytest.raises(SystemExit, match="--linears 'float,fancy'; expected float and/or panels"):
        R.main(["--linears", "float,fancy"])


def test_layer_subsets_parse_ranges_steps_and_lists():
    assert L.parse_subsets("0-1;0-2,28-29;0-8:4;7", 30) == [[0, 1], [0, 1, 2, 28, 29], [0, 4, 8], [7]]
    assert [len(b) for b in L.parse_subsets(L.DEFAULT_SUBSETS, 30)] == [30, 2, 4, 20, 16, 4, 15, 24]
    with pytest.raises(SystemExit, match="outside 0-29"):
        L.parse_subsets("0-30", 30)
    with pytest.raises(SystemExit, match="'a-b' is not a block range"):
        L.parse_subsets("0-1;a-b", 30)


@pytest.mark.parametrize("k", [1, 2])
def test_feature_head_rows_line_up(k):
    """Row for position i: h_i, the tokens x_{i+1..i+k}, the label greedy_{i+k} (the target's token
    k + 1 after i); scored rows label exactly the continuation's tokens j in [start, T)."""
    import numpy as np

    N, T, D, start = 2, 10, 3, 6
    h = np.arange(N * T * D, dtype=np.float32).reshape(N, T, D)
    x = np.arange(N * T).reshape(N, T) + 1000
    greedy = np.arange(N * T).reshape(N, T) + 5000
    hr, toks, lab = H.head_examples(h, x, greedy, k)
    assert len(lab) == N * (T - k)
    for r in (0, T - k - 1, T - k + 3):  # rows of the first window, then of the second
        n, i = divmod(r, T - k)
        assert hr[r][0] == h[n, i, 0]
        assert toks[r].tolist() == [x[n, i + j] for j in range(1, k + 1)]
        assert lab[r] == greedy[n, i + k]
    _, _, lab = H.head_examples(h, x, greedy, k, start=start)
    labelled_j = (lab - 5000) % T + 1  # greedy_{i+k} predicts token i + k + 1
    assert sorted(set(labelled_j.tolist())) == list(range(start, T))


def test_feature_heads_flag_errors():
    with pytest.raises(SystemExit, match="--steps 0: expected a positive integer"):
        H.main(["--steps", "0"])


def test_speculative_systems_include_prompt_lookup():
    from pallasite.benchmarks import speculative as S

    assert S.check_systems("tli@0.7,lookup") == ["tli@0.7", "lookup"]
    with pytest.raises(SystemExit, match="'look'"):
        S.check_systems("tli,look")
    with pytest.raises(SystemExit, match="--lookup-k -1: expected an integer >= 0"):
        S.main(["--methods", "lookup", "--lookup-k", "-1"])
    with pytest.raises(SystemExit, match="takes no --json-schema"):
        S.main(["--methods", "tli,lookup", "--json-schema", "tool"])
