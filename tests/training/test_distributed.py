"""Multi-process training: 2 processes x 4 CPU devices (gloo) give the losses of 1 process x 8
devices — dense (data x fsdp mesh) and expert-parallel MoE with Occult dispatch (expert axis) —
and a 2-process run SIGKILLed after its first checkpoint resumes to the same losses.

Every run is ``pallasite train`` in fresh processes (the CLI's --coordinator flags), on
configs/tiny.py with a batch of 8 so every device holds rows of it."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from pallasite.training.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.py")
BASE = ["--config.data.batch_size=8", "--config.train.sample_tokens=0", "--config.train.eval_every=0",
        "--config.train.log_every=1", "--config.train.async_checkpointing=false"]
DENSE = BASE + ["--config.mesh.data=2", "--config.mesh.fsdp=4"]
MOE = BASE + ["--config.mesh.data=2", "--config.mesh.expert=4", "--config.model.ffn=moe",
              "--config.model.ffn_config={'num_experts': 8, 'top_k': 2, 'dispatch': 'occult'}",
              "--config.train.export_hf=false"]

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               TOKENIZERS_PARALLELISM="false", PALLASITE_HEARTBEAT_TIMEOUT_S="600")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


def _launch(workdir, processes: int, overrides: list[str]) -> list[subprocess.Popen]:
    cmd = [sys.executable, "-m", "pallasite.cli", "train", "--config", TINY, "--workdir", str(workdir), *overrides]
    if processes == 1:
        return [subprocess.Popen(cmd, env=_env(8), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    port = _free_port()
    return [subprocess.Popen(cmd + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                                    "--process-id", str(i)], env=_env(8 // processes), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for i in range(processes)]


def _wait(procs, timeout=900):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append(out)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def _losses(workdir):
    return [(r["step"], r["loss"]) for r in read_jsonl(str(workdir), kind="train")]


def _compare(ref, got):
    assert [s for s, _ in got] == [s for s, _ in ref]
    np.testing.assert_allclose([v for _, v in got], [v for _, v in ref], rtol=2e-5, atol=2e-6)


def test_two_processes_match_one_dense_and_resume_after_kill(tmp_path):
    steps = ["--config.train.steps=24", "--config.train.checkpoint_every=4"]
    ref = tmp_path / "ref"
    _wait(_launch(ref, 1, DENSE + steps))
    # 2 x 4: killed (both processes, SIGKILL) once the first checkpoint is committed, then resumed
    run = tmp_path / "mp"
    procs = _launch(run, 2, DENSE + steps)
    ckpts = run / "checkpoints"
    deadline = time.time() + 900
    while time.time() < deadline and not (ckpts.is_dir() and any(d.isdigit() for d in os.listdir(ckpts))):
        assert all(p.poll() is None for p in procs), "a process ended before its first checkpoint"
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.wait()
    assert not (run / "result.json").exists(), "the run finished before it could be killed"
    killed_at = max(int(d) for d in os.listdir(ckpts) if d.isdigit())
    assert killed_at < 24
    outs = _wait(_launch(run, 2, DENSE + steps))
    result = json.loads(outs[0].strip().splitlines()[-1])
    assert result["resumed_from"] == killed_at and result["final_step"] == 24
    _compare(_losses(ref), _losses(run))
    # process 0 alone wrote the metrics (one record per step) and the HF export gathered the
    # sharded parameters: the same weights as the one-process run
    from safetensors.numpy import load_file

    a, b = load_file(str(ref / "hf" / "model.safetensors")), load_file(str(run / "hf" / "model.safetensors"))
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_two_processes_match_one_moe_occult_expert_parallel(tmp_path):
    steps = ["--config.train.steps=6", "--config.train.checkpoint_every=0"]
    ref, run = tmp_path / "ref", tmp_path / "mp"
    _wait(_launch(ref, 1, MOE + steps))
    _wait(_launch(run, 2, MOE + steps))
    ref_l, run_l = _losses(ref), _losses(run)
    assert len(ref_l) == 6 and all(np.isfinite(v) for _, v in ref_l)
    _compare(ref_l, run_l)
    aux = [r for r in read_jsonl(str(run), kind="train") if "aux/load_balancing" in r or
           any(k.startswith("aux/") for k in r)]
    assert aux, "the MoE run reports no auxiliary losses: the MoE layer did not run"
