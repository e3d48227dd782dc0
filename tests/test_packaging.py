"""The wheel carries every module of the tree: a new subpackage missing from the explicit package
list in pyproject.toml fails here instead of silently dropping out of ``pip install .``."""

import glob
import pathlib
import shutil
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_contains_every_module(tmp_path, package_modules):
    # build from a copy: pip builds in the source tree and would leave build/ behind in the checkout
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "venv", "build", "runs", "*.egg-info",
                                                              ".jax_cache", "__pycache__"))
    # no build isolation: the venv's setuptools builds it, so no index is reached (an isolated build
    # downloads setuptools, and hangs where the index is slow or unreachable)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=600)
    (wheel,) = glob.glob(str(tmp_path / "pallasite-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {"pallasite/" + str(p.relative_to(ROOT)) for p in package_modules.values()}
    missing = sorted(want - names)
    assert not missing, f"modules missing from the wheel (add their package to pyproject.toml): {missing}"
    assert "pallasite/ops/panels/panel_matmul.cc" in names, "the CPU kernel's source is package data"
    assert "pallasite/models/transformer.py" in names and not any(n.startswith("pallasite/tests/") for n in names)
