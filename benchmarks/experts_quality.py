"""Driver of the CPU-sized MoLE quality comparison (``configs/experts/quality.py``): trains every
variant and seed, then ``lut_eval`` measures a trained MoLE in LUT mode (fp16 / NF4 / NF3).

    python -m pallasite.benchmarks.experts_quality --out runs/experts --scale cpu2 --kinds dense,mole4,moe10
"""

from __future__ import annotations

import argparse
import json
import os

from pallasite.configs.experts.quality import KINDS, SCALES, get_config


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
    ds = data_lib.PackedDataset(
        data_lib.tokenize_documents(tokenizer, eval_docs, eos),
        seq_len=config.data.seq_len,
        batch_size=config.data.batch_size,
        seed=0,
        shuffle=False,
    )
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
    out = {
        "train_mode": mean_loss(lambda b: fwd(g, s, b["tokens"], b["positions"], segment_ids_BT=b["segment_ids"])[0])
    }
    lut = ML.build_lut(model, dtype="float16")
    gl, sl = nnx.split(ML.to_lut_model(model))
    lfwd = jax.jit(lut_forward, static_argnums=0)
    stores = {"lut_fp16": ML.HostLUT(lut)}
    for kind, block in quants:
        block = block or (cfg.d_model if kind == "nf4" else max(8, cfg.d_model // 4))
        stores[f"lut_{kind}_b{block}"] = ML.HostLUT(lut, quant=kind, block=block)
    for name, store in stores.items():
        out[name] = mean_loss(
            lambda b: lfwd(
                gl, sl, store.rows(b["tokens"]), b["tokens"], b["positions"], segment_ids_BT=b["segment_ids"]
            )[0]
        )
        out[name + "_storage_vs_fp16"] = store.nbytes / stores["lut_fp16"].nbytes
    return out


def run_all(
    out: str,
    kinds=KINDS,
    scale: str = "cpu",
    steps: int = 0,
    seeds=(0,),
    tokenizer: str = "",
    results_name: str = "quality.json",
) -> dict:
    """Train every (variant, seed) in ``out/<kind>`` (seed 0) or ``out/<kind>_s<seed>`` (resumes
    finished ones) and return their summaries, keyed ``kind`` / ``kind_s<seed>``. Every run uses
    one tokenizer: ``tokenizer`` if given, else the first finished run's, else the first run trains it."""
    from pallasite.training.config import load_config
    from pallasite.training.loop import train

    os.makedirs(out, exist_ok=True)
    qpath = os.path.join(out, results_name)
    results = json.load(open(qpath)) if os.path.exists(qpath) else {}  # extend an earlier run
    name = lambda k, sd: k if sd == 0 else f"{k}_s{sd}"
    tok = tokenizer or next(
        (
            os.path.join(out, k, "tokenizer")
            for k in KINDS
            if os.path.exists(os.path.join(out, k, "tokenizer", "tokenizer.json"))
        ),
        "",
    )
    for seed in seeds:
        for kind in kinds:
            arg = f"kind={kind},scale={scale},steps={steps},seed={seed}" + (f",tokenizer={tok}" if tok else "")
            res = train(load_config(get_config(arg)), os.path.join(out, name(kind, seed)))
            tok = tok or os.path.join(out, name(kind, seed), "tokenizer")
            results[name(kind, seed)] = {
                k: res[k] for k in ("eval_loss", "train_loss", "num_params", "tokens_per_s", "wall_s")
            }
            print(json.dumps({name(kind, seed): results[name(kind, seed)]}), flush=True)
            with open(qpath, "w") as f:  # after each model: partial runs keep results
                json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/experts")
    p.add_argument("--scale", default="cpu", choices=sorted(SCALES))
    p.add_argument("--steps", type=int, default=0, help="0 = the scale's default")
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--seeds", default="0", help="comma-separated seeds (init and data order)")
    p.add_argument("--tokenizer", default="", help="a trained tokenizer dir shared by every run")
    p.add_argument("--results", default="quality.json", help="results file name under --out")
    args = p.parse_args()
    run_all(
        args.out,
        tuple(args.kinds.split(",")),
        args.scale,
        args.steps,
        tuple(int(x) for x in args.seeds.split(",")),
        args.tokenizer,
        args.results,
    )
