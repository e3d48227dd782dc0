"""Knowledge editing with CE vs OVERTONE on a synthetic-facts world, in two stages.

    pallasite train --config configs/recipes/overtone.py:stage=facts,cpu --workdir runs/facts
    pallasite train --config configs/recipes/overtone.py:stage=edit,method=overtone \\
        --workdir runs/edit_ot \\
        --config.data.kind_config.init_from=runs/facts
    # method=ce for the cross-entropy baseline; mode=lora for LoRA editing (rank 4 on every MLP)

Stage ``facts`` trains a ~0.85M-parameter model on the world (``training/recipes/editing.py``);
``result.json`` reports recall and two-hop accuracy. Stage ``edit`` edits 24 facts at once
(FT of layer 1's MLP, or LoRA) and reports reliability, generality, locality and portability
before and after. HTO needs the per-step probabilities: ``benchmarks/recipes.py`` records them.
"""

from pallasite.configs.recipes.sft import kind_config, toy_model
from pallasite.errors import ConfigError
from pallasite.training.config import parse_arg, train_defaults
from pallasite.training.losses.overtone import OvertoneConfig
from pallasite.training.recipes.editing import EditDataConfig, FactsDataConfig


def get_config(arg=None):
    arg = parse_arg(
        arg,
        cpu=False,
        runlocal=False,
        stage="facts",
        method="overtone",
        mode="ft",
        init_from="",
        steps=0,
        lam=0.8,
    )
    c = train_defaults()
    c.mesh.data = 1
    c.train.sample_tokens = 0
    c.optim.weight_decay = 0.0
    c.tokenizer.vocab_size = 512
    world = dict(n_subjects=120, n_cities=16, n_countries=4, world_seed=0)
    if arg.stage == "facts":
        c.model = toy_model()
        c.data.kind = "facts"
        c.data.kind_config = kind_config(FactsDataConfig, **world, city_repeats=4)
        c.data.seq_len = 64
        c.data.batch_size = 32
        c.data.eval_batches = 2
        c.optim.lr = 3e-3
        c.optim.warmup_steps = 20
        c.train.loss = "lm"
        c.train.steps = 500 if not (arg.cpu or arg.runlocal) else 300
        c.train.log_every = 25
        c.train.eval_every = 100
        c.train.checkpoint_every = 100
    elif arg.stage == "edit":
        ft = dict(trainable=("layers/1/ffn/",))
        lora = dict(lora_rank=4, lora_alpha=8.0, lora_targets=("ffn/(gate|up|down)_proj",))
        c.data.kind = "edit"
        c.data.kind_config = kind_config(
            EditDataConfig,
            **world,
            init_from=arg.init_from,
            n_edits=24,
            edit_seed=0,
            n_locality=48,
            **(lora if arg.mode == "lora" else ft),
        )
        c.data.seq_len = 32
        c.data.batch_size = 24
        c.data.eval_batches = 1
        c.optim.lr = 2e-3 if arg.mode == "ft" else 5e-3
        c.optim.warmup_steps = 0
        c.optim.min_lr_ratio = 1.0
        c.optim.clip_norm = 1.0
        if arg.method == "overtone":
            c.train.loss = "overtone"
            c.train.loss_config = kind_config(OvertoneConfig, lam=arg.lam, filter="min_p", eps=0.1)
        elif arg.method == "ce":
            c.train.loss = "sft"
        else:
            raise ConfigError(f"overtone config: method={arg.method!r}; expected ce | overtone")
        c.train.steps = 15
        c.train.log_every = 5
        c.train.eval_every = 0
        c.train.checkpoint_every = 0
        c.train.keep_checkpoints = 1
    else:
        raise ConfigError(f"overtone config: stage={arg.stage!r}; expected facts | edit")
    if arg.steps:
        c.train.steps = arg.steps
    return c
