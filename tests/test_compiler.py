import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kernels import compiler
from kernels.cache import CubinCache, decode_entry, default_cache_dir, encode_entry, read_regular
from kernels.compiler import KernelCompileError, compile_kernel, declared_budgets, declared_defines

ROOT = Path(__file__).resolve().parent.parent
CHAIN = ROOT / "tests" / "kernels" / "chain.cu"
ARCH = "sm_90"
SOURCES = compiler.source_files() + [CHAIN]

LOCAL_ARRAY = """
extern "C" __global__ void histogram(float* x, const int* idx, int n) {
    float bins[8];
    for (int i = 0; i < 8; i++) bins[i] = 0.f;
    for (int i = 0; i < n; i++) bins[idx[i] & 7] += x[i];
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += bins[i] * (i + 1);
    x[threadIdx.x] = s;
}
"""

MANY_REGISTERS = """
extern "C" __global__ void many(float* y, const float* x, int n) {
    float v[48];
#pragma unroll
    for (int i = 0; i < 48; i++) v[i] = x[i * n + threadIdx.x];
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 48; i++) s += v[i] * v[47 - i] + v[(i * 7) % 48];
    y[threadIdx.x] = s;
}
"""

WITH_HEADER = """#include "common.cuh"
extern "C" __global__ void twice(float* y, const float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = twice_of(x[i]) + OFFSET;
}
"""


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("GDECODE_CACHE_DIR", str(d))
    return d


@pytest.fixture
def nvrtc_calls(monkeypatch):
    calls = []
    real = compiler._nvrtc_compile

    def counted(*args):
        calls.append(args[0])
        return real(*args)

    monkeypatch.setattr(compiler, "_nvrtc_compile", counted)
    return calls


@pytest.fixture
def header_kernel(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    (d / "common.cuh").write_text("__device__ __forceinline__ float twice_of(float v) { return 2.f * v; }\n")
    (d / "twice.cu").write_text(WITH_HEADER)
    return d / "twice.cu"


def _variants():
    for src in SOURCES:
        for i, defines in enumerate(declared_defines(src)):
            yield pytest.param(src, defines, id=f"{src.name}-{i}")


@pytest.mark.parametrize("source,defines", list(_variants()))
def test_kernel_builds_within_budget(source, defines):
    r = compile_kernel(source, defines=defines, arch=ARCH)
    budgets = declared_budgets(source)
    assert r.cubin and r.stats, f"{source.name}: no kernels compiled"
    for name, s in r.stats.items():
        assert s.stack == 0 and s.spill_stores == 0 and s.spill_loads == 0, s
        assert name in budgets, f"{source.name}: kernel {name} declares no `// budget: {name}=N`"
        assert 0 < s.registers <= budgets[name], f"{name}: {s.registers} registers > budget {budgets[name]}"


def test_chain_declarations():
    assert declared_budgets(CHAIN) == {"axpb": 32, "scale": 32, "block_sum": 48}
    assert declared_defines(CHAIN) == [{"BLOCK": "256"}]
    stats = compile_kernel(CHAIN, arch=ARCH).stats
    assert stats["block_sum"].smem == 32 and stats["block_sum"].barriers == 1


def test_runtime_indexed_local_array_is_rejected(tmp_path):
    src = tmp_path / "local.cu"
    src.write_text(LOCAL_ARRAY)
    with pytest.raises(KernelCompileError, match="(?i)local memory") as e:
        compile_kernel(src, arch=ARCH)
    assert "histogram" in str(e.value)


def test_spills_are_rejected(tmp_path):
    src = tmp_path / "spill.cu"
    src.write_text(MANY_REGISTERS)
    assert compile_kernel(src, arch=ARCH).stats["many"].spill_stores == 0
    with pytest.raises(KernelCompileError, match="Registers are spilled"):
        compile_kernel(src, arch=ARCH, options=("-maxrregcount=24",))


def test_compile_error_carries_file_and_line(tmp_path):
    src = tmp_path / "broken.cu"
    src.write_text('extern "C" __global__ void k(float* x) {\n    x[0] = 1.f;\n    x[1] = undefined_name;\n}\n')
    with pytest.raises(KernelCompileError) as e:
        compile_kernel(src, arch=ARCH)
    assert "broken.cu(3)" in str(e.value) and "undefined_name" in e.value.log


def test_unknown_arch_is_refused():
    with pytest.raises(ValueError, match="sm_1234"):
        compile_kernel(CHAIN, arch="sm_1234")
    with pytest.raises(ValueError):
        compile_kernel(CHAIN, arch="compute_90")


def test_cache_hit_skips_nvrtc(nvrtc_calls, cache_dir):
    a = compile_kernel(CHAIN, arch=ARCH)
    b = compile_kernel(CHAIN, arch=ARCH)
    assert len(nvrtc_calls) == 1 and not a.cached and b.cached
    assert a.cubin == b.cubin and a.log == b.log and a.stats == b.stats
    assert CubinCache().path(a.key).parent == cache_dir


def test_cache_misses_on_define_source_and_header(nvrtc_calls, header_kernel):
    keys = {compile_kernel(header_kernel, {"OFFSET": "1.f"}, ARCH).key}
    keys.add(compile_kernel(header_kernel, {"OFFSET": "2.f"}, ARCH).key)
    header_kernel.write_text(WITH_HEADER + "// changed\n")
    keys.add(compile_kernel(header_kernel, {"OFFSET": "2.f"}, ARCH).key)
    (header_kernel.parent / "common.cuh").write_text(
        "__device__ __forceinline__ float twice_of(float v) { return v + v; }\n")
    keys.add(compile_kernel(header_kernel, {"OFFSET": "2.f"}, ARCH).key)
    assert len(keys) == 4 and len(nvrtc_calls) == 4
    assert compile_kernel(header_kernel, {"OFFSET": "2.f"}, ARCH).cached


def test_several_define_sets(tmp_path):
    src = tmp_path / "multi.cu"
    src.write_text("// defines: A=1 B=2\n// defines: A=3\n// budget: k=32\n" + LOCAL_ARRAY)
    assert declared_defines(src) == [{"A": "1", "B": "2"}, {"A": "3"}]
    assert declared_budgets(src) == {"k": 32}


def test_defines_are_order_independent():
    a = compiler.cache_key(b"x", {}, compiler.build_options(ARCH, {"A": 1, "B": 2}), ARCH, "13.0")
    b = compiler.cache_key(b"x", {}, compiler.build_options(ARCH, {"B": 2, "A": 1}), ARCH, "13.0")
    assert a == b != compiler.cache_key(b"x", {}, compiler.build_options(ARCH, {"A": 1}), ARCH, "13.0")


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "append"])
def test_corrupt_entry_is_recompiled(nvrtc_calls, damage):
    good = compile_kernel(CHAIN, arch=ARCH)
    path = CubinCache().path(good.key)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "empty":
        data = bytearray()
    else:
        data += b"\0"
    path.write_bytes(bytes(data))
    again = compile_kernel(CHAIN, arch=ARCH)
    assert not again.cached and again.cubin == good.cubin and len(nvrtc_calls) == 2
    assert decode_entry(path.read_bytes()) == (again.cubin, again.log)


def test_entry_roundtrip():
    assert decode_entry(encode_entry(b"\x7fELF...", "log")) == (b"\x7fELF...", "log")
    assert decode_entry(b"junk") is None


def test_concurrent_compiles_agree(cache_dir):
    script = (
        "import hashlib, sys\n"
        "from kernels.compiler import compile_kernel\n"
        f"r = compile_kernel({str(CHAIN)!r}, arch={ARCH!r})\n"
        "print(hashlib.sha256(r.cubin).hexdigest())\n"
    )
    env = dict(os.environ, GDECODE_CACHE_DIR=str(cache_dir), PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    digests = {out.strip() for out, _ in outs}
    assert len(digests) == 1
    entries = list(cache_dir.glob("*.cubin"))
    assert len(entries) == 1 and not list(cache_dir.glob("*.tmp"))
    assert hashlib.sha256(decode_entry(entries[0].read_bytes())[0]).hexdigest() in digests


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("GDECODE_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("GDECODE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir().parent == tmp_path / "xdg" / "gdecode"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir().parent == tmp_path / "home" / ".cache" / "gdecode"


def test_parse_ptxas_log_with_cmem():
    log = (
        "ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
        "ptxas info    : Function properties for helper\n"
        "ptxas         .     8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Function properties for k\n"
        "ptxas         .     0 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 368 bytes cmem[0], 8 bytes cmem[2]\n"
    )
    (s,) = compiler.parse_ptxas_log(log).values()
    assert (s.name, s.registers, s.barriers, s.smem, s.cmem) == ("k", 40, 1, 2048, 376)
    assert (s.stack, s.spill_stores, s.spill_loads) == (0, 4, 8)


def test_cli_table():
    import typer
    from typer.testing import CliRunner

    from cli.kernels import kernels
    from engine.errors import GDecodeError

    app = typer.Typer()
    app.callback()(lambda: None)
    app.command("kernels")(kernels)
    result = CliRunner().invoke(app, ["kernels", "--arch", ARCH, str(CHAIN)])
    assert result.exit_code == 0, result.output
    assert "block_sum" in result.output and "48" in result.output
    result = CliRunner().invoke(app, ["kernels", "--arch", "sm_1"])
    assert isinstance(result.exception, GDecodeError)


# ---- cache entries and locks that are not plain files: never followed, never blocking, rebuilt ----


def _in_thread(fn, timeout=60):
    """fn() run in a thread: a call that blocks (on a FIFO) fails the test instead of hanging it."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "blocked"
    return out.get("r")


@pytest.mark.parametrize("kind", ["symlink", "fifo", "oversized", "directory"])
def test_odd_entry_is_rebuilt_without_following_it(nvrtc_calls, tmp_path, kind):
    good = compile_kernel(CHAIN, arch=ARCH)
    path = CubinCache().path(good.key)
    elsewhere = tmp_path / "elsewhere.cubin"
    elsewhere.write_bytes(path.read_bytes())  # a valid entry: following the link would wrongly hit
    path.unlink()
    if kind == "symlink":
        path.symlink_to(elsewhere)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.truncate(65 << 20)  # sparse
    else:
        path.mkdir()
    assert _in_thread(lambda: CubinCache().get(good.key)) is None
    again = _in_thread(lambda: compile_kernel(CHAIN, arch=ARCH))
    assert not again.cached and again.cubin == good.cubin and len(nvrtc_calls) == 2
    assert elsewhere.read_bytes() == encode_entry(good.cubin, good.log)
    if kind != "directory":  # a directory cannot be replaced by a file: the compile still succeeds
        assert path.is_file() and not path.is_symlink()
        assert decode_entry(path.read_bytes()) == (again.cubin, again.log)


@pytest.mark.parametrize("kind", ["symlink", "fifo", "dangling"])
def test_odd_lock_is_not_followed(cache_dir, tmp_path, kind):
    cache_dir.mkdir()
    lock = cache_dir / "k.lock"
    target = tmp_path / "precious"
    if kind == "symlink":
        target.write_text("keep me")
        lock.symlink_to(target)
    elif kind == "dangling":
        lock.symlink_to(target)
    else:
        os.mkfifo(lock)

    def locked():
        with CubinCache().lock("k"):
            return "ran"

    assert _in_thread(locked) == "ran"
    assert lock.is_file() and not lock.is_symlink()
    assert (target.read_text() == "keep me") if kind == "symlink" else not target.exists()


def test_read_regular_refuses_more_than_the_limit(tmp_path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * 11)
    assert read_regular(p, 10) is None and read_regular(p, 11) == b"x" * 11
