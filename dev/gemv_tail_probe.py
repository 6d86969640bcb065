"""When the blocks of the step's bf16 GEMVs start and end inside the graph: how long part of a grid idles
while the rest finishes.

PYTHONPATH=. python3 dev/gemv_tail_probe.py [--depth D] [--replays N] [shape ...]

Each bf16 GEMV launch of the step (kernels/gemv.cu) is swapped for the same build of dev/gemv_tail_probe.cu
(the step's defines, grid, block, PDL), whose blocks also write their start and end (%globaltimer, ns). A build
that the probe's extra stores make spill is left as it was, and said so. One step is captured as the bench
captures it and replayed; per kind, medians over layers and replays, in microseconds from the last block end
of the launch before where that one is probed too (marked *), else from the kind's own first start:
  start      the first and the last block's start (PDL launches blocks before the kernel before ends)
  end        the blocks' ends at the 10th, 50th and 90th percentile, and the last
  tail       last end - median end
  at copy    the matrix's bytes at the copy bandwidth of the same run
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import cupy as cp
import numpy as np

from engine import bench as B
from engine.backend_cuda import CudaBackend
from engine.shapes import shape as named_shape
from graphs.decode import Launches, step_launches
from graphs.graph import capture
from kernels.bandwidth import copy_bandwidth
from kernels.compiler import KernelCompileError
from kernels.launch import Launch, Module
from kernels.tuning import Tuning

PROBE = Path(__file__).with_suffix(".cu").resolve()


def defines_of(module: Module) -> dict[str, str]:
    return dict(o[2:].split("=", 1) for o in module.compiled.options if o.startswith("-D"))


def step_at(name: str, depth: int):
    """(backend with random weights and K/V, the step's launches) for a named shape at `depth` cached rows."""
    cfg = named_shape(name)
    backend = CudaBackend(cfg, None, max_context=depth + B.TG_TOKENS + B.WARMUP + 1)
    B.fill_cache(backend)
    B.fill_depth(backend, depth)
    return backend, step_launches(cfg, backend.weights, backend.bufs, Tuning())


def is_bf16_gemv(launch: Launch) -> bool:
    return Path(launch.kernel.module.compiled.source).name == "gemv.cu"


def relaunch(launch: Launch, kernel, extra: list, *, grid=None, smem: int | None = None) -> Launch:
    """`kernel` (a lab build taking the launch's arguments, then `extra`) in place of the step's launch: its
    grid, block, shared memory, PDL and name unless given."""
    args = [v.value if v.value is not None else 0 for v in launch._values] + list(extra)
    return Launch(kernel, grid or launch.grid, launch.block, args, smem=launch.smem if smem is None else smem,
                  pdl=launch.pdl, name=launch.name)


def probed(launch: Launch, times) -> Launch | None:
    """The probe build of a bf16 GEMV launch, writing block times to `times`; None where it cannot be built."""
    rope = launch.kernel.name == "gemv_rope"
    try:
        mod = Module.load(PROBE, defines_of(launch.kernel.module))
    except KernelCompileError:
        return None
    return relaunch(launch, mod.function("gemv_rope_probe" if rope else "gemv_probe", launch.sig + "P"), [times])


def main(argv):
    depth = int(argv[argv.index("--depth") + 1]) if "--depth" in argv else 0
    replays = int(argv[argv.index("--replays") + 1]) if "--replays" in argv else 8
    values = {argv[i + 1] for i, a in enumerate(argv) if a in ("--depth", "--replays")}
    shapes = [a for a in argv if not a.startswith("--") and a not in values] or ["llama3-8b", "qwen2.5-0.5b"]
    copy_gbs = copy_bandwidth(4 << 30, 10)
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s", flush=True)
    for name in shapes:
        backend, launches = step_at(name, depth)
        s = backend.stream
        probes = {}  # index in the step: (kind, times, weight bytes)
        skipped = set()
        for i, launch in enumerate(launches):
            if not is_bf16_gemv(launch):
                continue
            times = cp.zeros(2 * launch.grid[0], cp.uint64)
            p = probed(launch, times)
            if p is None:
                skipped.add(Launches.kind(launch.name))
                continue
            launches[i] = p
            probes[i] = (Launches.kind(launch.name), times, weight_bytes(launch))
        graph = capture(s, launches)
        s.synchronize()
        out: dict[str, list] = {}
        for r in range(replays + 2):
            for _, times, _ in probes.values():
                times.fill(0)
            cp.cuda.runtime.deviceSynchronize()
            B.set_position(backend, depth)
            graph.replay(s)
            s.synchronize()
            if r < 2:
                continue
            got = {i: times.get().reshape(-1, 2).astype(np.int64) for i, (_, times, _) in probes.items()}
            for i, (kind, _, nbytes) in probes.items():
                t = got[i]
                t = t[t[:, 1] > 0]
                before = got.get(i - 1)
                zero = before[:, 1].max() if before is not None else t[:, 0].min()
                start, end = (t[:, 0] - zero) / 1e3, (t[:, 1] - zero) / 1e3
                q = np.percentile(end, [10, 50, 90])
                out.setdefault(kind, []).append((start.min(), start.max(), q[0], q[1], q[2], end.max(),
                                                 end.max() - q[1], before is not None, nbytes))
        print(f"{name} depth {depth}, {replays} replays; us from the end of the kernel before where it is probed "
              f"(*), else from the first start" + (f"; not probed (spills): {', '.join(sorted(skipped))}"
                                                   if skipped else ""))
        print(f"{'kind':<12} {'first start':>11} {'last start':>10} {'end p10':>8} {'p50':>7} {'p90':>7} "
              f"{'last':>7} {'tail':>6} {'at copy':>8}")
        for kind, vals in out.items():
            m = [statistics.median(v[j] for v in vals) for j in range(7)]
            mark = "*" if vals[0][7] else " "
            at_copy = vals[0][8] / copy_gbs / 1e3
            print(f"{kind + mark:<12} {m[0]:11.2f} {m[1]:10.2f} {m[2]:8.2f} {m[3]:7.2f} {m[4]:7.2f} {m[5]:7.2f} "
                  f"{m[6]:6.2f} {at_copy:8.2f}", flush=True)
        del backend, graph


def weight_bytes(launch: Launch) -> int:
    """Bytes of the launch's weight matrix: its rows (n_out, or 2 n_out for SiLU; n_pairs * 2 for RoPE)
    times K bf16 weights."""
    d = defines_of(launch.kernel.module)
    k = int(d["K"])
    n = int(launch._values[5].value)
    if launch.kernel.name == "gemv_rope" or d["EPILOGUE"] == "EPI_SILU":
        n *= 2
    return n * k * 2


if __name__ == "__main__":
    main(sys.argv[1:])
