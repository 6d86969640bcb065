"""CUDA driver plumbing: return-code checks, GPU detection, the CuPy-owned context and stream."""

from __future__ import annotations

import functools
import glob
import os
import threading
from dataclasses import dataclass


class CudaError(RuntimeError):
    """A CUDA driver, runtime or NVRTC call returned something other than success."""

    def __init__(self, call: str, code=None, detail: str = ""):
        self.call = call
        self.code = code
        text = f"{call} failed"
        if code is not None:
            text += f": {getattr(code, 'name', code)}"
        if detail:
            text += f" ({detail})"
        super().__init__(text)


def _describe(code) -> str:
    try:
        from cuda.bindings import driver, nvrtc, runtime

        if isinstance(code, driver.CUresult):
            err, s = driver.cuGetErrorString(code)
        elif isinstance(code, nvrtc.nvrtcResult):
            err, s = nvrtc.nvrtcGetErrorString(code)
        elif isinstance(code, runtime.cudaError_t):
            err, s = runtime.cudaGetErrorString(code)
        else:
            return ""
        if int(err) == 0 and s:
            return s.decode() if isinstance(s, bytes) else str(s)
    except Exception:
        pass
    return ""


def check(result, call: str):
    """Raise `CudaError` unless `result` (a cuda-python return tuple or bare code) is success.

    Returns None, the single value, or the tuple of values that follow the code.
    """
    if isinstance(result, tuple):
        code, values = result[0], result[1:]
    else:
        code, values = result, ()
    if int(code) != 0:
        raise CudaError(call, code, _describe(code))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


@dataclass(frozen=True)
class GpuStatus:
    """What `probe_gpu` found: a usable device, none, or a CUDA stack that is broken."""

    available: bool
    broken: bool  # cuda-python or the driver failed to load or initialise (not merely no device)
    reason: str  # why no GPU is usable; "" when one is


NO_DEVICE = 100  # CUDA_ERROR_NO_DEVICE


def _load_driver():
    from cuda.bindings import driver

    return driver


def _device_nodes() -> bool:
    return os.path.exists("/dev/nvidiactl") or bool(glob.glob("/dev/nvidia[0-9]*"))


def probe_gpu(load_driver=_load_driver, device_nodes=_device_nodes) -> GpuStatus:
    """Look for a CUDA GPU; never raises.

    A missing cuda-python, or a driver error other than "no device", is reported as broken, and so
    is a driver that cannot be loaded where NVIDIA device nodes exist (a GPU machine whose install
    is broken), so that callers need not mistake it for a machine without a GPU.
    """
    try:
        driver = load_driver()
    except Exception as e:
        return GpuStatus(False, True, f"cuda-python import failed: {type(e).__name__}: {e}")
    try:
        (err,) = driver.cuInit(0)
    except Exception as e:  # libcuda not found or not loadable
        if device_nodes():
            return GpuStatus(False, True, f"NVIDIA device nodes exist but the CUDA driver could not be loaded "
                                          f"({type(e).__name__}: {e})")
        return GpuStatus(False, False, f"no CUDA GPU available (no CUDA driver: {type(e).__name__})")
    if int(err) == NO_DEVICE:
        return GpuStatus(False, False, "no CUDA GPU available (cuInit: CUDA_ERROR_NO_DEVICE)")
    if int(err) != 0:
        return GpuStatus(False, True, f"CUDA driver error: cuInit returned {getattr(err, 'name', err)}")
    try:
        err, count = driver.cuDeviceGetCount()
    except Exception as e:
        return GpuStatus(False, True, f"CUDA driver error: cuDeviceGetCount raised {type(e).__name__}: {e}")
    if int(err) != 0:
        return GpuStatus(False, True, f"CUDA driver error: cuDeviceGetCount returned {getattr(err, 'name', err)}")
    if count < 1:
        return GpuStatus(False, False, "no CUDA GPU available (the driver reports 0 devices)")
    return GpuStatus(True, False, "")


@functools.cache
def gpu_status() -> GpuStatus:
    """`probe_gpu()` of this process, once."""
    return probe_gpu()


def gpu_available() -> bool:
    """True when the CUDA driver initialises and reports at least one device; never raises."""
    return gpu_status().available


_local = threading.local()


def init(device: int = 0):
    """Make CuPy's primary context of `device` current on this thread; returns the CUdevice."""
    dev = getattr(_local, "device", None)
    if dev is not None and _local.ordinal == device:
        return dev
    import cupy
    from cuda.bindings import driver

    cupy.cuda.Device(device).use()
    check(driver.cuInit(0), "cuInit")
    dev = check(driver.cuDeviceGet(device), "cuDeviceGet")
    ctx = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    _local.device, _local.ordinal = dev, device
    return dev


def device_attribute(attr: str, device: int = 0) -> int:
    """One `CU_DEVICE_ATTRIBUTE_<attr>` value, e.g. `device_attribute("MULTIPROCESSOR_COUNT")`."""
    from cuda.bindings import driver

    dev = init(device)
    enum = getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{attr}")
    return check(driver.cuDeviceGetAttribute(enum, dev), "cuDeviceGetAttribute")


def device_arch(device: int = 0) -> str:
    """The device's own SASS arch, e.g. "sm_90"."""
    major = device_attribute("COMPUTE_CAPABILITY_MAJOR", device)
    minor = device_attribute("COMPUTE_CAPABILITY_MINOR", device)
    return f"sm_{major}{minor}"


_streams: dict[int, object] = {}


def shared_stream(device: int = 0):
    """The process-wide non-blocking `cupy.cuda.Stream` that CuPy work and driver launches share."""
    s = _streams.get(device)
    if s is None:
        import cupy

        init(device)
        s = _streams[device] = cupy.cuda.Stream(non_blocking=True)
    return s


def stream_handle(stream) -> int:
    """The CUstream address of `stream`: a cupy Stream, a CUstream, an int, or None (CuPy's current)."""
    if stream is None:
        import cupy

        return cupy.cuda.get_current_stream().ptr
    ptr = getattr(stream, "ptr", None)
    if ptr is not None:
        return ptr
    return int(stream)
