"""MoLE paper (Jie et al., ICML 2025) Table 2 model shapes: dense, MoE-10E / MoE-34E (top-2) and
MoLE-4E / MoLE-16E at 160M / 410M / 1B activated parameters, plus the pre-training recipe.

    from pallasite.configs.experts import paper
    d = paper.model("160m", "mole16")          # dict of ModelConfig fields (validated)
    c = load_config("configs/experts/paper.py:size=160m,kind=mole4")   # a training config

| size | L  | d    | heads | D_s  | MoLE D_r | MoE (top-2) D_r (paper, non-gated) |
|------|----|------|-------|------|----------|------------------------------------|
| 160M | 12 | 768  | 12    | 3072 | 3072     | 1536                               |
| 410M | 24 | 1024 | 16    | 4096 | 4096     | 2048                               |
| 1B   | 16 | 2048 | 8     | 8192 | 8192     | 4096                               |

Architecture (paper §4.1, official ``modeling_*.py``): Pythia/LLaMA-style pre-norm with RMSNorm,
RoPE, untied embeddings, no biases, multi-head attention (K = H). Dense and MoLE FFNs are the
non-gated two-matrix exact-GELU MLP (``ffn="mole"``; ``n_experts=0`` is the dense model).
Vocabulary: the GPT-NeoX tokenizer (50,277 tokens; Pythia pads the embedding to 50,304).

MoE baselines as in the paper: Mixtral-like top-2, no shared expert, experts are non-gated
two-matrix exact-GELU MLPs of width D_r = D_s/2 (``MoEConfig.gated=False``), so 2 experts ×
2·d·D_s/2 = 2·d·D_s activated FFN parameters, the dense model's. ``moe_gated=True`` switches to
the HF families' SwiGLU-form experts (width D_s/3 for equal activated parameters with
``moe_width="equal_params"``, or D_s/2 literally with ``moe_width="paper"``, 1.5× the activated
parameters) — a deviation kept only for ablations. Both MoE baselines use the load-balancing
(0.01) and z-loss (0.001) terms as in the paper; MoLE uses none.

Recipe (paper §4.1 / ``pretrain/README.md``): 100B Pile tokens, global batch 1024 × 2048, 50k
iterations, Adam(0.9, 0.95), weight decay 0.1, clip 1.0, lr 6e-4 (160M) / 3e-4 (410M, 1B) with
1% warmup and cosine decay to 0.1×, init std 0.01 (ours: 0.02, the core's default), bf16.
"""

from __future__ import annotations

from pallasite.models.config import model_config_from
from pallasite.models.mole import expert_variant_fields as ffn_fields  # noqa: F401  (re-exported)
from pallasite.training.config import parse_arg, train_defaults

SIZES = {
    "160m": dict(n_layers=12, d_model=768, n_heads=12, d_ff=3072, lr=6e-4),
    "410m": dict(n_layers=24, d_model=1024, n_heads=16, d_ff=4096, lr=3e-4),
    "1b": dict(n_layers=16, d_model=2048, n_heads=8, d_ff=8192, lr=3e-4),
}
KINDS = ("dense", "moe10", "moe34", "mole4", "mole16", "dense_glu")


def model(size: str, kind: str, *, vocab_size: int = 50304, moe_width: str = "equal_params", moe_gated: bool = False,
          **overrides) -> dict:
    if size not in SIZES:
        raise ValueError(f"unknown MoLE paper size {size!r}; expected one of {sorted(SIZES)}")
    s = SIZES[size]
    d = dict(family="llama", vocab_size=vocab_size, d_model=s["d_model"], n_layers=s["n_layers"],
             n_heads=s["n_heads"], n_kv_heads=s["n_heads"], d_ff=s["d_ff"], max_seq_len=2048,
             tie_embeddings=False, norm_eps=1e-5, rope_theta=10000.0, hidden_act="gelu_exact")
    d.update(ffn_fields(kind, s["d_ff"], moe_width=moe_width, moe_gated=moe_gated))
    d.update(overrides)
    return _validated(d)


def _validated(d: dict) -> dict:
    full = model_config_from(d).to_dict()
    full["vocab_size"] = d["vocab_size"]
    return full


def get_config(arg=None):
    """Pre-training config of one Table 2 model (accelerator-sized; ``runlocal`` shrinks the
    schedule for a smoke run of the real shapes)."""
    a = parse_arg(arg, size="160m", kind="mole4", moe_width="equal_params", moe_gated=False, runlocal=False)
    c = train_defaults()
    c.model = model(a.size, a.kind, moe_width=a.moe_width, moe_gated=bool(a.moe_gated))
    c.data.seq_len = 2048
    c.data.batch_size = 1024
    c.optim.lr = SIZES[a.size]["lr"]
    c.optim.warmup_steps = 500  # 1% of 50k
    c.optim.min_lr_ratio = 0.1
    c.optim.weight_decay = 0.1
    c.optim.clip_norm = 1.0
    c.train.steps = 50_000
    c.train.export_hf = False  # no HF layout for MoLE; orbax checkpoints + the LUT are the artifacts
    if a.runlocal:
        c.data.seq_len, c.data.batch_size, c.train.steps = 128, 2, 4
        c.train.eval_every = c.train.checkpoint_every = 0
        c.data.max_train_bytes, c.data.max_eval_bytes = 200_000, 50_000
        c.train.sample_tokens = 0
    return c
