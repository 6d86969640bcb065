"""Time the block-format GEMVs of model shapes, matrix by matrix, over launch tunings.

PYTHONPATH=. python3 dev/quant_gemv_sweep.py [--quick] [matrix-name-prefix ...]

Every (matrix, tuning) kernel is compiled first in a pool of processes (NVRTC only, no GPU), then
each GEMV is captured 20 times into one graph (PDL on, as in the step) and replayed; the median per
launch and the GB/s over the bytes the matrix holds are printed, fastest first. The 20 launches cycle
over copies of the matrix that together exceed the L2 cache (160 MB at least), so that every launch
streams from device memory, as in a step.
"""

from __future__ import annotations

import os
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from kernels.gemv_ops import EPI_ADD, EPI_SILU, EPI_STORE, QuantWeight, gemv
from kernels.tuning import FP32_X, GemvTuning


@dataclass(frozen=True)
class Mat:
    name: str
    fmt: str
    n_out: int
    k: int
    epi: int
    norm: bool
    argmax: bool = False

    @property
    def rows(self) -> int:
        return 2 * self.n_out if self.epi == EPI_SILU else self.n_out


MATS = [
    Mat("8b.qkv.q4_k", "q4_k", 6144, 4096, EPI_STORE, True),
    Mat("8b.o.q4_k", "q4_k", 4096, 4096, EPI_ADD, False),
    Mat("8b.gate_up.q4_k", "q4_k", 14336, 4096, EPI_SILU, True),
    Mat("8b.down.q4_k", "q4_k", 4096, 14336, EPI_ADD, False),
    Mat("8b.down.q6_k", "q6_k", 4096, 14336, EPI_ADD, False),
    Mat("8b.gate_up.q6_k", "q6_k", 14336, 4096, EPI_SILU, True),
    Mat("8b.lm_head.q6_k", "q6_k", 128256, 4096, EPI_STORE, True, True),
    Mat("8b.gate_up.q4_0", "q4_0", 14336, 4096, EPI_SILU, True),
    Mat("8b.down.q4_0", "q4_0", 4096, 14336, EPI_ADD, False),
    Mat("8b.gate_up.q8_0", "q8_0", 14336, 4096, EPI_SILU, True),
    Mat("8b.down.q8_0", "q8_0", 4096, 14336, EPI_ADD, False),
    Mat("0.5b.qkv.q5_0", "q5_0", 1152, 896, EPI_STORE, True),
    Mat("0.5b.gate_up.q5_0", "q5_0", 4864, 896, EPI_SILU, True),
    Mat("0.5b.down.q4_k", "q4_k", 896, 4864, EPI_ADD, False),
    Mat("0.5b.gate_up.q8_0", "q8_0", 4864, 896, EPI_SILU, True),
    Mat("0.5b.lm_head.q8_0", "q8_0", 151936, 896, EPI_STORE, True, True),
]

# (label, tuning, split_k or None for the heuristic)
T = GemvTuning
VARIANTS = [
    ("default", T(), None),
    ("f32 r4w4m3", FP32_X, None),
    ("w8m2", T(quant_warps=8, quant_min_blocks=2), None),
    ("short w16m1", T(quant_short_warps=16, quant_short_min_blocks=1), None),
    ("r4u2", T(quant_rows=4, quant_unroll=2), None),
    ("u3", T(quant_unroll=3), None),
    ("u2", T(quant_unroll=2), None),
    ("short r2", T(quant_short_rows=2), None),
    ("s2", T(), 2),
    ("w4m4", T(quant_warps=4, quant_min_blocks=4), None),
    ("s4", T(), 4),
    ("r1", T(quant_rows=1), None),
    ("r1 s2", T(quant_rows=1), 2),
    ("few r2", T(quant_few_rows=2), None),
    ("w8m2 s2", T(quant_warps=8, quant_min_blocks=2), 2),
    ("u6", T(quant_unroll=6), None),
    ("r1 u8 s2", T(quant_rows=1, quant_unroll=8), 2),
]
QUICK = {"default", "f32 r4w4m3", "w8m2"}
ROTATE_BYTES = 160e6


def build(m: Mat, tuning: GemvTuning, splitk, w, x, g, y, amax):
    return gemv(w, x, y, m.n_out, m.k, gamma=g if m.norm else None, epi=m.epi, eps=1e-5,
                amax=amax if m.argmax else None, tuning=tuning, splitk=splitk, pdl=True)


def _compile_only(job):
    """In a worker: build the launch with NVRTC alone (module and sm_count stubbed), filling the cache."""
    import kernels.gemv_ops as G
    from kernels.compiler import compile_kernel

    class Fake:
        def function(self, *a):
            return self

        def prepare(self, *a, **k):
            return None

    def module(source, **defines):
        compile_kernel(source, defines, "sm_90")
        return Fake()

    G.module = module
    G.sm_count = lambda: 132
    m, label = job
    tuning, splitk = next((t, s) for lb, t, s in VARIANTS if lb == label)
    try:
        build(m, tuning, splitk, QuantWeight(m.fmt, m.rows, m.k, None), 0, 0, 0, 0)
        return None
    except Exception as e:  # noqa: BLE001 - reported, the sweep goes on
        return f"{m.name} {label}: {str(e).splitlines()[0]}"


def main(argv):
    import cupy as cp

    from graphs.graph import capture
    from graphs.quant_weights import random_quant
    from kernels.cuda import init

    quick = "--quick" in argv
    prefixes = [a for a in argv if not a.startswith("--")]
    mats = [m for m in MATS if not prefixes or any(m.name.startswith(p) for p in prefixes)]
    labels = [lb for lb, _, _ in VARIANTS if not quick or lb in QUICK]
    jobs = [(m, lb) for m in mats for lb in labels]
    with ProcessPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        errors = list(pool.map(_compile_only, jobs))
    bad = {(m.name, lb) for (m, lb), err in zip(jobs, errors, strict=True) if err}
    for err in filter(None, errors):
        print("compile:", err, flush=True)
    init()
    s = cp.cuda.Stream(non_blocking=True)
    rng = cp.random.default_rng(0)
    for m in mats:
        w = random_quant(m.fmt, m.rows, m.k, seed=1)
        copies = [w] + [random_quant(m.fmt, m.rows, m.k, seed=2 + i) for i in range(int(ROTATE_BYTES // w.nbytes))]
        x = rng.standard_normal(m.k, dtype=cp.float32)
        g = (0.5 + rng.random(m.k, dtype=cp.float32)).astype(cp.float32)
        y = cp.zeros(m.n_out, cp.float32)
        amax = cp.zeros(1, cp.uint64)
        rows = []
        for label, tuning, splitk in VARIANTS:
            if label not in labels or (m.name, label) in bad:
                continue
            launches = [build(m, tuning, splitk, c, x, g, y, amax) for c in copies]
            launch = launches[0]
            graph = capture(s, [launches[i % len(launches)] for i in range(20)])
            times = []
            start, end = cp.cuda.Event(), cp.cuda.Event()
            for _ in range(6):
                start.record(s)
                graph.replay(s)
                end.record(s)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end) / 20)
            us = 1e3 * statistics.median(times[1:])
            rows.append((us, label, launch.grid[0], w.nbytes / (us * 1e-6) / 1e9))
        print(f"{m.name} {m.rows}x{m.k} {w.nbytes / 1e6:.1f} MB", flush=True)
        for us, label, grid, gbs in sorted(rows):
            print(f"   {label:<14} {us:8.2f} us {gbs:7.0f} GB/s grid {grid}", flush=True)
        del w, copies


if __name__ == "__main__":
    main(sys.argv[1:])
