"""Verdict on a GPU test run: `python dev/gpu_tests_ran.py RC JUNIT_XML`.

Prints one summary line and exits 0 only if pytest exited 0 and at least one test passed; "nothing
collected" (rc 5), every test skipped, or a missing report is a failure, so that a machine where the
GPU tests cannot run is never counted as one where they passed.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def counts(xml_path: str) -> dict[str, int]:
    """passed, failed, errors, skipped over every test suite of a JUnit XML report."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in total:
            total[k] += int(s.get(k, 0))
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return {"passed": passed, "failed": total["failures"], "errors": total["errors"], "skipped": total["skipped"]}


def verdict(rc: int, xml_path: str) -> tuple[bool, str]:
    if rc == 5:
        return False, "no tests collected (rc 5)"
    try:
        c = counts(xml_path)
    except (OSError, ET.ParseError) as e:
        return False, f"no test report (rc {rc}): {e}"
    line = ", ".join(f"{v} {k}" for k, v in c.items() if v)
    if rc != 0 or c["failed"] or c["errors"]:
        return False, f"FAILED (rc {rc}): {line or 'nothing ran'}"
    if c["passed"] == 0:
        return False, f"no test ran: {line or 'nothing collected'}"
    return True, f"ok: {line}"


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[0].lstrip("-").isdigit():
        print("usage: gpu_tests_ran.py RC JUNIT_XML", file=sys.stderr)
        return 2
    ok, line = verdict(int(argv[0]), argv[1])
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
