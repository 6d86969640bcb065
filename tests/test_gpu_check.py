"""dev/gpu_check.sh counts GPU tests as run only when some passed: not when none were collected,
all skipped, or any failed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "dev"))
from gpu_tests_ran import verdict  # noqa: E402

BODIES = {
    "passed": "def test_a():\n    pass\n\ndef test_b():\n    pytest.skip('sm_90 only')\n",
    "skipped": "def test_a():\n    pytest.skip('no GPU')\n\ndef test_b():\n    pytest.skip('no GPU')\n",
    "failed": "def test_a():\n    pass\n\ndef test_b():\n    assert 1 == 2\n",
    "error": "@pytest.fixture\ndef broken():\n    raise RuntimeError('no driver')\n\ndef test_a(broken):\n    pass\n",
    "none": "",
}


def run_pytest(tmp_path, body):
    d = tmp_path / "t"
    d.mkdir()
    (d / "test_x.py").write_text("import pytest\n\npytestmark = pytest.mark.gpu\n\n" + body)
    xml = tmp_path / "report.xml"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                        "-W", "ignore::pytest.PytestUnknownMarkWarning", f"--junitxml={xml}", str(d)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    return r.returncode, str(xml)


@pytest.mark.parametrize("kind, ok, needle", [
    ("passed", True, "ok: 1 passed, 1 skipped"),
    ("skipped", False, "no test ran: 2 skipped"),
    ("failed", False, "FAILED (rc 1): 1 passed, 1 failed"),
    ("error", False, "FAILED (rc 1): 1 errors"),
    ("none", False, "no tests collected (rc 5)"),
])
def test_verdict_on_real_pytest_runs(tmp_path, kind, ok, needle):
    rc, xml = run_pytest(tmp_path, BODIES[kind])
    assert verdict(rc, xml) == (ok, needle)


def test_a_missing_report_is_a_failure(tmp_path):
    ok, line = verdict(0, str(tmp_path / "absent.xml"))
    assert not ok and line.startswith("no test report (rc 0)")


def test_gpu_check_fails_when_every_gpu_test_skips(tmp_path):
    tests = tmp_path / "gpu_tests"
    tests.mkdir()
    (tests / "test_x.py").write_text("import pytest\n\npytestmark = pytest.mark.gpu\n\n" + BODIES["skipped"])
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_TESTS": str(tests), "PYTHON": sys.executable,
           "GDECODE_BENCH_ARGS": "--shape smollm2-135m --tests tg128", "GPU_CHECK_BENCH_TIMEOUT": "60"}
    r = subprocess.run(["bash", str(ROOT / "dev" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=300)
    summary = r.stdout[r.stdout.rindex("==== summary ===="):]
    row = next(line for line in summary.splitlines() if line.startswith("pytest -m gpu"))
    assert "no test ran: 2 skipped" in row, summary
    assert r.returncode != 0


def test_gpu_check_names_a_package_that_does_not_import(tmp_path):
    # an openai that cannot import (as when a wheel it needs is missing) shadows the real one
    fake = tmp_path / "site" / "openai"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'sniffio'\")\n")
    tests = tmp_path / "gpu_tests"
    tests.mkdir()
    (tests / "test_x.py").write_text("import pytest\n\npytestmark = pytest.mark.gpu\n\n" + BODIES["passed"])
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_TESTS": str(tests), "PYTHON": sys.executable,
           "PYTHONPATH": str(tmp_path / "site"), "GDECODE_BENCH_ARGS": "--shape smollm2-135m --tests tg128",
           "GPU_CHECK_BENCH_TIMEOUT": "60"}
    r = subprocess.run(["bash", str(ROOT / "dev" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                       timeout=300)
    summary = r.stdout[r.stdout.rindex("==== summary ===="):]
    row = next(line for line in summary.splitlines() if line.startswith("packages"))
    assert "FAILED: openai (ModuleNotFoundError: No module named 'sniffio')" in row, summary
    assert "gguf" not in row and r.returncode != 0
