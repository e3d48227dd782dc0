"""CRANE, GSM-Symbolic-style task: a ~0.5M-parameter model on 4000 problems x (direct, CoT) traces.

    pallasite train --config configs/crane/gsm.py --workdir /tmp/crane_gsm
    pallasite train --config configs/crane/gsm.py:kind=relations,steps=1500 --workdir /tmp/crane_gsm_relations \
        --config.model.d_model=128 --config.model.d_ff=384      # the multi-hop variant, docs/constrained.md
    pallasite train --config configs/crane/gsm.py:kind=ordinal,steps=900 --workdir /tmp/crane_models/gsm_ordinal
    pallasite train --config configs/crane/gsm.py:kind=relations_restated,steps=2400 \
        --workdir /tmp/crane_models/gsm_relations_restated
    pallasite train --config configs/crane/gsm.py:kind=relations_many_names \
        --workdir /tmp/crane_models/gsm_relations_many_names    # 40000 problems, 1800 steps

``arg``: ``data=PATH`` (traces jsonl; written if missing), ``n=``, ``steps=``,
``kind=steps|relations|relations_restated|relations_many_names|ordinal``
(``eval.tasks.gsm_symbolic.make_problems``; the last three: d_model 128, d_ff 384, rows of 512 tokens,
2400 / 1800 / 900 steps; relations_many_names 40000 problems), ``cpu`` (smoke).
"""

from pallasite.configs.crane.common import task_config


def get_config(arg=None):
    return task_config("gsm", arg, n_problems=4000, steps=300, seq_len=256)
