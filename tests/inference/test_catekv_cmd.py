"""``pallasite catekv-calibrate`` writes the head mask (with its per-prompt CVs) next to a tiny
model; ``pallasite generate --kv-cache catekv`` and ``pallasite.generate`` serve it from the model's
folder, at the stored r or another one; without a mask the error names the command."""

import json
import os

import numpy as np
import pytest

import pallasite
from pallasite import cli
from pallasite.inference.cache.catekv_mask import MASK_FILE, calibrate_head_mask, load_head_mask
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import init_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from flax import nnx

    from pallasite.models.tokenizer import train_bpe

    folder = tmp_path_factory.mktemp("tiny_catekv")
    texts = [open(os.path.join(os.path.dirname(os.__file__), name)).read() for name in ("os.py", "abc.py")]
    tokenizer = train_bpe(texts + ["The grass is green. The sky is blue. ### LINE red: 12345 ###"], vocab_size=320)
    cfg = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=1024)
    _, state = nnx.split(init_model(cfg, seed=0))
    pallasite.Model(cfg, state, tokenizer).save(str(folder), format="orbax")
    return str(folder)


def test_calibrate_command_writes_mask_and_generation_serves_it(tiny_dir, capsys):
    with pytest.raises(ValueError, match="pallasite catekv-calibrate --model"):
        pallasite.generate(pallasite.load(tiny_dir), [[1, 2, 3]], max_new_tokens=2, kv_cache="catekv")
    cli.main(["catekv-calibrate", "--model", tiny_dir, "--samples", "3", "--context", "512", "--batch", "2"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    model = pallasite.load(tiny_dir)
    path = os.path.join(tiny_dir, MASK_FILE)
    assert summary["mask"] == path and summary["adaptive_heads"] == 2 and summary["heads"] == 4  # ceil(0.4·4)
    with open(path) as f:
        doc = json.load(f)
    cvs = np.asarray(doc["cv_samples"])
    assert cvs.shape == (3, 2, 2) and np.isfinite(cvs).all() and cvs.std() > 0  # real, varying CVs
    mask = load_head_mask(path, model.config)
    np.testing.assert_array_equal(mask, calibrate_head_mask(cvs, 0.4))
    # another r is re-derived from the stored CVs
    np.testing.assert_array_equal(load_head_mask(path, model.config, adaptive_ratio=0.75),
                                  calibrate_head_mask(cvs, 0.75))
    # serving: with a budget covering the prompt CateKV keeps every token, so it equals the dense cache
    prompt = model.encode("def walk(top, topdown=True):\n    return top")
    dense = pallasite.generate(model, [prompt], max_new_tokens=5, stop_tokens=())
    for r in (None, 0.75):
        opts = {"budget": 512} if r is None else {"budget": 512, "r": r}
        got = pallasite.generate(model, [prompt], max_new_tokens=5, stop_tokens=(), kv_cache="catekv",
                                 kv_cache_config=opts)
        assert got == dense
    cli.main(["generate", "--model", tiny_dir, "--prompt", "def f(", "--max-new-tokens", "3", "--kv-cache", "catekv",
              "--catekv.r", "0.75", "--catekv.budget", "512"])
    assert capsys.readouterr().out.startswith("def f(")


def test_calibrate_ranks_only_the_global_layers_of_a_windowed_model(tmp_path, capsys):
    """Gemma-style interleave (layer 0 sliding, window 16; layer 1 global): the local layer is not
    ranked (NaN CVs, no votes), r counts the global heads only, and the mask serves: with a budget
    covering the prompt the CateKV cache decodes like the dense one."""
    from flax import nnx

    from pallasite.models.tokenizer import train_bpe

    texts = [open(os.path.join(os.path.dirname(os.__file__), "abc.py")).read()]
    tokenizer = train_bpe(texts + ["The grass is green. ### LINE red: 12345 ###"], vocab_size=320)
    cfg = ModelConfig(vocab_size=320, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=1024,
                      layer_types=("sliding", "full"), sliding_window=16, rope_local_theta=1e4)
    _, state = nnx.split(init_model(cfg, seed=1))
    folder = str(tmp_path / "windowed")
    pallasite.Model(cfg, state, tokenizer).save(folder, format="orbax")
    cli.main(["catekv-calibrate", "--model", folder, "--samples", "2", "--context", "512", "--batch", "2",
              "--r", "0.5"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["windowed_layers"] == [0] and summary["adaptive_heads"] == 1  # 0.5 of layer 1's 2
    with open(os.path.join(folder, MASK_FILE)) as f:
        cvs = np.asarray(json.load(f)["cv_samples"], np.float64)
    assert np.isnan(cvs[:, 0]).all() and np.isfinite(cvs[:, 1]).all()
    model = pallasite.load(folder)
    mask = load_head_mask(folder, model.config)
    assert not mask[0].any() and mask[1].sum() == 1
    assert load_head_mask(folder, model.config, adaptive_ratio=1.0)[1].all()  # re-derived, layer 1 only
    prompt = model.encode("def abstractmethod(funcobj):\n    return funcobj")
    dense = pallasite.generate(model, [prompt], max_new_tokens=5, stop_tokens=())
    got = pallasite.generate(model, [prompt], max_new_tokens=5, stop_tokens=(), kv_cache="catekv",
                             kv_cache_config={"budget": 512})
    assert got == dense


def _user_error(capsys, argv) -> str:
    """The one stderr line ``pallasite`` prints for a user error (exit status 1, no traceback)."""
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("pallasite catekv-calibrate: error: ") and "Traceback" not in err
    return err


def test_calibrate_command_rejects_bad_input(tiny_dir, tmp_path, capsys):
    cmd = ["catekv-calibrate", "--model", tiny_dir]
    assert "--r 1.5 must be a fraction" in _user_error(capsys, cmd + ["--r", "1.5"])
    assert "--samples must be >= 1" in _user_error(capsys, cmd + ["--samples", "0"])
    assert "--context 300 leaves no middle chunks" in _user_error(
        capsys, cmd + ["--context", "300", "--output", str(tmp_path / "m.json")])
