"""Registers against a shared-memory ring of bulk copies for the weights a GEMV keeps in flight.

    PYTHONPATH=. python3 dev/tma_probe.py [--layers N] [--only NAME ...]

A graph of N "layers" of int8 GEMVs in the 8B shape's order (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
down 4096x14336), each launch reading the output of the one before (PDL), every layer with its own weights
(N x 218 MB, far past the L2 cache), run with dev/tma_probe.cu's gemv_reg (the step's register streaming) and
gemv_tma in a few ring shapes. Prints us per layer and GB/s over the weight bytes, median of 7 timings of 10
replays (CUDA events), after checking that every variant's output equals gemv_reg's bit for bit and that
gemv_reg's first launch matches numpy.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

LAYER = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
# name: (kernel, warps, stages, batch); batch must divide K / 512 for every K above (8 and 28)
VARIANTS = {
    "reg": ("gemv_reg", 16, 0, 4),
    "tma w16 s3 b2": ("gemv_tma", 16, 3, 2),
    "tma w16 s2 b2": ("gemv_tma", 16, 2, 2),
    "tma w16 s4 b1": ("gemv_tma", 16, 4, 1),
    "tma w8 s3 b4": ("gemv_tma", 8, 3, 4),
    "tma w8 s6 b2": ("gemv_tma", 8, 6, 2),
}
MAXN = 28672


def main():
    import cupy as cp

    from graphs.graph import capture
    from kernels.bandwidth import copy_bandwidth
    from kernels.launch import Module
    from kernels.ops import sm_count

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--only", nargs="*", default=None)
    args = ap.parse_args()
    print(f"copy bandwidth {copy_bandwidth(1 << 30, 5):,.0f} GB/s", flush=True)
    src = Path(__file__).with_suffix(".cu").resolve()
    sms = sm_count()
    rng = np.random.default_rng(7)
    weights = []  # per layer, per matrix: (w, rs)
    for _ in range(args.layers):
        mats = []
        for _, n, k in LAYER:
            w = cp.random.randint(-127, 128, size=(n, k), dtype=cp.int32).astype(cp.int8)
            rs = cp.full(n, 1.0 / (73.0 * np.sqrt(k)), dtype=cp.float32)
            mats.append((w, rs))
        weights.append(mats)
    nbytes = sum(n * k for _, n, k in LAYER)
    x0 = cp.asarray(rng.standard_normal(MAXN).astype(np.float32))
    bufs = [cp.empty(MAXN, cp.float32), cp.empty(MAXN, cp.float32)]
    stream = cp.cuda.Stream(non_blocking=True)
    ref_out = None
    names = [v for v in VARIANTS if args.only is None or v in args.only or v == "reg"]
    for name in names:
        kname, warps, stages, batch = VARIANTS[name]
        launches = []
        fns = {}
        for _, n, k in LAYER:
            mod = Module.load(src, {"KX": k, "NROWS": n, "WARPS": warps, "STAGES": stages, "BATCH": batch})
            fn = mod.function(kname, "PPPP")
            smem = 0
            if kname == "gemv_tma":
                out = cp.zeros(1, cp.int32)
                mod.function("tma_smem", "P").launch(1, 1, [out])
                smem = int(out.get()[0])
            st = mod.stats
            fns[(n, k)] = (fn, smem)
            if name == names[0] or kname == "gemv_tma":
                print(f"  {name} {n}x{k}: {st.registers} regs, smem {smem}, spills {st.spill_stores}", flush=True)
        i = 0
        for layer in weights:
            for (_, n, k), (w, rs) in zip(LAYER, layer, strict=True):
                fn, smem = fns[(n, k)]
                launches.append(fn.prepare(sms, 32 * warps, [w, rs, bufs[i % 2], bufs[(i + 1) % 2]], smem=smem,
                                           pdl=True))
                i += 1
        with stream:
            bufs[0][:] = x0
            bufs[1].fill(np.nan)
            if name == "reg":
                launches[0](stream)
                stream.synchronize()
                w, rs = weights[0][0]
                xq = cp.asnumpy(x0[:4096]).astype(np.float64)
                want = (cp.asnumpy(w).astype(np.float64) @ xq) * cp.asnumpy(rs)
                got = cp.asnumpy(bufs[1][:6144]).astype(np.float64)
                err = np.abs(got - want).max() / np.abs(want).max()
                print(f"  reg first launch against numpy (x unquantized): max err {err:.2e} of max |y|", flush=True)
                assert err < 2e-2, err
                bufs[0][:] = x0
                bufs[1].fill(np.nan)
            graph = capture(stream, launches)
            graph.replay(stream)
            stream.synchronize()
            out = cp.asnumpy(bufs[i % 2])
            if ref_out is None:
                ref_out = out
                assert np.all(np.isfinite(out[:4096])), out[:8]
            else:
                same = np.array_equal(out[:4096].view(np.uint32), ref_out[:4096].view(np.uint32))
                print(f"  {name}: output {'equals' if same else 'DIFFERS FROM'} reg's bit for bit", flush=True)
            start, end = cp.cuda.Event(), cp.cuda.Event()
            times = []
            for _ in range(7):
                start.record(stream)
                for _ in range(10):
                    graph.replay(stream)
                end.record(stream)
                end.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / 10 / args.layers)
        us = statistics.median(times)
        print(f"{name:16s} {us:8.2f} us per layer, {nbytes / us / 1e3:8.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
