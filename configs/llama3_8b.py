"""Llama-3-8B pre-training with FSDP: the shape of Meta's release (``models.llama3_8b``), bf16
compute over float32 master weights, full remat per block, scanned layers, chunked
cross-entropy (the 128k-vocab logits never exist for the whole batch).

Mesh: every chip on ``fsdp`` (parameters, gradients and Adam moments are sharded over the
slice; the batch too). Check the memory per chip before paying for a slice::

    pallasite compile --config configs/llama3_8b.py --topology v5p:4x4x4
    pallasite compile --config configs/llama3_8b.py --topology v5e:16x16

``arg``: ``batch=N`` (global batch, default 256 sequences of 8192 tokens), ``seq=N``.
"""

from pallasite.configs import models
from pallasite.training.config import parse_arg, train_defaults


def get_config(arg=None):
    a = parse_arg(arg, batch=256, seq=8192)
    c = train_defaults()
    c.model = models.get("llama3_8b", dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True,
                        attention_impl="pallas")
    c.tokenizer.vocab_size = 128256  # a pre-trained tokenizer: set tokenizer.path to the Llama 3 one
    c.data.seq_len = a.seq
    c.data.batch_size = a.batch
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.optim.weight_decay = 0.1
    c.train.steps = 100_000
    c.train.loss_chunk = 8192  # tokens per cross-entropy chunk
    c.train.log_every = 10
    c.train.eval_every = 1000
    c.train.checkpoint_every = 1000
    c.train.export_hf = True
    c.mesh.data = 1
    c.mesh.fsdp = -1
    return c
