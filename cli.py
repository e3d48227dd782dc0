"""The ``pallasite`` console script (big_vision style).

    pallasite train    --config configs/quickstart.py[:arg] --workdir DIR [--config.train.steps=200 ...]
    pallasite generate --model PATH --prompt "text" [--max-new-tokens 64 --temperature 0.7 --top-p 0.9]
                       [--kv-cache catekv --catekv.head_mask MASK.json --catekv.r 0.4]
    pallasite eval     --model PATH [--data stdlib|FILE.txt|FILE.jsonl] [--seq-len 512] [--max-windows 64]
    pallasite convert  --input PATH --output DIR --to hf|orbax      (HF ⇄ orbax, GGUF → HF/orbax)
    pallasite lut      --model PATH --output FILE.lut [--quant nf4 --block 768]   (MoLE: experts → LUT file)
    pallasite compile  --config configs/llama3_8b.py --topology v5p:4x4x4 [--step decode]   (AOT memory check)

``generate`` and ``eval`` take ``--mole-lut host|device|FILE.lut`` for MoLE models: the experts
are replaced by their lookup table, in host memory (rows gathered in the compiled graph), in
device memory, or read from a LUT file (memory-mapped; built first if missing).
PATH may be an HF folder, a .gguf file, a pallasite orbax folder or a ``pallasite train`` workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def _split_config_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Separate ``--config.a.b=v`` (or ``--config.a.b v``) overrides from ordinary flags."""
    rest, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config."):
            key = arg[len("--config."):]
            if "=" not in key:
                if i + 1 >= len(argv):
                    raise SystemExit(f"pallasite: override {arg} needs a value (--config.key=value)")
                key = f"{key}={argv[i + 1]}"
                i += 1
            overrides.append(key)
        else:
            rest.append(arg)
        i += 1
    return rest, overrides


def _split_kind_options(argv: list[str], kinds) -> tuple[list[str], dict]:
    """Separate ``--KIND.FIELD=v`` (or ``--KIND.FIELD v``) options of registered kinds: {kind: {field: v}}."""
    rest, options = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        head = arg[2:].split(".", 1)[0] if arg.startswith("--") and "." in arg else None
        if head in kinds:
            key = arg[2 + len(head) + 1:]
            if "=" in key:
                key, value = key.split("=", 1)
            elif i + 1 < len(argv):
                value = argv[i + 1]
                i += 1
            else:
                raise SystemExit(f"pallasite: option {arg} needs a value (--{head}.field=value)")
            options.setdefault(head, {})[key.replace("-", "_")] = _literal(value)
        else:
            rest.append(arg)
        i += 1
    return rest, options


def _literal(text: str):
    """A command-line value as a Python literal where it is one (0.4, 128, None, true), else the string."""
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

    model = _load_for_inference(args)
    if model.tokenizer is None:
        raise SystemExit(f"pallasite generate: {args.model!r} has no tokenizer; cannot take a text prompt")
    prompt = args.prompt
    if args.chat:
        prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                     add_generation_prompt=True)
    print(args.prompt, end="", flush=True)
    generated: list[int] = []
    shown = [""]

    def stream(new_tokens):
        # Decode the whole completion each step and print the new suffix: token-by-token
        # decoding would split multi-byte characters.
        generated.extend(int(t) for t in new_tokens[0])
        text = model.decode(generated)
        print(text[len(shown[0]):], end="", flush=True)
        shown[0] = text

    options = args.kind_options
    unused = sorted(set(options) - {args.kv_cache})
    if unused:
        raise SystemExit(f"pallasite generate: options for kv cache kind(s) {unused} given, but --kv-cache is "
                         f"{args.kv_cache!r}")
    cache = {} if args.kv_cache is None else dict(kv_cache=args.kv_cache, kv_cache_config=options.get(args.kv_cache))
    pallasite.generate(model, [prompt], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, stream=stream, **cache)
    print()


def _cmd_eval(args, overrides):
    import numpy as np

    from pallasite.eval.perplexity import perplexity

    model = _load_for_inference(args)
    if model.tokenizer is None:
        raise SystemExit(f"pallasite eval: {args.model!r} has no tokenizer")
    if args.data == "stdlib":
        from pallasite.training.data import stdlib_texts

        texts = stdlib_texts(split="eval")
    elif args.data.endswith(".jsonl"):
        with open(args.data) as f:
            texts = [json.loads(line)[args.field] for line in f if line.strip()]
    else:
        with open(args.data) as f:
            texts = [f.read()]
    ids = []
    for t in texts:
        ids.extend(model.encode(t))
        if len(ids) >= args.seq_len * args.max_windows:
            break
    result = perplexity(model.logits, np.asarray(ids), args.seq_len, max_windows=args.max_windows)
    print(json.dumps({"model": args.model, "data": args.data, **result}))


def _cmd_convert(args, overrides):
    import pallasite

    model = pallasite.load(args.input, dtype=args.dtype)
    model.save(args.output, format=args.to)
    print(f"wrote {args.to} model to {args.output}")


def _cmd_lut(args, overrides):
    import pallasite
    from flax import nnx

    from pallasite.models import mole_lut as ML

    model = pallasite.load(args.model, dtype=args.dtype)
    if model.config.ffn != "mole":
        raise SystemExit(f"pallasite lut: {args.model!r} is not a MoLE model (ffn={model.config.ffn!r})")
    store = ML.HostLUT.from_model(nnx.merge(model.graphdef, model.state), quant=args.quant, block=args.block)
    ML.save_lut(args.output, store)
    print(json.dumps({"output": args.output, "bytes": os.path.getsize(args.output), "quant": args.quant,
                      "bytes_per_token": store.bytes_per_token, "shape": [store.meta.vocab_size, *store.meta.row_shape]}))


def main(argv=None):
    from pallasite.registry import KV_CACHE

    argv = list(sys.argv[1:] if argv is None else argv)
    argv, overrides = _split_config_overrides(argv)
    if argv[:1] == ["compile"]:  # its own parser (training/compile_check.py); exit status = fits
        from pallasite.training import compile_check

        raise SystemExit(compile_check.main(argv[1:], overrides))
    argv, kind_options = _split_kind_options(argv, KV_CACHE.names())
    parser = argparse.ArgumentParser(prog="pallasite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train from a config file")
    p.add_argument("--config", required=True, help="config file with get_config(arg); 'file.py:arg' passes arg")
    p.add_argument("--workdir", required=True)
    p.add_argument("--checkpoint-dir", default=None, help="orbax checkpoints (default WORKDIR/checkpoints; gs:// ok)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="multi-process run: process 0's address (Cloud TPU slices need none: auto-detected)")
    p.add_argument("--num-processes", type=int, default=None)
    p.add_argument("--process-id", type=int, default=None)
    p.set_defaults(fn=_cmd_train)
    sub.add_parser("compile", help="AOT-compile the train/decode step for a TPU topology: per-chip memory, fits")

    for name, fn, help_ in (("generate", _cmd_generate, "generate text"), ("eval", _cmd_eval, "perplexity"),
                            ("convert", _cmd_convert, "convert between formats"),
                            ("lut", _cmd_lut, "MoLE: re-parameterise the experts into a LUT file")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--dtype", default=None, help="load weights as this dtype (e.g. bfloat16)")
        if name == "convert":
            p.add_argument("--input", required=True)
            p.add_argument("--output", required=True)
            p.add_argument("--to", choices=("hf", "orbax"), required=True)
        else:
            p.add_argument("--model", required=True,
                           help="HF folder, .gguf file, pallasite orbax folder or training workdir")
        if name == "lut":
            p.add_argument("--output", required=True, help="the LUT file to write")
        if name in ("generate", "eval"):
            p.add_argument("--mole-lut", default=None, metavar="host|device|FILE.lut",
                           help="MoLE models: serve the experts as a LUT in host memory, device memory or a file")
        if name in ("generate", "eval", "lut"):
            flag = "--quant" if name == "lut" else "--lut-quant"
            p.add_argument(flag, default="none", choices=("none", "nf4", "nf3"),
                           help="NormalFloat LUT quantization with token-wise blocks (paper §4.4)")
            p.add_argument("--block" if name == "lut" else "--lut-block", type=int, default=768,
                           help="values per quantization block (paper: 768 for NF4, 128 for NF3)")
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
            p.add_argument("--max-new-tokens", type=int, default=64)
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--top-k", type=int, default=None)
            p.add_argument("--top-p", type=float, default=None)
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--kv-cache", default=None, metavar="|".join(KV_CACHE.names()),
                           help="KV cache kind (default: the model's); its options as --KIND.FIELD VALUE")
        if name == "eval":
            p.add_argument("--data", default="stdlib", help="stdlib | FILE.txt | FILE.jsonl")
            p.add_argument("--field", default="text", help="jsonl field holding the text")
            p.add_argument("--seq-len", type=int, default=512)
            p.add_argument("--max-windows", type=int, default=64)
        p.set_defaults(fn=fn)

    args = parser.parse_args(argv)
    args.kind_options = kind_options
    if overrides and args.command != "train":
        parser.error(f"--config.* overrides only apply to 'train', got {overrides}")
    if kind_options and args.command != "generate":
        parser.error(f"--KIND.FIELD options only apply to 'generate', got {sorted(kind_options)}")
    if getattr(args, "kv_cache", None) is not None and args.kv_cache not in KV_CACHE:
        parser.error(f"--kv-cache {args.kv_cache!r}; known kinds: {', '.join(KV_CACHE.names())}")
    args.fn(args, overrides)


if __name__ == "__main__":
    main()
