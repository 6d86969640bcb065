"""GPU detection tells "no GPU" from a broken CUDA install, GPU tests fail rather than skip when the
install is broken, and the `rng` fixture seeds from the test's node id."""

import zlib

import numpy as np
import pytest
from cuda.bindings.driver import CUresult

from kernels.cuda import GpuStatus, probe_gpu
from tests.conftest import gpu_verdict


class FakeDriver:
    def __init__(self, init=CUresult.CUDA_SUCCESS, count=(CUresult.CUDA_SUCCESS, 1), init_raises=None):
        self.init, self.count, self.init_raises = init, count, init_raises

    def cuInit(self, flags):
        if self.init_raises is not None:
            raise self.init_raises
        return (self.init,)

    def cuDeviceGetCount(self):
        return self.count


def probe(driver=None, import_error=None, nodes=False):
    def load():
        if import_error is not None:
            raise import_error
        return driver

    return probe_gpu(load, lambda: nodes)


def test_a_device_is_available():
    assert probe(FakeDriver()) == GpuStatus(True, False, "")


@pytest.mark.parametrize("driver", [
    FakeDriver(init=CUresult.CUDA_ERROR_NO_DEVICE),
    FakeDriver(count=(CUresult.CUDA_SUCCESS, 0)),
    FakeDriver(init_raises=OSError("libcuda.so.1: cannot open shared object file")),
])
def test_no_gpu_is_absent_not_broken(driver):
    st = probe(driver)
    assert not st.available and not st.broken and "no CUDA GPU available" in st.reason
    assert gpu_verdict(st, require=False) == ("skip", st.reason)
    assert gpu_verdict(st, require=True)[0] == "fail"


def test_import_failure_is_broken():
    st = probe(import_error=ModuleNotFoundError("No module named 'cuda'"))
    assert not st.available and st.broken
    assert st.reason.startswith("cuda-python import failed") and "No module named 'cuda'" in st.reason
    verdict, reason = gpu_verdict(st, require=False)
    assert verdict == "fail" and "cuda-python import failed" in reason


@pytest.mark.parametrize("driver, needle", [
    (FakeDriver(init=CUresult.CUDA_ERROR_SYSTEM_DRIVER_MISMATCH), "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH"),
    (FakeDriver(count=(CUresult.CUDA_ERROR_NOT_INITIALIZED, 0)), "cuDeviceGetCount"),
])
def test_driver_errors_are_broken(driver, needle):
    st = probe(driver)
    assert not st.available and st.broken and needle in st.reason
    assert gpu_verdict(st, require=False)[0] == "fail"


def test_unloadable_driver_with_device_nodes_is_broken():
    st = probe(FakeDriver(init_raises=OSError("libcuda.so.1: cannot open shared object file")), nodes=True)
    assert st.broken and "device nodes exist" in st.reason and "libcuda.so.1" in st.reason


def test_a_gpu_runs_whatever_is_required():
    assert gpu_verdict(GpuStatus(True, False, ""), require=True) == ("run", "")


def test_rng_seed_follows_the_node_id(capsys, request, rng):
    seed = zlib.crc32(request.node.nodeid.encode())
    assert ("seed", seed) in request.node.user_properties
    assert np.array_equal(rng.integers(0, 2**32, 8), np.random.default_rng(seed).integers(0, 2**32, 8))
    assert f"rng seed {seed}" in capsys.readouterr().out
