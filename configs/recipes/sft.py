"""SFT with response-only loss on the toy preference families (the SFT stage of the DPO experiment).

    pallasite train --config configs/recipes/sft.py:cpu --workdir runs/sft
    # your own data / model: --config.data.kind_config.source=jsonl
    #   --config.data.kind_config.paths="('chat.jsonl',)"
    #   --config.data.kind_config.init_from=PATH_TO_MODEL [--config.data.kind_config.lora_rank=8]

A fresh ~1.2M-parameter Llama-style model (d 128, 4 layers, BPE 512 with chat tokens) learns to add
two-digit numbers and to describe topics; ``result.json`` reports its greedy reward per family.
``arg``: ``cpu`` = a 2-core run of a few minutes (the default is already CPU-sized); ``lora`` adds
rank-8 LoRA (useful with ``init_from``).
"""

import dataclasses

from ml_collections import ConfigDict

from pallasite.training.config import parse_arg, train_defaults


def kind_config(cls, **fields) -> ConfigDict:
    """Every field of a data kind's sub-config (so any can be overridden from the command line)."""
    return ConfigDict(dataclasses.asdict(cls(**fields)))


def toy_model() -> dict:
    return dict(
        family="llama",
        vocab_size=0,
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=384,
        max_seq_len=256,
        tie_embeddings=True,
    )


def get_config(arg=None):
    arg = parse_arg(arg, cpu=False, runlocal=False, lora=False, steps=0)
    c = train_defaults()
    c.model = toy_model()
    c.tokenizer.vocab_size = 512
    c.data.kind = "sft"
    from pallasite.training.recipes.sft_data import SFTDataConfig

    c.data.kind_config = kind_config(
        SFTDataConfig,
        source="preference_toy",
        n_examples=3000,
        heldout_percent=5.0,
        lora_rank=8 if arg.lora else 0,
    )
    c.data.seq_len = 128
    c.data.batch_size = 32
    c.data.eval_batches = 4
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 20
    c.optim.weight_decay = 0.0
    c.train.loss = "sft"
    c.train.steps = 600
    c.train.log_every = 25
    c.train.eval_every = 200
    c.train.checkpoint_every = 200
    c.train.sample_tokens = 0
    c.mesh.data = 1
    if arg.cpu or arg.runlocal:
        c.train.steps = 300
        c.train.eval_every = 100
        c.train.checkpoint_every = 100
    if arg.steps:
        c.train.steps = arg.steps
    return c
