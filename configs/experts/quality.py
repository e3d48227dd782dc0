"""CPU-sized quality run of the MoLE paper's Table 3 comparison: dense, MoE (top-2) and
MoLE-4E / MoLE-16E at equal *activated* parameters, trained on the same corpus, tokenizer,
batches and steps; the table of held-out losses goes to docs/experts.md.

    python -m pallasite.configs.experts.quality --out /work/artifacts/experts   # all variants
    pallasite train --config configs/experts/quality.py:kind=mole4 --workdir /tmp/mole4

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
parameters; an ablation) and ``dense_glu`` (control: the core's gated FFN, GeGLU of width 2·D_s/3 — the MoE experts' form — at
the dense model's activated parameters, to separate "gated vs non-gated FFN" from "experts").
"""

from __future__ import annotations

import argparse
import json
import os

from pallasite.configs import parse_arg, train_defaults
from pallasite.configs.experts.paper import _validated, ffn_fields

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
        raise ValueError(f"configs/experts/quality.py: kind={a.kind!r}; expected one of {KINDS}")
    if a.scale not in SCALES:
        raise ValueError(f"configs/experts/quality.py: scale={a.scale!r}; expected one of {sorted(SCALES)}")
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
    c.train.progress = False
    c.train.export_hf = False
    c.train.sample_tokens = 0
    c.mesh.data = 1
    if a.runlocal:
        c.train.steps = 6
        c.data.max_train_bytes, c.data.max_eval_bytes, c.data.eval_batches = 200_000, 50_000, 2
    return c


def load_trained(workdir: str):
    """(ModelConfig, nnx model, tokenizer) of a finished quality-run workdir (latest checkpoint),
    e.g. the trained MoE routing for the Occult benchmark or a trained MoLE to tabulate."""
    from flax import nnx

    from pallasite.api import load_workdir

    m = load_workdir(workdir)
    return m.config, nnx.merge(m.graphdef, m.state), m.tokenizer


def lut_eval(workdir: str, quants=(("nf4", 0), ("nf3", 0))) -> dict:
    """Held-out loss of a trained MoLE workdir in training mode and in LUT mode: the fp16 LUT and
    NF-quantized LUTs (block 0 → d for NF4 and max(8, d/4) for NF3: the paper uses 768 = d and 128
    at d = 768, i.e. one block per expert row for NF4 and finer blocks for NF3). Same eval
    batches as the training loop. Returns losses and storage ratios per variant."""
    import jax
    import jax.numpy as jnp
    import ml_collections
    import numpy as np
    from flax import nnx

    from pallasite.inference.mole_decode import lut_forward
    from pallasite.models import mole_lut as ML
    from pallasite.models.transformer import forward
    from pallasite.training import data as data_lib

    cfg, model, tokenizer = load_trained(workdir)
    with open(os.path.join(workdir, "config.json")) as f:
        config = ml_collections.ConfigDict(json.load(f))
    _, eval_docs = data_lib.load_documents(config.data)
    eos = int(tokenizer.eos_token_id)
    ds = data_lib.PackedDataset(data_lib.tokenize_documents(tokenizer, eval_docs, eos), seq_len=config.data.seq_len,
                                batch_size=config.data.batch_size, seed=0, shuffle=False)
    batches = ds.first_batches(config.data.eval_batches)

    def ce(logits, b):
        lse = jax.nn.logsumexp(logits, -1)
        picked = jnp.take_along_axis(logits, b["targets"][..., None], -1)[..., 0]
        m = b["loss_mask"].astype(jnp.float32)
        return float(jnp.sum(m * (lse - picked))), float(jnp.sum(m))

    def mean_loss(fn):
        tot = n = 0.0
        for b in batches:
            c, k = ce(fn(b), b)
            tot, n = tot + c, n + k
        return tot / n

    g, s = nnx.split(model)
    fwd = jax.jit(forward, static_argnums=0)
    out = {"train_mode": mean_loss(lambda b: fwd(g, s, b["tokens"], b["positions"], segment_ids_BT=b["segment_ids"])[0])}
    lut = ML.build_lut(model, dtype="float16")
    gl, sl = nnx.split(ML.to_lut_model(model))
    lfwd = jax.jit(lut_forward, static_argnums=0)
    stores = {"lut_fp16": ML.HostLUT(lut)}
    for kind, block in quants:
        block = block or (cfg.d_model if kind == "nf4" else max(8, cfg.d_model // 4))
        stores[f"lut_{kind}_b{block}"] = ML.HostLUT(lut, quant=kind, block=block)
    for name, store in stores.items():
        out[name] = mean_loss(lambda b: lfwd(gl, sl, store.rows(b["tokens"]), b["tokens"], b["positions"],
                                             segment_ids_BT=b["segment_ids"])[0])
        out[name + "_storage_vs_fp16"] = store.nbytes / stores["lut_fp16"].nbytes
    return out


def run_all(out: str, kinds=KINDS, scale: str = "cpu", steps: int = 0, seeds=(0,), tokenizer: str = "",
            results_name: str = "quality.json") -> dict:
    """Train every (variant, seed) in ``out/<kind>`` (seed 0) or ``out/<kind>_s<seed>`` (resumes
    finished ones) and return their summaries, keyed ``kind`` / ``kind_s<seed>``. Every run uses
    one tokenizer: ``tokenizer`` if given, else the first finished run's, else the first run trains it."""
    from pallasite.configs import load_config
    from pallasite.training.loop import train

    os.makedirs(out, exist_ok=True)
    qpath = os.path.join(out, results_name)
    results = json.load(open(qpath)) if os.path.exists(qpath) else {}  # extend an earlier run
    name = lambda k, sd: k if sd == 0 else f"{k}_s{sd}"
    tok = tokenizer or next((os.path.join(out, k, "tokenizer") for k in KINDS
                             if os.path.exists(os.path.join(out, k, "tokenizer", "tokenizer.json"))), "")
    for seed in seeds:
        for kind in kinds:
            arg = f"kind={kind},scale={scale},steps={steps},seed={seed}" + (f",tokenizer={tok}" if tok else "")
            res = train(load_config(get_config(arg)), os.path.join(out, name(kind, seed)))
            tok = tok or os.path.join(out, name(kind, seed), "tokenizer")
            results[name(kind, seed)] = {k: res[k] for k in ("eval_loss", "train_loss", "num_params", "tokens_per_s",
                                                              "wall_s")}
            print(json.dumps({name(kind, seed): results[name(kind, seed)]}), flush=True)
            with open(qpath, "w") as f:  # after each model: partial runs keep results
                json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="/work/artifacts/experts")
    p.add_argument("--scale", default="cpu", choices=sorted(SCALES))
    p.add_argument("--steps", type=int, default=0, help="0 = the scale's default")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--seeds", default="0", help="comma-separated seeds (init and data order)")
    p.add_argument("--tokenizer", default="", help="a trained tokenizer dir shared by every run")
    p.add_argument("--results", default="quality.json", help="results file name under --out")
    args = p.parse_args()
    run_all(args.out, tuple(args.kinds.split(",")), args.scale, args.steps,
            tuple(int(x) for x in args.seeds.split(",")), args.tokenizer, args.results)
