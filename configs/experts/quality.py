"""CPU-sized quality run of the MoLE paper's Table 3 comparison: dense, MoE (top-2) and
MoLE-4E / MoLE-16E at equal *activated* parameters, trained on the same corpus, tokenizer,
batches and steps; the table of held-out losses goes to docs/experts.md.

    python -m pallasite.benchmarks.experts_quality --out runs/experts   # all variants (the driver)
    pallasite train --config configs/experts/quality.py:kind=mole4 --workdir runs/mole4

Two scales of one scaled-down Table 2 row (MHA, D_s = 4d, D_r = D_s for MoLE, untied
embeddings, byte-level BPE trained on the stdlib corpus by the first run and shared by all):

* ``scale=cpu`` (default; a 2-core laptop, minutes per model): L = 2, d = 32, 4 heads,
  D_s = 128, vocab 2048, 128 × 16 tokens per step, 300 steps.
* ``scale=cpu2`` (the run in docs/experts.md, ≈ 40–50 min per model on the shared 2-core box): L = 4,
  d = 64, 4 heads, D_s = 256, vocab 8192 (V/d = 128, so the lookup experts have many per-token rows to
  learn), 16 × 128 tokens per step, 600 steps (1.2M tokens) from an 8 MB train subset.
* ``scale=gpu`` (one accelerator, about a minute per model): L = 4, d = 128, 4 heads, D_s = 512,
  vocab 4096, 256 × 32 tokens per step, 1000 steps.

Per layer, activated FFN parameters: dense 2·d·D_s; MoLE the same + d·N (router); MoE top-2:
2 non-gated exact-GELU experts of width D_s/2 (+ router d·E), the paper's Table 2 baselines.
Training-time expert parameters: MoLE-4E = MoE-10E (5 FFN widths), MoLE-16E = MoE-34E (17), as in
the paper. ``--seeds 0,1`` repeats a comparison over seeds (init and data order; runs of seed s > 0
go to ``<kind>_s<s>``).

Variants (``kind``): dense, moe10, moe34, mole4, mole16, ``moe16k4`` (16 experts, top-4, SwiGLU-form
width D_s/6: a trained routing with k ≥ 4 for the Occult benchmark, saved with its checkpoint) and
``moe10g`` / ``moe34g`` (the SwiGLU-form MoE of the earlier run: width D_s/3, equal activated
parameters; an ablation) and ``dense_glu`` (control: the core's gated FFN, GeGLU of width
2·D_s/3 — the MoE experts' form — at the dense model's activated parameters, to separate "gated
vs non-gated FFN" from "experts").
"""

from __future__ import annotations

from pallasite.configs.experts.paper import _validated, ffn_fields
from pallasite.training.config import ConfigError, parse_arg, train_defaults

KINDS = ("dense", "moe10", "mole4", "mole16", "moe34", "moe16k4", "dense_glu", "moe10g", "moe34g")
SCALES = {
    "cpu": dict(d_model=32, n_layers=2, n_heads=4, d_ff=128, vocab=2048, seq_len=128, batch=16, steps=300,
                lr=3e-3, train_bytes=3_000_000),
    "cpu2": dict(d_model=64, n_layers=4, n_heads=4, d_ff=256, vocab=8192, seq_len=128, batch=16, steps=600,
                 lr=3e-3, train_bytes=8_000_000),
    "gpu": dict(d_model=128, n_layers=4, n_heads=4, d_ff=512, vocab=4096, seq_len=256, batch=32, steps=1000,
                lr=2e-3, train_bytes=0),
}


def model_dict(kind: str, scale: str = "cpu") -> dict:
    s = SCALES[scale]
    d = dict(family="llama", vocab_size=0, d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"],
             n_kv_heads=s["n_heads"], d_ff=s["d_ff"], max_seq_len=1024, tie_embeddings=False, hidden_act="gelu_exact")
    if kind == "moe16k4":  # gated: the Occult tools (expert similarity, HF export) expect SwiGLU experts
        d.update(ffn_fields("moe16", s["d_ff"], top_k=4, moe_gated=True))
    elif kind.endswith("g") and kind.startswith("moe"):  # moe10g / moe34g: SwiGLU-form ablation
        d.update(ffn_fields(kind[:-1], s["d_ff"], moe_gated=True))
    else:
        d.update(ffn_fields(kind, s["d_ff"]))
    return _validated(d)


def get_config(arg=None):
    a = parse_arg(arg, kind="mole4", scale="cpu", steps=0, seed=0, tokenizer="", runlocal=False)
    if a.kind not in KINDS:
        raise ConfigError(f"configs/experts/quality.py: kind={a.kind!r}; expected one of {KINDS}")
    if a.scale not in SCALES:
        raise ConfigError(f"configs/experts/quality.py: scale={a.scale!r}; expected one of {sorted(SCALES)}")
    s = SCALES[a.scale]
    c = train_defaults()
    c.seed = int(a.seed)
    c.model = model_dict(a.kind, a.scale)
    c.tokenizer.path = a.tokenizer
    c.tokenizer.vocab_size = s["vocab"]
    c.tokenizer.train_max_chars = 2_000_000
    c.data.source = "stdlib"
    c.data.max_train_bytes = s["train_bytes"]
    c.data.max_eval_bytes = 400_000
    c.data.seq_len = s["seq_len"]
    c.data.batch_size = s["batch"]
    c.data.eval_batches = 16
    c.optim.lr = s["lr"]
    c.optim.warmup_steps = 30
    c.train.steps = a.steps or s["steps"]
    c.train.log_every = 50
    c.train.eval_every = 0
    c.train.checkpoint_every = 0  # final checkpoint only
    c.train.keep_checkpoints = 1
    c.train.export_hf = False
    c.train.sample_tokens = 0
    c.mesh.data = 1
    if a.runlocal:
        c.train.steps = 6
        c.data.max_train_bytes, c.data.max_eval_bytes, c.data.eval_batches = 200_000, 50_000, 2
    return c
