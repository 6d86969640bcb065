import os
import zlib

import numpy as np
import pytest

from kernels.cuda import gpu_status

# set (as scripts/gpu_check.sh does) where GPU tests must run: a missing GPU fails them instead of skipping
REQUIRE_GPU = "GDECODE_REQUIRE_GPU"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU")


def gpu_verdict(status, require: bool) -> tuple[str, str]:
    """("run" | "skip" | "fail", reason) for a GPU test under `status` (kernels.cuda.GpuStatus)."""
    if status.available:
        return "run", ""
    if require:
        return "fail", f"{REQUIRE_GPU} is set but no GPU is usable: {status.reason}"
    if status.broken:
        return "fail", f"the CUDA stack is broken: {status.reason}"
    return "skip", status.reason


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is None:
        return
    verdict, reason = gpu_verdict(gpu_status(), os.environ.get(REQUIRE_GPU, "") not in ("", "0"))
    if verdict == "fail":
        pytest.fail(reason, pytrace=False)
    if verdict == "skip":
        pytest.skip(reason)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's node id: the same inputs on every run; the seed is printed
    (shown with a failure) and recorded as the test's `seed` property."""
    seed = zlib.crc32(request.node.nodeid.encode())
    request.node.user_properties.append(("seed", seed))
    print(f"rng seed {seed} for {request.node.nodeid}")
    return np.random.default_rng(seed)
