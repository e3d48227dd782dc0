"""Decode latency and memory of MoLE vs dense vs MoE (resident / offloaded), side by side.

    python -m pallasite.benchmarks.experts --quick          # < 3 min on a 2-core CPU
    python -m pallasite.benchmarks.experts --size 160m      # the paper's 160M shapes (accelerator)

Paper: Jie et al., "Mixture of Lookup Experts", ICML 2025, §4.3 / Fig. 4 (latency of dense,
MoE with expert offloading and MoLE at equal activated parameters, batch 1 / 8 / 32).

Five systems (plus one reference), same activated parameters, same random weights per system, the same prompts
(B rows of P random ids), greedy decode through the ONE project engine
(``inference.engine.run_decode``: jitted prefill + ``while_loop`` decode):

* ``dense``       — the paper's dense model (non-gated exact-GELU FFN of width D_s; MoLE N = 0).
* ``moe``         — MoE-10E top-2 (``models/moe.py``, the paper's non-gated exact-GELU experts of
                    width D_s/2: equal activated parameters), every expert resident on the device.
* ``moe_offload`` — the same MoE with the expert weights in host RAM: each layer routes on the
                    device, a host callback receives the selected expert ids and returns
                    their weights (the unique experts of the step, in a static buffer of
                    U = min(E, B·T·k) slots), then the experts run on the device.
* ``mole_host``   — MoLE-4E in LUT mode, the fp16 LUT [V, L, N, d] in the backend's host memory
                    space (``serve_in_host_memory``: memory kind ``pinned_host``); the compiled
                    decode step gathers the step's rows there and moves only those rows to the
                    device — no host callback. This is the headline MoLE system.
* ``mole_host_cb`` — the same LUT as a numpy array in host RAM, rows fetched by a per-step host
                    callback (``serve_with_store``), the portable path; it shows what the
                    callback round trip costs.
* ``mole_disk``   — the same LUT in a memory-mapped file (``save_lut`` / ``open_lut``), rows read
                    by the callback. The OS page cache serves repeated rows from RAM after the
                    first read, as it would in deployment.
* ``mole_device`` — reference point, not offloaded: the whole LUT in device memory, gathered in
                    the graph (``serve_on_device``). It separates MoLE's own compute from the
                    cost of the per-step host round trip.

Reported per system and batch size: per-token decode latency = time of the engine's compiled
decode loop (n − 1 steps after the prefill's first token) / (n − 1), best of the repetitions.
Repetitions are interleaved round-robin over every (batch, system), so load drift on a shared
machine hits all systems alike; the MoLE / dense ratios are also reported as the median of the
per-repetition ratios (``*_median``), which is the more robust figure on a noisy machine.
``--quick`` compiles fewer variants (batch > 1: dense, MoE-offloaded, MoLE host / device only)
and stops repeating after ``--time-budget`` seconds of timing (default 40 s; at least 2 reps);
device-resident parameter bytes
(``nnx.Param`` leaves on the device; the KV cache is the same for all and not counted; for
``moe_offload`` the static per-layer expert buffer is added); bytes moved host→device per
generated token (counted in the callbacks; for ``moe_offload`` both the buffer actually
transferred and the bytes of the *unique* experts a step needed).

On a CPU the "device" is host memory, so a transfer is a memcpy: measured MoE-offload
latencies understate what PCIe costs. Like the paper (which estimates loading at 16 GB/s),
we also report ``*_pcie16_modeled`` = measured latency + bytes moved per step / 16 GB/s. On an
accelerator the measured numbers include the real transfers. JSON keys required by the issue
(each a ratio at batch 1): ``mole_vs_dense_latency``, ``moe_offload_vs_mole_latency``,
``mole_device_bytes_vs_dense``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental.compute_on import compute_on

from pallasite.inference import engine
from pallasite.inference import mole_decode as MD
from pallasite.inference.cache import init_dense_cache
from pallasite.inference.engine import SamplingStrategy
from pallasite.inference.sampling import SamplingParams
from pallasite.models import mole_lut as ML
from pallasite.models.config import ModelConfig
from pallasite.models.layers import activation
from pallasite.models.moe import moe_config_of
from pallasite.models.moe_experts import expert_ffn_rows
from pallasite.models.moe_routing import route
from pallasite.models.mole import expert_variant_fields
from pallasite.models.transformer import init_model

PCIE_BPS = 16e9  # the paper's loading-speed estimate

SIZES = {  # d, L, heads, D_s, vocab
    "quick": dict(d_model=128, n_layers=4, n_heads=4, d_ff=512, vocab_size=4096),
    "small": dict(d_model=256, n_layers=6, n_heads=4, d_ff=1024, vocab_size=8192),
    "160m": dict(d_model=768, n_layers=12, n_heads=12, d_ff=3072, vocab_size=50304),
    "410m": dict(d_model=1024, n_layers=24, n_heads=16, d_ff=4096, vocab_size=50304),
}


def make_cfg(size: str, kind: str, *, n_mole: int = 4, n_moe: int = 10, top_k: int = 2) -> ModelConfig:
    s = SIZES[size]
    d = dict(family="llama", vocab_size=s["vocab_size"], d_model=s["d_model"], n_layers=s["n_layers"],
             n_heads=s["n_heads"], n_kv_heads=s["n_heads"], d_ff=s["d_ff"], max_seq_len=4096,
             hidden_act="gelu_exact")
    variant = {"dense": "dense", "moe": f"moe{n_moe}", "mole": f"mole{n_mole}"}[kind]
    d.update(expert_variant_fields(variant, s["d_ff"], top_k=top_k))
    return ModelConfig.from_dict(d)


# ----------------------------------------------------------------------------- MoE offloaded
OFFLOAD_DTYPE = np.float16  # offloaded bytes are moved in the LUT's dtype (fp16), for MoE and MoLE alike


class HostExperts:
    """Expert weights of one MoE layer in host RAM, stored in ``OFFLOAD_DTYPE`` (fp16, the LUT's
    dtype); ``fetch`` returns the step's unique experts in a static buffer of ``slots`` rows plus
    the remapped slot ids (host callback)."""

    def __init__(self, w_gate, w_up, w_down, slots: int, stats: dict):
        # (gate, up, down) for SwiGLU-form experts, (up, down) for non-gated ones (w_gate None)
        self.w = tuple(np.asarray(w).astype(OFFLOAD_DTYPE) for w in (w_gate, w_up, w_down) if w is not None)
        self.slots, self.stats = slots, stats  # slots of a decode step (T = 1)
        self.expert_bytes = sum(a[0].nbytes for a in self.w)

    def fetch(self, experts_RK):
        e = np.asarray(experts_RK)
        uniq, inv = np.unique(e, return_inverse=True)
        idx = np.zeros((min(self.w[0].shape[0], e.size),), np.int64)  # = U of the traced shape
        idx[: len(uniq)] = uniq
        bufs = tuple(np.ascontiguousarray(a[idx]) for a in self.w)
        self.stats["buffer_bytes"] += sum(b.nbytes for b in bufs)
        self.stats["unique_bytes"] += len(uniq) * self.expert_bytes
        self.stats["unique_experts"] += len(uniq)
        self.stats["calls"] += 1
        return bufs + (inv.reshape(e.shape).astype(np.int32),)


class OffloadedMoE(nnx.Module):
    """Drop-in FFN for a MoE block whose experts live in host RAM (routing as in models/moe.py)."""

    def __init__(self, moe_ffn, host: HostExperts, top_k: int, norm_topk_prob: bool, act: str, dtype):
        self.router = nnx.Param(moe_ffn.router[...])
        self.host, self.top_k, self.norm = host, top_k, norm_topk_prob
        self.act_name, self.dtype = act, dtype

    def __call__(self, x_BTD, ctx=None):
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(B * T, D).astype(self.dtype)
        logits = jnp.dot(x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        _, w, e = route(logits, self.top_k, norm_topk_prob=self.norm)
        ws = self.host.w
        U = min(ws[0].shape[0], B * T * self.top_k)  # static: at most this many distinct experts
        shapes = tuple(jax.ShapeDtypeStruct((U,) + a.shape[1:], a.dtype) for a in ws) + (
            jax.ShapeDtypeStruct(e.shape, jnp.int32),)
        *bufs, local = jax.pure_callback(self.host.fetch, shapes, e, vmap_method="sequential")
        bufs = [b.astype(self.dtype) for b in bufs]  # moved as fp16, computed in the model dtype
        g_b, u_b, d_b = bufs if len(bufs) == 3 else (None, *bufs)
        y = expert_ffn_rows(x, local, w, g_b, u_b, d_b, act=activation(self.act_name))
        return y.reshape(B, T, D), {}


def offload_moe(model, batch_size: int, stats: dict):
    cfg = model.cfg
    m = moe_config_of(cfg)
    slots = min(m.num_experts, batch_size * m.top_k)  # decode steps: T = 1
    for block in model.layers:
        f = block.ffn
        host = HostExperts(None if f.w_gate is None else f.w_gate[...], f.w_up[...], f.w_down[...], slots, stats)
        block.ffn = OffloadedMoE(f, host, m.top_k, m.norm_topk_prob, cfg.hidden_act, jnp.dtype(cfg.dtype))
    return model


# ----------------------------------------------------------------------------- MoE in host memory
class HostExpertArray(nnx.Variable):
    """One expert weight stack [E, ...] in the backend's host memory space (not a parameter, not
    device-resident) — the MoE counterpart of ``inference.mole_decode.HostLUTArray``."""


@compute_on("device_host")
@jax.jit
def _gather_experts_on_host(w_EXY, ids_U):
    """Runs in host memory next to the weights, like MoLE's host-memory row gather."""
    return w_EXY.at[ids_U].get(mode="promise_in_bounds")


class HostMemoryMoE(nnx.Module):
    """MoE FFN whose experts live in the host memory space (``pinned_host``) in fp16: routing on the
    device, the step's unique experts (a static U = min(E, B·T·k) slots, ``jnp.unique``) gathered
    in host memory and moved to the device in the compiled graph — the same mechanism and dtype as
    MoLE's ``serve_in_host_memory`` (no host callback), so the MoE/MoLE ratio measures bytes."""

    def __init__(self, moe_ffn, top_k: int, norm_topk_prob: bool, act: str, dtype, sharding):
        self.router = nnx.Param(moe_ffn.router[...])
        ws = [w for w in (moe_ffn.w_gate, moe_ffn.w_up, moe_ffn.w_down) if w is not None]
        self.gated = moe_ffn.w_gate is not None
        self.w = nnx.List([HostExpertArray(jax.device_put(np.asarray(w[...]).astype(OFFLOAD_DTYPE), sharding))
                           for w in ws])
        self.num_experts = int(ws[0].shape[0])
        self.expert_bytes = sum(int(np.prod(w.shape[1:])) * np.dtype(OFFLOAD_DTYPE).itemsize for w in ws)
        self.top_k, self.norm, self.act_name, self.dtype = top_k, norm_topk_prob, act, dtype

    def __call__(self, x_BTD, ctx=None):
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(B * T, D).astype(self.dtype)
        logits = jnp.dot(x.astype(jnp.float32), self.router[...].astype(jnp.float32))
        _, w, e = route(logits, self.top_k, norm_topk_prob=self.norm)
        U = min(self.num_experts, B * T * self.top_k)
        uniq, inv = jnp.unique(e.reshape(-1), size=U, fill_value=0, return_inverse=True)
        ids = jax.device_put(uniq.astype(jnp.int32), jax.memory.Space.Host)
        bufs = [jax.device_put(_gather_experts_on_host(a[...], ids), jax.memory.Space.Device).astype(self.dtype)
                for a in self.w]
        g_b, u_b, d_b = bufs if self.gated else (None, *bufs)
        local = inv.reshape(e.shape).astype(jnp.int32)
        y = expert_ffn_rows(x, local, w, g_b, u_b, d_b, act=activation(self.act_name))
        return y.reshape(B, T, D), {}


def offload_moe_host_memory(model, sharding):
    cfg = model.cfg
    m = moe_config_of(cfg)
    for block in model.layers:
        block.ffn = HostMemoryMoE(block.ffn, m.top_k, m.norm_topk_prob, cfg.hidden_act, jnp.dtype(cfg.dtype), sharding)
    return model


# ----------------------------------------------------------------------------- timing
def param_bytes(state) -> int:
    leaves = jax.tree.leaves(nnx.state(state, nnx.Param))
    return int(sum(x.size * x.dtype.itemsize for x in leaves if hasattr(x, "dtype")))


class DecodeTimer:
    """Times the engine's compiled decode loop (``engine.decode_loop``, n − 1 steps after the
    prefill's first token) for one system and batch; the prefill is run but not timed."""

    def __init__(self, model, prompts, n_new: int, on_reset=None):
        self.graphdef, self.state = nnx.split(model)
        self.cfg, self.n_new, self.on_reset = model.cfg, n_new, on_reset
        B = len(prompts)
        self.args, spec = SamplingParams.make(B, 0.0, None, None)
        self.strategy = SamplingStrategy(spec=spec)
        self.tokens, self.lengths, self.cache_len = engine.prepare_prompts(
            prompts, vocab_size=self.cfg.vocab_size, pad_id=0, max_new_tokens=n_new, cache_len=None)
        self.stops = jnp.asarray([-1], jnp.int32)
        self.times = []
        self.counters = None
        self.run()  # compile prefill + decode loop

    def _prefill(self):
        cache = init_dense_cache(self.cfg, self.tokens.shape[0], self.cache_len)
        s = engine.prefill(self.graphdef, self.state, cache, jnp.asarray(self.tokens), jnp.asarray(self.lengths),
                           jax.random.key(0), self.stops, jnp.int32(0), self.args, strategy=self.strategy,
                           max_new_tokens=self.n_new)
        return jax.block_until_ready(s)

    def run(self) -> float:
        s = self._prefill()
        if self.on_reset is not None:
            self.on_reset()
        t0 = time.perf_counter()
        s = engine.decode_loop(self.graphdef, self.state, s, self.stops, self.args, strategy=self.strategy)
        jax.block_until_ready(s.out_BN)
        dt = time.perf_counter() - t0
        if self.on_reset is not None:
            self.counters = self.on_reset()
        assert int(jax.device_get(s.n_out_B).min()) == self.n_new
        return dt

    def rep(self):
        self.times.append(self.run() / (self.n_new - 1))
        return self.times[-1]

    @property
    def latency(self) -> float:
        return min(self.times)


def main(argv=None):
    p = argparse.ArgumentParser(description="MoLE vs dense vs MoE decode latency / memory")
    p.add_argument("--quick", action="store_true",
                   help="small model, 32 new tokens, fewer b>1 variants, ≤ 20 reps within --time-budget "
                        "(< 3 min on CPU)")
    p.add_argument("--size", default=None, choices=sorted(SIZES))
    p.add_argument("--batches", default="1,8")
    p.add_argument("--skip", default="", help="comma-separated systems to leave out (e.g. mole_device at large "
                   "sizes, whose whole-LUT device copy costs memory); the headline ones are required")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--time-budget", type=float, default=None,
                   help="stop repeating after this many seconds of timing (≥ 2 reps); quick default 40")
    a = p.parse_args(argv)
    size = a.size or ("quick" if a.quick else "small")
    n_new = a.new_tokens or (32 if a.quick else 64)
    reps = a.reps or (20 if a.quick else 10)
    budget = a.time_budget if a.time_budget is not None else (40.0 if a.quick else float("inf"))
    batches = [int(b) for b in a.batches.split(",")]
    t_start = time.time()
    print(f"# experts benchmark: size={size} {SIZES[size]} backend={jax.default_backend()} "
          f"new_tokens={n_new} reps={reps}", file=sys.stderr)

    rng = np.random.default_rng(0)
    V = SIZES[size]["vocab_size"]
    prompts_all = rng.integers(0, V, size=(max(batches), a.prompt_len)).tolist()
    results = {"size": size, "backend": jax.default_backend(), "new_tokens": n_new, "systems": {}}
    tmp = tempfile.mkdtemp(prefix="mole_lut_")

    # --- build the systems once (weights independent of batch size)
    dense = init_model(make_cfg(size, "dense"), seed=0)
    moe_cfg = make_cfg(size, "moe")
    mole_train = init_model(make_cfg(size, "mole"), seed=0)
    t0 = time.time()
    host_lut = ML.HostLUT.from_model(mole_train)
    lut_path = ML.save_lut(os.path.join(tmp, "mole.lut"), host_lut)
    print(f"# LUT {host_lut.meta.row_shape} x {V} fp16 = {host_lut.nbytes / 2**20:.1f} MiB built+saved in "
          f"{time.time() - t0:.1f}s", file=sys.stderr)
    disk_lut = ML.open_lut(lut_path, mole_train)
    mole_models = {}  # callback-fed systems (their stores count the bytes they hand over)
    for name, store in (("mole_host_cb", host_lut), ("mole_disk", disk_lut)):
        mole_models[name] = (MD.serve_with_store(ML.to_lut_model(mole_train), store), store)
    try:  # host-memory spaces + compute_on("device_host") are backend features: fall back, say so
        mole_hostmem = MD.serve_in_host_memory(ML.to_lut_model(mole_train), host_lut)
    except Exception as e:  # noqa: BLE001 — recorded in the JSON, the callback system stands in
        mole_hostmem, results["mole_host_error"] = None, f"{type(e).__name__}: {e}"[:500]
        print(f"# mole_host unavailable ({results['mole_host_error']}); headline uses mole_host_cb", file=sys.stderr)
    skip = {x for x in a.skip.split(",") if x}
    if skip & {"dense", "moe_offload"}:
        raise SystemExit(f"--skip {a.skip}: dense and moe_offload are needed for the headline ratios")
    mole_dev = None if "mole_device" in skip else MD.serve_on_device(ML.to_lut_model(mole_train), host_lut.data[0])
    del mole_train

    timers = {}
    keep = []
    for B in batches:
        prompts = prompts_all[:B]
        off_stats = {"buffer_bytes": 0, "unique_bytes": 0, "unique_experts": 0, "calls": 0}

        def reset_off(st=off_stats):
            snap = dict(st)
            for k in st:
                st[k] = 0
            return snap

        systems = {"dense": (dense, None, None), "moe": (init_model(moe_cfg, seed=0), None, None),
                   "moe_offload": (offload_moe(init_model(moe_cfg, seed=0), B, off_stats), reset_off, "offload")}
        for name, (lm, store) in mole_models.items():
            def reset_store(st=store):
                snap = dict(st.stats)
                st.reset_stats()
                return snap

            systems[name] = (lm, reset_store, "lut")
        if mole_hostmem is not None:
            systems["mole_host"] = (mole_hostmem, None, "lut_hostmem")
            systems["moe_offload_host"] = (offload_moe_host_memory(init_model(moe_cfg, seed=0),
                                                                   MD.host_memory_sharding()), None, "offload_hostmem")
        if mole_dev is not None:
            systems["mole_device"] = (mole_dev, None, "lut_device")
        systems = {k: v for k, v in systems.items() if k not in skip}
        if a.quick and B > 1:  # fewer compiles: the batch-1 JSON keys need every system, b > 1 the MoLE/dense pair
            systems = {k: v for k, v in systems.items()
                       if k in ("dense", "moe_offload", "moe_offload_host", "mole_host", "mole_host_cb",
                                "mole_device")}
        for name, (model, reset, kind) in systems.items():
            t0 = time.time()
            try:
                timers[(B, name)] = (DecodeTimer(model, prompts, n_new, reset), model, kind)
            except Exception as e:  # noqa: BLE001 — only the host-memory paths may be unsupported
                if name not in ("mole_host", "moe_offload_host"):
                    raise
                results[f"{name}_error"] = f"{type(e).__name__}: {e}"[:500]
                print(f"# {name} failed to compile at b={B}: {results[f'{name}_error']}", file=sys.stderr)
                continue
            print(f"# compiled b={B} {name} in {time.time() - t0:.1f}s", file=sys.stderr)
        keep.append(systems)
    # round-robin repetitions: load drift on a shared machine hits every system alike
    t_timing, per_rep = time.time(), []
    for i in range(reps):
        per_rep.append({key: timer.rep() for key, (timer, _, _) in timers.items()})
        if i >= 1 and time.time() - t_timing > budget:
            break
    results["reps_done"] = len(per_rep)
    results["timing_s"] = time.time() - t_timing
    print(f"# timed {len(per_rep)} interleaved reps in {results['timing_s']:.1f}s", file=sys.stderr)

    rows = []
    for (B, name), (timer, model, kind) in timers.items():
        lat, cnt = timer.latency, timer.counters
        steps = n_new - 1
        dev_bytes = param_bytes(model)
        r = {"latency_ms": 1e3 * lat, "device_param_bytes": dev_bytes}
        if kind == "offload":
            hosts = [blk.ffn.host for blk in model.layers]
            buf = sum(sum(a[0].nbytes for a in h.w) for h in hosts) * hosts[0].slots
            r["device_param_bytes"] = dev_bytes + buf  # the static expert buffers live on the device
            r["h2d_bytes_per_token"] = cnt["buffer_bytes"] / (steps * B)
            r["needed_bytes_per_token"] = cnt["unique_bytes"] / (steps * B)
            r["unique_experts_per_layer_step"] = cnt["unique_experts"] / max(cnt["calls"], 1)
        elif kind == "offload_hostmem":  # static U expert slots per layer cross every step
            ffns = [blk.ffn for blk in model.layers]
            U = min(ffns[0].num_experts, B * moe_config_of(model.cfg).top_k)
            per_step = sum(f.expert_bytes for f in ffns) * U
            r["device_param_bytes"] = dev_bytes + per_step  # the gathered experts are device buffers
            r["h2d_bytes_per_token"] = per_step / B
            r["host_memory_bytes"] = int(sum(a[...].nbytes for f in ffns for a in f.w))
        elif kind == "lut_device":
            r["device_param_bytes"] = dev_bytes + model.table[...].nbytes  # the whole LUT is resident
            r["h2d_bytes_per_token"] = 0.0
        elif kind == "lut_hostmem":  # the gathered rows are what crosses (static shape [B, 1, L, N, d])
            r["h2d_bytes_per_token"] = float(host_lut.bytes_per_token)
            r["host_memory_bytes"] = MD.host_resident_bytes(model)
        elif kind == "lut":
            r["h2d_bytes_per_token"] = cnt["bytes_to_device"] / (steps * B)
            r["lut_bytes_read_per_token"] = cnt["bytes_read"] / (steps * B)
        else:
            r["h2d_bytes_per_token"] = 0.0
        r["latency_pcie16_modeled_ms"] = r["latency_ms"] + 1e3 * r["h2d_bytes_per_token"] * B / PCIE_BPS
        results["systems"].setdefault(name, {})[f"b{B}"] = r
        rows.append((B, name, r))
        print(f"# b={B} {name}: {json.dumps(r)}", file=sys.stderr)

    # --- table
    print(f"\n{'batch':>5} {'system':16s} {'ms/token':>9} {'x dense':>8} {'PCIe16 ms':>10} {'device MiB':>11} "
          f"{'H2D KiB/tok':>12}")
    for B, name, r in rows:
        base = results["systems"]["dense"][f"b{B}"]["latency_ms"]
        print(f"{B:5d} {name:16s} {r['latency_ms']:9.3f} {r['latency_ms'] / base:8.2f} "
              f"{r['latency_pcie16_modeled_ms']:10.3f} {r['device_param_bytes'] / 2**20:11.2f} "
              f"{r['h2d_bytes_per_token'] / 1024:12.2f}")
    S = results["systems"]
    b1 = lambda name, key="latency_ms": S[name]["b1"][key]  # noqa: E731
    head = "mole_host" if f"b{batches[0]}" in S.get("mole_host", {}) else "mole_host_cb"
    # the MoE/MoLE headline compares systems that move bytes by the same mechanism, in fp16
    moe_head = "moe_offload_host" if head == "mole_host" and "b1" in S.get("moe_offload_host", {}) else "moe_offload"
    if head == "mole_host" and moe_head != "moe_offload_host":
        head = "mole_host_cb"  # no host-memory MoE: pair the callback systems instead
    results["mole_headline_system"], results["moe_offload_headline_system"] = head, moe_head
    how = ("host memory space, in-graph gather (no callback)" if head == "mole_host" else
           "host callback (the backend's host memory space was not usable: see *_error in the JSON)")
    print(f"# headline MoE-offload vs MoLE pair: {moe_head} vs {head} — both fp16, {how}")
    if 1 in batches:
        results["mole_vs_dense_latency"] = b1(head) / b1("dense")
        results["moe_offload_vs_mole_latency"] = b1(moe_head) / b1(head)
        results["moe_offload_vs_mole_latency_pcie16_modeled"] = (
            b1(moe_head, "latency_pcie16_modeled_ms") / b1(head, "latency_pcie16_modeled_ms"))
        if "b1" in S.get("mole_host_cb", {}):  # the callback pair, always reported
            results["moe_offload_cb_vs_mole_cb_latency"] = b1("moe_offload") / b1("mole_host_cb")
        if "b1" in S.get("moe_offload_host", {}) and "b1" in S.get("mole_host", {}):
            results["moe_offload_host_vs_mole_host_latency"] = (b1("moe_offload_host")
                                                                 / b1("mole_host"))
        results["mole_device_bytes_vs_dense"] = b1(head, "device_param_bytes") / b1("dense", "device_param_bytes")
        for key, name in (("mole_callback_vs_dense_latency", "mole_host_cb"),
                          ("mole_disk_vs_dense_latency", "mole_disk"),
                          ("mole_device_lut_vs_dense_latency", "mole_device"),
                          ("moe_resident_vs_dense_latency", "moe")):
            if "b1" in S.get(name, {}):  # absent when --skip'ped
                results[key] = b1(name) / b1("dense")
        if "b1" in S.get("moe", {}):
            results["moe_device_bytes_vs_dense"] = b1("moe", "device_param_bytes") / b1("dense", "device_param_bytes")
    for B in batches:  # per-repetition ratios (same round of the interleaved loop), median over rounds
        for name in ("mole_host", "mole_host_cb", "mole_disk", "mole_device"):
            if (B, name) in timers:
                ratios = [r[(B, name)] / r[(B, "dense")] for r in per_rep]
                results[f"{name}_vs_dense_b{B}_per_rep"] = [round(x, 3) for x in ratios]
                results[f"{name}_vs_dense_b{B}_median"] = float(np.median(ratios))
                results[f"{name}_vs_dense_b{B}_best"] = (S[name][f"b{B}"]["latency_ms"]
                                                         / S["dense"][f"b{B}"]["latency_ms"])
    B0 = f"b{batches[0]}"  # bytes per token do not depend on the batch's timing: report the first batch's
    results["mole_h2d_bytes_per_token"] = S[head][B0]["h2d_bytes_per_token"]
    results["moe_offload_h2d_bytes_per_token"] = S[moe_head][B0]["h2d_bytes_per_token"]
    results["lut_bytes"] = host_lut.nbytes
    results["wall_s"] = time.time() - t_start
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
