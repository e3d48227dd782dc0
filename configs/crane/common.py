"""Shared settings of the CRANE task models: a ~0.5M-parameter Llama trained on the task's traces.

The traces are written on first use to ``data`` (default: ``$PALLASITE_CRANE_DATA`` or the temp
folder), deterministically (``eval.tasks.traces``), so the config is all a run needs.
"""

import os
import tempfile

from pallasite.errors import ConfigError
from pallasite.eval.tasks import gsm_symbolic, traces
from pallasite.training.config import parse_arg, train_defaults

# the steps the wide GSM kinds were trained for in docs/constrained.md
WIDE_GSM_STEPS = {"ordinal": 900, "relations_restated": 2400, "relations_many_names": 1800}
# problems per GSM kind where not the task's default (its model needs the variety to learn to copy)
GSM_PROBLEMS = {"relations_many_names": 40000}


def task_config(task: str, arg, *, n_problems: int, steps: int, seq_len: int):
    arg = parse_arg(arg, data="", n=0, steps=0, cpu=False, kind=traces.GSM_KIND)
    if task == "gsm" and arg.kind not in gsm_symbolic.KINDS:
        raise ConfigError(f"config arg kind={arg.kind!r}; expected one of {gsm_symbolic.KINDS}")
    arg.n = arg.n or (GSM_PROBLEMS.get(arg.kind, n_problems) if task == "gsm" else n_problems)
    root = os.environ.get("PALLASITE_CRANE_DATA") or os.path.join(
        tempfile.gettempdir(), "pallasite_crane"
    )
    suffix = f"_{arg.kind}" if task == "gsm" else ""
    path = arg.data or os.path.join(root, f"{task}_train_{arg.n}{suffix}.jsonl")
    if not os.path.exists(path):
        traces.write(task, path, arg.n, kind=arg.kind)
    c = train_defaults()
    c.seed = 0
    c.model = dict(
        family="llama",
        vocab_size=0,
        d_model=96,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=256,
        max_seq_len=1024,
        tie_embeddings=True,
        rope_theta=10000.0,
    )
    c.tokenizer.vocab_size = 512
    c.tokenizer.train_max_chars = 400_000
    c.data.source = "jsonl"
    c.data.paths = (path,)
    c.data.heldout_percent = 2
    c.data.seq_len = seq_len
    if task == "gsm" and arg.kind in WIDE_GSM_STEPS:
        # its traces restate every sentence (~300 tokens): whole problems in a row, and a wider
        # model (docs/constrained.md)
        c.data.seq_len = 512
        c.model.update(d_model=128, d_ff=384)
        steps = WIDE_GSM_STEPS[arg.kind]
    c.data.batch_size = 16
    c.data.eval_batches = 4
    c.optim.lr = 3e-3
    c.optim.warmup_steps = 30
    c.optim.min_lr_ratio = 0.05
    c.optim.weight_decay = 0.05
    c.train.steps = arg.steps or steps
    c.train.log_every = 50
    c.train.eval_every = 0
    c.train.checkpoint_every = 0
    c.train.async_checkpointing = False
    c.train.progress = False
    c.train.sample_prompt = "Question:" if task == "gsm" else "Problem:"
    c.train.sample_tokens = 32
    c.mesh.data = 1
    if arg.cpu:  # smoke size
        c.train.steps = 4
        c.data.batch_size = 4
    return c
