"""The ``pallasite`` console script (big_vision style).

    pallasite train    --config configs/quickstart.py[:arg] --workdir DIR [--config.a.b=v ...]
    pallasite generate --model PATH --prompt "text" [--max-new-tokens 64 --temperature 0.7]
                       [--top-p 0.9]
                       [--chat] [--kv-cache catekv --catekv.head_mask MASK.json --catekv.r 0.4]
                       [--drafter PATH --method auto|sd|slem|tli --num-draft-tokens 5]  (speculative)
                       [--prompt-lookup --num-draft-tokens 3]   (drafts copied from the text, no drafter)
                       [--cpu-panels]   (f32 / bf16 linears through the few-row XLA:CPU kernel, ops.panels)
    pallasite eval     --model PATH [--data heldout|stdlib|FILE.txt|FILE.jsonl] [--seq-len N]
                       [--max-windows 64]
    pallasite eval     --facttest --model PATH [--alpha 0.05 0.1 --delta 0.05 ...]   (eval/facttest/cli.py)
    pallasite convert  --input PATH --output DIR --to hf|orbax      (HF ⇄ orbax, GGUF → HF/orbax)
    pallasite lut      --model PATH --output FILE.lut [--quant nf4 --block 768]   (MoLE)
    pallasite quantize --model PATH --output DIR --method flatquant|hadamard|rtn|smoothquant  (W4A4KV4)
    pallasite catekv-calibrate --model PATH [--r 0.4]   (CateKV head mask next to the model)
    pallasite occult-place --model MOE --output DIR --devices 8   (Occult expert placement)
    pallasite compile  --config configs/llama3_8b.py --topology v5p:4x4x4 [--step decode]   (AOT memory)

``generate`` and ``eval`` take ``--mole-lut host|device|FILE.lut`` for MoLE models: the experts
are replaced by their lookup table, in host memory (rows gathered in the compiled graph), in
device memory, or read from a LUT file (memory-mapped; built first if missing).
PATH may be an HF folder, a .gguf file, a pallasite orbax folder or a ``pallasite train`` workdir.
A wrong input (config key, path, prompt, option) prints one line naming it and exits 1; Ctrl-C
exits 130 (training first saves a checkpoint). ``--debug`` or ``PALLASITE_DEBUG=1`` shows the
traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from pallasite.errors import InputError, describe, is_user_error

DEBUG_ENV = "PALLASITE_DEBUG"
EXIT_USER_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, the shell's convention

TRAIN_EPILOG = """\
config overrides (any number, after the flags):
  --config.a.b=VALUE    set field a.b of the experiment config, parsed by the type of its default
                        (e.g. --config.train.steps=500 --config.optim.lr=1e-3
                        --config.data.paths='("a.txt","b.txt")'); an unknown key or a value of the
                        wrong type fails naming the key
  --config FILE.py:ARG  passes ARG to the file's get_config(ARG): a preset word (e.g.
                        configs/quickstart.py:cpu, a 10-step smoke run) or key=value pairs
                        (e.g. configs/experts/quality.py:kind=mole4,scale=cpu)

Re-running the same command resumes from the workdir's latest checkpoint; Ctrl-C saves one first.
"""


def _split_config_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--config.a.b=v`` (or ``--config.a.b v``) overrides from ordinary flags."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            key = arg[len("--config.") :]
            if "=" not in key:
                if i + 1 >= len(argv):
                    raise InputError(f"override {arg} needs a value (--config.key=value)")
                key = f"{key}={argv[i + 1]}"
                i += 1
            overrides.append(key)
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _split_kind_options(argv: list[str], kinds) -> tuple[list[str], dict]:
    """Separate ``--KIND.FIELD=v`` (or ``--KIND.FIELD v``) options of registered kinds:
    {kind: {field: v}}."""
    rest, options = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        head = arg[2:].split(".", 1)[0] if arg.startswith("--") and "." in arg else None
        if head in kinds:
            key = arg[2 + len(head) + 1 :]
            if "=" in key:
                key, value = key.split("=", 1)
            elif i + 1 < len(argv):
                value = argv[i + 1]
                i += 1
            else:
                raise InputError(f"option {arg} needs a value (--{head}.field=value)")
            options.setdefault(head, {})[key.replace("-", "_")] = _literal(value)
        else:
            rest.append(arg)
        i += 1
    return rest, options


def _literal(text: str):
    """A command-line value as a Python literal where it is one (0.4, 128, None, true), else the
    string."""
    import ast

    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _cmd_train(args, overrides):
    from pallasite.training import distributed
    from pallasite.training.config import load_config
    from pallasite.training.loop import train

    # before any jax backend use: joins a multi-process run (flags, JAX_* env or the TPU slice)
    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    config = load_config(args.config, overrides=overrides)
    result = train(config, args.workdir, checkpoint_dir=args.checkpoint_dir)
    if distributed.is_main():
        print(json.dumps({k: v for k, v in (result or {}).items() if isinstance(v, (int, float, str))}))


def _load_for_inference(args):
    """``pallasite.load`` plus, for MoLE models, the ``--mole-lut`` serving choice."""
    import pallasite

    model = pallasite.load(args.model, dtype=args.dtype)
    lut = getattr(args, "mole_lut", None)
    if lut:
        quant = getattr(args, "lut_quant", "none")
        if lut in ("host", "device"):
            model = pallasite.serve_lut(model, lut, quant=quant, block=args.lut_block)
        else:
            model = pallasite.serve_lut(model, "disk", path=lut, quant=quant, block=args.lut_block)
    return model


def _cmd_generate(args, overrides):
    import pallasite

    if not args.prompt.strip():
        raise InputError("--prompt is empty; give the text to complete (or to answer, with --chat)")
    model = _load_for_inference(args)
    if model.tokenizer is None:
        raise InputError(f"{args.model!r} has no tokenizer; cannot take a text prompt")
    if args.cpu_panels:  # the few-row XLA:CPU kernel (ops.panels), for the drafter too
        from pallasite.models.panel_linear import with_panels as as_run
    else:
        as_run = lambda m: m  # noqa: E731
    model = as_run(model)
    prompt = args.prompt
    if args.chat:
        if not getattr(model.tokenizer, "chat_template", None):
            raise InputError(
                f"--chat: the tokenizer of {args.model!r} has no chat template; drop --chat"
            )
        prompt = model.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        print(
            args.prompt, end="\n\n", flush=True
        )  # the answer goes below the question, not glued to it
    else:
        print(args.prompt, end="", flush=True)  # a completion continues the prompt's text
    generated: list[int] = []
    shown = [""]
    t_first = []

    def stream(new_tokens):
        # Decode the whole completion each step and print the new suffix: token-by-token
        # decoding would split multi-byte characters.
        if not t_first:
            t_first.append(time.perf_counter())
        generated.extend(int(t) for t in new_tokens[0])
        text = model.decode(generated)
        print(text[len(shown[0]) :], end="", flush=True)
        shown[0] = text

    options = args.kind_options
    unused = sorted(set(options) - {args.kv_cache})
    if unused:
        raise InputError(
            f"options for kv cache kind(s) {unused} given, but --kv-cache is {args.kv_cache!r}"
        )
    cache = (
        {}
        if args.kv_cache is None
        else dict(kv_cache=args.kv_cache, kv_cache_config=options.get(args.kv_cache))
    )
    if args.prompt_lookup and args.drafter:
        raise InputError("--prompt-lookup copies its drafts from the text itself; it takes no --drafter "
                         f"(got --drafter {args.drafter})")
    if args.prompt_lookup:  # prompt lookup decoding (docs/speculative.md)
        k = 3 if args.num_draft_tokens is None else args.num_draft_tokens
        cache.update(strategy="lookup", strategy_config={"num_draft_tokens": k})
    if args.drafter:  # speculative decoding (docs/speculative.md)
        cache.update(drafter=as_run(pallasite.load(args.drafter, dtype=args.dtype)), method=args.method,
                     strategy_config={"num_draft_tokens": 5 if args.num_draft_tokens is None else args.num_draft_tokens,
                                      "confidence_threshold": args.draft_confidence,
                                      "confidence_of": args.draft_confidence_of})
    from pallasite.inference.constrained.sugar import cli_options  # --grammar/--json-schema/--regex

    constraint = cli_options(args)
    t0 = time.perf_counter()
    pallasite.generate(
        model,
        [prompt],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stream=stream,
        **cache,
        **constraint,
    )
    t_end = time.perf_counter()
    print()
    n = len(generated)
    rate = (
        f"{(n - 1) / (t_end - t_first[0]):.1f} tokens/s after the first"
        if n > 1 and t_end > t_first[0]
        else ""
    )
    print(
        f"[generate] {n} tokens in {t_end - t0:.2f} s; {rate}{'; ' if rate else ''}"
        f"first token after "
        f"{t_first[0] - t0:.2f} s (compilation + prompt)",
        file=sys.stderr,
    )


def _workdir_config(path: str):
    """The experiment config of a ``pallasite train`` workdir, or None for any other model path."""
    from pallasite.api import _is_training_workdir

    if not os.path.isdir(path) or not _is_training_workdir(path):
        return None
    import ml_collections

    with open(os.path.join(path, "config.json")) as f:
        return ml_collections.ConfigDict(json.load(f))


def _eval_texts(args, model, run_config) -> tuple[list[str], str]:
    """(documents, which split/files they are) for --data stdlib | FILE.txt | FILE.jsonl."""
    from pallasite.training import data as data_lib

    if args.data == "stdlib":
        percent = run_config.data.heldout_percent if run_config is not None else 5
        texts = data_lib.stdlib_texts(split="eval", heldout_percent=percent)
        return texts, (
            f"the stdlib held-out split ({percent}% of files by crc32 of the path: "
            f"{len(texts)} files, "
            f"no byte budget)"
        )
    if args.data.endswith((".jsonl", ".jsonl.gz")):
        docs = data_lib.jsonl_documents([args.data], args.field)
        return [d.text for d in docs], f"{args.data} ({len(docs)} records, field {args.field!r})"
    docs = data_lib.text_documents([args.data])
    return [d.text for d in docs], f"{args.data} ({len(docs)} file{'s' if len(docs) != 1 else ''})"


def _cmd_eval(args, overrides):
    if args.facttest:  # FactTest (eval/facttest/cli.py)
        from pallasite.eval.facttest import cli as facttest_cli

        return facttest_cli.run(args)
    import numpy as np

    from pallasite.eval.perplexity import packed_nll, perplexity
    from pallasite.training import data as data_lib

    run_config = _workdir_config(args.model)
    data = args.data or ("heldout" if run_config is not None else "stdlib")
    model = _load_for_inference(args)
    if model.tokenizer is None:
        raise InputError(f"{args.model!r} has no tokenizer; eval needs one to read text")
    if data in ("heldout", "run"):
        if run_config is None:
            raise InputError(
                f"--data {data} scores a training run's own held-out set: --model must be a "
                f"`pallasite train` workdir, got {args.model!r}"
            )
        if args.seq_len is not None or args.max_windows is not None:
            raise InputError(
                f"--data {data} uses the run's windows (data.seq_len={run_config.data.seq_len}, "
                f"data.eval_batches={run_config.data.eval_batches}); drop --seq-len / --max-windows"
            )
        _, eval_docs = data_lib.load_documents(run_config.data)
        batches = data_lib.heldout_batches(run_config.data, model.tokenizer, eval_docs)
        where = data_lib.describe_heldout(run_config.data, eval_docs, batches)
        protocol = "packed documents, as the training run's eval"
        result = packed_nll(model.logits, batches)
        seq_len = int(run_config.data.seq_len)
    else:
        args.data = data
        texts, where = _eval_texts(args, model, run_config)
        if args.seq_len is not None:
            seq_len = args.seq_len
        elif run_config is not None:
            seq_len = int(run_config.data.seq_len)  # the context length the model was trained at
        else:
            seq_len = min(512, model.config.max_seq_len)
        if not 2 <= seq_len <= model.config.max_seq_len:
            raise InputError(
                f"--seq-len {seq_len}: expected 2 .. the model's context "
                f"max_seq_len={model.config.max_seq_len}"
            )
        max_windows = 64 if args.max_windows is None else args.max_windows
        eos = model.tokenizer.eos_token_id
        ids: list[int] = []
        for t in texts:
            ids.extend(model.encode(t, bos=False) + ([int(eos)] if eos is not None else []))
            if len(ids) >= seq_len * max_windows:
                break
        bos = model.bos_prefix[0] if model.bos_prefix else None  # Gemma: every window starts at BOS
        result = perplexity(model.logits, np.asarray(ids), seq_len, max_windows=max_windows, bos_id=bos)
        protocol = (
            "non-overlapping windows over the documents joined with eos, every next token scored"
            + ("; each window led by the tokenizer's bos" if bos is not None else "")
        )
        where += (
            f"; the first {result['windows']} windows of {seq_len} tokens (files in path order; "
            f"`--data heldout` on a training workdir scores exactly the run's own eval set)"
        )
    print(f"[eval] data: {where}; protocol: {protocol}", file=sys.stderr)
    print(
        json.dumps(
            {"model": args.model, "data": data, "split": where, "seq_len": seq_len, **result}
        )
    )


def _cmd_convert(args, overrides):
    import pallasite

    model = pallasite.load(args.input, dtype=args.dtype)
    model.save(args.output, format=args.to)
    print(f"wrote {args.to} model to {args.output}")


def _cmd_lut(args, overrides):
    from flax import nnx

    import pallasite
    from pallasite.models import mole_lut as ML

    model = pallasite.load(args.model, dtype=args.dtype)
    if model.config.ffn != "mole":
        raise InputError(f"{args.model!r} is not a MoLE model (ffn={model.config.ffn!r})")
    store = ML.HostLUT.from_model(
        nnx.merge(model.graphdef, model.state), quant=args.quant, block=args.block
    )
    ML.save_lut(args.output, store)
    print(
        json.dumps(
            {
                "output": args.output,
                "bytes": os.path.getsize(args.output),
                "quant": args.quant,
                "bytes_per_token": store.bytes_per_token,
                "shape": [store.meta.vocab_size, *store.meta.row_shape],
            }
        )
    )


def _parser(kv_kinds) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pallasite", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--debug", action="store_true", help=f"show tracebacks (also {DEBUG_ENV}=1)"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train from a config file",
        epilog=TRAIN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="pallasite train --config FILE.py[:ARG] --workdir DIR [--config.a.b=VALUE ...]",
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="FILE.py[:ARG]",
        help="experiment file defining get_config(arg); 'FILE.py:ARG' passes ARG (see below)",
    )
    p.add_argument(
        "--workdir",
        required=True,
        help="where checkpoints, metrics and the model go (resumed if present)",
    )
    p.add_argument("--checkpoint-dir", default=None, help="orbax checkpoints (default WORKDIR/checkpoints; gs:// ok)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process run: process 0's address (Cloud TPU slices need none: auto-detected)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.set_defaults(fn=_cmd_train)
    sub.add_parser("compile", help="AOT-compile the train/decode step for a TPU topology: per-chip memory, fits")

    for name, fn, help_ in (
        ("generate", _cmd_generate, "generate text"),
        ("eval", _cmd_eval, "perplexity"),
        ("convert", _cmd_convert, "convert between formats"),
        ("lut", _cmd_lut, "MoLE: re-parameterise the experts into a LUT file"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--dtype", default=None, help="load weights as this dtype (e.g. bfloat16)")
        if name == "convert":
            p.add_argument("--input", required=True)
            p.add_argument("--output", required=True)
            p.add_argument("--to", choices=("hf", "orbax"), required=True)
        else:
            p.add_argument(
                "--model",
                required=True,
                help="HF folder, .gguf file, pallasite orbax folder or training workdir",
            )
        if name == "lut":
            p.add_argument("--output", required=True, help="the LUT file to write")
        if name in ("generate", "eval"):
            p.add_argument(
                "--mole-lut",
                default=None,
                metavar="host|device|FILE.lut",
                help="MoLE models: serve the experts as a LUT in host memory, device memory or "
                "a file",
            )
        if name in ("generate", "eval", "lut"):
            flag = "--quant" if name == "lut" else "--lut-quant"
            p.add_argument(
                flag,
                default="none",
                choices=("none", "nf4", "nf3"),
                help="NormalFloat LUT quantization with token-wise blocks (paper §4.4)",
            )
            p.add_argument(
                "--block" if name == "lut" else "--lut-block",
                type=int,
                default=768,
                help="values per quantization block (paper: 768 for NF4, 128 for NF3)",
            )
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument(
                "--chat",
                action="store_true",
                help="wrap the prompt in the tokenizer's chat template; the answer is printed "
                "below it",
            )
            p.add_argument("--max-new-tokens", type=int, default=64)
            p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
            p.add_argument("--top-k", type=int, default=None)
            p.add_argument("--top-p", type=float, default=None)
            p.add_argument("--seed", type=int, default=0)
            p.add_argument(
                "--kv-cache",
                default=None,
                metavar="|".join(kv_kinds),
                help="KV cache kind (default: the model's); its options as --KIND.FIELD VALUE",
            )
            p.add_argument("--drafter", default=None,
                           help="speculative decoding: the drafter model (any tokenizer)")
            p.add_argument("--method", default="auto", choices=("auto", "sd", "slem", "tli", "slrs"))
            p.add_argument("--num-draft-tokens", type=int, default=None,
                           help="speculative: draft tokens per round (default 5; --prompt-lookup: 3)")
            p.add_argument("--prompt-lookup", action="store_true",
                           help="prompt lookup decoding: drafts copied from the prompt and the text so far, "
                                "no drafter model (lossless)")
            p.add_argument("--cpu-panels", action="store_true",
                           help="run the float32 / bfloat16 linears through ops.panels, a few-row XLA:CPU kernel "
                                "(faster decoding and speculative verifies on CPU; same numbers up to rounding)")
            p.add_argument("--draft-confidence", type=float, default=None, metavar="TAU",
                           help="speculative (sd/tli/slem): draft only while the drafter's top probability "
                                "is >= TAU, and verify only what was drafted (faster where a wide verify is dear)")
            p.add_argument("--draft-confidence-of", default="step", choices=("step", "prefix"),
                           help="--draft-confidence applies to each draft's top probability (step) or to their "
                                "product over the round (prefix)")
            from pallasite.inference.constrained.sugar import add_cli_arguments

            add_cli_arguments(p)  # --grammar FILE, --json-schema FILE, --regex PATTERN
        if name == "eval":
            p.add_argument(
                "--data",
                default=None,
                metavar="heldout|stdlib|FILE.txt|FILE.jsonl",
                help="heldout: a training workdir's own eval set, as its training run scored it "
                "(the default for a workdir); stdlib: the stdlib held-out files (the default "
                "otherwise); or text / jsonl files",
            )
            p.add_argument("--field", default="text", help="jsonl field holding the text")
            p.add_argument(
                "--seq-len",
                type=int,
                default=None,
                help="window length (default: a workdir's training seq_len, else 512)",
            )
            p.add_argument(
                "--max-windows",
                type=int,
                default=None,
                help="at most this many windows (default 64)",
            )
            from pallasite.eval.facttest import cli as facttest_cli

            facttest_cli.add_arguments(p)
        p.set_defaults(fn=fn)

    from pallasite.inference.cache import catekv_calibrate
    from pallasite.models import occult_place
    from pallasite.training import quantize as quantize_cmd
    quantize_cmd.add_parser(sub)
    catekv_calibrate.add_parser(sub)
    occult_place.add_parser(sub)
    return parser


def _run(argv: list[str]) -> None:
    from pallasite.registry import KV_CACHE

    argv, overrides = _split_config_overrides(argv)
    if argv[:1] == ["compile"]:  # its own parser (training/compile_check.py); exit status = fits
        from pallasite.training import compile_check

        raise SystemExit(compile_check.main(argv[1:], overrides))
    argv, kind_options = _split_kind_options(argv, KV_CACHE.names())
    parser = _parser(KV_CACHE.names())
    args = parser.parse_args(argv)
    args.kind_options = kind_options
    if overrides and args.command != "train":
        parser.error(f"--config.* overrides only apply to 'train', got {overrides}")
    if kind_options and args.command != "generate":
        parser.error(f"--KIND.FIELD options only apply to 'generate', got {sorted(kind_options)}")
    if getattr(args, "kv_cache", None) is not None:
        KV_CACHE.check(args.kv_cache, field="--kv-cache")  # UnknownKindError names the known kinds
    args.fn(args, overrides)


def main(argv=None) -> None:
    """Entry point: runs one command; a user error is one line on stderr and exit status 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "").lower() not in (
        "",
        "0",
        "false",
        "no",
    )
    argv = [a for a in argv if a != "--debug"]
    command = next((a for a in argv if not a.startswith("-")), "")
    prefix = f"pallasite {command}".strip()
    saved = os.environ.get(DEBUG_ENV)
    if debug:  # child processes (pallasite compile's compiler process) inherit it, for this command only
        os.environ[DEBUG_ENV] = "1"
    try:
        _run(argv)
    except KeyboardInterrupt as e:
        if debug:
            raise
        print(f"\n{prefix}: {describe(e) if str(e) else 'interrupted (Ctrl-C)'}", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except Exception as e:  # noqa: BLE001 — only the user-error family is turned into one line
        if debug or not is_user_error(e):
            raise
        print(f"{prefix}: error: {describe(e)}  (--debug shows the traceback)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR) from None
    finally:
        if debug:
            if saved is None:
                os.environ.pop(DEBUG_ENV, None)
            else:
                os.environ[DEBUG_ENV] = saved


if __name__ == "__main__":
    main()
