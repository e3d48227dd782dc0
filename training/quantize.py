"""``pallasite quantize``: W4A4KV4 post-training quantization of a model into a folder that
``pallasite.load``, ``pallasite generate`` and ``pallasite eval`` serve.

    pallasite quantize --model M --output DIR --method flatquant|hadamard|rtn|smoothquant
                       [--config pallasite.configs.quant.flatquant:quick] [--text FILE|DIR|stdlib]

The result is a ``pallasite.Model`` folder: config ``linear="w4a4"`` (``QuantConfig``) and
``kv_cache="kv4"`` with ``KV4Config(transforms="kv4_transforms.npz")`` (the K transforms and K/V
clips, written next to the parameters), packed int4 kernels, and the tokenizer. Calibration data
(FlatQuant's training, SmoothQuant's statistics, GPTQ's Hessians) are random windows of the first
80% of the text files (``eval.corpora``); the method and its settings come from a
``configs/quant`` file, flags override them. The pipeline itself is
``training.quant_baselines.quantize_model``.
"""

from __future__ import annotations

import json
import time
from typing import Callable, Optional

import numpy as np

from pallasite.errors import InputError
from pallasite.models.quantized import QUANT_METHODS

DEFAULT_CONFIG = "pallasite.configs.quant.flatquant"


def calibration_windows(tokenizer, text: Optional[str], n: int, length: int, seed: int = 0) -> np.ndarray:
    """``n`` random windows of ``length`` tokens from the calibration part of ``text`` (a file, a
    directory of .txt files, ``"stdlib"`` for the Python sources, or None for python3.11-doc)."""
    from pallasite.eval.corpora import load_texts, token_streams

    if text == "stdlib":
        from pallasite.training.data import stdlib_texts

        texts = stdlib_texts(split="train")
    else:
        texts = load_texts(text)
    # a stream several times the windows' size, so the random windows are distinct text
    stream, _ = token_streams(tokenizer, texts, max(4 * n * length, 200_000), max_eval_tokens=0)
    if len(stream) < length + 1:
        raise InputError(f"quantize: the calibration text has {len(stream)} tokens, fewer than one window of "
                         f"{length}; pass more text (--text) or a shorter --calib-len")
    starts = np.random.default_rng(seed).integers(0, len(stream) - length, n)
    return np.stack([stream[s:s + length] for s in starts])


def quantize(model, method: str, output: str, *, calib_tokens=None, calib=None, weight_quantizer: str = "rtn",
             w_bits: int = 4, a_bits: int = 4, kv_bits: int = 4, impl: str = "ref", checkpoint: Optional[str] = None,
             log: Callable[[str], None] = print):
    """Quantize a ``pallasite.Model`` with ``method`` and write it to ``output``; returns the saved
    model (a ``pallasite.Model`` loaded from ``output``). ``calib``: a ``CalibConfig``;
    ``calib_tokens`` int [windows, length] (FlatQuant, SmoothQuant and GPTQ need them)."""
    return _quantize(model, method, output, calib_tokens=calib_tokens, calib=calib, weight_quantizer=weight_quantizer,
                     w_bits=w_bits, a_bits=a_bits, kv_bits=kv_bits, impl=impl, checkpoint=checkpoint, log=log)[0]


def _quantize(model, method, output, *, calib_tokens, calib, weight_quantizer, w_bits, a_bits, kv_bits, impl,
              checkpoint, log):
    """(saved model, FlatQuant's per-layer calibration history or None)."""
    from flax import nnx

    from pallasite.training.flatquant import CalibConfig
    from pallasite.training.quant_baselines import quantize_model

    if method not in QUANT_METHODS:
        raise InputError(f"quantize: method={method!r}; expected one of {', '.join(QUANT_METHODS)}")
    qm = quantize_model(model.config, nnx.to_pure_dict(model.state), method, calib_tokens=calib_tokens,
                        ccfg=calib or CalibConfig(), w_bits=w_bits, a_bits=a_bits, kv_bits=kv_bits, impl=impl,
                        log=log, checkpoint=checkpoint, weight_quantizer=weight_quantizer)
    return qm.save(output, tokenizer=model.tokenizer), qm.history


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="W4A4KV4 post-training quantization (FlatQuant and baselines)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF folder, .gguf file, pallasite folder or training workdir")
    p.add_argument("--output", required=True, help="folder to write the quantized pallasite model to")
    p.add_argument("--method", default=None, choices=QUANT_METHODS, help="default: the config's (flatquant)")
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help="quantization settings, a configs/quant file or module with :arg "
                        f"(default {DEFAULT_CONFIG}, the paper's; ':quick' for minutes on a CPU)")
    p.add_argument("--text", default=None,
                   help="calibration text: FILE, DIR of .txt files, or 'stdlib' (the Python sources, always "
                        "offline); default: the config's (python3.11-doc prose)")
    for flag, kind, what in (("--calib-windows", int, "calibration windows"), ("--calib-len", int, "tokens per window"),
                             ("--epochs", int, "FlatQuant epochs per layer"), ("--batch", int, "calibration batch")):
        p.add_argument(flag, type=kind, default=None, help=f"{what} (default: the config's)")
    p.add_argument("--weight-quantizer", default="rtn", choices=("rtn", "gptq"))
    p.add_argument("--w-bits", type=int, default=None, choices=(4, 16))
    p.add_argument("--a-bits", type=int, default=None, choices=(4, 16))
    p.add_argument("--kv-bits", type=int, default=None, choices=(4, 16))
    p.add_argument("--impl", default=None, choices=("ref", "pallas"), help="kernels the saved model runs")
    p.add_argument("--checkpoint", default=None, help="FlatQuant: folder for per-layer results (resumable)")
    p.set_defaults(fn=run)


def run(args, overrides=None) -> dict:
    import pallasite
    from pallasite.training.config import load_config
    from pallasite.training.flatquant import CalibConfig

    c = load_config(args.config)
    method = args.method or c.method
    calib_fields = {f: c.calib[f] for f in ("nsamples", "seq_len", "batch", "epochs", "lr", "clip_lr_mult",
                                            "weight_decay", "diag_alpha", "seed")}
    for field, flag in (("nsamples", "calib_windows"), ("seq_len", "calib_len"), ("epochs", "epochs"),
                        ("batch", "batch")):
        value = getattr(args, flag)
        if value is not None:
            if value < 1:
                raise InputError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
            calib_fields[field] = value
    ccfg = CalibConfig(**calib_fields)
    bits = {k: getattr(args, k) if getattr(args, k) is not None else c[k] for k in ("w_bits", "a_bits", "kv_bits")}
    t0 = time.time()
    model = pallasite.load(args.model)
    if model.tokenizer is None:
        raise InputError(f"{args.model!r} has no tokenizer (calibration text must be tokenized)")
    needs_data = method in ("smoothquant", "flatquant") or args.weight_quantizer == "gptq"
    calib_tokens = None
    if needs_data:
        text = args.text if args.text is not None else (c.text or None)
        calib_tokens = calibration_windows(model.tokenizer, text, ccfg.nsamples, ccfg.seq_len, ccfg.seed)
    _, history = _quantize(model, method, args.output, calib_tokens=calib_tokens, calib=ccfg,
                           weight_quantizer=args.weight_quantizer, impl=args.impl or c.impl,
                           checkpoint=args.checkpoint, log=lambda s: print(s, flush=True), **bits)
    summary = {"output": args.output, "method": method, "weight_quantizer": args.weight_quantizer, **bits,
               "calibration": (None if calib_tokens is None else
                               {"windows": int(calib_tokens.shape[0]), "tokens_per_window": int(calib_tokens.shape[1]),
                                "epochs": ccfg.epochs if method == "flatquant" else None}),
               "layer_mse_first_last": None if not history else [[round(h[0], 6), round(h[-1], 6)] for h in history],
               "seconds": round(time.time() - t0, 1)}
    print(json.dumps(summary))
    return summary
