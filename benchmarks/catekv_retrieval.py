"""CateKV long-context retrieval on SmolLM2-135M (offline GGUF): full cache vs CateKV vs the
inverted mask vs a memory-matched window (``pallasite.eval.catekv_retrieval``).

    python -m pallasite.benchmarks.catekv_retrieval        # = --n-eval 12 --n-calib 2 --context 1088 --budget 384 --seed 1
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

from pallasite.eval.catekv_retrieval import TASKS, run


def main(argv: Optional[list] = None):
    p = argparse.ArgumentParser(description="CateKV pass-key retrieval check on SmolLM2-135M")
    p.add_argument("--n-eval", type=int, default=12)
    p.add_argument("--n-calib", type=int, default=2)
    p.add_argument("--context", type=int, default=1088)
    p.add_argument("--budget", type=int, default=384)
    p.add_argument("--r", type=float, default=0.4)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk; context - 64 must be a multiple")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--task", default="passkey", choices=sorted(TASKS))
    p.add_argument("--out", default=None, help="write the full result (answers included) as JSON here")
    a = p.parse_args(argv)
    res = run(n_eval=a.n_eval, n_calib=a.n_calib, context=a.context, budget=a.budget, r=a.r, chunk=a.chunk, seed=a.seed,
              task=a.task, log=lambda *m: print(*m, flush=True))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "answers"}))
    return res


if __name__ == "__main__":
    main()
