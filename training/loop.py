"""The training loop: ``train(config, workdir) -> dict``.

    data -> tokenizer (trained or loaded) -> packed batches -> sharded state -> jitted steps
         -> periodic eval / checkpoints / metrics -> final HF export + tokenizer -> greedy sample

Guarantees:

* **Exact resume.** The latest committed checkpoint (train state + data-iterator position +
  config) is restored automatically; the data order depends only on the seed and the step, so a
  run killed at any point and restarted produces bit-identical losses to an uninterrupted run.
  ``metrics.jsonl`` is truncated to the restored step so it describes one run.
* **NaN/inf stop.** Losses and gradient norms are pulled to the host at every log / eval /
  checkpoint boundary (not every step: that would serialise the device); the first non-finite
  value raises ``FloatingPointError`` naming the step. A checkpoint is only ever written after
  every step up to it has been checked, so the last checkpoint is always a good state.
* **Multi-process.** Launched as several processes (``training/distributed.py``), every process
  runs the same steps on one global mesh, feeds only the rows of each batch its devices hold,
  and saves/restores the orbax checkpoint together; process 0 alone logs and writes metrics,
  TensorBoard, ``config.json``, ``result.json``, the tokenizer and the HF export.
  ``checkpoint_dir`` may be a ``gs://`` path (orbax writes it directly).
* Everything runs under ``jax.set_mesh(mesh)`` with the mesh of ``config.mesh`` and the rule
  table of ``config.sharding_rules`` (MoE layers find the mesh there for ``shard_map``).

Outputs in ``workdir``: ``checkpoints/`` (orbax), ``tokenizer/``, ``metrics.jsonl``, ``tb/``
(TensorBoard events), ``hf/`` (final model in Hugging Face layout + tokenizer), ``config.json``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Callable, Optional

import jax
import numpy as np
from flax import nnx

from pallasite import sharding as shd
from pallasite.inference.engine import generate_ids
from pallasite.models.config import model_config_from
from pallasite.models.tokenizer import load_tokenizer, train_bpe
from pallasite.ops.common import round_up
from pallasite.registry import LOSS
from pallasite.training import data as data_lib
from pallasite.training import distributed as dist
from pallasite.training import step as step_lib
from pallasite.training.checkpointing import Checkpointer
from pallasite.training.config import ConfigDict, to_json_dict
from pallasite.training.metrics import MetricsWriter
from pallasite.training.optim import make_optimizer

StepHook = Callable[[int, dict], Optional[dict]]


class _NoMetrics:
    """The metrics sink of processes other than 0."""

    def truncate_after(self, step):
        pass

    def write(self, step, metrics, *, kind="train"):
        pass

    def flush(self):
        pass

    def close(self):
        pass


def _log(msg: str) -> None:
    if not dist.is_main():
        return
    try:
        from tqdm import tqdm

        tqdm.write(f"[train] {msg}", file=sys.stderr)
    except ImportError:  # pragma: no cover
        print(f"[train] {msg}", file=sys.stderr, flush=True)


def prepare_tokenizer(config: ConfigDict, workdir: str, train_docs) -> Any:
    """The run's tokenizer: ``config.tokenizer.path``, else the one this run trained earlier
    (resume), else a fresh byte-level BPE on the training split, saved to ``workdir/tokenizer``."""
    if config.tokenizer.path:
        return load_tokenizer(config.tokenizer.path)
    tok_dir = os.path.join(workdir, "tokenizer")
    # Process 0 loads or trains+saves it; then the others read it (a workdir that is not shared
    # between hosts: they train the same deterministic BPE themselves, without saving).
    tok = None
    if dist.is_main():
        tok = _load_or_train_tokenizer(config, tok_dir, train_docs, save=True)
    dist.barrier("tokenizer")
    if tok is None:
        tok = _load_or_train_tokenizer(config, tok_dir, train_docs, save=False)
    return tok


def _load_or_train_tokenizer(config: ConfigDict, tok_dir: str, train_docs, *, save: bool):
    if os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        return load_tokenizer(tok_dir)
    budget = config.tokenizer.train_max_chars

    def texts():
        used = 0
        for d in train_docs:
            if budget and used >= budget:
                return
            yield d.text
            used += len(d.text)

    t0 = time.time()
    tok = train_bpe(texts(), config.tokenizer.vocab_size, save_to=tok_dir if save else None)
    _log(f"trained byte-level BPE: vocab {len(tok)} in {time.time() - t0:.1f}s -> {tok_dir}")
    return tok


def model_config_for(config: ConfigDict, tokenizer):
    """ModelConfig from ``config.model`` with vocab (0 = tokenizer size rounded up to 64) and
    special-token ids filled from the tokenizer."""
    n_tok = len(tokenizer)
    vocab = int(config.model.vocab_size) or round_up(n_tok, 64)
    cfg = model_config_from(config.model, vocab_size=vocab)
    if cfg.vocab_size < n_tok:
        raise ValueError(f"config.model.vocab_size={cfg.vocab_size} is smaller than the tokenizer's {n_tok} tokens")
    fill = {}
    if cfg.bos_token_id is None and tokenizer.bos_token_id is not None:
        fill["bos_token_id"] = int(tokenizer.bos_token_id)
    if cfg.eos_token_id is None and tokenizer.eos_token_id is not None:
        fill["eos_token_id"] = (int(tokenizer.eos_token_id),)
    if cfg.pad_token_id is None and tokenizer.pad_token_id is not None:
        fill["pad_token_id"] = int(tokenizer.pad_token_id)
    return cfg.replace(**fill) if fill else cfg


def _check_resume_config(saved: dict, current: dict) -> None:
    for key in ("seed", "model", "data", "tokenizer"):
        if saved.get(key) != current.get(key):
            raise ValueError(f"workdir checkpoint was written with a different config.{key}: saved "
                             f"{saved.get(key)!r}, now {current.get(key)!r}; use a fresh workdir to change it")


def evaluate(eval_fn, state: dict, batches, batch_shardings) -> dict:
    ce, n = 0.0, 0.0
    for b in batches:
        B = len(next(iter(b.values())))
        put = dist.global_batch(lambda lo, hi: {k: v[lo:hi] for k, v in b.items()}, batch_shardings, B)
        c, k = dist.host_value(eval_fn(state["params"], state["other"], put))
        ce, n = ce + float(c), n + float(k)
    loss = ce / max(n, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": n}


def sample(cfg, graphdef, state: dict, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy completion of ``prompt`` with the inference engine."""
    model = nnx.merge(graphdef, state["params"], state["other"])
    g, s = nnx.split(model)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    stop = () if cfg.eos_token_id is None else tuple(cfg.eos_token_id)
    out = generate_ids(g, s, cfg, [ids], max_new_tokens=max_new_tokens, stop_tokens=stop)[0]
    return prompt + tokenizer.decode([t for t in out if t not in stop])


def train(config: ConfigDict, workdir: str, *, step_hook: Optional[StepHook] = None,
          checkpoint_dir: Optional[str] = None) -> dict:
    """Train (or resume) the experiment ``config`` in ``workdir``; returns a summary dict.

    ``step_hook(step, state)`` (tests and debugging) runs before each step and may return a
    replacement state. ``checkpoint_dir`` (default ``workdir/checkpoints``; ``gs://`` allowed)."""
    t_start = time.time()
    workdir = os.path.abspath(workdir)
    os.makedirs(workdir, exist_ok=True)
    main = dist.is_main()
    tc = config.train
    config_json = to_json_dict(config)
    if main:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(config_json, f, indent=2)

    # ---- data and tokenizer
    train_docs, eval_docs = data_lib.load_documents(config.data)
    tokenizer = prepare_tokenizer(config, workdir, train_docs)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {config.tokenizer.path or 'trained'} has no eos token; packing needs one")
    eos = int(tokenizer.eos_token_id)
    train_ds = data_lib.PackedDataset(data_lib.tokenize_documents(tokenizer, train_docs, eos),
                                      seq_len=config.data.seq_len, batch_size=config.data.batch_size, seed=config.seed)
    eval_ds = data_lib.PackedDataset(data_lib.tokenize_documents(tokenizer, eval_docs, eos),
                                     seq_len=config.data.seq_len, batch_size=config.data.batch_size, seed=0,
                                     shuffle=False)
    eval_batches = eval_ds.first_batches(config.data.eval_batches)
    unigram = data_lib.unigram_entropy(eval_batches)
    _log(f"data: {len(train_docs)} train docs ({train_ds.num_tokens} tokens, {train_ds.batches_per_epoch} "
         f"batches/epoch), {len(eval_docs)} eval docs; held-out unigram entropy {unigram:.4f} nats/token")

    # ---- model, mesh, optimizer, state
    cfg = model_config_for(config, tokenizer)
    mesh = shd.make_mesh(dict(config.mesh))
    rules = shd.rules_from_config(config.sharding_rules)
    optimizer, schedule = make_optimizer(config.optim, tc.steps)
    B = config.data.batch_size
    ckpt = Checkpointer(checkpoint_dir or os.path.join(workdir, "checkpoints"), keep=tc.keep_checkpoints,
                        async_save=tc.async_checkpointing)
    writer = MetricsWriter(workdir) if main else _NoMetrics()
    latest = ckpt.latest_step()
    data_state = None
    if latest is not None:
        graphdef, abstract, shardings = step_lib.abstract_train_state(cfg, optimizer, mesh, rules, config.seed)
        state, data_state, saved_config = ckpt.restore(latest, abstract)
        _check_resume_config(saved_config, config_json)
        writer.truncate_after(latest)
        _log(f"resumed from checkpoint step {latest} in {ckpt.directory}")
    else:
        graphdef, state, shardings = step_lib.init_train_state(cfg, optimizer, mesh, rules, config.seed)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state["params"]))
    _log(f"model: {n_params / 1e6:.2f}M params, vocab {cfg.vocab_size}, mesh {dict(mesh.shape)}, "
         f"{jax.process_count()} process(es)")

    loss = LOSS.get(tc.loss, field="config.train.loss")
    loss_config = LOSS.make_config(tc.loss, tc.loss_config.to_dict() if hasattr(tc.loss_config, "to_dict")
                                   else tc.loss_config, field="config.train.loss_config")
    train_step = step_lib.make_train_step(graphdef, optimizer, schedule, shardings, mesh, rules, B, loss=loss,
                                          loss_config=loss_config, grad_accum=tc.grad_accum, loss_chunk=tc.loss_chunk)
    eval_fn = step_lib.make_eval_step(graphdef, shardings, mesh, rules, B, loss=loss, loss_config=loss_config,
                                      loss_chunk=tc.loss_chunk)
    batch_sh = step_lib.batch_shardings(mesh, rules, B, loss.batch_keys)
    it = train_ds.iterator(data_state)

    start = int(dist.host_value(state["step"]))
    total = int(tc.steps)
    tokens_per_step = B * config.data.seq_len
    pending: list[tuple[int, Any]] = []
    last_train: dict = {}
    last_eval: dict = {}
    last_saved = latest
    bar = None
    if tc.progress and start < total and main:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    t_window, steps_window = time.time(), 0
    t_loop = time.time()

    def flush(step: int) -> None:
        """Pull pending metrics, stop on the first non-finite one, write them."""
        nonlocal pending, last_train, t_window, steps_window
        if not pending:
            return
        host = dist.host_value([m for _, m in pending])
        for (s, _), m in zip(pending, host):
            m = {k: float(v) for k, v in m.items()}
            if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
                ckpt.wait()
                writer.write(s, m)
                writer.close()
                good = ckpt.latest_step()
                raise FloatingPointError(
                    f"non-finite training loss at step {s} (loss={m['loss']}, grad_norm={m['grad_norm']}); "
                    f"stopped without saving it. Last good checkpoint: "
                    f"{'step ' + str(good) + ' in ' + ckpt.directory if good is not None else 'none'}")
            writer.write(s, m)
            last_train = m
        dt = time.time() - t_window
        tok_s = steps_window * tokens_per_step / max(dt, 1e-9)
        writer.write(step, {"tokens_per_s": tok_s}, kind="perf")
        writer.flush()
        if bar is not None:
            bar.update(len(pending))
            bar.set_postfix(loss=f"{last_train['loss']:.4f}", tok_s=f"{tok_s:,.0f}")
        pending, t_window, steps_window = [], time.time(), 0

    try:
        with jax.set_mesh(mesh):
            for step in range(start, total):
                pos = it.next_position()
                if step_hook is not None:
                    state = step_hook(step, state) or state
                batch = dist.global_batch(lambda lo, hi: train_ds.batch(*pos, rows=(lo, hi)), batch_sh, B)
                state, metrics = train_step(state, batch)
                done = step + 1
                pending.append((done, metrics))
                steps_window += 1
                do_eval = done == total or (tc.eval_every and done % tc.eval_every == 0)
                do_ckpt = done == total or (tc.checkpoint_every and done % tc.checkpoint_every == 0)
                if do_eval or do_ckpt or done % max(tc.log_every, 1) == 0:
                    flush(done)
                if do_eval:
                    last_eval = evaluate(eval_fn, state, eval_batches, batch_sh)
                    writer.write(done, {"loss": last_eval["loss"], "perplexity": last_eval["perplexity"],
                                        "unigram_entropy": unigram}, kind="eval")
                    _log(f"step {done}: eval loss {last_eval['loss']:.4f} (ppl {last_eval['perplexity']:.2f}; "
                         f"unigram entropy {unigram:.4f})")
                    t_window = time.time()  # eval time is not training throughput
                if do_ckpt:
                    ckpt.save(done, state, it.state(), config_json)
                    last_saved = done
            flush(total)
            if start >= total and not last_eval:
                last_eval = evaluate(eval_fn, state, eval_batches, batch_sh)
    finally:
        if bar is not None:
            bar.close()
        ckpt.wait()
    train_wall = time.time() - t_loop
    ckpt.close()

    # ---- final model, tokenizer, sample
    hf_dir = None
    multi = jax.process_count() > 1
    if multi and (tc.export_hf or tc.sample_tokens > 0):  # every process joins the gather
        state = {k: dist.host_value(state[k]) for k in ("params", "other")}
    if tc.export_hf:
        from pallasite.models.hf import export_hf

        hf_dir = os.path.join(workdir, "hf")
        if main:
            export_hf(cfg, jax.device_get(state["params"]), hf_dir)
            tokenizer.save_pretrained(hf_dir)
        _log(f"saved final model (HF format) and tokenizer to {hf_dir}")
    text = None
    if tc.sample_tokens > 0 and main:
        if multi:  # the gathered host copy, on this process's devices only
            text = sample(cfg, graphdef, state, tokenizer, tc.sample_prompt, tc.sample_tokens)
        else:
            with jax.set_mesh(mesh):
                text = sample(cfg, graphdef, state, tokenizer, tc.sample_prompt, tc.sample_tokens)
        if text is not None:
            _log(f"sample (greedy): {text!r}")
    writer.close()
    steps_run = total - start
    result = {
        "final_step": total, "resumed_from": int(latest or 0), "last_checkpoint": last_saved,
        "train_loss": last_train.get("loss", float("nan")), "eval_loss": last_eval.get("loss", float("nan")),
        "eval_perplexity": last_eval.get("perplexity", float("nan")), "unigram_entropy": unigram,
        "num_params": n_params, "tokens_per_s": steps_run * tokens_per_step / max(train_wall, 1e-9),
        "wall_s": time.time() - t_start, "workdir": workdir, "hf_dir": hf_dir, "sample": text,
    }
    if main:
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier("train_end")  # the processes leave together (the runtime's shutdown barrier times out)
    return result


__all__ = ["train", "evaluate", "sample", "prepare_tokenizer", "model_config_for"]
