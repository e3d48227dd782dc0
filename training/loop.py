"""The training loop: ``train(config, workdir) -> dict``.

    data -> tokenizer (trained or loaded) -> packed batches -> sharded state -> jitted steps
         -> periodic eval / checkpoints / metrics -> final HF export + tokenizer -> a sample

Guarantees: exact resume (the latest committed checkpoint holds the state, the data-iterator
position and the config; a killed run re-run in the same workdir gives bit-identical losses, and
``metrics.jsonl`` / ``tb/`` are cut back to the step it starts from, so every step is logged
once); a resume with a changed seed/model/data/tokenizer is refused naming the fields; the first
non-finite loss or gradient norm (checked on the host at each log/eval/checkpoint boundary)
raises ``FloatingPointError`` and no checkpoint holds an unchecked step; Ctrl-C finishes the step,
saves a checkpoint and raises ``TrainingInterrupted`` naming the step to resume from. Outputs in
``workdir``: ``checkpoints/``, ``tokenizer/``, ``metrics.jsonl``, ``tb/``, ``hf/``,
``config.json`` and ``result.json`` (strict JSON; unknown values are ``null``). docs/training.md.

Multi-process (``training/distributed.py``): every process runs the same steps on one global
mesh, feeds only the rows of each batch its devices hold and saves/restores the orbax checkpoint
together (``checkpoint_dir`` may be ``gs://``); process 0 alone logs and writes metrics,
TensorBoard, ``config.json``, ``result.json``, the tokenizer and the HF export.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Optional

import jax
import numpy as np
from flax import nnx

from pallasite import sharding as shd
from pallasite.errors import ConfigError, ResumeError, TrainingInterrupted, UserError
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
from pallasite.training.metrics import MetricsWriter, read_jsonl
from pallasite.training.optim import make_optimizer

StepHook = Callable[[int, dict], Optional[dict]]


class _NoMetrics:
    """The metrics sink of processes other than 0: every MetricsWriter method does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


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
    special-token ids filled from the tokenizer (``tokenizer=None``: only validate the fields)."""
    if tokenizer is not None:
        n_tok = len(tokenizer)
    else:  # validation only: any vocab of the configured size's order
        n_tok = 64 * max(1, int(config.tokenizer.vocab_size) // 64)
    vocab = int(config.model.vocab_size) or round_up(n_tok, 64)
    try:
        cfg = model_config_from(config.model, vocab_size=vocab)
    except (ValueError, TypeError) as e:  # ModelConfig's validation of the experiment's values
        if isinstance(e, UserError):
            raise
        raise ConfigError(f"config.model: {e}") from e
    if tokenizer is None:
        return cfg
    if cfg.vocab_size < n_tok:
        raise ConfigError(f"config.model.vocab_size={cfg.vocab_size} is smaller than the "
                          f"tokenizer's {n_tok} tokens")
    fill = {}
    if cfg.bos_token_id is None and tokenizer.bos_token_id is not None:
        fill["bos_token_id"] = int(tokenizer.bos_token_id)
    if cfg.eos_token_id is None and tokenizer.eos_token_id is not None:
        fill["eos_token_id"] = (int(tokenizer.eos_token_id),)
    if cfg.pad_token_id is None and tokenizer.pad_token_id is not None:
        fill["pad_token_id"] = int(tokenizer.pad_token_id)
    return cfg.replace(**fill) if fill else cfg


RESUME_SECTIONS = ("seed", "model", "data", "tokenizer")  # what a resumed run may not change


def config_diff(saved, current, prefix: str = "config") -> list[str]:
    """``"config.a.b: saved X, now Y"`` for every leaf that differs between two JSON dicts."""
    if isinstance(saved, dict) and isinstance(current, dict):
        out = []
        for key in sorted(set(saved) | set(current), key=str):
            if key not in current:
                out.append(f"{prefix}.{key}: saved {saved[key]!r}, now absent")
            elif key not in saved:
                out.append(f"{prefix}.{key}: absent when saved, now {current[key]!r}")
            else:
                out.extend(config_diff(saved[key], current[key], f"{prefix}.{key}"))
        return out
    return [] if saved == current else [f"{prefix}: saved {saved!r}, now {current!r}"]


def _check_resume_config(saved: dict, current: dict, workdir: str) -> None:
    diffs = [d for key in RESUME_SECTIONS
             for d in config_diff({key: saved.get(key)}, {key: current.get(key)})]
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; … ({len(diffs)} in all)" if len(diffs) > 8 else "")
        raise ResumeError(f"{workdir} holds a checkpoint of a run with a different config "
                          f"({shown}); "
                          f"resuming would mix two experiments: use a fresh --workdir to change "
                          f"{', '.join('config.' + k for k in RESUME_SECTIONS)}")


def evaluate(eval_fn, state: dict, batches, batch_shardings) -> dict:
    ce, n = 0.0, 0.0
    for b in batches:
        B = len(next(iter(b.values())))
        put = dist.global_batch(lambda lo, hi: {k: v[lo:hi] for k, v in b.items()}, batch_shardings, B)
        c, k = dist.host_value(eval_fn(state["params"], state["other"], put))
        ce, n = ce + float(c), n + float(k)
    loss = ce / max(n, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": n}


def sample(cfg, graphdef, state: dict, tokenizer, prompt: str, max_new_tokens: int, *,
           temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> str:
    """Completion of ``prompt`` with the inference engine (greedy at ``temperature=0``)."""
    model = nnx.merge(graphdef, state["params"], state["other"])
    g, s = nnx.split(model)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    stop = () if cfg.eos_token_id is None else tuple(cfg.eos_token_id)
    nucleus = top_p if temperature > 0 and top_p < 1 else None
    out = generate_ids(g, s, cfg, [ids], max_new_tokens=max_new_tokens, stop_tokens=stop,
                       temperature=temperature, top_p=nucleus, seed=seed)[0]
    return prompt + tokenizer.decode([t for t in out if t not in stop])


def explain_eval(eval_loss: float, unigram: float) -> str:
    """The eval loss next to the unigram baseline, in words a newcomer can read."""
    ppl, base = math.exp(min(eval_loss, 50.0)), math.exp(min(unigram, 50.0))
    gap = abs(unigram - eval_loss)
    verdict = (f"this model is {gap:.2f} nats/token better: it has learned to use the context"
               if eval_loss < unigram else
               f"this model is {gap:.2f} nats/token worse: it has not learned to use the context "
               f"yet")
    return (f"held-out loss {eval_loss:.3f} nats/token (perplexity {ppl:.0f}: as unsure as a blind "
            f"pick among {ppl:.0f} tokens). A model that ignores the context and only knows how "
            f"often each token occurs scores {unigram:.3f} (perplexity {base:.0f}). Lower is "
            f"better; {verdict}.")


class _StopOnInterrupt:
    """First Ctrl-C (SIGINT) asks the loop to stop after the current step; a second one raises at
    once. Only in the main thread (signal handlers cannot be installed elsewhere)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        _log("Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again to stop at once)")

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        return False


def _strict_json(value):
    """NaN/inf -> None, recursively (``result.json`` is strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict_json(v) for v in value]
    return value


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


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

    # ---- fail fast on a bad model or loss config, before data loading and tokenizer training
    if data_lib.data_kind_of(config.data)[0] == "lm":  # other kinds may bring their own model
        model_config_for(config, None)
    LOSS.get(tc.loss, field="config.train.loss")

    # ---- data and tokenizer (config.data.kind; "lm" = packed documents, lm_data below)
    spec = data_lib.build_data(config, workdir)
    tokenizer, train_ds, eval_batches, unigram = spec.tokenizer, spec.train, spec.eval_batches, spec.unigram_entropy
    for line in spec.summary.splitlines():
        _log(line)

    # ---- model, mesh, optimizer, state
    cfg = spec.model_config or model_config_for(config, tokenizer)
    mesh = shd.make_mesh(dict(config.mesh))
    rules = shd.rules_from_config(config.sharding_rules)
    optimizer, schedule = make_optimizer(config.optim, tc.steps)
    B = config.data.batch_size
    ckpt = Checkpointer(checkpoint_dir or os.path.join(workdir, "checkpoints"), keep=tc.keep_checkpoints,
                        async_save=tc.async_checkpointing)
    latest = ckpt.latest_step()
    data_state = None
    if latest is not None:
        # the config first: a changed model would otherwise fail later as a shape mismatch
        _check_resume_config(ckpt.saved_config(latest), config_json, workdir)
        graphdef, abstract, shardings = (spec.abstract_state or step_lib.abstract_train_state)(
            cfg, optimizer, mesh, rules, config.seed)
        state, data_state, _ = ckpt.restore(latest, abstract)
        _log(f"resumed from checkpoint step {latest} in {ckpt.directory}")
    else:
        graphdef, state, shardings = (spec.init_state or step_lib.init_train_state)(
            cfg, optimizer, mesh, rules, config.seed)
    if main:
        with open(os.path.join(workdir, "config.json"), "w") as f:  # only once the resume is accepted
            json.dump(config_json, f, indent=2)
    writer = MetricsWriter(workdir, start_step=int(latest or 0)) if main else _NoMetrics()
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
    tokens_per_step = spec.tokens_per_batch
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

    interrupt = _StopOnInterrupt()
    try:
        with jax.set_mesh(mesh), interrupt:
            for step in range(start, total):
                pos = it.next_position()
                if step_hook is not None:
                    state = step_hook(step, state) or state
                batch = dist.global_batch(lambda lo, hi: _batch_rows(train_ds, pos, lo, hi), batch_sh, B)
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
                    base = f"; unigram entropy {unigram:.4f}" if math.isfinite(unigram) else ""
                    _log(f"step {done}: eval loss {last_eval['loss']:.4f} (ppl {last_eval['perplexity']:.2f}"
                         f"{base})")
                    t_window = time.time()  # eval time is not training throughput
                if do_ckpt or (interrupt.requested and done < total):
                    if not do_ckpt:
                        flush(done)  # a checkpoint is written only after its steps were checked
                    ckpt.save(done, state, it.state(), config_json)
                    last_saved = done
                if interrupt.requested and done < total:
                    raise TrainingInterrupted(
                        f"stopped by Ctrl-C after step {done} of {total}; saved a checkpoint: "
                        f"re-run the same command to resume from step {done}")
            flush(total)
            if start >= total and not last_eval:
                last_eval = evaluate(eval_fn, state, eval_batches, batch_sh)
    except KeyboardInterrupt as e:
        if isinstance(e, TrainingInterrupted):
            raise
        ckpt.wait()
        good = ckpt.latest_step()
        resume = (f"resume from step {good} (the last checkpoint)" if good is not None
                  else "start from step 0")
        raise TrainingInterrupted(f"stopped by Ctrl-C before step {total}; re-running the same "
                                  f"command will {resume}") from None
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
            export_cfg, export_params = (spec.export(cfg, graphdef, state) if spec.export
                                         else (cfg, state["params"]))
            export_hf(export_cfg, jax.device_get(export_params), hf_dir)
            tokenizer.save_pretrained(hf_dir)
        _log(f"saved final model (HF format) and tokenizer to {hf_dir}")
    text = None
    if tc.sample_tokens > 0 and main:
        how = (f"temperature {tc.sample_temperature}, top-p {tc.sample_top_p}"
               if tc.sample_temperature > 0 else "greedy")
        kw = dict(temperature=float(tc.sample_temperature), top_p=float(tc.sample_top_p), seed=config.seed)
        if multi:  # the gathered host copy, on this process's devices only
            text = sample(cfg, graphdef, state, tokenizer, tc.sample_prompt, tc.sample_tokens, **kw)
        else:
            with jax.set_mesh(mesh):
                text = sample(cfg, graphdef, state, tokenizer, tc.sample_prompt, tc.sample_tokens, **kw)
        _log(f"sample ({how}):\n{text}")
    writer.close()
    if last_eval and math.isfinite(unigram):  # recipe data kinds have no unigram baseline
        _log(explain_eval(last_eval["loss"], unigram))
    steps_run = total - start
    previous = _read_json(os.path.join(workdir, "result.json")) or {}
    if not last_train and main:  # nothing trained in this call (a finished workdir): the log has it
        logged = read_jsonl(workdir, "train")
        last_train = next((r for r in reversed(logged) if r["step"] == total), {})
    # a finished run's throughput is kept, not zeroed, when this call trained nothing
    tokens_per_s = (steps_run * tokens_per_step / max(train_wall, 1e-9) if steps_run > 0
                    else previous.get("tokens_per_s"))
    result = {
        "final_step": total, "resumed_from": int(latest or 0), "steps_run": steps_run,
        "last_checkpoint": last_saved,
        "train_loss": last_train.get("loss"), "eval_loss": last_eval.get("loss"),
        "eval_perplexity": last_eval.get("perplexity"), "unigram_entropy": unigram,
        "num_params": n_params, "tokens_per_s": tokens_per_s,
        "wall_s": time.time() - t_start, "workdir": workdir, "hf_dir": hf_dir, "sample": text,
    }
    if spec.finish is not None:
        with jax.set_mesh(mesh):
            result.update(spec.finish(cfg, graphdef, state, workdir))
    result = _strict_json(result)
    if main:
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump(result, f, indent=2, allow_nan=False)
    dist.barrier("train_end")  # the processes leave together (the runtime's shutdown barrier times out)
    return result


def _batch_rows(dataset, pos, lo: int, hi: int) -> dict:
    """Rows [lo, hi) of batch ``pos``: read alone where the dataset can (``batch(..., rows=)``,
    e.g. ``PackedDataset``), else cut from the whole batch (data kinds without it)."""
    if "rows" in inspect.signature(dataset.batch).parameters:
        return dataset.batch(*pos, rows=(lo, hi))
    return {k: v[lo:hi] for k, v in dataset.batch(*pos).items()}


def lm_data(config: ConfigDict, workdir: str, kind_config=None) -> data_lib.DataSpec:
    """The default data kind ``lm``: documents -> tokenizer -> packed LM batches (``data.py``)."""
    train_docs, eval_docs = data_lib.load_documents(config.data)
    tokenizer = prepare_tokenizer(config, workdir, train_docs)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {config.tokenizer.path or 'trained'} has no eos token; "
                          f"packing needs one")
    eos = int(tokenizer.eos_token_id)
    train_ds = data_lib.PackedDataset(data_lib.tokenize_documents(tokenizer, train_docs, eos),
                                      seq_len=config.data.seq_len, batch_size=config.data.batch_size, seed=config.seed)
    eval_batches = data_lib.heldout_batches(config.data, tokenizer, eval_docs)
    unigram = data_lib.unigram_entropy(eval_batches)
    summary = (f"data: {len(train_docs)} train docs ({train_ds.num_tokens} tokens, {train_ds.batches_per_epoch} "
               f"batches/epoch); held-out unigram entropy {unigram:.4f} nats/token\n"
               f"eval set: {data_lib.describe_heldout(config.data, eval_docs, eval_batches)} "
               f"(`pallasite eval --model {workdir}` scores the same set)")
    return data_lib.DataSpec(tokenizer, train_ds, eval_batches, config.data.batch_size * config.data.seq_len,
                             summary=summary, unigram_entropy=unigram)


data_lib.DATA_KIND.register("lm", lm_data)


__all__ = ["train", "evaluate", "sample", "prepare_tokenizer", "model_config_for", "config_diff",
           "explain_eval", "lm_data"]
