"""Training traces for the CRANE tasks as jsonl (``{"text": ...}`` per line), for ``pallasite train``.

    python -m pallasite.eval.tasks.traces gsm OUT.jsonl [--n 4000 --seed 1]

GSM: every problem twice, once with the direct cue and answer, once with the step-by-step cue and
the chain of thought (so one model serves the with- and without-CoT modes). FOLIO: every problem
with its reasoning and program. Evaluation problems come from other seeds (``EVAL_SEED``).
"""

from __future__ import annotations

import argparse
import json
import os

from pallasite.eval.tasks import folio, gsm_symbolic

TRAIN_SEED = 1
EVAL_SEED = 1_000_003


# the trained GSM models' problems (gsm_symbolic.make_problems): positional variable names, and
# kind "steps" (one person's operations in order) by default or "relations" (shuffled multi-hop chains)
GSM_KIND, GSM_NAMES = "steps", "positional"


def texts(task: str, n: int, seed: int = TRAIN_SEED, kind: str = GSM_KIND) -> list:
    if task == "gsm":
        return [
            gsm_symbolic.training_text(p, cot)
            for p in gsm_symbolic.make_problems(n, seed, GSM_NAMES, kind)
            for cot in (False, True)
        ]
    if task == "folio":
        return [folio.training_text(p) for p in folio.make_problems(n, seed)]
    raise ValueError(f"task {task!r}; expected gsm | folio")


def write(task: str, path: str, n: int, seed: int = TRAIN_SEED, kind: str = GSM_KIND) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for t in texts(task, n, seed, kind):
            f.write(json.dumps({"text": t}) + "\n")
    os.replace(tmp, path)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("task", choices=("gsm", "folio"))
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=TRAIN_SEED)
    ap.add_argument("--kind", default=GSM_KIND, choices=gsm_symbolic.KINDS, help="GSM problem kind")
    a = ap.parse_args(argv)
    print(write(a.task, a.out, a.n, a.seed, a.kind))


if __name__ == "__main__":
    main()
