"""Train-step throughput: pallasite (jitted step, donated state, chunked fused loss) vs a plain
PyTorch training loop of the same Llama architecture, eager and ``torch.compile``d, in one process.

    python -m pallasite.benchmarks.train            # ~20M params (configs.models.bench20m), B=8, T=256
    python -m pallasite.benchmarks.train --quick    # same model, B=4, T=128, fewer steps (< 3 min)

Both systems train the same architecture (RMSNorm, RoPE, GQA, SwiGLU, untied head) with AdamW
(same lr, betas, eps, weight decay), global-norm clipping 1.0, float32, on the same random token
batches. PyTorch runs the usual loop (zero_grad, forward, cross_entropy, backward, clip, step)
with ``scaled_dot_product_attention`` and the fused-for-each AdamW, twice: eager, and with the
model ``torch.compile``d (inductor; the optimizer step stays eager). ``--torch-compile off`` drops
the compiled one (it is then absent from the table, named in its title). Matmul precision is the
same on both sides (``--matmul-precision``): ``highest`` = full float32 (jax
``default_matmul_precision="highest"``, torch ``set_float32_matmul_precision("highest")``, no
TF32), ``tf32`` = TF32 on both (jax ``"tensorfloat32"``, torch ``"high"`` + cuDNN TF32); on a CPU
both are float32 either way. Timing alternates rounds between the systems (the machine is shared
and noisy) and reports the median step time of each; compile / warm-up steps are excluded for all.
Prints a table and ends with one JSON line whose ``speedup_vs_torch`` = pallasite tokens/s ÷ the
best PyTorch tokens/s (eager or compiled; ``torch_best`` names it).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np


# ----------------------------------------------------------------------------- pallasite
def pallasite_runner(model_dict: dict, B: int, T: int, loss_chunk: int, seed: int = 0):
    import jax

    from pallasite import sharding as shd
    from pallasite.models.config import model_config_from
    from pallasite.training import step as st
    from pallasite.training.config import train_defaults
    from pallasite.training.optim import make_optimizer

    cfg = model_config_from(model_dict)
    oc = train_defaults().optim
    oc.warmup_steps = 0
    opt, sched = make_optimizer(oc, 10_000)
    mesh = shd.make_mesh({"data": 1}, devices=jax.devices()[:1])
    rules = shd.DEFAULT_RULES
    graphdef, state, shardings = st.init_train_state(cfg, opt, mesh, rules, seed)
    step = st.make_train_step(graphdef, opt, sched, shardings, mesh, rules, B, loss_chunk=loss_chunk)
    bsh = st.batch_shardings(mesh, rules, B)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    holder = {"state": state}

    def run(batches) -> list[float]:
        times = []
        with jax.set_mesh(mesh):
            for b in batches:
                db = st.put_batch(b, bsh)
                t0 = time.perf_counter()
                holder["state"], m = step(holder["state"], db)
                jax.block_until_ready(m["loss"])
                times.append(time.perf_counter() - t0)
        return times, float(m["loss"])

    return run, n_params


# ----------------------------------------------------------------------------- torch
def torch_runner(model_dict: dict, B: int, T: int, seed: int = 0, compile_model: bool = False):
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    d, H, K = model_dict["d_model"], model_dict["n_heads"], model_dict["n_kv_heads"]
    Dh = d // H
    V, Fdim, L = model_dict["vocab_size"], model_dict["d_ff"], model_dict["n_layers"]
    eps, theta = model_dict.get("norm_eps", 1e-5), model_dict.get("rope_theta", 10000.0)

    class RMSNorm(nn.Module):
        def __init__(self, n):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * self.weight

    inv = 1.0 / (theta ** (torch.arange(0, Dh, 2, dtype=torch.float32) / Dh))
    ang = torch.outer(torch.arange(T, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().to(device), torch.cat([ang, ang], -1).sin().to(device)

    def rope(x):  # x [B, H, T, Dh], HF rotate_half convention
        x1, x2 = x[..., : Dh // 2], x[..., Dh // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = RMSNorm(d), RMSNorm(d)
            self.q = nn.Linear(d, H * Dh, bias=False)
            self.k = nn.Linear(d, K * Dh, bias=False)
            self.v = nn.Linear(d, K * Dh, bias=False)
            self.o = nn.Linear(H * Dh, d, bias=False)
            self.gate = nn.Linear(d, Fdim, bias=False)
            self.up = nn.Linear(d, Fdim, bias=False)
            self.down = nn.Linear(Fdim, d, bias=False)

        def forward(self, x):
            b, t, _ = x.shape
            h = self.n1(x)
            q = rope(self.q(h).view(b, t, H, Dh).transpose(1, 2))
            k = rope(self.k(h).view(b, t, K, Dh).transpose(1, 2))
            v = self.v(h).view(b, t, K, Dh).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, H * Dh))
            h = self.n2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, d)
            self.blocks = nn.ModuleList([Block() for _ in range(L)])
            self.norm = RMSNorm(d)
            self.head = nn.Linear(d, V, bias=False)

        def forward(self, tok):
            x = self.embed(tok)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.norm(x))

    model = LM()
    with torch.no_grad():  # pallasite's init: N(0, 0.02) for every matrix, ones for norms
        for name, prm in model.named_parameters():
            if prm.ndim == 2:
                prm.normal_(0.0, 0.02)
    model = model.to(device)
    fwd = torch.compile(model) if compile_model else model  # same parameters; the optimizer sees them
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    n_params = sum(p.numel() for p in model.parameters())

    def run(batches):
        times = []
        for b in batches:
            tok = torch.from_numpy(b["tokens"]).long().to(device)
            tgt = torch.from_numpy(b["targets"]).long().to(device)
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = fwd(tok)
            loss = F.cross_entropy(logits.view(-1, V), tgt.view(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return times, float(loss.detach())

    return run, n_params, device


# ----------------------------------------------------------------------------- main
def set_matmul_precision(name: str) -> None:
    """The same float32 matmul precision for jax and torch (see the module doc)."""
    import jax
    import torch

    jax.config.update("jax_default_matmul_precision", {"highest": "highest", "tf32": "tensorfloat32"}[name])
    torch.set_float32_matmul_precision({"highest": "highest", "tf32": "high"}[name])
    torch.backends.cudnn.allow_tf32 = name == "tf32"


def _batches(n, B, T, V, seed):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tok = rng.integers(0, V, (B, T + 1)).astype(np.int32)
        out.append(dict(tokens=tok[:, :-1], targets=tok[:, 1:],
                        positions=np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy(),
                        segment_ids=np.ones((B, T), np.int32), loss_mask=np.ones((B, T), np.float32)))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="B=4, T=128, 2 rounds of 3 steps")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps-per-round", type=int, default=None)
    p.add_argument("--loss-chunk", type=int, default=0, help="tokens per fused cross-entropy chunk (0 = one)")
    p.add_argument("--matmul-precision", choices=("highest", "tf32"), default="highest",
                   help="float32 matmul precision, the same for jax and torch (default: highest, no TF32)")
    p.add_argument("--torch-compile", choices=("on", "off"), default="on",
                   help="also time the torch.compile'd model (default on)")
    args = p.parse_args(argv)
    set_matmul_precision(args.matmul_precision)
    from pallasite.configs.models import bench20m

    B = args.batch or (4 if args.quick else 8)
    T = args.seq or (128 if args.quick else 256)
    rounds = args.rounds or (2 if args.quick else 4)
    per_round = args.steps_per_round or (3 if args.quick else 5)
    model_dict = bench20m()
    V = model_dict["vocab_size"]
    warm = _batches(1 if args.quick else 2, B, T, V, seed=1)
    timed = _batches(per_round, B, T, V, seed=2)

    t0 = time.perf_counter()
    px_run, px_params = pallasite_runner(model_dict, B, T, args.loss_chunk)
    px_run(warm)  # compile + first steps
    systems = {"pallasite": px_run}
    setup = {"pallasite": time.perf_counter() - t0}
    variants = [("torch_eager", False)] + ([("torch_compile", True)] if args.torch_compile == "on" else [])
    for name, comp in variants:
        t0 = time.perf_counter()
        run, th_params, th_device = torch_runner(model_dict, B, T, compile_model=comp)
        run(warm)  # torch.compile traces and compiles here
        if comp:
            run(warm)  # a second warm-up step: the first backward may still recompile
        systems[name], setup[name] = run, time.perf_counter() - t0

    times = {k: [] for k in systems}
    loss = {k: float("nan") for k in systems}
    for _ in range(rounds):  # alternate so every system sees the same machine load
        for k, run in systems.items():
            t, loss[k] = run(timed)
            times[k] += t
    step = {k: statistics.median(v) for k, v in times.items()}
    tokens = B * T
    tok_s = {k: tokens / v for k, v in step.items()}
    torch_best = max((k for k in systems if k != "pallasite"), key=lambda k: tok_s[k])
    import jax

    result = {
        "benchmark": "train_step", "device": jax.devices()[0].platform, "torch_device": th_device,
        "params_pallasite": px_params, "params_torch": th_params, "batch": B, "seq_len": T,
        "tokens_per_step": tokens, "loss_chunk": args.loss_chunk, "matmul_precision": args.matmul_precision,
        "torch_compile": args.torch_compile, "torch_best": torch_best,
        "pallasite_step_s": step["pallasite"], "torch_step_s": step[torch_best],
        "pallasite_tokens_per_s": tok_s["pallasite"], "torch_tokens_per_s": tok_s[torch_best],
        "speedup_vs_torch": tok_s["pallasite"] / tok_s[torch_best],
        "final_loss_pallasite": loss["pallasite"], "final_loss_torch": loss[torch_best], "ln_vocab": math.log(V),
        "steps_timed_each": len(times["pallasite"]),
    }
    for k in systems:
        result[f"{k}_tokens_per_s"] = tok_s[k]
        result[f"{k}_setup_s"] = setup[k]
        if k != "pallasite":
            result[f"speedup_vs_{k}"] = tok_s["pallasite"] / tok_s[k]
    title = "" if args.torch_compile == "on" else " (torch.compile NOT timed: --torch-compile off)"
    print(f"\ntrain step, {px_params / 1e6:.1f}M params (torch {th_params / 1e6:.1f}M), batch {B} x {T} tokens, "
          f"matmul precision {args.matmul_precision} on both, median of {len(times['pallasite'])} steps each "
          f"(alternating rounds){title}")
    print(f"{'system':<15}{'step ms':>10}{'tokens/s':>12}{'setup s':>10}{'final loss':>12}")
    for k in systems:
        print(f"{k:<15}{step[k] * 1e3:>10.1f}{tok_s[k]:>12,.0f}{setup[k]:>10.1f}{loss[k]:>12.3f}")
    print(f"speedup (pallasite / best pytorch = {torch_best}, tokens/s): "
          f"{tok_s['pallasite'] / tok_s[torch_best]:.2f}x")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
