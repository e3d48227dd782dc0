"""AOT memory check: compile the real train (or decode) step for a TPU topology on a CPU host.

As MaxText's ``train_compile``: libtpu (the ``tpu`` extra) describes an abstract slice
(``jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name="v5p:4x4x4")``),
the config's mesh is laid over its chips, the train state and one batch become
``ShapeDtypeStruct``s carrying their shardings (nothing is allocated), and the jitted step of
``training/step.py`` is lowered and compiled by the real XLA:TPU compiler. The per-chip figure
is ``memory_analysis()``'s arguments + outputs - aliased (donated) + temporaries + code, compared
with the chip's HBM (``HBM_BYTES``). ``--step decode`` compiles one cached decode step
(batch ``--batch``, cache ``--cache-len``) and reports the bytes it reads per step.

    pallasite compile --config configs/llama3_8b.py --topology v5p:4x4x4 [--batch 256] [--timeout 900]

Prints a table, then ONE JSON line (``topology``, ``per_chip_bytes``, ``fits``, ...). The compile
runs in a child process killed after ``--timeout`` seconds (some compiles hang instead of
failing). Exit status: 0 fits, 1 does not fit, 2 compile error, 3 timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Optional, Sequence

GIB = 1024**3
# HBM per chip (Cloud TPU system architecture pages), keyed by jax's device_kind
HBM_BYTES = {
    "TPU v4": 32 * GIB,
    "TPU v5 lite": 16 * GIB,
    "TPU v5": 95 * GIB,
    "TPU v5p": 95 * GIB,
    "TPU v6 lite": 32 * GIB,
}


def topology_devices(topology: str):
    """The abstract chips of ``topology`` (``v5e:2x2``, ``v5p:4x4x4``, ...); needs libtpu."""
    from jax.experimental import topologies

    if ":" not in topology:
        raise ValueError(f"--topology {topology!r}: expected GENERATION:SHAPE, e.g. v5e:2x2 or v5p:4x4x4")
    try:
        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # libtpu missing or an unknown shape: say which
        raise ValueError(f"--topology {topology!r}: libtpu could not describe it ({type(e).__name__}: {e}); "
                         f"install the tpu extra (pip install 'pallasite[tpu]') and use e.g. v5e:2x2") from e
    return list(desc.devices)


def _mesh_for(config, devices):
    from pallasite import sharding as shd

    shape = {k: int(v) for k, v in dict(config.mesh).items()}
    return shd.make_mesh(shape, devices=devices)


def _model_cfg(config):
    from pallasite.models.config import model_config_from
    from pallasite.ops.common import round_up

    vocab = int(config.model.vocab_size) or round_up(int(config.tokenizer.vocab_size), 64)
    return model_config_from(config.model, vocab_size=vocab)


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    parts = {k: int(getattr(m, f"{k}_size_in_bytes", 0) or 0)
             for k in ("argument", "output", "alias", "temp", "generated_code")}
    parts["per_chip_bytes"] = (parts["argument"] + parts["output"] - parts["alias"] + parts["temp"]
                               + parts["generated_code"])
    return parts


def compile_train_step(config, devices, *, batch_size: Optional[int] = None):
    """(compiled, info) for the config's train step on ``devices`` (abstract or real)."""
    import jax
    import numpy as np

    from pallasite import sharding as shd
    from pallasite.registry import LOSS
    from pallasite.training import step as step_lib
    from pallasite.training.optim import make_optimizer

    cfg = _model_cfg(config)
    mesh = _mesh_for(config, devices)
    rules = shd.rules_from_config(config.sharding_rules)
    tc = config.train
    B = int(batch_size or config.data.batch_size)
    T = int(config.data.seq_len)
    optimizer, schedule = make_optimizer(config.optim, tc.steps)
    loss = LOSS.get(tc.loss, field="config.train.loss")
    loss_config = LOSS.make_config(tc.loss, tc.loss_config.to_dict() if hasattr(tc.loss_config, "to_dict")
                                   else tc.loss_config, field="config.train.loss_config")
    graphdef, abstract, shardings = step_lib.abstract_train_state(cfg, optimizer, mesh, rules, config.seed)
    batch_sh = step_lib.batch_shardings(mesh, rules, B, loss.batch_keys)
    batch = {k: jax.ShapeDtypeStruct((B, T), np.float32 if "mask" in k else np.int32, sharding=batch_sh[k])
             for k in loss.batch_keys}
    fn = step_lib.make_train_step(graphdef, optimizer, schedule, shardings, mesh, rules, B, loss=loss,
                                  loss_config=loss_config, grad_accum=tc.grad_accum, loss_chunk=tc.loss_chunk)
    with jax.set_mesh(mesh):
        compiled = fn.lower(abstract, batch).compile()
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(abstract["params"]))
    return compiled, {"step": "train", "batch": B, "seq_len": T, "num_params": n_params,
                      "mesh": {k: int(v) for k, v in mesh.shape.items()}}


def compile_decode_step(config, devices, *, batch_size: int = 1, cache_len: int = 0):
    """(compiled, info) for one cached decode step (one new token per row) of the config's model,
    parameters and cache placed with the config's mesh; ``bytes_per_step`` = parameters + cache
    read once (the HBM traffic floor of a bandwidth-bound step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallasite import sharding as shd
    from pallasite.inference.engine import forward_with_cache
    from pallasite.models.transformer import Transformer
    from pallasite.registry import KV_CACHE
    from pallasite.training.step import attach_shardings

    cfg = _model_cfg(config)
    mesh = _mesh_for(config, devices)
    rules = shd.rules_from_config(config.sharding_rules)
    S = int(cache_len or cfg.max_seq_len)
    graphdef, abstract = jax.eval_shape(lambda: nnx.split(Transformer(cfg, rngs=nnx.Rngs(0))))
    abstract_idx = jax.tree.map(lambda a: np.broadcast_to(np.zeros((), a.dtype), a.shape), abstract)
    state = attach_shardings(abstract, shd.state_shardings(abstract_idx, mesh, rules))
    cache_cls = KV_CACHE.get(cfg.kv_cache)
    cache = jax.eval_shape(lambda: cache_cls.create(cfg, batch_size, S, config=None))
    replicated = NamedSharding(mesh, P())
    cache = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), cache)
    tok = jax.ShapeDtypeStruct((batch_size, 1), jnp.int32, sharding=replicated)
    with jax.set_mesh(mesh):
        compiled = forward_with_cache.lower(graphdef, state, cache, tok, tok).compile()
    param_bytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract))
    cache_bytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(cache))
    return compiled, {"step": "decode", "batch": batch_size, "cache_len": S, "param_bytes": param_bytes,
                      "cache_bytes": cache_bytes, "bytes_per_step": param_bytes + cache_bytes,
                      "mesh": {k: int(v) for k, v in mesh.shape.items()}}


def check(config, topology: str, *, step: str = "train", batch_size: Optional[int] = None,
          cache_len: int = 0, hbm_bytes: Optional[int] = None) -> dict:
    """Compile ``step`` for ``topology`` in this process; the report dict (see module docstring)."""
    devices = topology_devices(topology)
    kind = devices[0].device_kind
    hbm = int(hbm_bytes or HBM_BYTES.get(kind, 0)) or None
    t0 = time.time()
    if step == "train":
        compiled, info = compile_train_step(config, devices, batch_size=batch_size)
    elif step == "decode":
        compiled, info = compile_decode_step(config, devices, batch_size=batch_size or 1, cache_len=cache_len)
    else:
        raise ValueError(f"--step {step!r}; expected train | decode")
    mem = _memory(compiled)
    fits = None if hbm is None else mem["per_chip_bytes"] <= hbm
    return {"topology": topology, "device_kind": kind, "chips": len(devices), **info, **mem,
            "hbm_bytes_per_chip": hbm, "fits": fits, "compile_s": round(time.time() - t0, 1)}


def format_report(r: dict) -> str:
    g = lambda b: f"{b / 2**20:12.1f} MiB"  # noqa: E731
    lines = [f"AOT {r['step']} step for {r['topology']} ({r['chips']} x {r['device_kind']}), mesh {r['mesh']}, "
             f"batch {r['batch']}, compiled in {r['compile_s']} s"]
    for k in ("argument", "output", "alias", "temp", "generated_code"):
        lines.append(f"  {k:<15}{g(r[k])}")
    lines.append(f"  {'per chip':<15}{g(r['per_chip_bytes'])}  ({r['per_chip_bytes']} bytes)")
    if r.get("bytes_per_step"):
        lines.append(f"  {'read per step':<15}{g(r['bytes_per_step'])}  (parameters + KV cache, all chips)")
    if r["hbm_bytes_per_chip"] is None:
        lines.append(f"  HBM of {r['device_kind']!r} unknown: pass --hbm-gib")
    elif r["fits"]:
        lines.append(f"  fits: {r['per_chip_bytes']} of {r['hbm_bytes_per_chip']} bytes HBM per chip "
                     f"({100 * r['per_chip_bytes'] / r['hbm_bytes_per_chip']:.0f}%)")
    else:
        lines.append(f"  DOES NOT FIT: needs {r['per_chip_bytes']} bytes per chip, the chip has "
                     f"{r['hbm_bytes_per_chip']} bytes HBM (over by "
                     f"{r['per_chip_bytes'] - r['hbm_bytes_per_chip']} bytes); lower the batch, raise "
                     f"fsdp, turn on remat or grad_accum")
    return "\n".join(lines)


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def compiler_oom_bytes(message: str) -> tuple[Optional[int], Optional[int]]:
    """(needed, available) bytes from XLA:TPU's "Ran out of memory in memory space hbm ... (323.75G)
    exceeds available HBM (95.74G)" message; (None, None) for any other error."""
    import re

    m = re.search(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT]?)\).*?available[^(]*\(([\d.]+)([KMGT]?)\)", message)
    if not m:
        return None, None
    return int(float(m.group(1)) * _UNITS[m.group(2)]), int(float(m.group(3)) * _UNITS[m.group(4)])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pallasite compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="config file with get_config(arg); 'file.py:arg' passes arg")
    p.add_argument("--topology", required=True, help="TPU slice, e.g. v5e:2x2, v5e:16x16, v5p:4x4x4")
    p.add_argument("--step", default="train", choices=("train", "decode"))
    p.add_argument("--batch", type=int, default=None, help="global batch (default: config.data.batch_size; "
                                                          "decode: 1)")
    p.add_argument("--cache-len", type=int, default=0, help="decode: KV cache length (default max_seq_len)")
    p.add_argument("--hbm-gib", type=float, default=None, help="HBM per chip, overriding the built-in table")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the compile is killed (0: none)")
    return p


def _run_here(args, overrides: Sequence[str]) -> int:
    from pallasite.errors import describe, is_user_error
    from pallasite.training.config import load_config

    hbm = int(args.hbm_gib * GIB) if args.hbm_gib else None
    try:
        config = load_config(args.config, overrides=overrides)
        r = check(config, args.topology, step=args.step, batch_size=args.batch, cache_len=args.cache_len,
                  hbm_bytes=hbm)
    except Exception as e:
        # a bad config, or a mesh the topology cannot hold (ValueError): one line, as cli.main does
        # (this runs in a child process, outside it); anything else is the compiler's verdict
        if not (is_user_error(e) or isinstance(e, ValueError)):
            return _compile_failure(args, e)
        if os.environ.get("PALLASITE_DEBUG", "").lower() not in ("", "0", "false", "no"):
            raise
        print(f"pallasite compile: error: {describe(e)}  (--debug shows the traceback)", file=sys.stderr)
        print(json.dumps({"topology": args.topology, "per_chip_bytes": None, "fits": None, "error": describe(e)}))
        return 2
    print(format_report(r))
    print(json.dumps(r))
    return 0 if r["fits"] in (True, None) else 1


def _compile_failure(args, e: Exception) -> int:
    """A compile error, e.g. the TPU compiler's own out-of-memory verdict."""
    msg = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    need, have = compiler_oom_bytes(msg)
    if need is not None:  # XLA:TPU refused it for HBM: that *is* the answer "does not fit"
        print(f"DOES NOT FIT on {args.topology}: the TPU compiler needs at least {need} bytes per chip for "
              f"temporaries alone, the chip has {have} bytes HBM ({msg})")
        print(json.dumps({"topology": args.topology, "per_chip_bytes": need, "hbm_bytes_per_chip": have,
                          "fits": False, "error": msg}))
        return 1
    print(f"compile failed for {args.topology}: {msg}", file=sys.stderr)
    print(json.dumps({"topology": args.topology, "per_chip_bytes": None, "fits": None, "error": msg}))
    return 2


def main(argv: Optional[Sequence[str]] = None, overrides: Sequence[str] = ()) -> int:
    """CLI entry. With ``--timeout`` > 0 the compile runs in a child process (a hung compile
    cannot be interrupted from Python) and is killed after that many seconds."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if not args.timeout:
        return _run_here(args, overrides)
    child = [sys.executable, "-m", "pallasite.training.compile_check", *argv, "--timeout", "0",
             *[f"--config.{o}" for o in overrides]]
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")  # the TPU compiler runs from libtpu; no TPU is needed
    env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # another process's libtpu lockfile is no obstacle
    try:
        return subprocess.run(child, env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        msg = f"the compile did not finish within --timeout {args.timeout:g} s"
        print(f"compile for {args.topology}: {msg}", file=sys.stderr)
        print(json.dumps({"topology": args.topology, "per_chip_bytes": None, "fits": None, "error": msg}))
        return 3


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    _argv, _overrides = [], []
    for a in sys.argv[1:]:
        (_overrides if a.startswith("--config.") else _argv).append(a[len("--config."):] if
                                                                   a.startswith("--config.") else a)
    sys.exit(main(_argv, _overrides))
