"""An MoE trained with Occult expert-parallel dispatch (Luo et al., ICML 2025) on the Python stdlib:
d=128, 4 layers, 32 SwiGLU experts of width 64, top-4, experts sharded over ``devices`` devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        pallasite train --config pallasite.configs.occult --workdir /tmp/occult
    pallasite occult-place --model /tmp/occult --output /tmp/occult_placed --devices 8

``arg``: ``dispatch=standard`` (the baseline), ``devices=N`` (the ``expert`` mesh axis; 1 = no
expert parallelism), ``prune=N`` (collaboration pruning to N devices per token), ``steps=N``,
``cpu`` (a smoke run: a few steps, tiny data). On CPU the devices are host devices (XLA_FLAGS).
"""

from pallasite.configs import models
from pallasite.training.config import parse_arg, train_defaults


def get_config(arg=None):
    a = parse_arg(arg, dispatch="occult", devices=8, prune=0, steps=300, cpu=False)
    c = train_defaults()
    moe = dict(num_experts=32, top_k=4, d_expert=64, dispatch=a.dispatch)
    if a.prune:
        moe.update(occult_devices=int(a.devices), occult_max_devices=int(a.prune))
    c.model = dict(models.get("quickstart"), d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=256,
                   ffn="moe", ffn_config=moe)
    c.tokenizer.vocab_size = 2048
    c.data.source = "stdlib"
    c.data.max_train_bytes = 4_000_000
    c.data.max_eval_bytes = 400_000
    c.data.seq_len = 128
    c.data.batch_size = 16
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 20
    c.train.steps = int(a.steps)
    c.train.eval_every = 100
    c.train.checkpoint_every = 100
    c.train.sample_tokens = 0
    c.mesh = dict(data=1, fsdp=1, tensor=1, expert=int(a.devices))
    if a.cpu:
        c.tokenizer.vocab_size = 512
        c.tokenizer.train_max_chars = 300_000
        c.data.max_train_bytes = 400_000
        c.data.max_eval_bytes = 80_000
        c.data.batch_size = 8
        c.data.eval_batches = 2
        c.train.steps = 4
        c.train.eval_every = 2
        c.train.checkpoint_every = 2
    return c
