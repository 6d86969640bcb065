"""Quantized prefill on a random shape: pp512 with the next matrix dequantized ahead on a side stream
or not, and with dequant_rows' plain stores (the earlier kernel's), each checked bit for bit against
one stream; where the time goes (GEMMs alone, dequantization alone); dequant_rows alone in GB/s
against the copy bandwidth.

Measured on the H200 (llama3-8b q4_k_m, copy 4,261 GB/s), before the side stream: whole matrices with
plain stores 21.0 ms (24,361 tok/s), with staged stores 16.9 ms (30,364). Slices of rows (8-64 MB of
bf16, over 1-3 streams, each slice's GEMM right after its dequantization) were all slower, 18.7-33 ms,
and not bit-identical: cuBLAS picks other kernels for the narrower GEMMs, which cost more (12.6 ms of
GEMMs whole, 14.3 ms in 32 MB slices, 17.9 ms in 16 MB) than the L2 saves. With the side stream:
16.7-16.8 ms (30,444-30,669 tok/s) against 17.05-17.08 on one stream; the side stream at high
priority 16.96 ms. cuBLAS's GEMM blocks fill the SMs, so the dequantization overlaps mostly the
attention and row kernels between GEMMs.

    PYTHONPATH=. python3 dev/qprefill_sweep.py [--shape llama3-8b] [--quant q4_k_m]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

MB = 1 << 20


def median_ms(cp, stream, fn, reps=5, warmup=1):
    for _ in range(warmup):
        fn()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    out = []
    for _ in range(reps):
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        out.append(cp.cuda.get_elapsed_time(a, b))
    return float(np.median(out))


def dequant_alone(cp, s, w, copy_gbs):
    """dequant_rows over a whole matrix, and in 16 MB slices into one small buffer (L2-resident)."""
    from kernels import prefill_ops as pops

    rows, k = w.rows, w.cols
    big = cp.empty(rows * k, cp.uint16)
    step = 16 * MB // (2 * k)
    small = cp.empty(step * k, cp.uint16)
    nbytes = w.nbytes + 2 * rows * k
    for items, stage in [(1, False), (1, True), (2, True)]:
        whole = [pops.dequant_rows(w, big, 0, rows, items=items, stage=stage)]
        sliced = [pops.dequant_rows(w, small, r0, min(step, rows - r0), items=items, stage=stage)
                  for r0 in range(0, rows, step)]
        res = []
        for launches in (whole, sliced):
            def go(launches=launches):
                for la in launches:
                    la(s)
            ms = median_ms(cp, s, go, reps=7)
            res.append(f"{ms:.3f} ms {nbytes / ms / 1e6:.0f} GB/s ({100 * nbytes / ms / 1e6 / copy_gbs:.0f}%)")
        print(f"  dequant {w.fmt} {rows}x{k} items={items} stage={int(stage)}: whole {res[0]}; 16 MB slices {res[1]}",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--quant", default="q4_k_m")
    args = ap.parse_args()
    import cupy as cp

    from engine.shapes import shape
    from graphs.buffers import DecodeBuffers, DeviceWeights
    from graphs.prefill import Prefill
    from kernels import prefill_ops as pops
    from kernels.bandwidth import copy_bandwidth
    from kernels.cuda import init, shared_stream
    from kernels.tuning import PrefillTuning, Tuning

    init()
    s = shared_stream()
    copy_gbs = copy_bandwidth()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    cfg = shape(args.shape)
    t0 = time.time()
    with s:
        w = DeviceWeights.random(cfg, 0, args.quant)
        bufs = DecodeBuffers(cfg, 1024, 8, 4)
    s.synchronize()
    print(f"{args.shape} {args.quant}: weights in {time.time() - t0:.1f} s", flush=True)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 512)

    def build(pt, stage=True, priority=None):
        pf = Prefill(cfg, w, bufs, s, Tuning(prefill=pt))
        if priority is not None:  # CUDA clamps a priority into the device's range
            pf.ahead.side = cp.cuda.Stream(non_blocking=True, priority=priority)
        if not stage:
            for g in pf.ahead.gemms:
                base = pf.ahead.scratch[g.slot].data.ptr
                g.fill = [pops.dequant_rows(p, base + 2 * r0 * g.k, 0, p.rows, stage=False)
                          for p, r0 in zip(g.parts, g.offsets, strict=False)]
        return pf

    want = None
    for name, pt, stage, prio in [
            ("one stream, plain stores (the old prefill)", PrefillTuning(dequant_ahead=False), False, None),
            ("one stream", PrefillTuning(dequant_ahead=False), True, None),
            ("dequantized ahead", PrefillTuning(dequant_ahead=True), True, None),
            ("dequantized ahead, side stream at high priority", PrefillTuning(dequant_ahead=True), True, -5)]:
        pf = build(pt, stage, prio)
        ms = median_ms(cp, s, lambda: pf.run(ids))  # noqa: B023
        got = (bufs.k_cache.copy(), bufs.v_cache.copy(), pf.x.copy())
        if want is None:
            want = got
        same = all(bool(cp.array_equal(a, b)) for a, b in zip(got, want, strict=True))
        fills = [g.fill for g in pf.ahead.gemms]
        for g in pf.ahead.gemms:
            g.fill = []
        ms_gemm = median_ms(cp, s, lambda: pf.run(ids), reps=3)  # noqa: B023
        gemms = [g.gemm for g in pf.ahead.gemms]
        for g, f in zip(pf.ahead.gemms, fills, strict=True):
            g.fill, g.gemm = f, (lambda h, t: None)
            pf.ahead.holder = [None] * len(pf.ahead.holder)
        ms_deq = median_ms(cp, s, lambda: pf.run(ids), reps=3)  # noqa: B023
        for g, gm in zip(pf.ahead.gemms, gemms, strict=True):
            g.gemm = gm
        print(f"{name}: {ms:.2f} ms = {512 / ms * 1e3:,.0f} tok/s, bitwise equal {same}; "
              f"without dequant {ms_gemm:.2f} ms, without GEMMs {ms_deq:.2f} ms", flush=True)
        pf = got = None
        cp.get_default_memory_pool().free_all_blocks()

    ly = w.layers[0]
    for m in (ly.w_gate_up, ly.w_down):
        for part in getattr(m, "parts", (m,)):
            dequant_alone(cp, s, part, copy_gbs)


if __name__ == "__main__":
    main()
