"""The training loop end to end on configs/tiny.py: outputs, exact resume after a real SIGKILL,
NaN stop keeping the last good checkpoint."""
import json
import math
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from pallasite.training.config import load_config
from pallasite.training.checkpointing import Checkpointer
from pallasite.training.loop import train
from pallasite.training.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.py")


def _config(*overrides):
    return load_config(TINY, overrides=list(overrides))


def _train_losses(workdir):
    return [(r["step"], r["loss"]) for r in read_jsonl(str(workdir), kind="train")]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """Uninterrupted 12-step run (eval every 6, checkpoints every 3), with HF export and a sample."""
    workdir = tmp_path_factory.mktemp("reference")
    result = train(_config(), str(workdir))
    return workdir, result


def test_end_to_end_outputs(reference_run):
    workdir, result = reference_run
    assert result["final_step"] == 12 and result["resumed_from"] == 0
    vocab = 384
    assert math.isfinite(result["eval_loss"]) and result["eval_loss"] < math.log(vocab)  # learned something
    assert result["unigram_entropy"] > 0 and result["tokens_per_s"] > 0
    steps = [s for s, _ in _train_losses(workdir)]
    assert steps == list(range(1, 13))  # one record per step
    evals = read_jsonl(str(workdir), kind="eval")
    assert [r["step"] for r in evals] == [6, 12] and evals[-1]["perplexity"] == pytest.approx(
        math.exp(evals[-1]["loss"]), rel=1e-6)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir / "tb"))
    assert Checkpointer(str(workdir / "checkpoints")).all_steps() == [9, 12]  # keep_checkpoints=2
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (workdir / "hf" / f).exists(), f
    if result["sample"] is not None:  # the inference engine is present
        assert result["sample"].startswith("def ")


def test_hf_export_holds_the_trained_weights(reference_run):
    from pallasite.models.hf import import_hf

    workdir, _ = reference_run
    cfg, state = import_hf(str(workdir / "hf"))
    ckpt = Checkpointer(str(workdir / "checkpoints"))
    from pallasite import sharding as shd
    from pallasite.training import step as st
    from pallasite.training.optim import make_optimizer

    config = _config()
    opt, _ = make_optimizer(config.optim, config.train.steps)
    _, abstract, _ = st.abstract_train_state(cfg, opt, shd.make_mesh({"data": 1}), shd.DEFAULT_RULES)
    saved, data_state, _ = ckpt.restore(12, abstract)
    a = jax.tree.leaves(state)
    b = jax.tree.leaves(saved["params"])
    assert len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b))
    assert data_state["epoch"] == 0 and data_state["batch"] == 12
    # pallasite.load(workdir) restores the latest checkpoint (any architecture), with the tokenizer;
    # an earlier step gives other logits (the restore is really by step)
    import pallasite
    from pallasite.api import load_workdir

    ids = np.array([[1, 5, 9, 2, 7]])
    from_workdir = pallasite.load(str(workdir))
    np.testing.assert_array_equal(np.asarray(from_workdir.logits(ids)),
                                  np.asarray(pallasite.load(str(workdir / "hf")).logits(ids)))
    assert from_workdir.tokenizer is not None
    assert not np.allclose(np.asarray(load_workdir(str(workdir), step=9).logits(ids)),
                           np.asarray(from_workdir.logits(ids)))


_KILL_SCRIPT = """
import os, signal, sys
from pallasite.training.config import load_config
from pallasite.training.loop import train
config = load_config(sys.argv[1], overrides=sys.argv[3:])
kill_at = 10
def hook(step, state):
    if step == kill_at:  # before step 11 runs; checkpoints 3, 6, 9 were started (9 may be in flight)
        os.kill(os.getpid(), signal.SIGKILL)
train(config, sys.argv[2], step_hook=hook)
raise SystemExit("not killed")
"""


def test_resume_after_kill_reproduces_losses_exactly(reference_run, tmp_path):
    ref_dir, _ = reference_run
    workdir = tmp_path / "killed"
    overrides = ["--config.train.export_hf=false", "--config.train.sample_tokens=0"]
    env = dict(os.environ)
    env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir or ""
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, TINY, str(workdir), *overrides], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    killed_steps = [s for s, _ in _train_losses(workdir)]
    assert killed_steps and max(killed_steps) <= 10
    committed = Checkpointer(str(workdir / "checkpoints")).latest_step()
    assert committed is not None and committed >= 3, proc.stderr[-2000:]

    result = train(_config(*overrides), str(workdir))  # a fresh process resumes from disk
    assert result["resumed_from"] == committed
    ref = _train_losses(ref_dir)
    got = _train_losses(workdir)
    assert [s for s, _ in got] == list(range(1, 13))
    assert got == ref  # bit-for-bit: same floats, not just close
    assert result["eval_loss"] == reference_run[1]["eval_loss"]


def test_nan_stops_run_and_keeps_last_good_checkpoint(tmp_path):
    workdir = tmp_path / "nan"

    def poison(step, state):
        if step == 8:  # the update of step 9 produces NaN; 9 is also a checkpoint step
            state = dict(state, params=jax.tree.map(lambda x: x * np.float32("nan"), state["params"]))
        return state

    config = _config("--config.train.export_hf=false", "--config.train.sample_tokens=0")
    with pytest.raises(FloatingPointError, match=r"step 9\b") as e:
        train(config, str(workdir), step_hook=poison)
    assert "step 6" in str(e.value)  # names the last good checkpoint
    ckpt = Checkpointer(str(workdir / "checkpoints"))
    assert ckpt.all_steps() == [3, 6]  # the bad state (step 9) was never saved
    records = read_jsonl(str(workdir), kind="train")
    assert records[-1]["step"] == 9 and records[-1]["loss"] == "nan"
    # the kept checkpoint is finite
    from pallasite import sharding as shd
    from pallasite.training import step as st
    from pallasite.training.loop import model_config_for
    from pallasite.models.tokenizer import load_tokenizer
    from pallasite.training.optim import make_optimizer

    cfg = model_config_for(config, load_tokenizer(str(workdir / "tokenizer")))
    opt, _ = make_optimizer(config.optim, config.train.steps)
    _, abstract, _ = st.abstract_train_state(cfg, opt, shd.make_mesh({"data": 1}), shd.DEFAULT_RULES)
    state, _, _ = ckpt.restore(6, abstract)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def test_resume_with_changed_config_fails_naming_the_section(reference_run, tmp_path):
    import shutil

    ref_dir, _ = reference_run
    workdir = tmp_path / "copy"
    shutil.copytree(ref_dir / "checkpoints", workdir / "checkpoints")
    shutil.copytree(ref_dir / "tokenizer", workdir / "tokenizer")
    with pytest.raises(ValueError, match=r"config\.seed"):
        train(_config("--config.seed=1", "--config.train.steps=13"), str(workdir))
