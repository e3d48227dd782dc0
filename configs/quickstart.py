"""Quickstart: a 1.97M-parameter Llama-style model trained from scratch on the Python stdlib.

A byte-level BPE (vocab 2048) is trained on the training split first, then the model trains
for ``train.steps`` steps of 16 x 128 tokens, is evaluated on held-out stdlib files (loss,
perplexity, and the held-out unigram entropy as the bar to beat), saved in HF format and
sampled. Sized for ~3 minutes on a 2-core CPU::

    pallasite train --config configs/quickstart.py --workdir /tmp/quickstart --config.train.steps=200

``arg``: ``cpu``/``runlocal`` shrink further (smoke test: a few steps, tiny data).
"""

from pallasite.configs import models
from pallasite.training.config import parse_arg, train_defaults


def get_config(arg=None):
    arg = parse_arg(arg, cpu=False, runlocal=False)
    c = train_defaults()
    c.seed = 0
    c.model = models.get("quickstart")
    c.tokenizer.vocab_size = 2048
    c.tokenizer.train_max_chars = 2_000_000
    c.data.source = "stdlib"
    c.data.heldout_percent = 5
    c.data.max_train_bytes = 4_000_000  # ~1.3M tokens: more than the run consumes, no repeats
    c.data.max_eval_bytes = 400_000
    c.data.seq_len = 128
    c.data.batch_size = 16
    c.data.eval_batches = 16
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 20
    c.optim.min_lr_ratio = 0.1
    c.optim.weight_decay = 0.1
    c.train.steps = 200
    c.train.log_every = 10
    c.train.eval_every = 100
    c.train.checkpoint_every = 100
    c.train.sample_prompt = "def __init__(self"
    c.train.sample_tokens = 48
    # greedy decoding of a 2M model loops on its likeliest tokens ("self.self.self"); a nucleus
    # sample at temperature 0.7 reads like Python
    c.train.sample_temperature = 0.7
    c.train.sample_top_p = 0.9
    c.mesh.data = 1  # 2 cores: one device; the same config runs on a pod with data=-1
    if arg.cpu or arg.runlocal:
        c.tokenizer.vocab_size = 512
        c.tokenizer.train_max_chars = 300_000
        c.data.max_train_bytes = 400_000
        c.data.max_eval_bytes = 80_000
        c.data.batch_size = 4
        c.data.eval_batches = 2
        c.train.steps = 10
        c.train.eval_every = 5
        c.train.checkpoint_every = 5
    return c
