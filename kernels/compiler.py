"""NVRTC compilation of kernels/*.cu to CUBIN, with ptxas statistics and an on-disk cache."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from kernels.cache import CubinCache
from kernels.cuda import check

KERNELS_DIR = Path(__file__).resolve().parent
PTXAS_OPTIONS = (
    "-Xptxas=-v",
    "-Xptxas=--warn-on-local-memory-usage",
    "-Xptxas=--warn-on-spills",
    "-Xptxas=--warning-as-error",
)
BASE_OPTIONS = ("-std=c++17", "-default-device", *PTXAS_OPTIONS)

_INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
_BUDGET = re.compile(r"^\s*//\s*budget:(.*)$", re.M)
_DEFINES = re.compile(r"^\s*//\s*defines:(.*)$", re.M)
_ARCH = re.compile(r"^sm_(\d+)([af]?)$")


class KernelCompileError(Exception):
    """NVRTC or ptxas rejected a kernel source; `log` holds NVRTC's full program log."""

    def __init__(self, message: str, log: str = "", source: Path | None = None):
        self.log = log
        self.source = source
        super().__init__(f"{message}\n{log}".rstrip())


@dataclass
class KernelStats:
    name: str
    registers: int = 0
    smem: int = 0
    cmem: int = 0
    barriers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


@dataclass
class CompiledKernel:
    source: Path
    arch: str
    options: tuple[str, ...]
    key: str
    cubin: bytes
    log: str
    stats: dict[str, KernelStats] = field(default_factory=dict)
    budgets: dict[str, int] = field(default_factory=dict)
    cached: bool = False


def source_files(directory: Path = KERNELS_DIR) -> list[Path]:
    """Every *.cu file of `directory`, sorted."""
    return sorted(Path(directory).glob("*.cu"))


def resolve_source(source: str | os.PathLike) -> Path:
    """A path as given, or a bare name ("chain" / "chain.cu") looked up in kernels/."""
    p = Path(source)
    if p.suffix != ".cu" and not p.exists():
        p = p.with_suffix(".cu")
    if not p.is_absolute() and not p.exists():
        p = KERNELS_DIR / p
    if not p.is_file():
        raise FileNotFoundError(f"kernel source not found: {source}")
    return p.resolve()


def _pairs(lines) -> dict[str, str]:
    items = (item.strip(",").partition("=") for line in lines for item in line.split())
    return {name: value for name, sep, value in items if sep}


def _budgets(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in _pairs(_BUDGET.findall(text)).items()}


def declared_budgets(source: str | os.PathLike) -> dict[str, int]:
    """Per-kernel register budgets from `// budget: kernel=128` lines."""
    return _budgets(resolve_source(source).read_text())


def declared_defines(source: str | os.PathLike) -> list[dict[str, str]]:
    """Representative compile-time constants, one dict per `// defines: HEAD_DIM=128 ...` line."""
    sets = [_pairs([line]) for line in _DEFINES.findall(resolve_source(source).read_text()) if "=" in line]
    return sets or [{}]


def project_headers(path: Path) -> dict[str, bytes]:
    """Quoted includes found beside the source or in kernels/, recursively: {include name: text}."""
    found: dict[str, bytes] = {}

    def visit(text: str, here: Path):
        for name in _INCLUDE.findall(text):
            if name in found:
                continue
            for d in (here, path.parent, KERNELS_DIR):
                candidate = d / name
                if candidate.is_file():
                    data = candidate.read_bytes()
                    found[name] = data
                    visit(data.decode(errors="replace"), candidate.parent)
                    break

    visit(path.read_text(), path.parent)
    return found


def _header_dir_ok(d: Path) -> bool:
    return (d / "cuda_bf16.h").is_file() and (d / "cuda_fp16.h").is_file()


def _candidate_include_dirs():
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for sub in ("cu13/include", "cuda_runtime/include", "cuda_nvrtc/include"):
            yield Path(base) / sub
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            yield Path(os.environ[var]) / "include"
    try:
        from cuda.pathfinder import locate_nvidia_header_directory

        located = locate_nvidia_header_directory("cudart")
        if located is not None and located.abs_path:
            yield Path(located.abs_path)
    except Exception:
        pass
    yield Path("/usr/local/cuda/include")


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """The CUDA include directory (wheels first, then the toolkit) and its cccl/ subdirectory."""
    for d in _candidate_include_dirs():
        if _header_dir_ok(d):
            dirs = [d] + ([d / "cccl"] if (d / "cccl").is_dir() else [])
            return tuple(str(x) for x in dirs)
    return ()


@functools.cache
def nvrtc_version() -> str:
    """NVRTC's major.minor plus the size of the loaded library, which tells patch releases apart."""
    from cuda.bindings import nvrtc

    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        lib = load_nvidia_dynamic_lib("nvrtc").abs_path
        return f"{major}.{minor} {os.path.basename(lib)}:{os.path.getsize(lib)}"
    except Exception:
        return f"{major}.{minor}"


@functools.cache
def supported_archs() -> tuple[int, ...]:
    from cuda.bindings import nvrtc

    return tuple(check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def check_arch(arch: str) -> str:
    """Validate an arch like "sm_90" (or "sm_90a") against what this NVRTC can emit."""
    m = _ARCH.match(arch or "")
    if not m or int(m.group(1)) not in supported_archs():
        known = ", ".join(f"sm_{a}" for a in supported_archs())
        raise ValueError(f"unknown or unsupported arch {arch!r} (this NVRTC supports {known})")
    return arch


def build_options(arch: str, defines: dict | None = None, extra=()) -> tuple[str, ...]:
    opts = [f"--gpu-architecture={arch}", *BASE_OPTIONS]
    for name, value in sorted((defines or {}).items()):
        if not re.fullmatch(r"[A-Za-z_]\w*", name):
            raise ValueError(f"bad define name {name!r}")
        if isinstance(value, bool):
            value = int(value)
        opts.append(f"-D{name}={value}")
    return tuple(opts) + tuple(extra)


def cache_key(source: bytes, headers: dict[str, bytes], options, arch: str, nvrtc: str) -> str:
    h = hashlib.sha256()
    meta = {
        "format": 1,
        "source": hashlib.sha256(source).hexdigest(),
        "headers": sorted((n, hashlib.sha256(t).hexdigest()) for n, t in headers.items()),
        "options": sorted(options),
        "arch": arch,
        "nvrtc": nvrtc,
    }
    h.update(json.dumps(meta, sort_keys=True).encode())
    return h.hexdigest()


def parse_ptxas_log(log: str) -> dict[str, KernelStats]:
    """Per-entry-function statistics from a `ptxas -v` log."""
    stats: dict[str, KernelStats] = {}
    entry = props = None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            entry = m.group(1)
            stats[entry] = KernelStats(entry)
        elif m := re.search(r"Function properties for (\S+)", line):
            props = m.group(1)
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            if props in stats:
                s = stats[props]
                s.stack, s.spill_stores, s.spill_loads = (int(x) for x in m.groups())
        elif (m := re.search(r"Used (\d+) registers", line)) and entry in stats:
            s = stats[entry]
            s.registers = int(m.group(1))
            if b := re.search(r"used (\d+) barriers", line):
                s.barriers = int(b.group(1))
            if sm := re.search(r"(\d+) bytes smem", line):
                s.smem = int(sm.group(1))
            s.cmem = sum(int(c) for c in re.findall(r"(\d+) bytes cmem\[\d+\]", line))
    return stats


def _nvrtc_compile(name: str, source: bytes, headers: dict[str, bytes], options) -> tuple[bytes | None, str]:
    """Run NVRTC once; returns (cubin or None on a compile error, log)."""
    from cuda.bindings import nvrtc

    names = list(headers)
    prog = check(
        nvrtc.nvrtcCreateProgram(source, name.encode(), len(names), [headers[n] for n in names],
                                 [n.encode() for n in names]),
        "nvrtcCreateProgram",
    )
    try:
        opts = [o.encode() for o in options] + [f"-I{d}".encode() for d in include_dirs()]
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = "\n".join(ln.rstrip() for ln in buf.decode(errors="replace").replace("\x00", "\n").splitlines())
        log = log.strip() + "\n"
        if result == nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION:
            return None, log
        check((result,), "nvrtcCompileProgram")
        size = check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return cubin, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _reject_local_memory(path: Path, stats: dict[str, KernelStats], log: str):
    bad = [s for s in stats.values() if s.stack or s.spill_stores or s.spill_loads]
    if bad:
        what = ", ".join(f"{s.name}: {s.stack} B stack, {s.spill_stores}/{s.spill_loads} B spills" for s in bad)
        raise KernelCompileError(f"{path}: local memory used ({what})", log, path)


def compile_kernel(source, defines: dict | None = None, arch: str | None = None, options=(),
                   cache: CubinCache | None = None) -> CompiledKernel:
    """Compile one .cu file (path or name in kernels/) to CUBIN for `arch` (default: the device's).

    Results are cached on disk; a kernel using local memory or spilling raises KernelCompileError.
    """
    path = resolve_source(source)
    if arch is None:
        from kernels.cuda import device_arch

        arch = device_arch()
    check_arch(arch)
    text = path.read_bytes()
    headers = project_headers(path)
    opts = build_options(arch, defines, options)
    key = cache_key(text, headers, opts, arch, nvrtc_version())
    budgets = _budgets(text.decode(errors="replace"))
    cache = cache or CubinCache()

    def done(cubin, log, cached):
        stats = parse_ptxas_log(log)
        return CompiledKernel(path, arch, opts, key, cubin, log, stats, budgets, cached)

    hit = cache.get(key)
    if hit is not None:
        return done(*hit, True)
    with cache.lock(key):
        hit = cache.get(key)
        if hit is not None:
            return done(*hit, True)
        cubin, log = _nvrtc_compile(path.name, text, headers, opts)
        if cubin is None:
            raise KernelCompileError(f"{path}: NVRTC compilation for {arch} failed", log, path)
        _reject_local_memory(path, parse_ptxas_log(log), log)
        try:
            cache.put(key, cubin, log)
        except OSError as e:
            warnings.warn(f"cubin cache not written ({e})", stacklevel=2)
    return done(cubin, log, False)
