"""Occult benchmark on 8 host devices: bytes sent and MoE-layer time for standard expert
parallelism, Occult dispatch, Occult + collaboration-aware placement, and + collaboration
pruning (N_d' = 2), on the routing of a *trained* MoE.

    python -m pallasite.benchmarks.occult --quick [--seed 0] [--comm-only]

Routing source: a small MoE (byte-level, d=64, 2 layers, 32 experts, top-4 — top-k ≥ 4 as
the issue asks) trained by ``models/occult_finetune.train`` on the Python stdlib sources. It
is cached under ``$PALLASITE_CACHE`` (default ``~/.cache/pallasite``) so reruns skip the
training; the JSON line's ``routing_source`` names it with its steps and eval loss.

Steps: profile routing on training windows → co-activation → greedy placement (Algorithm 1);
measure CT and off-device bytes on *held-out* windows for contiguous / random / greedy
placement; time the MoE layer (layer 0, its real input hidden states) under ``jax.shard_map``
for each dispatch at two token counts and check Occult == standard outputs; fine-tune the
MoE blocks (non-MoE frozen) with pruned routing (score and similarity, N_d' = 2 and, without
``--quick``, 1) and compare eval loss with an unpruned fine-tune of the same length.

CPU host devices share memory and cores, so the wall-time ratios are indicative only; the
byte counts are what a ragged all-to-all would send (``models/occult_accounting.py``).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from pallasite import sharding  # noqa: E402
from pallasite.models import occult  # noqa: E402
from pallasite.models import occult_finetune as ft  # noqa: E402
from pallasite.models.config import ModelConfig  # noqa: E402
from pallasite.models.moe import MoEConfig  # noqa: E402
from pallasite.models.occult_accounting import check_ct_bounds, communication_stats, padded_buffer_bytes  # noqa: E402
from pallasite.models.transformer import Transformer  # noqa: E402

N_DEV = 8


def base_config() -> ModelConfig:
    return ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, ffn="moe",
                       ffn_config=MoEConfig(num_experts=32, top_k=4, d_expert=32))


def _cache_path(steps: int, seed: int = 0) -> str:
    root = os.environ.get("PALLASITE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pallasite"))
    os.makedirs(root, exist_ok=True)
    return os.path.join(root, f"occult_moe_e32k4_d64_s{steps}" + (f"_seed{seed}" if seed else "") + ".npz")


def trained_moe(steps: int, data, log=print, seed: int = 0):
    """(graphdef, state, info) of the trained MoE (init and data order from ``seed``); loads the
    cache when present."""
    cfg = base_config()
    path = _cache_path(steps, seed)
    abs_model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abs_model)
    keys = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(abs_state)]
    if os.path.exists(path):
        z = np.load(path)
        flat = [(p, v.replace(jnp.asarray(z["/".join(map(str, p))]))) for p, v in nnx.to_flat_state(abs_state)]
        info = json.loads(str(z["__info__"]))
        info["cached"] = True
        return graphdef, nnx.from_flat_state(flat), info
    t0 = time.time()
    gd, params, rest, losses = ft.train(cfg, steps=steps, batch=16, seq_len=128, lr=3e-3, data=data, seed=seed,
                                        log_every=max(1, steps // 4))
    state = nnx.state(nnx.merge(gd, params, rest))
    info = {"train_steps": steps, "seed": seed, "final_train_ce": float(np.mean(losses[-10:])),
            "train_s": round(time.time() - t0, 1)}
    flat = dict(("/".join(map(str, p)), np.asarray(v[...])) for p, v in nnx.to_flat_state(state))
    assert set(flat) == set(keys)
    np.savez(path, __info__=json.dumps(info), **flat)
    info["cached"] = False
    return graphdef, state, info


def variant_state(cfg_v: ModelConfig, base_state, similarity=None):
    """(graphdef, state) of a model variant (other MoE config) carrying the base parameters."""
    abs_model = nnx.eval_shape(lambda: Transformer(cfg_v, rngs=nnx.Rngs(0)))
    gd, abs_st = nnx.split(abs_model)
    base = occult._flat(base_state)
    flat = []
    for p, v in nnx.to_flat_state(abs_st):
        if p in base:
            flat.append((p, base[p]))
        elif p[-1] == "similarity":
            flat.append((p, v.replace(jnp.eye(v.shape[-1], dtype=jnp.float32))))
        else:
            raise KeyError(f"variant has a parameter the base model lacks: {p}")
    st = nnx.from_flat_state(flat)
    if similarity is not None:
        st = occult.set_similarity(st, similarity)
    return gd, st


def layer_timer(graphdef, state, x_BTD, mesh, repeats: int):
    """Median seconds of the jitted layer-0 MoE forward under the mesh, and its output."""
    model = nnx.merge(graphdef, state)
    lgd, lst = nnx.split(model.layers[0].ffn)
    f = jax.jit(lambda st, x: nnx.merge(lgd, st)(x)[0])
    with jax.set_mesh(mesh):
        y = jax.block_until_ready(f(lst, x_BTD))
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(f(lst, x_BTD))
            ts.append(time.perf_counter() - t)
    return float(np.median(ts)), np.asarray(y)


def _eval(graphdef, state, data, batches):
    gd, params, rest = nnx.split(nnx.merge(graphdef, state), nnx.Param, ...)
    return ft.eval_loss(gd, params, rest, data, batches=batches)


def _comm_only_report(comm, bytes_std, m, cfg, eval_tokens, routing_source, quick, seed, t_start) -> dict:
    """The CT / bytes rows of the full report (``--comm-only``)."""
    ct = {name: comm[name]["ct"] for name in comm}
    print(f"\n{'system':34s} {'CT':>6s} {'bytes/layer-step':>17s} {'vs standard':>12s}")
    rows = [("standard EP (contiguous)", None, bytes_std),
            ("Occult dispatch (contiguous)", ct["contiguous"], comm["contiguous"]["bytes_occult"]),
            ("Occult + random placement", ct["random"], comm["random"]["bytes_occult"]),
            ("Occult + greedy placement", ct["greedy"], comm["greedy"]["bytes_occult"])]
    for name, c, b in rows:
        print(f"{name:34s} {'k=4' if c is None else f'{c:.3f}':>6s} {b / cfg.n_layers:17.0f} {1 - b / bytes_std:11.1%}")
    print(f"(held-out tokens {sum(t.size for t in eval_tokens)}; placement alone lowers CT by "
          f"{1 - ct['greedy'] / ct['contiguous']:.1%} vs contiguous, {1 - ct['greedy'] / ct['random']:.1%} vs random)")
    result = {
        "bytes_reduction_occult": round(1 - comm["contiguous"]["bytes_occult"] / bytes_std, 4),
        "bytes_reduction_occult_random": round(1 - comm["random"]["bytes_occult"] / bytes_std, 4),
        "bytes_reduction_occult_placement": round(1 - comm["greedy"]["bytes_occult"] / bytes_std, 4),
        "ct_standard": float(m.top_k), "ct_occult_contiguous": round(ct["contiguous"], 4),
        "ct_occult_random": round(ct["random"], 4), "ct_occult_greedy": round(ct["greedy"], 4),
        "ct_reduction_placement_vs_contiguous": round(1 - ct["greedy"] / ct["contiguous"], 4),
        "routing_source": routing_source, "comm_only": True, "quick": quick, "seed": seed,
        "wall_s": round(time.time() - t_start, 1),
    }
    print(json.dumps(result))
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--train_steps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the trained MoE (init, data order) and of the profiling / held-out windows")
    ap.add_argument("--comm-only", action="store_true",
                    help="stop after the CT / bytes table (no layer timing, no pruned fine-tuning): the seed spread")
    args = ap.parse_args(argv)
    quick = args.quick
    t_start = time.time()
    steps = args.train_steps or (150 if quick else 400)
    ft_steps = 20 if quick else 120
    prof_batches = 4 if quick else 12
    if len(jax.devices()) < N_DEV:
        raise SystemExit(f"needs {N_DEV} devices, found {len(jax.devices())} (set XLA_FLAGS before importing jax)")
    mesh = sharding.make_mesh({"expert": N_DEV})
    cfg = base_config()
    m = cfg.ffn_config
    train_data = ft.stdlib_bytes("train", 3_000_000)
    eval_data = ft.stdlib_bytes("eval", 400_000)

    seed = args.seed
    graphdef, state, info = trained_moe(steps, train_data, seed=seed)
    base_eval = _eval(graphdef, state, eval_data, 4 if quick else 16)
    routing_source = (f"pallasite MoE (byte-level, d=64, 2 layers, {m.num_experts} experts, top-{m.top_k}) trained "
                      f"{info['train_steps']} steps on Python stdlib sources by models/occult_finetune.train "
                      f"(eval CE {base_eval:.3f} nats/byte)")
    print(f"routing source: {routing_source}  [cached={info['cached']}]")

    # ---- profiling (train windows) → co-activation → placements
    it = ft.byte_batches(train_data, 16, 128, seed=7 + 100 * seed)
    prof = occult.profile_routing(graphdef, state, [next(it)[:, :-1] for _ in range(prof_batches)])
    coact = np.stack([occult.coactivation(e, m.num_experts) for e in prof["experts"]])
    placements = {
        "contiguous": occult.contiguous_placement(cfg.n_layers, m.num_experts, N_DEV),
        "random": occult.random_placement(cfg.n_layers, m.num_experts, N_DEV, seed=0),
        "greedy": occult.greedy_placement(coact, N_DEV),
    }
    sims = np.stack([occult.expert_similarity(*w, x[:2048]) for w, x in
                     zip(occult.layer_expert_weights(state), prof["inputs"])])

    # ---- held-out routing: CT and bytes per placement (bytes per layer, summed over layers)
    it_eval = ft.byte_batches(eval_data, 16, 128, seed=11 + 100 * seed)
    eval_tokens = [next(it_eval)[:, :-1] for _ in range(2 if quick else 8)]
    held = occult.profile_routing(graphdef, state, eval_tokens)
    comm = {}
    for name, pl in placements.items():
        slot_of = np.argsort(pl.array(), axis=1)  # original expert → slot
        tot = {"bytes_standard": 0, "bytes_occult": 0, "ct": []}
        for layer, e in enumerate(held["experts"]):
            s = communication_stats(slot_of[layer][e], num_experts=m.num_experts, num_devices=N_DEV,
                                    d_model=cfg.d_model)
            check_ct_bounds(s["ct"], m.top_k, m.num_experts, N_DEV)
            tot["bytes_standard"] += s["bytes_standard"]
            tot["bytes_occult"] += s["bytes_occult"]
            tot["ct"].append(s["ct"])
        tot["ct"] = float(np.mean(tot["ct"]))
        comm[name] = tot
    bytes_std = comm["contiguous"]["bytes_standard"]  # standard EP's bytes do not depend on placement much
    # standard EP with the *same* placement as its baseline: contiguous (the default layout)
    if args.comm_only:
        return _comm_only_report(comm, bytes_std, m, cfg, eval_tokens, routing_source, quick, seed, t_start)

    # ---- pruning: fine-tune MoE blocks with pruned routing (non-MoE frozen); unpruned FT baseline
    placed_state = occult.apply_placement(state, placements["greedy"], num_devices=N_DEV)
    placed_sims = np.stack([s[np.ix_(p, p)] for s, p in zip(sims, placements["greedy"].array())])
    results_prune = {}
    if quick:  # the unpruned reference is the trained model itself (saves one fine-tune)
        results_prune["unpruned_ft"] = base_eval
    else:  # same MoE-only fine-tune without pruning: the paper's "standard SFT" baseline
        gd_b, p_b, r_b, _ = ft.train(cfg, steps=ft_steps, state=placed_state, trainable="moe", data=train_data,
                                      lr=1e-3, seed=3)
        results_prune["unpruned_ft"] = ft.eval_loss(gd_b, p_b, r_b, eval_data, batches=16)
    pruned_states = {}
    for nd_keep in ((2,) if quick else (2, 1)):
        for kind in ("score", "similarity"):
            cfg_p = cfg.replace(ffn_config=MoEConfig(num_experts=32, top_k=4, d_expert=32, occult_devices=N_DEV,
                                              occult_max_devices=nd_keep, prune=kind))
            _, st_p = variant_state(cfg_p, placed_state, placed_sims if kind == "similarity" else None)
            gd_no_ft = nnx.split(nnx.eval_shape(lambda: Transformer(cfg_p, rngs=nnx.Rngs(0))))[0]
            before = _eval(gd_no_ft, st_p, eval_data, 4 if quick else 16)
            gd_p, p_p, r_p, _ = ft.train(cfg_p, steps=ft_steps, state=st_p, trainable="moe", data=train_data,
                                          lr=1e-3, seed=3)
            after = ft.eval_loss(gd_p, p_p, r_p, eval_data, batches=4 if quick else 16)
            pst = nnx.state(nnx.merge(gd_p, p_p, r_p))
            ct_p = np.mean([communication_stats(e, num_experts=32, num_devices=N_DEV, d_model=cfg.d_model)["ct"]
                            for e in occult.profile_routing(gd_p, pst, eval_tokens[:1])["experts"]])
            results_prune[f"nd{nd_keep}_{kind}"] = {"eval_before_ft": before, "eval_after_ft": after, "ct": float(ct_p)}
            pruned_states[(nd_keep, kind)] = (cfg_p, pst)

    # ---- timing + exactness on 8 host devices (layer 0, real hidden states)
    x_all = np.concatenate(held["inputs"][:1])
    token_counts = (512, 2048) if quick else (1024, 8192)
    timing, max_abs_diff, pruned_bytes = {}, 0.0, None
    cfg_p2, st_p2 = pruned_states[(2, "similarity")]
    variants = {
        "standard_ep": (cfg.replace(ffn_config=MoEConfig(num_experts=32, top_k=4, d_expert=32, dispatch="standard")),
                        state),
        "occult": (cfg.replace(ffn_config=MoEConfig(num_experts=32, top_k=4, d_expert=32, dispatch="occult")), state),
        "occult_placement": (cfg.replace(ffn_config=MoEConfig(num_experts=32, top_k=4, d_expert=32, dispatch="occult")),
                             placed_state),
        "occult_placement_prune2": (cfg_p2.replace(ffn_config=MoEConfig(
            num_experts=32, top_k=4, d_expert=32, dispatch="occult", occult_devices=N_DEV, occult_max_devices=2,
            prune="similarity")), st_p2),
    }
    for n_tok in token_counts:
        need = n_tok
        x = np.resize(x_all, (need, cfg.d_model)) if len(x_all) < need else x_all[:need]
        x_BTD = jnp.asarray(x.reshape(N_DEV, need // N_DEV, cfg.d_model))
        outs = {}
        for name, (cfg_v, st_v) in variants.items():
            gd_v, st_vv = variant_state(cfg_v, st_v)
            t, y = layer_timer(gd_v, st_vv, x_BTD, mesh, repeats=3 if quick else 10)
            timing[f"{name}@{n_tok}"] = t
            outs[name] = y
        max_abs_diff = max(max_abs_diff, float(np.abs(outs["occult"] - outs["standard_ep"]).max()),
                           float(np.abs(outs["occult_placement"] - outs["standard_ep"]).max()))
    # bytes of the pruned model's routing (layer 0 and 1, held-out)
    pr_routing = occult.profile_routing(*variant_state(*variants["occult_placement_prune2"]), eval_tokens)
    pruned_bytes = sum(communication_stats(e, num_experts=32, num_devices=N_DEV, d_model=cfg.d_model)["bytes_occult"]
                       for e in pr_routing["experts"])

    red_occ = 1 - comm["contiguous"]["bytes_occult"] / bytes_std
    red_occ_pl = 1 - comm["greedy"]["bytes_occult"] / bytes_std
    red_prune = 1 - pruned_bytes / bytes_std
    ct_contig, ct_greedy, ct_rand = comm["contiguous"]["ct"], comm["greedy"]["ct"], comm["random"]["ct"]

    print()
    print(f"{'system':34s} {'CT':>6s} {'bytes/layer-step':>17s} {'vs standard':>12s}")
    n_eval_tok = sum(t.size for t in eval_tokens)
    rows = [
        ("standard EP (contiguous)", m.top_k * 1.0, bytes_std),
        ("Occult dispatch (contiguous)", ct_contig, comm["contiguous"]["bytes_occult"]),
        ("Occult + random placement", ct_rand, comm["random"]["bytes_occult"]),
        ("Occult + greedy placement", ct_greedy, comm["greedy"]["bytes_occult"]),
        ("Occult + placement + prune N_d'=2", results_prune["nd2_similarity"]["ct"], pruned_bytes),
    ]
    for name, ct, b in rows:
        ct_s = "k=4" if name.startswith("standard") else f"{ct:.3f}"
        print(f"{name:34s} {ct_s:>6s} {b / cfg.n_layers:17.0f} {1 - b / bytes_std:11.1%}")
    print(f"(held-out tokens {n_eval_tok}; CT bounds [{int(np.ceil(4 * 8 / 32))}, {min(4, 8)}]; "
          f"placement alone lowers CT by {1 - ct_greedy / ct_contig:.1%} vs contiguous, "
          f"{1 - ct_greedy / ct_rand:.1%} vs random)")
    print()
    print(f"{'MoE layer time (8 host devices)':34s} " + " ".join(f"{n:>10d}" for n in token_counts))
    for name in variants:
        print(f"{name:34s} " + " ".join(f"{timing[f'{name}@{n}'] * 1e3:8.2f}ms" for n in token_counts))
    print("time ratios vs standard EP: " + ", ".join(
        f"{name}@{n}={timing[f'standard_ep@{n}'] / timing[f'{name}@{n}']:.2f}x"
        for name in list(variants)[1:] for n in token_counts))
    print(f"padded CPU buffers per layer @ {token_counts[-1]} tokens: standard "
          f"{padded_buffer_bytes(token_counts[-1], 4, 32, 8, 64, 'standard')} B, occult "
          f"{padded_buffer_bytes(token_counts[-1], 4, 32, 8, 64, 'occult')} B")
    print()
    print("pruning (fine-tune MoE blocks only, %d steps; eval CE nats/byte): base %.4f, unpruned reference %.4f%s"
          % (ft_steps, base_eval, results_prune["unpruned_ft"], " (= base in --quick)" if quick else " (same FT)"))
    for k, v in results_prune.items():
        if k != "unpruned_ft":
            print(f"  {k:16s} before FT {v['eval_before_ft']:.4f}  after FT {v['eval_after_ft']:.4f}  "
                  f"(Δ vs unpruned {v['eval_after_ft'] - results_prune['unpruned_ft']:+.4f})  CT {v['ct']:.3f}")
    result = {
        "bytes_reduction_occult": round(red_occ, 4),
        "bytes_reduction_occult_placement": round(red_occ_pl, 4),
        "bytes_reduction_occult_placement_prune2": round(red_prune, 4),
        "max_abs_diff": max_abs_diff,
        "routing_source": routing_source,
        "ct_standard": float(m.top_k),
        "ct_occult_contiguous": round(ct_contig, 4),
        "ct_occult_random": round(ct_rand, 4),
        "ct_occult_greedy": round(ct_greedy, 4),
        "ct_reduction_placement_vs_contiguous": round(1 - ct_greedy / ct_contig, 4),
        "ct_reduction_placement_vs_random": round(1 - ct_greedy / ct_rand, 4),
        "time_ratio_vs_standard": {f"{name}@{n}": round(timing[f"standard_ep@{n}"] / timing[f"{name}@{n}"], 3)
                                   for name in variants for n in token_counts},
        "layer_time_ms": {k: round(v * 1e3, 3) for k, v in timing.items()},
        "pruning_eval_ce": {k: (round(v, 4) if isinstance(v, float) else {a: round(b, 4) for a, b in v.items()})
                            for k, v in results_prune.items()},
        "base_eval_ce": round(base_eval, 4),
        "finetune_steps": ft_steps,
        "quick": quick,
        "seed": seed,
        "wall_s": round(time.time() - t_start, 1),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
