"""``pallasite occult-place``: Occult's collaboration-aware expert placement for a trained MoE
(Luo et al., ICML 2025; ``models/occult.py``), written as a model folder that serves it.

    pallasite occult-place --model M --output DIR --devices 8 [--text stdlib|FILE|DIR] [--windows 16]

Profiles the routing on ``--windows`` text windows (taps inside the model's blocks), builds each
layer's co-activation matrix and the greedy placement for ``--devices`` expert-parallel devices,
and writes DIR: the model (orbax, experts in their trained order), ``occult_placement.json`` and a
config with ``ffn_config.placement`` naming it and ``dispatch="occult"``. ``pallasite.load(DIR)``
applies the placement (experts and router columns permuted; outputs unchanged). The JSON line
reports CT (distinct devices per token) on held-out windows, contiguous vs placed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from pallasite.errors import InputError
from pallasite.models import occult
from pallasite.models.occult_accounting import communication_times


def text_windows(tokenizer, text: str, n: int, length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(profiling windows [n, length], held-out windows [max(n // 4, 1), length]) of token ids."""
    from pallasite.eval.corpora import load_texts, token_streams

    if text == "stdlib":
        from pallasite.training.data import stdlib_texts

        texts = stdlib_texts(split="all")
    else:
        texts = load_texts(text)
    n_eval = max(n // 4, 1)
    calib, held = token_streams(tokenizer, texts, max(4 * n * length, 100_000), max(4 * n_eval * length, 50_000))
    rng = np.random.default_rng(seed)

    def windows(stream, k):
        if len(stream) < length + 1:
            raise InputError(f"occult-place: the text has {len(stream)} tokens, fewer than one window of {length}")
        return np.stack([stream[s:s + length] for s in rng.integers(0, len(stream) - length, k)])

    return windows(calib, n), windows(held, n_eval)


def placement_for(model, windows: np.ndarray, devices: int, batch: int = 4) -> occult.Placement:
    """Greedy (Algorithm 1) placement from the routing of ``model`` on ``windows``."""
    experts = occult.profile_routing(model.graphdef, model.state,
                                     [windows[i:i + batch] for i in range(0, len(windows), batch)])["experts"]
    E = model.config.ffn_config.num_experts
    return occult.greedy_placement(np.stack([occult.coactivation(e, E) for e in experts]), devices)


def mean_ct(model, windows: np.ndarray, placement: occult.Placement, batch: int = 4) -> float:
    experts = occult.profile_routing(model.graphdef, model.state,
                                     [windows[i:i + batch] for i in range(0, len(windows), batch)])["experts"]
    E = model.config.ffn_config.num_experts
    slot_of = np.argsort(placement.array(), axis=1)  # original expert -> slot
    return float(np.mean([communication_times(slot_of[layer][e], E, placement.num_devices)
                          for layer, e in enumerate(experts)]))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("occult-place", help="Occult: collaboration-aware expert placement for an MoE",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an MoE: pallasite folder, training workdir or HF folder")
    p.add_argument("--output", required=True, help="model folder to write (with the placement)")
    p.add_argument("--devices", type=int, required=True, help="expert-parallel devices N_d (divides the experts)")
    p.add_argument("--text", default="stdlib", help="profiling text: 'stdlib' (Python sources), FILE or DIR")
    p.add_argument("--windows", type=int, default=16, help="profiling windows")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=run)


def run(args, overrides=None) -> dict:
    import pallasite
    from pallasite.api import ORBAX_MARKER

    for name in ("devices", "windows", "seq_len"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    t0 = time.time()
    model = pallasite.load(args.model)
    cfg = model.config
    if cfg.ffn != "moe":
        raise InputError(f"{args.model!r} is not an MoE model (ffn={cfg.ffn!r})")
    E = cfg.ffn_config.num_experts
    if E % args.devices:
        raise InputError(f"--devices {args.devices} does not divide the {E} experts")
    if model.tokenizer is None:
        raise InputError(f"{args.model!r} has no tokenizer to encode the profiling text")
    prof, held = text_windows(model.tokenizer, args.text, args.windows, args.seq_len, args.seed)
    placement = placement_for(model, prof, args.devices)
    contiguous = occult.contiguous_placement(placement.num_layers, E, args.devices)
    ct = {"contiguous": mean_ct(model, held, contiguous), "placed": mean_ct(model, held, placement)}
    model.save(args.output, format="orbax")  # experts in their trained order; the load applies the placement
    occult.save_placement(os.path.join(args.output, occult.PLACEMENT_FILE), placement)
    placed_cfg = cfg.replace(ffn_config=dataclasses.replace(cfg.ffn_config, placement=occult.PLACEMENT_FILE,
                                                            dispatch="occult"))
    marker = os.path.join(args.output, ORBAX_MARKER)
    with open(marker) as f:
        meta = json.load(f)
    meta["config"] = placed_cfg.to_dict()
    with open(marker, "w") as f:
        json.dump(meta, f, indent=1)
    summary = {"output": args.output, "placement": occult.PLACEMENT_FILE, "devices": args.devices, "experts": E,
               "moe_layers": placement.num_layers, "profiling_tokens": int(prof.size),
               "held_out_tokens": int(held.size),
               "ct_contiguous": round(ct["contiguous"], 4), "ct_placed": round(ct["placed"], 4),
               "ct_reduction": round(1 - ct["placed"] / ct["contiguous"], 4), "seconds": round(time.time() - t0, 1)}
    print(json.dumps(summary))
    return summary
