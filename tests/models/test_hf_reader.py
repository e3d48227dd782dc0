"""A damaged HF folder fails naming the file and what is wrong: empty, truncated (header or
tensor data) or garbage ``model.safetensors``, a damaged or missing shard, a garbage index or
config.json. The intact folder still loads (the check reads no tensor data)."""

import json
import shutil

import numpy as np
import pytest
from flax import nnx

from pallasite.errors import DataError, UserError
from pallasite.models.config import ModelConfig
from pallasite.models.hf import export_hf, import_hf
from pallasite.models.transformer import init_model

CFG = ModelConfig(
    family="llama", vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_reader")
    state = nnx.split(init_model(CFG, seed=0))[1]
    export_hf(CFG, state, str(root / "single"))
    export_hf(CFG, state, str(root / "sharded"), max_shard_bytes=8_000)
    return root


def _copy(folders, which, tmp_path):
    dst = tmp_path / which
    shutil.copytree(folders / which, dst)
    return dst


def test_intact_folders_load(folders):
    a = {
        tuple(p): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(import_hf(str(folders / "single"))[1])
    }
    b = {
        tuple(p): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(import_hf(str(folders / "sharded"))[1])
    }
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert len(list((folders / "sharded").glob("model-*.safetensors"))) > 1


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda b: b"", "the file is empty (0 bytes)"),
        (lambda b: b[:5], "truncated: 5 bytes"),
        (lambda b: b[:40], "truncated: the header needs"),
        (lambda b: b[:-64], "truncated: its"),
        (
            lambda b: b"PK\x03\x04 this is a zip file, not safetensors " * 4,
            "not a safetensors file",
        ),
        (lambda b: b[:8] + b"[" + b[9:], "not a safetensors file"),
        (lambda b: b[:8] + b"{" + b"\xff" * (len(b) - 9), "its header is not JSON"),
    ],
)
def test_damaged_single_file_names_it(folders, tmp_path, damage, needle):
    folder = _copy(folders, "single", tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError) as e:
        import_hf(str(folder))
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)


def test_damaged_or_missing_shard_and_bad_index_name_the_file(folders, tmp_path):
    folder = _copy(folders, "sharded", tmp_path)
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(DataError, match=rf"{shard.name}: truncated"):
        import_hf(str(folder))
    shard.unlink()
    with pytest.raises(DataError, match=rf"names shard\(s\) that are not in .*{shard.name}"):
        import_hf(str(folder))
    (folder / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    with pytest.raises(DataError, match="not a safetensors index"):
        import_hf(str(folder))


def test_garbage_config_json_names_it(folders, tmp_path):
    folder = _copy(folders, "single", tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(DataError, match=r"config\.json: not valid JSON"):
        import_hf(str(folder))
    (folder / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(UserError, match=r"config\.json: expected a JSON object"):
        import_hf(str(folder))
