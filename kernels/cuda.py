"""CUDA driver plumbing: return-code checks, GPU detection, the CuPy-owned context and stream."""

from __future__ import annotations

import functools
import threading


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


@functools.cache
def gpu_available() -> bool:
    """True when the CUDA driver initialises and reports at least one device; never raises."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return False
        err, count = driver.cuDeviceGetCount()
        return int(err) == 0 and count >= 1
    except Exception:
        return False


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
