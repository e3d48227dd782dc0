"""Code-first vs CoT-first SFT on synthetic program synthesis (``training/recipes/code_cot.py``).

    pallasite train --config configs/recipes/code_cot.py:variant=code_first,cpu --workdir runs/cf
    # variant=cot_first | code_only: the same specs, tokens per step, epochs, LR and seeds

A fresh ~0.85M-parameter model learns {instruction -> response}; ``result.json`` reports greedy
pass@1 (``code/pass@1``) on 100 held-out specs, run in the sandbox against hidden I/O tests.
"""

from pallasite.configs.recipes.sft import kind_config, toy_model
from pallasite.training.config import parse_arg, train_defaults
from pallasite.training.recipes.code_cot import CodeCoTDataConfig


def get_config(arg=None):
    arg = parse_arg(arg, cpu=False, runlocal=False, variant="code_first", steps=0, n_train=1600)
    c = train_defaults()
    c.model = toy_model()
    c.tokenizer.vocab_size = 512
    c.data.kind = "code_cot"
    c.data.kind_config = kind_config(
        CodeCoTDataConfig,
        variant=arg.variant,
        n_train=arg.n_train,
        n_test=100,
        data_seed=0,
        max_new_tokens=176,
    )
    c.data.seq_len = 192
    c.data.batch_size = 16
    c.data.eval_batches = 2
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 20
    c.optim.weight_decay = 0.0
    c.train.loss = "sft"
    c.train.steps = 240
    c.train.log_every = 20
    c.train.eval_every = 120
    c.train.checkpoint_every = 120
    c.train.sample_tokens = 0
    c.mesh.data = 1
    if arg.cpu or arg.runlocal:
        c.train.steps = 120
        c.train.eval_every = 60
        c.train.checkpoint_every = 60
    if arg.steps:
        c.train.steps = arg.steps
    return c
