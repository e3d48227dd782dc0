"""``pallasite quantize`` on a tiny model with a real tokenizer: the output folder is a
``pallasite.Model`` (w4a4 + kv4 with the saved transforms) that ``load``, ``generate`` and ``eval``
serve, equal to the in-memory quantization; the calibration data path; clear errors."""

import json
import os
import re

import numpy as np
import pytest

import pallasite
from pallasite import cli
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import init_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from flax import nnx

    from pallasite.models.tokenizer import train_bpe

    folder = tmp_path_factory.mktemp("tiny_fp")
    texts = [open(os.path.join(os.path.dirname(os.__file__), name)).read() for name in ("os.py", "abc.py")]
    tokenizer = train_bpe(texts, vocab_size=320)
    cfg = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128)
    _, state = nnx.split(init_model(cfg, seed=0))
    pallasite.Model(cfg, state, tokenizer).save(str(folder), format="orbax")
    text = folder / "calib.txt"
    text.write_text("".join(texts))
    return str(folder), str(text)


def _summary(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_quantize_cli_writes_a_model_load_generate_and_eval_serve(tiny_model_dir, tmp_path, capsys):
    from pallasite.training.quant_baselines import hadamard_transforms, quantize_model

    src, text = tiny_model_dir
    out = str(tmp_path / "had")
    cli.main(["quantize", "--model", src, "--output", out, "--method", "hadamard"])
    s = _summary(capsys)
    assert s["method"] == "hadamard" and s["calibration"] is None
    assert (s["w_bits"], s["a_bits"], s["kv_bits"]) == (4, 4, 4)
    model = pallasite.load(out)
    assert model.config.linear == "w4a4" and model.config.linear_config.method == "hadamard"
    assert model.config.kv_cache == "kv4" and os.path.exists(os.path.join(out, "kv4_transforms.npz"))
    assert model.tokenizer is not None
    # the saved model is the in-memory quantization (same seed-0 Hadamards), KV4 cache included
    fp = pallasite.load(src)
    from flax import nnx

    qm = quantize_model(fp.config, nnx.to_pure_dict(fp.state), "hadamard", resolved=hadamard_transforms(fp.config, 0))
    ids = np.asarray([model.encode("def walk(top, topdown=True):\n    return top")])
    import jax
    import jax.numpy as jnp

    from pallasite.models.transformer import forward

    run = jax.jit(lambda st, x, cache: forward(qm.graphdef, st, x, cache=cache)[0])  # as Model.logits runs it
    want = run(qm.state, jnp.asarray(ids), qm.init_cache(*ids.shape))
    np.testing.assert_array_equal(np.asarray(model.logits(ids)), np.asarray(want))
    cli.main(["eval", "--model", out, "--data", text, "--seq-len", "32", "--max-windows", "2"])
    ev = _summary(capsys)
    assert ev["windows"] == 2 and np.isfinite(ev["ppl"])
    cli.main(["generate", "--model", out, "--prompt", "def f(", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.startswith("def f(")


def test_quantize_needs_calibration_text_and_names_how_to_get_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    src, _ = tiny_model_dir
    monkeypatch.setenv("PALLASITE_DATA", str(tmp_path / "empty"))

    def user_error(argv) -> str:  # one stderr line, exit status 1, no traceback
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("pallasite quantize: error: ") and "Traceback" not in err
        return err

    err = user_error(["quantize", "--model", src, "--output", str(tmp_path / "x"), "--method", "smoothquant"])
    assert re.search(r"apt-get download python3.11-doc.*dpkg -x.*--text", err), err
    with pytest.raises(SystemExit):  # argparse: an unknown method lists the choices
        cli.main(["quantize", "--model", src, "--output", str(tmp_path / "x"), "--method", "awq"])
    capsys.readouterr()
    assert "--calib-len must be >= 1" in user_error(
        ["quantize", "--model", src, "--output", str(tmp_path / "x"), "--calib-len", "0"])


@pytest.mark.slow  # one FlatQuant calibration of the tiny model through the CLI
def test_quantize_cli_flatquant_quick(tiny_model_dir, tmp_path, capsys):
    src, text = tiny_model_dir
    out = str(tmp_path / "fq")
    cli.main(["quantize", "--model", src, "--output", out, "--config", "pallasite.configs.quant.flatquant:quick",
              "--text", text, "--calib-windows", "4", "--calib-len", "32", "--epochs", "2"])
    s = _summary(capsys)
    assert s["method"] == "flatquant" and s["calibration"] == {"windows": 4, "tokens_per_window": 32, "epochs": 2}
    assert len(s["layer_mse_first_last"]) == 2
    model = pallasite.load(out)
    assert model.config.linear_config.method == "flatquant" and model.config.kv_cache == "kv4"
    ids = np.asarray([model.encode("import os\nprint(os.getcwd())")])
    assert np.isfinite(np.asarray(model.logits(ids))).all()
