"""The public API (load / Model.logits / generate / Model.save) and the CLI on tiny models."""

import json
import os

import numpy as np
import pytest

import pallasite
from pallasite import cli
from pallasite.errors import InputError

torch = pytest.importorskip("torch")
from pallasite.testing import make_tiny_hf_model, pt_greedy, pt_logits  # noqa: E402


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny random HF Llama folder with a real (freshly trained) BPE tokenizer beside it."""
    from pallasite.models.tokenizer import train_bpe

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch_model, path = make_tiny_hf_model("llama", folder, vocab_size=300)
    texts = [open(os.path.join(os.path.dirname(os.__file__), name)).read() for name in ("os.py", "abc.py")]
    tokenizer = train_bpe(texts, vocab_size=300)
    tokenizer.save_pretrained(path)
    return torch_model, str(path)


def test_load_logits_and_generate_match_torch(tiny_hf):
    torch_model, path = tiny_hf
    model = pallasite.load(path)
    ids = np.array([[5, 17, 42, 99, 3, 250]])
    logits = model.logits(ids)
    assert logits.dtype == np.float32 and logits.shape == (1, 6, 300)
    np.testing.assert_allclose(np.asarray(logits), pt_logits(torch_model, ids), atol=1e-4)
    want = pt_greedy(torch_model, ids, 8)[0].tolist()
    ids_only = pallasite.Model(model.config, model.state)  # no tokenizer → ids come back
    assert pallasite.generate(ids_only, [ids[0].tolist()], max_new_tokens=8, stop_tokens=[]) == [want]
    # Token ids in, token ids out, with a tokenizer too (the README's contract); text in, text out.
    assert pallasite.generate(model, [ids[0].tolist()], max_new_tokens=8, stop_tokens=[]) == [want]
    text = model.decode(ids[0].tolist())
    got = pallasite.generate(model, [text, ids[0].tolist()], max_new_tokens=8, stop_tokens=[])
    assert isinstance(got[0], str) and got[1] == want


def test_save_orbax_and_hf_round_trip(tiny_hf, tmp_path):
    _, path = tiny_hf
    model = pallasite.load(path)
    ids = np.array([[1, 2, 3, 4]])
    want = np.asarray(model.logits(ids))
    for fmt in ("orbax", "hf"):
        out = model.save(str(tmp_path / fmt), format=fmt)
        again = pallasite.load(out)
        np.testing.assert_array_equal(np.asarray(again.logits(ids)), want)
        assert again.tokenizer is not None
    with pytest.raises(ValueError, match="format='npz'"):
        model.save(str(tmp_path / "x"), format="npz")


def test_bad_inputs_fail_clearly(tiny_hf, tmp_path):
    _, path = tiny_hf
    model = pallasite.load(path)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 300\)"):
        model.logits([[1, 300]])
    no_tok = pallasite.Model(model.config, model.state)
    with pytest.raises(ValueError, match="no tokenizer"):
        pallasite.generate(no_tok, ["hello"], max_new_tokens=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        pallasite.load(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="cannot tell what"):
        pallasite.load(str(tmp_path / "empty"))
    # Token-id prompts without a tokenizer return ids.
    out = pallasite.generate(no_tok, [[1, 2, 3]], max_new_tokens=3, stop_tokens=[])
    assert len(out[0]) == 3 and all(isinstance(t, int) for t in out[0])
    with pytest.raises(InputError, match=r"prompt 0 \(''\) is empty"):
        pallasite.generate(model, [""], max_new_tokens=2)
    # Ragged rows are named (numpy would say "inhomogeneous shape" or make an object array).
    with pytest.raises(InputError, match=r"rows have different lengths \[2, 3\]"):
        model.logits([[1, 2, 3], [4, 5]])


def test_logits_of_packed_rows_equal_each_document_alone(tiny_hf):
    """positions / segment_ids: two documents packed in one row score as if alone."""
    model = pallasite.load(tiny_hf[1])
    a, b = [5, 17, 42, 99], [3, 250, 7]
    packed = model.logits([a + b], positions=[[0, 1, 2, 3, 0, 1, 2]], segment_ids=[[1, 1, 1, 1, 2, 2, 2]])
    np.testing.assert_allclose(np.asarray(packed[0, 4:]), np.asarray(model.logits([b])[0]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(packed[0, :4]), np.asarray(model.logits([a])[0]), atol=1e-5)
    unpacked = model.logits([a + b])
    assert not np.allclose(np.asarray(unpacked[0, 4:]), np.asarray(model.logits([b])[0]), atol=1e-3)


def test_cli_convert_generate_eval(tiny_hf, tmp_path, capsys):
    _, path = tiny_hf
    cli.main(["convert", "--input", path, "--output", str(tmp_path / "orbax"), "--to", "orbax"])
    assert os.path.exists(tmp_path / "orbax" / "pallasite_model.json")
    capsys.readouterr()
    cli.main(["generate", "--model", str(tmp_path / "orbax"), "--prompt", "def f(", "--max-new-tokens", "4"])
    assert capsys.readouterr().out.startswith("def f(")
    text = tmp_path / "eval.txt"
    text.write_text(open(os.__file__).read()[:20000])
    cli.main(["eval", "--model", path, "--data", str(text), "--seq-len", "64", "--max-windows", "4"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["windows"] == 4 and np.isfinite(result["ppl"]) and result["ppl"] > 1
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", path, "--prompt", "x", "--config.a=1"])


def test_mole_lut_serving_api_and_cli(tiny_hf, tmp_path, capsys):
    """A MoLE model saved as orbax, served with its experts as a LUT (host memory, device memory,
    a LUT file built by `pallasite lut`): the same greedy text as training mode (fp32 LUT), the
    CLI's --mole-lut gives the same completion, and non-MoLE models are refused by name."""
    from flax import nnx

    from pallasite.models.mole import MoLEConfig
    from pallasite.models.transformer import init_model

    tokenizer = pallasite.load(tiny_hf[1]).tokenizer
    cfg = pallasite.load(tiny_hf[1]).config.replace(
        ffn="mole", hidden_act="gelu_exact", ffn_config=MoLEConfig(n_experts=4, lut_dtype="float32"))
    g, s = nnx.split(init_model(cfg, seed=0))
    trained = pallasite.Model(cfg, s, tokenizer, g)
    folder = trained.save(str(tmp_path / "mole"), format="orbax")
    model = pallasite.load(folder)
    prompt = "def __init__(self"
    want = pallasite.generate(model, [prompt], max_new_tokens=8, stop_tokens=[])
    ids = np.array([tokenizer.encode(prompt)])
    ref_logits = np.asarray(model.logits(ids))
    lut_file = str(tmp_path / "mole.lut")
    for where, path in (("host", None), ("device", None), ("disk", lut_file)):
        served = pallasite.serve_lut(model, where, path=path)
        np.testing.assert_allclose(np.asarray(served.logits(ids)), ref_logits, atol=1e-5)
        assert pallasite.generate(served, [prompt], max_new_tokens=8, stop_tokens=[]) == want, where
    assert os.path.exists(lut_file)  # built on first use
    capsys.readouterr()
    cli.main(["lut", "--model", folder, "--output", str(tmp_path / "cli.lut")])
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["shape"] == [cfg.vocab_size, cfg.n_layers, 4, cfg.d_model]
    outs = {}
    for lut in (None, "host", str(tmp_path / "cli.lut")):
        cli.main(["generate", "--model", folder, "--prompt", prompt, "--max-new-tokens", "8"]
                 + ([] if lut is None else ["--mole-lut", lut]))
        outs[lut] = capsys.readouterr().out
    assert len(set(outs.values())) == 1 and outs[None].startswith(prompt)
    with pytest.raises(ValueError, match="ffn='dense'"):
        pallasite.serve_lut(pallasite.load(tiny_hf[1]), "host")
    with pytest.raises(ValueError, match="where='gpu'"):
        pallasite.serve_lut(model, "gpu")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(["lut", "--model", tiny_hf[1], "--output", str(tmp_path / "x.lut")])
    assert e.value.code == 1 and "not a MoLE model" in capsys.readouterr().err
