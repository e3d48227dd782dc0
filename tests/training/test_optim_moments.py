"""Adam with FP8 / FP16 moments (``training/optim_moments.py``, FP8-LM's mixed precision used by
FP4 training): per-tensor scaling keeps tiny moments representable (a plain cast flushes them to
zero, and Adam then stops tracking), the optimizer follows float32 AdamW closely, its state is 3
bytes per parameter, a bad ``optim.moments`` names the field, and a run with it resumes exactly."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pallasite.errors import ConfigError
from pallasite.training import optim_moments as om
from pallasite.training.config import load_config, train_defaults
from pallasite.training.optim import make_optimizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_scaled_storage_keeps_tiny_values_a_plain_cast_flushes_them():
    x = jnp.asarray(np.random.default_rng(0).normal(size=4096) * 1e-6, jnp.float32)
    for dtype, rel in ((jnp.float8_e4m3fn, 2.0**-4), (jnp.float16, 2.0**-11)):
        t = om.store(x, dtype)
        fmax, ratio = om.FMT_MAX[jnp.dtype(dtype)], float(jnp.max(jnp.abs(x)) / t.scale)
        assert np.frexp(np.float32(t.scale))[0] == 0.5 and fmax / 2 < ratio <= fmax  # a power of two
        err = jnp.abs(om.load(t) - x)
        big = jnp.abs(x) > 1e-3 * jnp.max(jnp.abs(x))  # away from the format's underflow
        assert float(jnp.max(err[big] / jnp.abs(x[big]))) <= rel
    assert float(jnp.mean(x.astype(jnp.float8_e4m3fn).astype(jnp.float32) == 0)) > 0.99  # the negative control


def _regression(opt, steps=150, grad_scale=1.0):
    rng = np.random.default_rng(1)
    X = jnp.asarray(rng.normal(size=(256, 64)), jnp.float32)
    Y = jnp.asarray(rng.normal(size=(256, 16)), jnp.float32)
    p = {"w": jnp.asarray(rng.normal(size=(64, 16)) * 0.1, jnp.float32), "b": jnp.zeros(16)}
    loss = lambda p: jnp.mean((X @ p["w"] + p["b"] - Y) ** 2)  # noqa: E731
    s = opt.init(p)
    for _ in range(steps):
        g = jax.tree.map(lambda a: a * grad_scale, jax.grad(loss)(p))  # Adam is invariant to the scale
        u, s = opt.update(g, s, p)
        p = optax.apply_updates(p, u)
    return float(loss(p)), p, s


def test_fp8_moments_track_float32_adamw_at_any_gradient_scale(monkeypatch):
    kw = dict(b1=0.9, b2=0.95, weight_decay=0.1)
    ref, p_ref, _ = _regression(optax.adamw(1e-2, **kw))
    start, _, _ = _regression(optax.adamw(1e-2, **kw), steps=0)
    for scale in (1.0, 1e-6):
        got, p, s = _regression(om.adamw_low_precision(1e-2, **kw), grad_scale=scale)
        assert abs(got - ref) < 0.01 * (start - ref), (scale, got, ref)
        assert float(jnp.max(jnp.abs(p["w"] - p_ref["w"]))) > 0  # low precision, not float32 in disguise
        mu = s[0].mu["w"].astype(jnp.float32) * s[0].mu_scale["w"]
        assert float(jnp.mean(mu == 0)) < 0.05  # the moments are alive at this scale
    assert s[0].mu["w"].dtype == jnp.float8_e4m3fn and s[0].nu["w"].dtype == jnp.float16
    # negative control: without the per-tensor scale, the moments of 1e-6 gradients flush to zero
    monkeypatch.setattr(om, "scale_for", lambda x, dtype: jnp.float32(1.0))
    bad, _, s = _regression(om.adamw_low_precision(1e-2, **kw), grad_scale=1e-6)
    assert float(jnp.mean(s[0].mu["w"].astype(jnp.float32) == 0)) > 0.99
    assert abs(bad - ref) > 0.03 * (start - ref), (bad, ref)


def test_a_bad_moments_value_names_the_field():
    oc = train_defaults().optim
    oc.moments = "fp4"
    with pytest.raises(ConfigError, match=r"optim.moments='fp4'; expected one of \['float32', 'fp8'\]"):
        make_optimizer(oc, 10)


def test_a_run_with_fp8_moments_resumes_exactly(tmp_path):
    from pallasite.errors import TrainingInterrupted
    from pallasite.training.loop import train
    from pallasite.training.metrics import read_jsonl

    over = ["--config.optim.moments=fp8", "--config.train.export_hf=false", "--config.train.sample_tokens=0"]
    cfg = lambda: load_config(os.path.join(ROOT, "configs", "tiny.py"), overrides=over)  # noqa: E731
    losses = lambda w: [(r["step"], r["loss"]) for r in read_jsonl(str(w), kind="train")]  # noqa: E731
    train(cfg(), str(tmp_path / "ref"))

    def ctrl_c(step, state):
        if step == 4:
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(TrainingInterrupted):
        train(cfg(), str(tmp_path / "cut"), step_hook=ctrl_c)
    assert train(cfg(), str(tmp_path / "cut"))["resumed_from"] == 5
    assert losses(tmp_path / "cut") == losses(tmp_path / "ref")
