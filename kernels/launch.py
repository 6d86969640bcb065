"""Loaded kernel modules and launches whose parameter arrays are built once."""

from __future__ import annotations

import ctypes

from cuda.bindings import driver

from kernels.compiler import CompiledKernel, compile_kernel
from kernels.cuda import CudaError, check, device_arch, init, stream_handle

SIG_CTYPES = {
    "P": ctypes.c_uint64,  # device pointer: int, cupy array, cupy MemoryPointer or CUdeviceptr
    "i": ctypes.c_int32,
    "I": ctypes.c_uint32,
    "q": ctypes.c_int64,
    "Q": ctypes.c_uint64,
    "f": ctypes.c_float,
    "d": ctypes.c_double,
}
_POINTER_CTYPES = (ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t)
_DEFAULT_SMEM_LIMIT = 48 * 1024  # dynamic shared memory a kernel may use without opting in


def device_pointer(value) -> int:
    """The device address of an int, a cupy array, a cupy MemoryPointer or a CUdeviceptr."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    data = getattr(value, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return data.ptr
    if hasattr(value, "ptr"):
        return value.ptr
    return int(value)


def pack_args(args, sig: str | None = None) -> tuple[list, ctypes.Array]:
    """ctypes values for each argument and the void*[] array pointing at them.

    Each arg is typed by `sig` (one letter of SIG_CTYPES per arg), or given as a (value, ctype)
    pair, or is already a ctypes value.
    """
    args = list(args)
    if sig is not None and len(sig) != len(args):
        raise ValueError(f"signature {sig!r} has {len(sig)} entries for {len(args)} arguments")
    values = []
    for i, a in enumerate(args):
        if sig is not None:
            ct = SIG_CTYPES[sig[i]]
            values.append(ct(device_pointer(a)) if sig[i] == "P" else ct(a))
        elif isinstance(a, tuple) and len(a) == 2:
            value, ct = a
            values.append(ct(device_pointer(value)) if ct in _POINTER_CTYPES else ct(value))
        elif isinstance(a, ctypes._SimpleCData):
            values.append(a)
        else:
            raise TypeError(f"argument {i} ({type(a).__name__}) needs a ctype: give a signature or (value, ctype)")
    array = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    return values, array


def _dims(d) -> tuple[int, int, int]:
    d = (d,) if isinstance(d, int) else tuple(d)
    if not 1 <= len(d) <= 3 or any(int(x) < 1 for x in d):
        raise ValueError(f"bad launch dimensions {d}")
    return tuple(int(x) for x in d) + (1,) * (3 - len(d))


class Launch:
    """One kernel launch with fixed grid, block, shared memory and prebuilt parameters.

    `launch(stream)` costs one cuLaunchKernel (or cuLaunchKernelEx with `pdl=True`). `name` labels
    it in timings (e.g. "layer3.attn"); it defaults to the kernel's name.
    """

    def __init__(self, kernel: Kernel, grid, block, args, smem: int = 0, sig: str | None = None,
                 pdl: bool = False, name: str | None = None):
        self.kernel = kernel
        self.name = name or kernel.name
        self.grid, self.block, self.smem = _dims(grid), _dims(block), int(smem)
        self.sig = sig if sig is not None else kernel.sig
        self.pdl = pdl
        self.version = 0
        if self.smem:
            kernel.set_max_dynamic_smem(self.smem)
        self._set(args)
        self._config = self._pdl_config() if pdl else None

    def _set(self, args):
        self._values, self._array = pack_args(args, self.sig)
        self._params = ctypes.addressof(self._array)

    def _pdl_config(self):
        cfg = driver.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
        cfg.sharedMemBytes = self.smem
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs = [attr]
        cfg.numAttrs = 1
        return cfg

    def update_args(self, args):
        """Rebuild the parameters (e.g. a buffer moved); graphs pick them up through Graph.update."""
        self._set(args)
        self.version += 1

    def set_arg(self, index: int, value):
        """Change one argument in place."""
        v = self._values[index]
        v.value = device_pointer(value) if isinstance(v, _POINTER_CTYPES) else value
        self.version += 1

    def node_params(self) -> driver.CUDA_KERNEL_NODE_PARAMS:
        p = driver.CUDA_KERNEL_NODE_PARAMS()
        p.func = self.kernel.func
        p.gridDimX, p.gridDimY, p.gridDimZ = self.grid
        p.blockDimX, p.blockDimY, p.blockDimZ = self.block
        p.sharedMemBytes = self.smem
        p.kernelParams = self._params
        return p

    def __call__(self, stream=None):
        h = stream if type(stream) is int else stream_handle(stream)
        if self._config is None:
            g, b = self.grid, self.block
            (err,) = driver.cuLaunchKernel(self.kernel.func, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, h,
                                           self._params, 0)
        else:
            self._config.hStream = h
            (err,) = driver.cuLaunchKernelEx(self._config, self.kernel.func, self._params, 0)
        if err:
            check((err,), "cuLaunchKernelEx" if self.pdl else "cuLaunchKernel")

    def __repr__(self):
        return f"Launch({self.name!r}, grid={self.grid}, block={self.block[0]})"


class Kernel:
    """A function of a loaded module; `sig` (e.g. "PPfi") types the arguments of its launches."""

    def __init__(self, module: Module, name: str, func, sig: str | None = None):
        self.module, self.name, self.func, self.sig = module, name, func, sig
        self._smem_limit = None

    def attribute(self, attr: str) -> int:
        enum = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{attr}")
        return check(driver.cuFuncGetAttribute(enum, self.func), "cuFuncGetAttribute")

    def set_max_dynamic_smem(self, nbytes: int):
        """Allow `nbytes` of dynamic shared memory (opts in above the 48 KiB default when needed)."""
        if self._smem_limit is None:
            self._smem_limit = _DEFAULT_SMEM_LIMIT - self.attribute("SHARED_SIZE_BYTES")
        if nbytes <= self._smem_limit:
            return
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(driver.cuFuncSetAttribute(self.func, attr, int(nbytes)), "cuFuncSetAttribute")
        self._smem_limit = int(nbytes)

    def prepare(self, grid, block, args, smem: int = 0, sig: str | None = None, pdl: bool = False,
                name: str | None = None) -> Launch:
        return Launch(self, grid, block, args, smem, sig, pdl, name)

    def launch(self, grid, block, args, smem: int = 0, stream=None, sig: str | None = None, pdl: bool = False):
        Launch(self, grid, block, args, smem, sig, pdl)(stream)


class Module:
    """A compiled (cached) and loaded cubin in CuPy's primary context."""

    def __init__(self, compiled: CompiledKernel, handle):
        self.compiled, self.handle = compiled, handle
        self._functions: dict[str, Kernel] = {}

    @classmethod
    def load(cls, source, defines: dict | None = None, arch: str | None = None, options=()) -> Module:
        init()
        compiled = compile_kernel(source, defines, arch or device_arch(), options)
        handle = check(driver.cuModuleLoadData(compiled.cubin), "cuModuleLoadData")
        return cls(compiled, handle)

    @property
    def stats(self):
        return self.compiled.stats

    def function(self, name: str, sig: str | None = None) -> Kernel:
        k = self._functions.get(name)
        if k is None:
            try:
                func = check(driver.cuModuleGetFunction(self.handle, name.encode()), "cuModuleGetFunction")
            except CudaError as e:
                raise CudaError(f"cuModuleGetFunction({name!r})", e.code, str(e)) from None
            k = self._functions[name] = Kernel(self, name, func, sig)
        elif sig is not None:
            k.sig = sig
        return k

    def unload(self):
        if self.handle is not None:
            check(driver.cuModuleUnload(self.handle), "cuModuleUnload")
            self.handle = None
            self._functions.clear()
