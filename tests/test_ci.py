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


def _collected(*args: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if "::" in line]


def test_quick_g_tests_are_deselected_when_their_slow_runs_are_selected_and_heavy_files_go_first():
    """tests/conftest.py: the 16384-row G-tests (``superseded_by_slow``) run in the quick suite only;
    the full suite (CI's ``-m "not accelerator"``) runs their 51200-row versions; heavy files first."""
    dist = "tests/inference/test_speculative_dist.py"
    full = _collected("-m", "not accelerator", "tests/test_sharding.py", dist)  # the heavy file named last
    quick = _collected("-m", "not slow", dist)
    g_full = [n for n in full if "test_lossless_g_test" in n]
    g_quick = [n for n in quick if "test_lossless_g_test" in n]
    assert g_full and all(n.endswith("-51200]") for n in g_full), g_full
    assert g_quick and all(n.endswith("-16384]") for n in g_quick), g_quick
    assert len(g_full) == len(g_quick)
    assert full[0].startswith(dist + "::") and full[-1].startswith("tests/test_sharding.py::"), (full[0], full[-1])


def test_loadfile_runs_files_in_collection_order_not_by_test_count():
    """tests/conftest.py turns off pytest-xdist's re-sorting of files by test count, so that
    ``--dist loadfile`` hands files out heaviest first (HEAVY_FIRST), not most tests first. The file
    named first here has one selected test, the other two: with the re-sort the second runs first."""
    one = "tests/test_layering.py::test_the_import_graph_was_parsed"
    two = ["tests/test_sharding.py::test_make_mesh_axes_and_errors",
           "tests/test_sharding.py::test_constrain_and_per_shard_are_no_ops_without_a_mesh"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "1", "--dist", "loadfile", "-p", "no:randomly",
                           one, *two], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ran = [line.split("PASSED ")[1].strip() for line in proc.stdout.splitlines() if "PASSED " in line]
    assert ran == [one, *two], ran
