"""Occult from a config, end to end: ``pallasite train`` an MoE with Occult dispatch over an
8-device expert axis (``configs/occult.py``), ``pallasite occult-place`` writes a model folder whose
config names the placement file, ``pallasite.load`` applies it (experts and router columns
permuted as the file says, outputs unchanged), and the placed model serves with Occult
expert-parallel dispatch on the mesh with the single-device logits."""

import json
import os

import jax
import numpy as np
import pytest

import pallasite
from pallasite import cli, sharding
from pallasite.models import occult


@pytest.mark.slow  # trains a tiny MoE through the loop (BPE + a few steps) and profiles it
def test_train_place_load_serve(tmp_path, capsys):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 host devices (tests/conftest.py sets them)")
    work, placed = str(tmp_path / "moe"), str(tmp_path / "placed")
    cli.main(["train", "--config", "pallasite.configs.occult:cpu", "--workdir", work])
    capsys.readouterr()
    cli.main(["occult-place", "--model", work, "--output", placed, "--devices", "8", "--windows", "8",
              "--seq-len", "64"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["moe_layers"] == 4 and summary["experts"] == 32
    assert 1.0 <= summary["ct_placed"] <= 4.0 and summary["ct_placed"] <= summary["ct_contiguous"] + 1e-9
    with open(os.path.join(placed, "pallasite_model.json")) as f:
        saved = json.load(f)["config"]["ffn_config"]
    assert saved["placement"] == occult.PLACEMENT_FILE and saved["dispatch"] == "occult"
    trained = pallasite.load(work)
    model = pallasite.load(placed)
    assert model.config.ffn_config.placement is None  # applied once; saving keeps the placed order
    perm = occult.load_placement(os.path.join(placed, occult.PLACEMENT_FILE)).array()
    before, after = occult._flat(trained.state), occult._flat(model.state)
    up = [p for p in before if p[-1] == "w_up"]
    for layer, path in enumerate(up):
        np.testing.assert_array_equal(np.asarray(after[path][...]), np.asarray(before[path][...])[perm[layer]])
    assert not all(np.array_equal(p, np.arange(32)) for p in perm)  # the placement really moves experts
    ids = np.asarray([model.encode("def f(x):\n    return x + 1\n" * 3)[:48]] * 8)
    want = np.asarray(trained.logits(ids))
    np.testing.assert_allclose(np.asarray(model.logits(ids)), want, atol=2e-5)
    mesh = sharding.make_mesh({"expert": 8})  # Occult expert-parallel dispatch on 8 devices
    placed_ep = pallasite.Model(model.config, sharding.shard_state(model.state, mesh), model.tokenizer)
    with jax.set_mesh(mesh):
        np.testing.assert_allclose(np.asarray(placed_ep.logits(ids)), want, atol=2e-5)
    # saving the loaded (placed) model and loading it again does not permute twice
    model.save(str(tmp_path / "again"), format="orbax")
    again = pallasite.load(str(tmp_path / "again"))
    np.testing.assert_array_equal(np.asarray(occult._flat(again.state)[up[0]][...]), np.asarray(after[up[0]][...]))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # a user error: one line naming the flag, exit status 1
        cli.main(["occult-place", "--model", work, "--output", str(tmp_path / "x"), "--devices", "5"])
    assert e.value.code == 1
    assert "--devices 5 does not divide the 32 experts" in capsys.readouterr().err
