"""`.ci/run` fails when a test it selects is skipped (`.ci/check_junit.py` on real pytest reports)
and lints before testing."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = os.path.join(ROOT, ".ci", "check_junit.py")


def _report(tmp_path, body: str) -> str:
    (tmp_path / "test_sample.py").write_text(body)
    report = str(tmp_path / "junit.xml")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_sample.py"),
            f"--junitxml={report}",
        ],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    return report


def test_a_skipped_test_fails_ci_naming_it(tmp_path):
    report = _report(
        tmp_path,
        "import pytest\n\ndef test_ok():\n    pass\n\n"
        "def test_missing_dep():\n    pytest.importorskip('no_such_module_xyz')\n",
    )
    proc = subprocess.run([sys.executable, CHECK, report], capture_output=True, text=True)
    assert proc.returncode == 1
    assert (
        "test_missing_dep" in proc.stderr
        and "no_such_module_xyz" in proc.stderr
        and "test_ok" not in proc.stderr
    )


def test_no_skip_passes(tmp_path):
    report = _report(tmp_path, "def test_ok():\n    pass\n")
    proc = subprocess.run([sys.executable, CHECK, report], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_ci_lints_before_testing_and_checks_skips():
    script = open(os.path.join(ROOT, ".ci", "run")).read()
    lint, tests, check = (
        script.index("ruff check ."),
        script.index("python -m pytest"),
        script.index("check_junit.py"),
    )
    assert lint < tests < check and "--junitxml" in script and "-rs" in script
