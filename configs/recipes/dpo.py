"""DPO from the SFT model of ``configs/recipes/sft.py`` with on-/off-policy or SimpleMix pairs.

    pallasite train --config configs/recipes/sft.py:cpu --workdir runs/sft
    pallasite train --config configs/recipes/dpo.py:cpu,init_from=runs/sft --workdir runs/dpo_mix
    # pure streams: ...:cpu,mix=onpolicy | offpolicy;  ratio: --config.data.kind_config.ratio=0.5

``result.json`` reports the greedy reward per family of π_SFT (``sft_reward/*``) and of the DPO
policy (``reward/*``). β = 0.1. ``arg``: ``cpu`` (already CPU-sized; fewer steps), ``mix=...``,
``lora`` (rank-8 adapters instead of full fine-tuning).
"""

from pallasite.configs.recipes.sft import kind_config
from pallasite.training.config import parse_arg, train_defaults
from pallasite.training.losses.dpo import DPOConfig
from pallasite.training.preference.data import PreferenceDataConfig


def get_config(arg=None):
    arg = parse_arg(
        arg, cpu=False, runlocal=False, lora=False, mix="simplemix", init_from="", steps=0
    )
    c = train_defaults()
    c.data.kind = "preference"
    c.data.kind_config = kind_config(
        PreferenceDataConfig,
        init_from=arg.init_from,
        mix=arg.mix,
        ratio=0.5,
        n_prompts=200,
        n_samples=8,
        temperature=1.0,
        max_new_tokens=16,
        eval_prompts=64,
        lora_rank=8 if arg.lora else 0,
    )
    c.data.seq_len = 64
    c.data.batch_size = 16
    c.data.eval_batches = 2
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 10
    c.optim.weight_decay = 0.0
    c.optim.min_lr_ratio = 0.0
    c.train.loss = "dpo"
    c.train.loss_config = kind_config(DPOConfig, beta=0.1)
    c.train.steps = 150
    c.train.log_every = 10
    c.train.eval_every = 50
    c.train.checkpoint_every = 150
    c.train.sample_tokens = 0
    c.mesh.data = 1
    if arg.cpu or arg.runlocal:
        c.train.steps = 80
        c.train.eval_every = 40
    if arg.steps:
        c.train.steps = arg.steps
    return c
