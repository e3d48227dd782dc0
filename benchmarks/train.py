"""Train-step throughput: pallasite (jitted step, donated state, chunked fused loss) vs a plain
PyTorch training loop of the same Llama architecture, side by side in one process.

    python -m pallasite.benchmarks.train            # ~20M params (configs.models.bench20m), B=8, T=256
    python -m pallasite.benchmarks.train --quick    # same model, B=4, T=128, fewer steps (< 3 min)

Both systems train the same architecture (RMSNorm, RoPE, GQA, SwiGLU, untied head) with AdamW
(same lr, betas, eps, weight decay), global-norm clipping 1.0, float32, on the same random token
batches. PyTorch runs eagerly (the usual training loop: zero_grad, forward, cross_entropy,
backward, clip, step) with ``scaled_dot_product_attention`` and the fused-for-each AdamW.
Timing alternates rounds between the two systems (the machine is shared and noisy) and reports
the median step time of each; compile / warm-up steps are excluded for both. Prints a table and
ends with one JSON line whose ``speedup_vs_torch`` = pallasite tokens/s ÷ PyTorch tokens/s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import numpy as np


# ----------------------------------------------------------------------------- pallasite
def pallasite_runner(model_dict: dict, B: int, T: int, loss_chunk: int, seed: int = 0):
    import jax

    from pallasite import sharding as shd
    from pallasite.models.config import model_config_from
    from pallasite.training.config import train_defaults
    from pallasite.training import step as st
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
def torch_runner(model_dict: dict, B: int, T: int, seed: int = 0):
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
            logits = model(tok)
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
    args = p.parse_args(argv)
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
    px_setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    th_run, th_params, th_device = torch_runner(model_dict, B, T)
    th_run(warm)
    th_setup = time.perf_counter() - t0

    px_times, th_times = [], []
    px_loss = th_loss = float("nan")
    for _ in range(rounds):  # alternate so both see the same machine load
        t, px_loss = px_run(timed)
        px_times += t
        t, th_loss = th_run(timed)
        th_times += t
    px_step, th_step = statistics.median(px_times), statistics.median(th_times)
    tokens = B * T
    px_tok_s, th_tok_s = tokens / px_step, tokens / th_step
    import jax

    result = {
        "benchmark": "train_step", "device": jax.devices()[0].platform, "torch_device": th_device, "params_pallasite": px_params,
        "params_torch": th_params, "batch": B, "seq_len": T, "tokens_per_step": tokens,
        "loss_chunk": args.loss_chunk, "pallasite_step_s": px_step, "torch_step_s": th_step,
        "pallasite_tokens_per_s": px_tok_s, "torch_tokens_per_s": th_tok_s,
        "speedup_vs_torch": px_tok_s / th_tok_s, "pallasite_setup_s": px_setup, "torch_setup_s": th_setup,
        "final_loss_pallasite": px_loss, "final_loss_torch": th_loss, "ln_vocab": math.log(V),
        "steps_timed_each": len(px_times),
    }
    print(f"\ntrain step, {px_params / 1e6:.1f}M params (torch {th_params / 1e6:.1f}M), batch {B} x {T} tokens, "
          f"median of {len(px_times)} steps each (alternating rounds)")
    print(f"{'system':<12}{'step ms':>10}{'tokens/s':>12}{'setup s':>10}")
    print(f"{'pallasite':<12}{px_step * 1e3:>10.1f}{px_tok_s:>12,.0f}{px_setup:>10.1f}")
    print(f"{'pytorch':<12}{th_step * 1e3:>10.1f}{th_tok_s:>12,.0f}{th_setup:>10.1f}")
    print(f"speedup (pallasite / pytorch tokens/s): {px_tok_s / th_tok_s:.2f}x")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
