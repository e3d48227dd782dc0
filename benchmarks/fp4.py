"""FP4 training side by side (Wang et al., ICML 2025): BF16 vs FP4 with DGE + OCC vs direct FP4,
plus the paper's ablations, on the same data, seeds and steps, in one process.

    python -m pallasite.benchmarks.fp4 --quick        # bf16 / fp4 / fp4_direct, < 10 min on CPU
    python -m pallasite.benchmarks.fp4 --rows all --seeds 0,1,2 --ablation-seeds 0 \\
        --plot docs/fp4_loss.png                               # the docs/fp4.md comparison

Rows (``--rows``): ``bf16`` (float linears, bf16 compute), ``fp4`` (W4A4, DGE, OCC α=0.99),
``fp4_direct`` (W4A4, straight-through, no OCC), ``w4a8_dge`` (FP8 activations, DGE only),
``w8a4_occ`` (FP8 weights, OCC only), ``fp4_pow2`` (``fp4`` with the released code's
power-of-two scale), ``w8a8`` (a control: FP8 E4M3 operands, no OCC, must track bf16),
``bf16_lr05x`` / ``bf16_lr2x`` / ``bf16_lr4x`` (bf16 at 0.5x / 2x / 4x the peak learning rate),
``fp4_fp8adam`` / ``bf16_fp8adam`` (Adam's first moment in FP8 E4M3, second in FP16: the paper's
FP8-LM mixed precision, ``training/optim_moments.py``), and
any row at X times the peak lr as ``ROW@lrX`` (``fp4@lr0.5``): is the baseline's lr the reason DGE
rows end lower?
Every row uses bf16 compute outside the linears and the same AdamW, schedule,
data order (seeded per seed) and initialisation (same seed -> same initial weights). Headline rows
(bf16, fp4) run every seed of ``--seeds``, the others ``--ablation-seeds``. The data is the local
Python stdlib (held-out files for eval), tokenized by a byte-level BPE trained on the train split.

Also measured: the quantizer's overhead per GEMM (one activation quantization with OCC + one
weight quantization, divided by the bf16 GEMM they feed; the compiled jnp quantizer on CPU, the
Pallas kernel elsewhere), Table 1 of the paper on activations captured from the trained bf16
model (FFN down-projection inputs), and on a GPU the FP8-emulated GEMM vs the bf16 GEMM at 4096².
Prints a table and ends with one JSON line (final eval losses in nats/token).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite import sharding as shd
from pallasite.benchmarks.timing import median_time
from pallasite.models.config import ModelConfig
from pallasite.models.context import Taps
from pallasite.models.fp4 import FP4Config
from pallasite.models.tokenizer import train_bpe
from pallasite.ops.quant import fp4 as q
from pallasite.ops.quant.fp4_kernel import quantize_rows, resolve_impl
from pallasite.training import data as data_lib
from pallasite.training import step as st
from pallasite.training.config import train_defaults
from pallasite.training.optim import make_optimizer

FP8_CONTROL = FP4Config(
    w_bits=8, a_bits=8, w_grad="ste", occ=False
)  # sanity row: should track bf16
ROWS: dict[str, Optional[FP4Config]] = {
    "bf16": None,
    "fp4": FP4Config(),
    "fp4_direct": FP4Config(w_grad="ste", occ=False),
    "w4a8_dge": FP4Config(a_bits=8, occ=False),
    "w8a4_occ": FP4Config(w_bits=8, w_grad="ste"),
    "fp4_pow2": FP4Config(scale="pow2"),
    "w8a8": FP8_CONTROL,
    "bf16_lr05x": None,
    "bf16_lr2x": None,
    "bf16_lr4x": None,
    "fp4_fp8adam": FP4Config(),  # fp4 with Adam's moments in FP8 / FP16 (the paper's FP8-LM setup)
    "bf16_fp8adam": None,
}
HEADLINE = ("bf16", "fp4")
# controls for "is DGE's lead a learning-rate effect?": bf16 with the peak lr scaled (docs/fp4.md: at
# the full size part of it is, since 3e-3 is too high for bf16; ROW@lrX tunes any row the same way)
LR_SCALE = {"bf16_lr05x": 0.5, "bf16_lr2x": 2.0, "bf16_lr4x": 4.0}
ROW_MOMENTS = {"fp4_fp8adam": "fp8", "bf16_fp8adam": "fp8"}  # optim.moments per row (default float32)


def parse_row(name: str) -> tuple[Optional[FP4Config], float]:
    """A row name -> (its FP4 config or None for bf16, the peak-lr factor). ``ROW@lrX`` is any row at
    X times the peak lr (``fp4@lr0.5``): every row at its own best lr is the fair comparison."""
    base, sep, factor = name.partition("@lr")
    if base not in ROWS:
        raise KeyError(name)
    try:
        scale = float(factor) if sep else LR_SCALE.get(base, 1.0)
    except ValueError:
        raise KeyError(name) from None
    if not (math.isfinite(scale) and scale > 0):
        raise KeyError(name)
    return ROWS[base], scale


def _known_row(name: str) -> bool:
    try:
        parse_row(name)
        return True
    except KeyError:
        return False


SIZES = {  # model, data and schedule per size
    "quick": dict(
        d_model=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        d_ff=384,
        vocab=1024,
        seq=128,
        batch=8,
        steps=300,
        eval_every=50,
        eval_batches=8,
        lr=3e-3,
        warmup=20,
        train_bytes=1_500_000,
    ),
    "full": dict(
        d_model=192,
        n_layers=4,
        n_heads=6,
        n_kv_heads=2,
        d_ff=512,
        vocab=2048,
        seq=128,
        batch=8,
        steps=500,
        eval_every=50,
        eval_batches=16,
        lr=3e-3,
        warmup=25,
        train_bytes=3_000_000,
    ),
}


def model_config(size: dict, vocab: int, fp4_config: Optional[FP4Config]) -> ModelConfig:
    fields = dict(
        family="llama",
        vocab_size=vocab,
        d_model=size["d_model"],
        n_layers=size["n_layers"],
        n_heads=size["n_heads"],
        n_kv_heads=size["n_kv_heads"],
        d_ff=size["d_ff"],
        max_seq_len=max(256, size["seq"]),
        tie_embeddings=True,
        dtype="bfloat16",
        param_dtype="float32",
    )
    if fp4_config is None:
        return ModelConfig(**fields, linear="float")
    return ModelConfig(**fields, linear="fp4", linear_config=fp4_config)


# ----------------------------------------------------------------------------- data
def prepare_data(size: dict, log=print):
    t0 = time.time()
    dc = train_defaults().data
    dc.max_train_bytes, dc.max_eval_bytes = size["train_bytes"], 400_000
    train_docs, eval_docs = data_lib.load_documents(dc)
    tok = train_bpe((d.text for d in train_docs[: max(1, len(train_docs) // 2)]), size["vocab"])
    eos = int(tok.eos_token_id)
    train_tok = data_lib.tokenize_documents(tok, train_docs, eos)
    eval_tok = data_lib.tokenize_documents(tok, eval_docs, eos)
    eval_ds = data_lib.PackedDataset(
        eval_tok, seq_len=size["seq"], batch_size=size["batch"], seed=0, shuffle=False
    )
    evals = eval_ds.first_batches(size["eval_batches"])
    vocab = -(-len(tok) // 64) * 64
    log(
        f"data: {sum(map(len, train_tok)):,} train / {sum(map(len, eval_tok)):,} eval tokens, "
        f"vocab {len(tok)} "
        f"({time.time() - t0:.1f}s)"
    )
    return train_tok, evals, vocab


# ----------------------------------------------------------------------------- one training run
def train_row(cfg: ModelConfig, train_tok, evals, size: dict, seed: int, steps: int,
              moments: str = "float32") -> dict:
    oc = train_defaults().optim
    oc.lr, oc.warmup_steps, oc.moments = size["lr"], size["warmup"], moments
    opt, sched = make_optimizer(oc, steps)
    mesh = shd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    rules, B = shd.DEFAULT_RULES, size["batch"]
    graphdef, state, shardings = st.init_train_state(cfg, opt, mesh, rules, seed)
    step = st.make_train_step(graphdef, opt, sched, shardings, mesh, rules, B)
    evaluate = st.make_eval_step(graphdef, shardings, mesh, rules, B)
    bsh = st.batch_shardings(mesh, rules, B)
    it = data_lib.PackedDataset(train_tok, seq_len=size["seq"], batch_size=B, seed=seed).iterator()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))

    def eval_loss():
        ce = n = 0.0
        for b in evals:
            c, k = evaluate(state["params"], state["other"], st.put_batch(b, bsh))
            ce, n = ce + float(c), n + float(k)
        return ce / max(n, 1.0)

    train_losses, eval_curve, diverged, step_times = [], [], None, []
    with jax.set_mesh(mesh):
        eval_curve.append((0, eval_loss()))
        for i in range(1, steps + 1):
            t0 = time.perf_counter()
            state, m = step(state, st.put_batch(next(it), bsh))
            loss = float(m["loss"])
            step_times.append(time.perf_counter() - t0)
            train_losses.append(loss)
            if not math.isfinite(loss):
                diverged = i
                break
            if i % size["eval_every"] == 0 or i == steps:
                eval_curve.append((i, eval_loss()))
    final = eval_curve[-1][1] if diverged is None else float("nan")
    return dict(
        final_eval_loss=final,
        eval_curve=eval_curve,
        train_losses=train_losses,
        diverged_at=diverged,
        step_s=float(np.median(step_times[1:])) if len(step_times) > 1 else float("nan"),
        params=n_params,
        state=state,
        graphdef=graphdef,
    )


# ----------------------------------------------------------------------------- measurements
def quantizer_overhead(n: int, k: int, m: int) -> dict:
    """(activation quant with OCC + weight quant) / bf16 GEMM, and without OCC."""
    x = jax.random.normal(jax.random.PRNGKey(0), (n, k)).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.PRNGKey(1), (k, m)) * 0.02).astype(jnp.bfloat16)
    gemm = jax.jit(
        lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    )
    q_occ = jax.jit(lambda x, w: (quantize_rows(x, occ_alpha=0.99), quantize_rows(w.T)))
    q_plain = jax.jit(lambda x, w: (quantize_rows(x), quantize_rows(w.T)))
    t_gemm, t_occ, t_plain = (median_time(f, x, w, iters=10) for f in (gemm, q_occ, q_plain))
    return {
        "quant_overhead_per_gemm": t_occ / t_gemm,
        "quant_overhead_per_gemm_no_occ": t_plain / t_gemm,
        "overhead_shape": [n, k, m],
        "quantizer_impl": resolve_impl("auto"),
        "gemm_bf16_s": t_gemm,
    }


def gpu_gemm_4096() -> dict:
    """FP8-emulated GEMM (E4M3 operands, f32 accumulation) vs bf16 GEMM at 4096^2 (GPU only)."""
    n = 4096
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    a8, b8 = a.astype(jnp.float8_e4m3fn), b.astype(jnp.float8_e4m3fn)
    dims = (((1,), (0,)), ((), ()))
    f8 = jax.jit(
        lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(
            jnp.bfloat16
        )
    )
    bf = jax.jit(
        lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32).astype(
            jnp.bfloat16
        )
    )
    t8, t16 = median_time(f8, a8, b8, iters=20), median_time(bf, a, b, iters=20)
    return {"gemm4096_fp8_s": t8, "gemm4096_bf16_s": t16, "gemm4096_fp8_speedup": t16 / t8}


TABLE1_SETTINGS = [
    ("no_clamp", None, False),
    ("clamp_0.999", 0.999, False),
    ("comp_0.999", 0.999, True),
    ("comp_0.99", 0.99, True),
    ("comp_0.97", 0.97, True),
]


def table1_stats(y: jax.Array) -> dict:
    """Paper Table 1 (cos sim, MSE, SNR dB) of E2M1 quantization of rows ``y`` per OCC setting."""
    out = {}
    for name, alpha, comp in TABLE1_SETTINGS:
        rq = q.quantize_rows_ref(y, occ_alpha=alpha)
        yq = rq.dequantize() + (rq.residual.astype(jnp.float32) if comp else 0.0)
        err = yq - y
        norms = jnp.linalg.norm(y, axis=-1) * jnp.linalg.norm(yq, axis=-1)
        out[name] = {
            "cos": float(jnp.mean(jnp.sum(y * yq, -1) / jnp.maximum(norms, 1e-30))),
            "mse": float(jnp.mean(err**2)),
            "snr_db": float(10 * jnp.log10(jnp.sum(y**2) / jnp.sum(err**2))),
        }
    return out


def table1_on_captured(graphdef, state, batch) -> dict:
    """Table 1 on the linear inputs of a trained model, read through its own blocks: the taps
    ``attn.in`` (q/k/v input), ``attn.out`` (o_proj input), ``ffn.in`` (gate/up input), and the
    down_proj input ``act(gate(u)) ⊙ up(u)`` from each block's own FFN linears on ``ffn.in``."""
    model = nnx.merge(graphdef, state["params"], state["other"])
    taps = Taps(capture=("attn.in", "attn.out", "ffn.in"))
    _, _, _, inter = model.run(
        jnp.asarray(batch["tokens"]),
        jnp.asarray(batch["positions"]),
        segment_ids_BT=jnp.asarray(batch["segment_ids"]),
        taps=taps,
    )
    rows = lambda a: jnp.asarray(a, jnp.float32).reshape(-1, a.shape[-1])  # noqa: E731
    inputs = {name: rows(inter[name]) for name in taps.capture}
    down = []
    for layer, block in enumerate(model.layers):
        u = inter["ffn.in"][layer]
        down.append(rows(block.ffn.act(block.ffn.gate_proj(u)) * block.ffn.up_proj(u)))
    inputs["down_proj.in"] = jnp.concatenate(down)
    y = inputs["down_proj.in"]
    return {
        "table1": table1_stats(y),
        "captured_rows": int(y.shape[0]),
        "captured_kurtosis": float(jnp.mean(((y - y.mean()) / y.std()) ** 4)),
        "table1_snr_by_input": {
            name: {k: v["snr_db"] for k, v in table1_stats(x).items()} for name, x in inputs.items()
        },
    }


# ----------------------------------------------------------------------------- main
def plot(results: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, runs in results.items():
        curves = [r["train_losses"] for r in runs if r["diverged_at"] is None]
        if not curves:
            continue
        n = min(map(len, curves))
        mean = np.mean([c[:n] for c in curves], axis=0)
        w = max(1, n // 40)
        smooth = np.convolve(mean, np.ones(w) / w, mode="valid")
        ax1.plot(
            np.arange(len(smooth)) + w,
            smooth,
            label=f"{name} ({len(curves)} seed{'s' * (len(curves) > 1)})",
        )
        ev = np.mean(
            [[v for _, v in r["eval_curve"]] for r in runs if r["diverged_at"] is None], axis=0
        )
        ax2.plot([s for s, _ in runs[0]["eval_curve"]], ev, marker="o", label=name)
    ax1.set(xlabel="step", ylabel="train loss (nats/token, smoothed)", title=title)
    ax2.set(xlabel="step", ylabel="eval loss (nats/token)", title="held-out stdlib files")
    lo = min(
        min(v for _, v in r["eval_curve"])
        for runs in results.values()
        for r in runs
        if r["diverged_at"] is None
    )
    for ax in (ax1, ax2):
        ax.set_ylim(lo - 0.1, lo + 2.0)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


_RUN_KEYS = (
    "name",
    "seed",
    "final_eval_loss",
    "eval_curve",
    "train_losses",
    "diverged_at",
    "step_s",
    "params",
)


def _save_runs(path: str, size: dict, runs: dict) -> None:
    with open(path, "w") as fh:
        json.dump({"size": size, "runs": [{k: r[k] for k in _RUN_KEYS} for r in runs.values()]}, fh)


def _load_runs(path: Optional[str], size: dict) -> dict:
    if not path:
        raise SystemExit("--resume needs --curves PATH")
    try:
        with open(path) as fh:
            blob = json.load(fh)
    except FileNotFoundError:
        return {}
    if blob.get("size") != size:
        raise SystemExit(f"--resume: {path} was written for size {blob.get('size')}, not {size}")
    return {(r["name"], r["seed"]): r for r in blob["runs"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="small model, bf16/fp4/fp4_direct, one seed (< 10 min)"
    )
    p.add_argument("--rows", default=None, help=f"comma list or 'all' (known: {','.join(ROWS)})")
    p.add_argument("--seeds", default="0", help="seeds of the headline rows (bf16, fp4)")
    p.add_argument(
        "--ablation-seeds", default=None, help="seeds of the other rows (default: the first seed)"
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--size", choices=sorted(SIZES), default=None)
    p.add_argument("--plot", default=None, help="write the loss curves to this PNG")
    p.add_argument(
        "--curves",
        default=None,
        help="write every run (curves, losses) to this JSON file, after each run",
    )
    p.add_argument(
        "--resume", action="store_true", help="reuse the runs already in --curves (same size/steps)"
    )
    args = p.parse_args(argv)
    size = dict(SIZES[args.size or ("quick" if args.quick else "full")])
    if args.steps:
        size["steps"] = args.steps
    rows = (
        ["bf16", "fp4", "fp4_direct"]
        if args.rows is None and args.quick
        else list(ROWS)
        if args.rows in (None, "all")
        else args.rows.split(",")
    )
    unknown = [r for r in rows if not _known_row(r)]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; known: {list(ROWS)}, each optionally ROW@lrX (X > 0)")
    seeds = [int(s) for s in args.seeds.split(",")]
    ablation_seeds = (
        [int(s) for s in args.ablation_seeds.split(",")] if args.ablation_seeds else seeds[:1]
    )
    t_start = time.time()
    train_tok, evals, vocab = prepare_data(size)

    saved = _load_runs(args.curves, size) if args.resume else {}
    results: dict[str, list] = {}
    for name in rows:
        for seed in seeds if name in HEADLINE else ablation_seeds:
            if (name, seed) in saved:
                r = saved[(name, seed)]
                print(
                    f"{name:<11} seed {seed}: eval {r['final_eval_loss']:.4f}  "
                    f"(resumed from {args.curves})"
                )
            else:
                t0 = time.time()
                r = train_row(
                    model_config(size, vocab, parse_row(name)[0]),
                    train_tok,
                    evals,
                    dict(size, lr=size["lr"] * parse_row(name)[1]),
                    seed,
                    size["steps"],
                    moments=ROW_MOMENTS.get(name.partition("@lr")[0], "float32"),
                )
                r.update(name=name, seed=seed)
                print(
                    f"{name:<11} seed {seed}: eval {r['final_eval_loss']:.4f}  train(last 10%) "
                    f"{np.mean(r['train_losses'][-max(1, len(r['train_losses']) // 10) :]):.4f}  "
                    f"{r['step_s'] * 1e3:.0f} ms/step  {time.time() - t0:.0f}s"
                    + (f"  DIVERGED at step {r['diverged_at']}" if r["diverged_at"] else ""),
                    flush=True,
                )
                saved[(name, seed)] = r
                if args.curves:
                    _save_runs(args.curves, size, saved)
            results.setdefault(name, []).append(r)

    final = {n: float(np.mean([r["final_eval_loss"] for r in runs])) for n, runs in results.items()}
    spread = {n: float(np.std([r["final_eval_loss"] for r in runs])) for n, runs in results.items()}
    out: dict[str, Any] = {
        "benchmark": "fp4_training",
        "device": jax.devices()[0].platform,
        "size": args.size or ("quick" if args.quick else "full"),
        "steps": size["steps"],
        "tokens_per_step": size["batch"] * size["seq"],
        "seeds": seeds,
        "ablation_seeds": ablation_seeds,
        "params": results[rows[0]][0]["params"],
    }
    for n in rows:
        out[f"loss_{n}"] = final[n]
        out[f"loss_std_{n}"] = spread[n]
        out[f"step_s_{n}"] = float(np.mean([r["step_s"] for r in results[n]]))
        out[f"diverged_{n}"] = [r["diverged_at"] for r in results[n]]
    if "bf16" in final:
        for n in rows:
            if n != "bf16":
                key = "direct" if n == "fp4_direct" else n
                out[f"loss_gap_{key}_vs_bf16"] = final[n] - final["bf16"]
    if "loss_gap_fp4_vs_bf16" in out and "loss_gap_direct_vs_bf16" in out:
        out["gap_ratio_fp4_over_direct"] = (
            out["loss_gap_fp4_vs_bf16"] / out["loss_gap_direct_vs_bf16"]
        )
        gap4, gapd = out["loss_gap_fp4_vs_bf16"], out["loss_gap_direct_vs_bf16"]
        out["target_met"] = bool(gapd > 0 and gap4 <= gapd / 3 and gap4 <= 0.05)
    out.update(quantizer_overhead(2048, 2048, 2048))
    trained_bf16 = [r for r in results.get("bf16", []) if "state" in r]
    if trained_bf16:  # needs a model trained in this process (not a resumed record)
        out.update(
            table1_on_captured(trained_bf16[0]["graphdef"], trained_bf16[0]["state"], evals[0])
        )
    out.update(
        gpu_gemm_4096() if jax.default_backend() == "gpu" else {"gemm4096_fp8_speedup": None}
    )
    out["wall_s"] = time.time() - t_start

    print(
        f"\nFP4 training, {out['params'] / 1e6:.2f}M params, {size['steps']} steps of "
        f"{size['batch']}x{size['seq']} tokens, final eval loss (nats/token) over seeds"
    )
    print(f"{'row':<12}{'seeds':>6}{'eval loss':>11}{'± std':>8}{'gap vs bf16':>13}{'ms/step':>9}")
    for n in rows:
        gap = final[n] - final["bf16"] if "bf16" in final else float("nan")
        print(
            f"{n:<12}{len(results[n]):>6}{final[n]:>11.4f}{spread[n]:>8.4f}{gap:>13.4f}"
            f"{out[f'step_s_{n}'] * 1e3:>9.0f}"
        )
    print(
        f"quantizer overhead per GEMM {out['overhead_shape']}: "
        f"{out['quant_overhead_per_gemm']:.2f}x with OCC, "
        f"{out['quant_overhead_per_gemm_no_occ']:.2f}x without ({out['quantizer_impl']})"
    )
    if "table1" in out:
        print(
            "Table 1 on captured FFN down-proj inputs (kurtosis %.1f):" % out["captured_kurtosis"]
        )
        for k, v in out["table1"].items():
            print(f"  {k:<12} cos {v['cos']:.4f}  mse {v['mse']:.3e}  snr {v['snr_db']:.2f} dB")
        print(
            "SNR (dB) by linear input: "
            + "; ".join(
                f"{n}: " + " / ".join(f"{v:.1f}" for v in d.values())
                for n, d in out["table1_snr_by_input"].items()
            )
        )
    if args.plot:
        plot(results, args.plot, f"{out['params'] / 1e6:.1f}M params, {size['steps']} steps")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
