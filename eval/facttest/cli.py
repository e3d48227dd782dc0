"""``pallasite eval --facttest``: FactTest on the offline QA set for any loadable model.

    pallasite eval --facttest --model PATH [--alpha 0.05 0.1] [--delta 0.05]
        [--n-cal 400 --n-test 200 --n-shift 200 --mix 0.25] [--m-ve 5 --m-se 10]
        [--scores ve,se,kle,wb] [--judge normalized|lm] [--cache DIR] [--output result.json]

Prints a table per score and alpha (threshold, held-out Type I, abstention, accuracy on answered
questions; shifted set with the plain and the covariate-shift rule) and one JSON line.
``cli.py`` calls ``add_arguments`` on its ``eval`` parser and ``run`` when ``--facttest`` is set.
"""

from __future__ import annotations

import hashlib
import json
import os
import time


def add_arguments(p) -> None:
    g = p.add_argument_group("FactTest (with --facttest)")
    g.add_argument("--facttest", action="store_true", help="run FactTest instead of perplexity")
    g.add_argument("--alpha", type=float, nargs="+", default=[0.05, 0.1], help="Type I levels")
    g.add_argument(
        "--delta", type=float, default=0.05, help="allowed P(Type I > alpha) over calibrations"
    )
    g.add_argument("--n-cal", type=int, default=400)
    g.add_argument("--n-test", type=int, default=200)
    g.add_argument("--n-shift", type=int, default=200)
    g.add_argument("--m-ve", type=int, default=5, help="samples at T=1 for vanilla entropy")
    g.add_argument(
        "--m-se", type=int, default=10, help="samples at T=0.7 for semantic / kernel entropy"
    )
    g.add_argument("--scores", default="ve,se,kle,wb", help="comma list of ve, se, kle, wb")
    g.add_argument(
        "--judge",
        default="normalized",
        choices=("normalized", "lm"),
        help="entailment for se / kle: normalised-answer equality, or the model itself",
    )
    g.add_argument(
        "--mix",
        type=float,
        default=0.25,
        help="share of far-continent questions in-distribution (the shifted set has 1 - mix)",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--cache", default=None, help="folder for the collected model outputs (reused when present)"
    )
    g.add_argument("--output", default=None, help="write the full result JSON here")


def run(args) -> dict:
    import pallasite
    from pallasite.eval.facttest import (
        CollectConfig,
        build_qa,
        make_judge,
        make_splits,
        run_facttest,
    )
    from pallasite.eval.facttest.outputs import collect_splits
    from pallasite.eval.facttest.report import format_table

    names = tuple(s.strip() for s in args.scores.split(",") if s.strip())
    splits = make_splits(
        build_qa(),
        n_cal=args.n_cal,
        n_test=args.n_test,
        n_shift=args.n_shift,
        seed=args.seed,
        mix=args.mix,
    )
    cfg = CollectConfig(m_ve=args.m_ve, m_se=args.m_se, seed=args.seed)
    cache = None
    if args.cache:
        key = json.dumps(
            [
                os.path.abspath(args.model),
                args.n_cal,
                args.n_test,
                args.n_shift,
                args.m_ve,
                args.m_se,
                args.mix,
                args.seed,
            ]
        )
        cache = os.path.join(
            args.cache, f"facttest_{hashlib.sha1(key.encode()).hexdigest()[:12]}.json"
        )
    loaded = {}

    def model():
        if "m" not in loaded:
            loaded["m"] = pallasite.load(args.model, dtype=getattr(args, "dtype", None))
        return loaded["m"]

    t0 = time.time()
    col = collect_splits(
        model,
        splits,
        cfg,
        cache_path=cache,
        progress=lambda m: print(f"[{time.time() - t0:6.0f}s] {m}", flush=True),
    )
    judge = make_judge(args.judge, model() if args.judge == "lm" else None)
    res = run_facttest(
        col["calibration"],
        {"test": col["test"], "shifted": col["shifted"]},
        alphas=tuple(args.alpha),
        delta=args.delta,
        names=names,
        judge=judge,
        seed=args.seed,
    )
    res["model"] = args.model
    print(format_table(res))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps(res))
    return res
