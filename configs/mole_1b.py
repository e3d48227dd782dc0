"""MoLE-16E at the paper's 1B size (Jie et al., ICML 2025, Table 2; ``configs/experts/paper.py``)
for a TPU slice: bf16 compute, remat per block, scanned layers, FSDP over every chip, the
paper's global batch of 1024 x 2048 tokens and its schedule. The experts' LUT is built after
training (``pallasite lut``)::

    pallasite compile --config configs/mole_1b.py --topology v5p:4x4x4

``arg``: ``kind=mole4|mole16|dense|moe34``, ``size=160m|410m|1b``, ``batch=N``.
"""

from pallasite.configs.experts import paper
from pallasite.training.config import parse_arg


def get_config(arg=None):
    a = parse_arg(arg, kind="mole16", size="1b", batch=1024)
    c = paper.get_config(f"size={a.size},kind={a.kind}")
    c.model = paper.model(a.size, a.kind, dtype="bfloat16", param_dtype="float32", remat="full",
                          scan_layers=True, attention_impl="pallas")
    c.data.batch_size = a.batch
    c.train.loss_chunk = 8192
    # all 16 experts run for every token in training: a [tokens, 16 x 8192] hidden per layer, so the
    # 1024 x 2048 batch goes in two micro-batches (64 GiB of 95 per v5p chip; one pass needs 122 GiB)
    c.train.grad_accum = 2
    c.mesh.data = 1
    c.mesh.fsdp = -1
    return c
