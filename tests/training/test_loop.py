"""The training loop end to end on configs/tiny.py: outputs, exact resume after a real SIGKILL,
NaN stop keeping the last good checkpoint, Ctrl-C saving a checkpoint, every step logged once
(JSONL and TensorBoard) after kills, strict result.json on a re-run, the resume refusal naming the
fields, files written with the user's umask, and `pallasite eval` agreeing with the run's eval."""
import json
import math
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

from pallasite.training.checkpointing import Checkpointer
from pallasite.training.config import load_config
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
    from pallasite.models.tokenizer import load_tokenizer
    from pallasite.training import step as st
    from pallasite.training.loop import model_config_for
    from pallasite.training.optim import make_optimizer

    cfg = model_config_for(config, load_tokenizer(str(workdir / "tokenizer")))
    opt, _ = make_optimizer(config.optim, config.train.steps)
    _, abstract, _ = st.abstract_train_state(cfg, opt, shd.make_mesh({"data": 1}), shd.DEFAULT_RULES)
    state, _, _ = ckpt.restore(6, abstract)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))


def test_resume_with_changed_config_names_the_fields_and_keeps_the_workdir(reference_run, tmp_path):
    import shutil

    from pallasite.errors import ResumeError

    ref_dir, _ = reference_run
    workdir = tmp_path / "copy"
    shutil.copytree(ref_dir, workdir)
    saved = (workdir / "config.json").read_text()
    with pytest.raises(ResumeError) as e:
        train(_config("--config.seed=1", "--config.model.d_model=48", "--config.train.steps=13"),
              str(workdir))
    msg = str(e.value)
    assert "config.seed: saved 0, now 1" in msg and "config.model.d_model: saved 32, now 48" in msg
    assert "n_heads" not in msg and "'family'" not in msg  # the differing fields, not both dicts
    assert (workdir / "config.json").read_text() == saved  # the refused run did not overwrite it


def _tb_scalars(workdir):
    """[(tag, step)] of every scalar in every TensorBoard event file of the run."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for name in sorted(os.listdir(workdir / "tb")):
        data = (workdir / "tb" / name).read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            out.extend((v.tag, event.step) for v in event.summary.value)
            i += 12 + n + 4
    return out


def test_kill_before_the_first_checkpoint_logs_every_step_once(reference_run, tmp_path):
    """A run dies at step 8 before any checkpoint (it had logged steps 1-8); the re-run starts over
    and the JSONL and TensorBoard logs hold each step once, with the reference run's losses."""
    workdir = tmp_path / "early"
    overrides = ["--config.train.export_hf=false", "--config.train.sample_tokens=0",
                 "--config.train.checkpoint_every=0", "--config.train.eval_every=0"]

    def die(step, state):
        if step == 8:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        train(_config(*overrides), str(workdir), step_hook=die)
    assert [s for s, _ in _train_losses(workdir)] == list(range(1, 9))
    assert Checkpointer(str(workdir / "checkpoints")).latest_step() is None
    train(_config(*overrides), str(workdir))
    got = _train_losses(workdir)
    assert [s for s, _ in got] == list(range(1, 13))
    assert got == _train_losses(reference_run[0])
    tb = _tb_scalars(workdir)
    train_steps = sorted(step for tag, step in tb if tag == "train/loss")
    assert train_steps == list(range(1, 13)), train_steps
    assert len(tb) == len(set(tb))  # no (tag, step) twice in the event files


def test_ctrl_c_saves_a_checkpoint_and_resumes_exactly(reference_run, tmp_path):
    from pallasite.errors import TrainingInterrupted

    workdir = tmp_path / "ctrl_c"
    overrides = ["--config.train.export_hf=false", "--config.train.sample_tokens=0"]

    def ctrl_c(step, state):
        if step == 4:  # arrives as step 5 is about to run: step 5 finishes, then the run stops
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(TrainingInterrupted, match="resume from step 5"):
        train(_config(*overrides), str(workdir), step_hook=ctrl_c)
    assert 5 in Checkpointer(str(workdir / "checkpoints")).all_steps()  # no regular checkpoint
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler was restored
    result = train(_config(*overrides), str(workdir))
    assert result["resumed_from"] == 5
    assert _train_losses(workdir) == _train_losses(reference_run[0])


def test_rerunning_a_finished_workdir_keeps_its_figures_and_strict_json(reference_run, tmp_path):
    import shutil

    ref_dir, ref = reference_run
    workdir = tmp_path / "again"
    shutil.copytree(ref_dir, workdir)
    result = train(_config(), str(workdir))
    assert result["steps_run"] == 0 and result["resumed_from"] == 12
    assert result["train_loss"] == ref["train_loss"]
    assert result["tokens_per_s"] == ref["tokens_per_s"]
    assert result["eval_loss"] == ref["eval_loss"]

    def refuse(name):
        raise AssertionError(f"result.json holds {name}: not strict JSON")

    on_disk = json.loads((workdir / "result.json").read_text(), parse_constant=refuse)
    assert on_disk["train_loss"] == ref["train_loss"]


def test_files_follow_the_users_umask(reference_run):
    """safetensors writes 0600 files; every output of a run is readable as the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    want = 0o444 & ~umask
    for dirpath, _, files in os.walk(reference_run[0]):
        for name in files:
            mode = os.stat(os.path.join(dirpath, name)).st_mode
            assert mode & 0o444 == want, (os.path.join(dirpath, name), oct(mode))


def test_cli_eval_of_a_workdir_matches_the_runs_eval(reference_run, capsys):
    from pallasite import cli

    workdir, result = reference_run
    capsys.readouterr()
    cli.main(["eval", "--model", str(workdir)])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["data"] == "heldout" and out["seq_len"] == 32
    assert out["nll"] == pytest.approx(result["eval_loss"], abs=1e-5)
    assert "held-out split" in captured.err and "packed windows of 32 tokens" in captured.err
    cli.main(["eval", "--model", str(workdir), "--data", "stdlib", "--max-windows", "4"])
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["seq_len"] == 32 and out["windows"] == 4  # the run's window length, and it says so
    assert "4 windows of 32 tokens" in captured.err
