"""Quantized prefill on a random shape: pp512 over slice sizes, lanes and dequant_rows variants, each
checked bit for bit against whole matrices; where the time goes (GEMMs alone, dequantization alone);
dequant_rows alone in GB/s against the copy bandwidth.

    PYTHONPATH=. python3 dev/qprefill_sweep.py [--shape llama3-8b] [--quant q4_k_m] [--quick]
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
    for items, stage in [(1, False), (2, False), (4, False), (1, True), (4, True)]:
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
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import cupy as cp

    from engine.shapes import shape
    from graphs.buffers import DecodeBuffers, DeviceWeights
    from graphs.dequant_gemm import DequantGemm
    from graphs.prefill import Prefill
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

    def build(pt):
        return Prefill(cfg, w, bufs, s, Tuning(prefill=pt))

    base = PrefillTuning(dequant_slice=0, dequant_lanes=1, dequant_items=1, dequant_stage=False)
    pf = build(base)
    ms0 = median_ms(cp, s, lambda: pf.run(ids))
    want = (bufs.k_cache.copy(), bufs.v_cache.copy(), pf.x.copy())
    s.synchronize()
    print(f"whole matrices, items 1, plain stores (the old prefill): {ms0:.2f} ms = {512 / ms0 * 1e3:,.0f} tok/s",
          flush=True)
    pf = None

    grid = [dict(dequant_slice=0, dequant_items=4, dequant_stage=False),
            dict(dequant_slice=0, dequant_items=4, dequant_stage=True),
            dict(dequant_slice=0, dequant_items=1, dequant_stage=True)]
    for mb in ([16] if args.quick else [8, 16, 24, 32, 64]):
        for lanes in (1, 2, 3):
            grid.append(dict(dequant_slice=mb * MB, dequant_lanes=lanes, dequant_items=4, dequant_stage=True))
    grid += [dict(dequant_slice=16 * MB, dequant_lanes=2, dequant_items=4, dequant_stage=False),
             dict(dequant_slice=16 * MB, dequant_lanes=2, dequant_items=1, dequant_stage=False),
             dict(dequant_slice=16 * MB, dequant_lanes=4, dequant_items=4, dequant_stage=True)]
    best = (ms0, base)
    for g in grid:
        pt = PrefillTuning(**g)
        pf = build(pt)
        ms = median_ms(cp, s, lambda: pf.run(ids))  # noqa: B023
        same = all(bool(cp.array_equal(a, b)) for a, b in zip((bufs.k_cache, bufs.v_cache, pf.x), want, strict=True))
        # where the time goes: the same slices without their dequantization, and without their GEMMs
        gemms = [ly_op for ly in pf.layers for ly_op in (ly.qkv, ly.wo, ly.gate_up, ly.down)
                 if isinstance(ly_op, DequantGemm)]
        saved = [g_.slices for g_ in gemms]
        for g_ in gemms:
            g_.slices = [(lane, [], gemm) for lane, _, gemm in g_.slices]
        ms_gemm = median_ms(cp, s, lambda: pf.run(ids), reps=3)  # noqa: B023
        for g_, sl in zip(gemms, saved, strict=True):
            g_.slices = [(lane, fill, lambda h, t: None) for lane, fill, _ in sl]
        ms_deq = median_ms(cp, s, lambda: pf.run(ids), reps=3)  # noqa: B023
        for g_, sl in zip(gemms, saved, strict=True):
            g_.slices = sl
        print(f"{g}: {ms:.2f} ms = {512 / ms * 1e3:,.0f} tok/s, bitwise equal {same}; "
              f"without dequant {ms_gemm:.2f} ms, without GEMMs {ms_deq:.2f} ms", flush=True)
        if same and ms < best[0]:
            best = (ms, pt)
        pf = gemms = saved = None
        cp.get_default_memory_pool().free_all_blocks()
    print(f"best: {best[1]} {512 / best[0] * 1e3:,.0f} tok/s", flush=True)

    ly = w.layers[0]
    for m in (ly.w_gate_up, ly.w_down):
        for part in getattr(m, "parts", (m,)):
            dequant_alone(cp, s, part, copy_gbs)


if __name__ == "__main__":
    main()
