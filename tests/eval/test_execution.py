"""The sandboxed executor (eval/execution/sandbox.py) and the HumanEval harness through it."""

import os
import time

import pytest

from pallasite.eval.execution import humaneval as HE
from pallasite.eval.execution.sandbox import run_many, run_python


def test_runs_in_a_separate_process_and_reports_status():
    r = run_python("import os\nprint(os.getpid())")
    assert r.status == "passed" and int(r.stdout) != os.getpid()
    assert run_python("raise ValueError('boom')").status == "failed"
    assert run_python("import sys; sys.exit(3)").returncode == 3
    assert [x.status for x in run_many(["pass", "1/0", "x = 1"], workers=2)] == [
        "passed",
        "failed",
        "passed",
    ]


def test_writing_outside_the_temp_dir_is_stopped(tmp_path):
    target = tmp_path / "escaped.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert r.status == "blocked" and not target.exists()
    assert any("escaped.txt" in b for b in r.blocked)
    # also through os-level calls, relative escapes and deletes of existing files
    keep = tmp_path / "keep.txt"
    keep.write_text("data")
    for prog in (
        f"import os; os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import os; os.remove({str(keep)!r})",
        f"import shutil; shutil.rmtree({str(tmp_path)!r})",
        "import os\nos.chdir('..')\nopen('escaped2.txt', 'w').write('x')",
    ):
        assert run_python(prog).status == "blocked", prog
    assert not target.exists() and keep.read_text() == "data"
    # inside its own temp dir the candidate may write and read
    ok = run_python("open('scratch.txt', 'w').write('hi')\nprint(open('scratch.txt').read())")
    assert ok.status == "passed" and ok.stdout.strip() == "hi"


def test_timeout_memory_network_and_subprocesses_are_refused():
    t0 = time.monotonic()
    r = run_python("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" and time.monotonic() - t0 < 10
    assert "MemoryError" in run_python("x = bytearray(2 << 30)", memory_mb=256).stderr
    assert (
        run_python("import socket\nsocket.create_connection(('127.0.0.1', 9))").status == "blocked"
    )
    assert run_python("import subprocess\nsubprocess.run(['true'])").status == "blocked"
    assert run_python("import os\nos.system('true')").status == "blocked"


def test_humaneval_harness_on_a_few_problems():
    problems = dict(list(HE.load_problems().items())[:6])
    assert HE.evaluate(HE.canonical_completions(problems), problems)["passed"] == 6
    assert HE.evaluate(HE.pass_completions(problems), problems)["passed"] == 0
    escape = {
        tid: ["    open('/tmp/pallasite_he_escape.txt', 'w').write('x')\n"] for tid in problems
    }
    rep = HE.evaluate(escape, problems)
    assert rep["passed"] == 0 and all(r == ["blocked"] for r in rep["results"].values())
    assert not os.path.exists("/tmp/pallasite_he_escape.txt")
    with pytest.raises(KeyError, match="no completion for 1 task"):
        HE.evaluate({t: [""] for t in list(problems)[:5]}, problems)


def test_generation_to_completion():
    p = HE.load_problems()["HumanEval/0"]
    assert (
        HE.completion_from_generation(
            p, "Sure:\n```python\ndef f():\n    return 1\n```\nThis works."
        )
        == "\ndef f():\n    return 1\n"
    )
    assert HE.truncate_completion("    return 1\n\ndef main():\n    pass") == "    return 1\n"


@pytest.mark.slow
def test_humaneval_canonical_164_and_pass_bodies_0():
    problems = HE.load_problems()
    assert len(problems) == 164
    assert HE.evaluate(HE.canonical_completions(problems), problems)["passed"] == 164
    assert HE.evaluate(HE.pass_completions(problems), problems)["passed"] == 0
