"""CRANE side by side: the four decoding modes on the GSM-Symbolic-style and FOLIO-style tasks.

    python -m pallasite.benchmarks.crane --quick            # GSM task, trained tiny model, 48 problems
    python -m pallasite.benchmarks.crane                    # + FOLIO task, more problems
    python -m pallasite.benchmarks.crane --smollm2          # SmolLM2-135M-Instruct few-shot (slow on CPU)
    python -m pallasite.benchmarks.crane --json-schema      # tool-call JSON on SmolLM2: valid-output rate
    python -m pallasite.benchmarks.crane --masking          # CRANE: opportunistic vs always-mask (+ overlap)
    python -m pallasite.benchmarks.crane --quick --gsm-kind relations   # the shuffled multi-hop GSM variant
    python -m pallasite.benchmarks.crane --quick --gsm-kind relations_restated   # same, CoT restates the chain
    python -m pallasite.benchmarks.crane --quick --gsm-kind ordinal     # operations tagged First, ... and shuffled
    python -m pallasite.benchmarks.crane --quick --gsm-kind relations_many_names   # restated, 48 names
    python -m pallasite.benchmarks.crane_engines            # llguidance vs XGrammar: compile / mask times

The task models are ``pallasite train`` runs of ``configs/crane/{gsm,folio}.py`` in ``--models``
(trained there first when missing: ~10 min each on 2 cores; the ordinal, relations_restated and
relations_many_names GSM kinds train a wider model on longer rows, ~27 / ~75 / ~47 min). Problems
come from the evaluation seed (never the training seed). Greedy decoding (the paper's T = 0). Accuracy: GSM, the last
``<< ... >>`` span equals the gold expression (z3, floor ``//``; random-substitution fallback);
FOLIO, the label z3 derives from the program equals the gold label. Parse rate: the final answer
span (GSM) / the program (FOLIO) parses. ``mask_ms_per_step``: host milliseconds computing masks
per decode step of the CRANE run (whole batch). ``chain_right_<mode>`` (the restating GSM kinds):
the share of answers whose chain of thought restates the whole chain exactly as the gold one does.
The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np


def _log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- tasks


def gsm_task(kind: str = ""):
    from pallasite.eval.tasks import gsm_symbolic as T
    from pallasite.eval.tasks.traces import GSM_KIND, GSM_NAMES

    kind = kind or GSM_KIND

    def score(text, p):
        ans = T.last_span(text)
        return T.equivalent(ans, p.answer, p.variable_types), T.parses(ans)

    def chain_right(text, p):
        """The chain of thought restates the gold chain's sentences, in order (restating kinds)."""
        n = len(p.steps)  # one restated sentence per person: the root and every hop
        return _sentences(text)[:n] == _sentences(p.cot)[:n]

    return dict(
        name="gsm",
        prompt=T.prompt,
        grammar=lambda p: T.answer_grammar(p.variables),
        start=T.START,
        end=T.END,
        score=score,
        make=lambda n, seed: T.make_problems(n, seed, GSM_NAMES, kind),
        modes=("unconstrained", "constrained", "cot", "crane"),
        chain_right=chain_right if kind in T.RESTATING_KINDS else None,
    )


def _sentences(text: str) -> list:
    """The sentences after the CoT opener, whitespace-stripped."""
    body = text.split("Let's think step by step.", 1)[-1]
    return [s.strip() for s in re.findall(r"[^.]*\.", body)]


def gsm_cot_tokens(kind: str = "") -> int:
    from pallasite.eval.tasks import gsm_symbolic as T
    from pallasite.eval.tasks.traces import GSM_KIND

    return T.COT_TOKENS[kind or GSM_KIND]


def folio_task():
    from pallasite.eval.tasks import folio as F

    def score(text, p):
        k = text.find(F.START.strip())
        program = text[k:] if k >= 0 else ""
        label = F.evaluate(program)
        return label == p.label, label is not None

    return dict(
        name="folio",
        prompt=lambda p, cot: F.prompt(p),
        grammar=lambda p: F.program_grammar(),
        start=F.START,
        end=None,
        score=score,
        make=F.make_problems,
        modes=("constrained", "cot", "crane"),
    )


def ensure_model(task: str, models_dir: str, steps: int = 0, kind: str = "") -> str:
    """The workdir of the task model, trained with configs/crane/<task>.py when missing (``kind``:
    the GSM problem kind, default ``traces.GSM_KIND``; a model of its own in
    ``<models_dir>/gsm_<kind>``, the in-order ``steps`` kind's in ``<models_dir>/gsm``)."""
    if task == "gsm":
        from pallasite.eval.tasks.traces import GSM_KIND

        kind = kind or GSM_KIND
    workdir = os.path.join(models_dir, task + (f"_{kind}" if kind and kind != "steps" else ""))
    if os.path.isdir(os.path.join(workdir, "checkpoints")) and os.listdir(
        os.path.join(workdir, "checkpoints")
    ):
        return workdir
    cfg = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "configs",
        "crane",
        f"{task}.py",
    )
    cfg_args = [a for a in (f"steps={steps}" if steps else "", f"kind={kind}" if kind else "") if a]
    cmd = [
        sys.executable,
        "-m",
        "pallasite.cli",
        "train",
        "--config",
        cfg + (":" + ",".join(cfg_args) if cfg_args else ""),
        "--workdir",
        workdir,
    ]
    _log(f"[crane] training the {task} model: {' '.join(cmd)}")
    t0 = time.time()
    subprocess.run(cmd, check=True)
    _log(f"[crane] trained {task} in {time.time() - t0:.0f}s")
    return workdir


def run_task(
    task: dict,
    model,
    n: int,
    *,
    seed: int,
    max_new_tokens: int,
    batch_size: int,
    opportunistic=True,
    overlap=True,
):
    from pallasite.eval.tasks.traces import EVAL_SEED
    from pallasite.inference.constrained.crane import generate_modes

    problems = task["make"](n, EVAL_SEED + seed)
    res = generate_modes(
        model,
        problems,
        prompt_fn=task["prompt"],
        grammar_fn=task["grammar"],
        start=task["start"],
        end=task["end"],
        modes=task["modes"],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
        opportunistic=opportunistic,
        overlap=overlap,
    )
    rows = {}
    for mode, r in res.items():
        scored = [task["score"](t, p) for t, p in zip(r.texts, problems)]
        rows[mode] = dict(
            acc=float(np.mean([c for c, _ in scored])),
            parse=float(np.mean([ok for _, ok in scored])),
            seconds=r.seconds,
            steps=r.steps,
            stats=r.stats,
            errors=r.row_errors,
            example=r.texts[0],
            texts=r.texts,
        )
        if task.get("chain_right") and mode in ("cot", "crane"):
            rows[mode]["chain_right"] = float(
                np.mean([task["chain_right"](t, p) for t, p in zip(r.texts, problems)])
            )
    return rows


def print_table(name, rows):
    print(
        f"\n{name}: mode | accuracy | parse rate | wall s | host mask ms/step | invalid proposals"
    )
    for mode, r in rows.items():
        st = r["stats"] or {}
        print(
            f"  {mode:13s} | {r['acc']:.3f} | {r['parse']:.3f} | {r['seconds']:.1f} | "
            f"{st.get('mask_ms_per_step', 0):.3f} | {st.get('invalid_proposals', '-')}"
            + (f" | chain restated right {r['chain_right']:.3f}" if "chain_right" in r else "")
        )


# ----------------------------------------------------------------------------- SmolLM2 few-shot


def smollm2_gsm(n: int, shots: int, max_new_tokens: int, batch_size: int):
    """SmolLM2-135M-Instruct, ``shots``-shot prompts built from training-seed problems (direct
    answers for the two no-CoT modes, CoT traces for the others); completions are cut at the next
    "Question:" (a stop string) before the last span is scored."""
    import pallasite
    from pallasite.eval.tasks import gsm_symbolic as T
    from pallasite.eval.tasks.traces import TRAIN_SEED
    from pallasite.models import gguf

    model = pallasite.load(gguf.smollm2_gguf_path())
    demos = T.make_problems(shots, TRAIN_SEED + 7)
    task = gsm_task()
    base_prompt = task["prompt"]

    def prompt(p, cot):
        shots_text = "\n\n".join(T.training_text(d, cot) for d in demos)
        return f"{shots_text}\n\n{base_prompt(p, cot)}"

    def score(text, p):
        return gsm_task()["score"](text.split("\nQuestion:")[0], p)

    task = dict(task, prompt=prompt, score=score)
    return run_task(task, model, n, seed=0, max_new_tokens=max_new_tokens, batch_size=batch_size)


# ----------------------------------------------------------------------------- JSON schema on SmolLM2

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "get_time"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
CITIES = ("Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Seoul")


def _valid_tool_call(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    if (
        not isinstance(obj, dict)
        or set(obj) != {"name", "arguments"}
        or obj["name"] not in ("get_weather", "get_time")
    ):
        return False
    a = obj["arguments"]
    return (
        isinstance(a, dict)
        and set(a) == {"city", "unit"}
        and isinstance(a["city"], str)
        and a["unit"] in ("celsius", "fahrenheit")
    )


def json_schema_example(n: int, max_new_tokens: int):
    import pallasite
    from pallasite.models import gguf

    model = pallasite.load(gguf.smollm2_gguf_path())
    tok = model.tokenizer
    prompts = [
        tok.apply_chat_template(
            [
                {
                    "role": "system",
                    "content": 'You call tools. Reply with one JSON object {"name": ..., "arguments": '
                    '{"city": ..., "unit": ...}} and nothing else.',
                },
                {"role": "user", "content": f"What is the weather in {c} in {u}?"},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        for c, u in zip(CITIES * 4, ("celsius", "fahrenheit") * 16)
    ][:n]
    out = {}
    for name, kw in (("unconstrained", {}), ("json_schema", {"json_schema": TOOL_SCHEMA})):
        t0 = time.perf_counter()
        texts = pallasite.generate(model, prompts, max_new_tokens=max_new_tokens, **kw)
        out[name] = dict(
            valid=float(np.mean([_valid_tool_call(t) for t in texts])),
            seconds=time.perf_counter() - t0,
            example=texts[0],
        )
    return out


# ----------------------------------------------------------------------------- masking modes


def masking_modes(model, n: int, seed: int, batch_size: int) -> dict:
    """CRANE on the GSM task under the three masking modes: opportunistic (check the proposal,
    mask only invalid rows), always-mask, always-mask with the mask computed on a host thread
    during the forward pass. Greedy completions must be identical; the host costs differ."""
    task = dict(gsm_task(), modes=("crane",))
    out = {}
    for name, opp, overlap in (
        ("opportunistic", True, True),
        ("always", False, False),
        ("always_overlap", False, True),
    ):
        r = run_task(
            task,
            model,
            n,
            seed=seed,
            max_new_tokens=gsm_cot_tokens(),
            batch_size=batch_size,
            opportunistic=opp,
            overlap=overlap,
        )["crane"]
        out[name] = r
    print(
        f"\ngsm CRANE masking modes (n={n}): mode | accuracy | wall s | mask ms/step | "
        "host ms/step | device wait s | rows masked"
    )
    for name, r in out.items():
        st = r["stats"]
        print(
            f"  {name:15s} | {r['acc']:.3f} | {r['seconds']:.1f} | {st['mask_ms_per_step']:.3f} | "
            f"{st['host_ms_per_step']:.3f} | {st['wait_s']:.2f} | {st['mask_rows']}"
        )
    same = all(r["texts"] == out["opportunistic"]["texts"] for r in out.values())
    print(f"  identical completions in the three modes: {same}")
    summary = {"n": n, "seed": seed, "identical_completions": same}
    for name, r in out.items():
        st = r["stats"]
        summary[f"{name}_mask_ms_per_step"] = round(st["mask_ms_per_step"], 4)
        summary[f"{name}_host_ms_per_step"] = round(st["host_ms_per_step"], 4)
        summary[f"{name}_wait_s"] = round(st["wait_s"], 3)
        summary[f"{name}_seconds"] = round(r["seconds"], 2)
    return summary


# ----------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GSM task only, 48 problems")
    ap.add_argument(
        "--models",
        default=os.environ.get(
            "PALLASITE_CRANE_MODELS", os.path.join(tempfile.gettempdir(), "pallasite_crane_models")
        ),
    )
    ap.add_argument(
        "--n", type=int, default=0, help="problems per task (default 48 quick, 120 full)"
    )
    ap.add_argument("--seed", type=int, default=0, help="evaluation problem seed offset")
    ap.add_argument(
        "--tasks", default="", help="comma list: gsm,folio (default: gsm quick, both full)"
    )
    ap.add_argument(
        "--smollm2", action="store_true", help="also SmolLM2-135M-Instruct few-shot on the tasks"
    )
    ap.add_argument(
        "--json-schema", action="store_true", help="only the SmolLM2 tool-call JSON example"
    )
    ap.add_argument(
        "--gsm-kind",
        default="",
        choices=("", "steps", "relations", "relations_restated", "relations_many_names", "ordinal"),
        help="GSM problems: steps (default; one person, operations in order), relations "
        "(shuffled multi-hop chains of people; its model in MODELS/gsm_relations), "
        "relations_restated (the same problems, a CoT that restates the chain first), "
        "relations_many_names (those problems with 48 names, not 12) or ordinal "
        "(one person's operations tagged First, Second, ... and shuffled; MODELS/gsm_ordinal)",
    )
    ap.add_argument("--batch-size", type=int, default=48)
    ap.add_argument(
        "--masking",
        action="store_true",
        help="only CRANE on the GSM task under opportunistic / always / always+overlap masking",
    )
    a = ap.parse_args(argv)

    if a.masking:
        import pallasite

        model = pallasite.load(ensure_model("gsm", a.models))
        summary = masking_modes(model, a.n or 48, a.seed, a.batch_size)
        print(json.dumps(summary))
        return summary

    if a.json_schema:
        res = json_schema_example(8, 96)
        for k, v in res.items():
            print(
                f"{k:14s} valid {v['valid']:.3f}  {v['seconds']:.1f}s  e.g. {v['example']!r:.120}"
            )
        print(
            json.dumps(
                {
                    "json_valid_unconstrained": res["unconstrained"]["valid"],
                    "json_valid_constrained": res["json_schema"]["valid"],
                }
            )
        )
        return res

    import pallasite

    if a.smollm2:
        rows = smollm2_gsm(a.n or 16, 3, 128, a.batch_size)
        print_table(f"gsm, SmolLM2-135M-Instruct 3-shot (n={a.n or 16})", rows)
        summary = {f"smollm2_acc_{m}": round(r["acc"], 4) for m, r in rows.items()}
        summary.update({f"smollm2_parse_rate_{m}": round(r["parse"], 4) for m, r in rows.items()})
        summary["smollm2_mask_ms_per_step"] = round(rows["crane"]["stats"]["mask_ms_per_step"], 4)
        print(json.dumps(summary))
        return summary
    n = a.n or (48 if a.quick else 120)
    tasks = a.tasks.split(",") if a.tasks else (["gsm"] if a.quick else ["gsm", "folio"])
    summary = {"n": n, "seed": a.seed}
    for name in tasks:
        task = gsm_task(a.gsm_kind) if name == "gsm" else folio_task()
        model = pallasite.load(ensure_model(name, a.models, kind=a.gsm_kind if name == "gsm" else ""))
        rows = run_task(
            task,
            model,
            n,
            seed=a.seed,
            max_new_tokens=gsm_cot_tokens(a.gsm_kind) if name == "gsm" else 192,
            batch_size=a.batch_size,
        )
        print_table(f"{name} (trained {model.config.d_model}-wide model, n={n})", rows)
        for mode, r in rows.items():
            key = {
                "unconstrained": "unconstrained",
                "constrained": "constrained",
                "cot": "cot",
                "crane": "crane",
            }[mode]
            prefix = "" if name == "gsm" else "folio_"
            summary[f"{prefix}acc_{key}"] = round(r["acc"], 4)
            summary[f"{prefix}parse_rate_{key}"] = round(r["parse"], 4)
            if "chain_right" in r:
                summary[f"chain_right_{key}"] = round(r["chain_right"], 4)
        crane = rows["crane"]["stats"]
        if name == "gsm":
            summary["mask_ms_per_step"] = round(crane["mask_ms_per_step"], 4)
            summary["host_ms_per_step"] = round(crane["host_ms_per_step"], 4)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
