"""CRANE, GSM-Symbolic-style task: a ~0.5M-parameter model on 4000 problems x (direct, CoT) traces.

    pallasite train --config configs/crane/gsm.py --workdir /tmp/crane_gsm        # ~25 min on 2 busy cores

``arg``: ``data=PATH`` (traces jsonl; written if missing), ``n=``, ``steps=``, ``cpu`` (smoke).
"""

from pallasite.configs.crane.common import task_config


def get_config(arg=None):
    return task_config("gsm", arg, n_problems=4000, steps=300, seq_len=256)
