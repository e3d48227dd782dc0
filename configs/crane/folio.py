"""CRANE, FOLIO-style task: a ~0.5M-parameter model on 3000 problems' reasoning + program traces.

    pallasite train --config configs/crane/folio.py --workdir /tmp/crane_folio    # ~25 min on 2 busy cores

``arg``: ``data=PATH`` (traces jsonl; written if missing), ``n=``, ``steps=``, ``cpu`` (smoke).
"""

from pallasite.configs.crane.common import task_config


def get_config(arg=None):
    return task_config("folio", arg, n_problems=3000, steps=400, seq_len=320)
