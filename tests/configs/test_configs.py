"""Config loading, `--config.x=y` overrides by type, error messages, model presets."""
import math
import os

import pytest

from pallasite.configs import models
from pallasite.models.config import model_config_from
from pallasite.training.config import ConfigError, load_config, parse_arg, train_defaults

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")


def test_overrides_parse_by_type():
    c = load_config(QUICKSTART, overrides=[
        "--config.train.steps=7", "--config.optim.lr=1e-3", "--config.train.progress=false",
        "config.data.paths=a.txt,b.txt", "--config.model.head_dim=32", "--config.tokenizer.path=/x/y",
        "--config.train.steps=1e2",
    ])
    assert c.train.steps == 100 and isinstance(c.train.steps, int)
    assert c.optim.lr == 1e-3 and c.train.progress is False
    assert tuple(c.data.paths) == ("a.txt", "b.txt")
    assert c.model.head_dim == 32  # a None-valued field takes a Python literal
    assert c.tokenizer.path == "/x/y"
    # float fields accept ints, and the result is still a float
    c = load_config(QUICKSTART, overrides=["--config.optim.lr=1"])
    assert isinstance(c.optim.lr, float)


@pytest.mark.parametrize("override, needle", [
    ("--config.train.stepz=5", "train.stepz"),
    ("--config.nope.x=1", "nope.x"),
])
def test_unknown_key_names_it(override, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(QUICKSTART, overrides=[override])
    assert "known" in str(e.value)


@pytest.mark.parametrize("override, key, expected", [
    ("--config.train.steps=ten", "train.steps", "an int"),
    ("--config.optim.lr=fast", "optim.lr", "a float"),
    ("--config.train.progress=maybe", "train.progress", "a bool"),
])
def test_wrong_type_names_key_and_type(override, key, expected):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, overrides=[override])
    assert key in str(e.value) and expected in str(e.value)


def test_group_override_and_malformed_override_fail():
    with pytest.raises(ConfigError, match="group"):
        load_config(QUICKSTART, overrides=["--config.data=1"])
    with pytest.raises(ConfigError, match="form"):
        load_config(QUICKSTART, overrides=["--config.train.steps"])


def test_arg_shrinks_and_module_name_loading():
    full = load_config(QUICKSTART)
    small = load_config(QUICKSTART + ":cpu")
    assert small.train.steps < full.train.steps and small.data.max_train_bytes < full.data.max_train_bytes
    assert load_config("pallasite.configs.tiny").data.seq_len == 32
    assert load_config("tiny", arg="runlocal").train.steps > 0
    with pytest.raises(ConfigError, match="bogus"):
        load_config(QUICKSTART, arg="bogus")
    assert parse_arg("cpu,steps=3", cpu=False, steps=10).steps == 3


def test_every_experiment_uses_the_full_schema():
    keys = lambda c: {f"{g}.{k}" for g in c for k in (c[g].keys() if hasattr(c[g], "keys") else [])}  # noqa: E731
    schema = keys(train_defaults()) - {k for k in keys(train_defaults()) if k.startswith("model.")}
    for path in (QUICKSTART, os.path.join(ROOT, "configs", "tiny.py")):
        assert schema <= keys(load_config(path)), path


@pytest.mark.parametrize("name, params", [
    ("llama3_8b", 8.030e9), ("qwen2_5_0_5b", 494.0e6), ("smollm2_135m", 134.5e6), ("bench20m", 20.16e6),
])
def test_presets_match_published_sizes(name, params):
    d = models.get(name)
    cfg = model_config_from(d, vocab_size=8192)
    assert math.isclose(cfg.num_params(), params, rel_tol=0.01), (name, cfg.num_params())


def test_presets_are_validated():
    assert model_config_from(models.get("llama3_1_8b")).rope_scaling_dict["rope_type"] == "llama3"
    assert models.get("qwen2_5_0_5b")["qkv_bias"] is True
    with pytest.raises(ValueError, match="n_kv_heads"):
        models.get("tiny", n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown key"):
        models.get("tiny", n_layer=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        models.get("llama9")


@pytest.mark.parametrize("spec", ["quickstart", "experts.quality:kind=mole4", "experts.quality:kind=moe10",
                                  "experts.paper:size=160m,kind=mole4"])
def test_user_facing_training_configs_show_the_progress_bar(spec):
    assert load_config(spec).train.progress is True  # only configs/tiny.py (the tests' config) is quiet


def test_quickstart_docstring_states_the_real_parameter_count():
    import re

    from pallasite.configs import quickstart

    c = load_config(QUICKSTART)
    n = model_config_from(c.model, vocab_size=c.tokenizer.vocab_size).num_params()  # BPE size = vocab_size
    stated = re.search(r"([\d.]+)M-parameter", quickstart.__doc__)
    assert stated, quickstart.__doc__
    assert abs(float(stated.group(1)) * 1e6 - n) / n < 0.01, (stated.group(0), n)
