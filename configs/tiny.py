"""A tiny CPU experiment: 2-layer d=32 Llama on a few stdlib files, a few dozen steps.

Used by the tests and as a smoke run::

    pallasite train --config configs/tiny.py --workdir /tmp/tiny
"""

from pallasite.configs import models
from pallasite.training.config import parse_arg, train_defaults


def get_config(arg=None):
    arg = parse_arg(arg, cpu=False, runlocal=False)  # already CPU-sized; accepted for uniformity
    c = train_defaults()
    c.model = models.get("tiny")
    c.tokenizer.vocab_size = 384
    c.tokenizer.train_max_chars = 200_000
    c.data.max_train_bytes = 300_000
    c.data.max_eval_bytes = 60_000
    c.data.seq_len = 32
    c.data.batch_size = 4
    c.data.eval_batches = 2
    c.optim.lr = 1e-2
    c.optim.warmup_steps = 4
    c.train.steps = 12
    c.train.log_every = 4
    c.train.eval_every = 6
    c.train.checkpoint_every = 3
    c.train.progress = False
    c.train.sample_tokens = 8
    c.mesh.data = 1
    return c
