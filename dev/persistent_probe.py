"""What one persistent launch per step would cost: a shape's layer GEMVs as phases with a grid barrier
between them (dev/persistent_probe.cu), against the bytes at copy speed.

    PYTHONPATH=. python3 dev/persistent_probe.py [--reps N] [SHAPE ...]

Per shape and variant: microseconds per launch (median of 7 timings of N launches back to back, CUDA
events), and GB/s over the weight bytes. Variants: `barriers` (every phase empty: the barriers alone),
`plain` (GEMVs, no prefetch), `prefetch` (each warp's first row of the next phase loaded before the
barrier), each at 16 warps per block holding 8 chunks per lane and 32 holding 4, one block per SM;
barrier 1 is a counter and a generation bumped by the last block, barrier 2 a monotonic counter
that every block adds to and polls.
The last phase's output is checked against numpy on the same (random, finite) data.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from engine.shapes import SHAPES

PHASE = np.dtype([("w", "u8"), ("x", "u8"), ("y", "u8"), ("rows", "i4"), ("k8", "i4")])


def layer_phases(cfg):
    q, kv = cfg.q_size, cfg.kv_size
    h, i = cfg.hidden_size, cfg.intermediate_size
    return [(q + 2 * kv, h), (0, 8), (h, q), (2 * i, h), (h, i)]  # qkv, attention, o, gate_up, down


def main():
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["smollm2-135m", "qwen2.5-0.5b", "llama3.2-1b"])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    src = (Path(__file__).parent / "persistent_probe.cu").read_text()
    kernels = Path(__file__).resolve().parent.parent / "kernels"
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    n = 1 << 28
    a, b = cp.ones(n, cp.float32), cp.empty(n, cp.float32)
    s, e = cp.cuda.Event(), cp.cuda.Event()
    cp.copyto(b, a)
    s.record()
    for _ in range(10):
        cp.copyto(b, a)
    e.record()
    e.synchronize()
    copy = 10 * 2 * 4 * n / (cp.cuda.get_elapsed_time(s, e) * 1e-3) / 1e9
    print(f"copy bandwidth {copy:,.0f} GB/s, {sms} SMs")
    del a, b
    rng = np.random.default_rng(1)
    for name in args.shapes:
        cfg = SHAPES[name]
        shapes = layer_phases(cfg) * cfg.num_layers
        width = max(max(r, k) for r, k in shapes)
        bufs = [cp.asarray(rng.standard_normal(width).astype(np.float32)) for _ in range(2)]
        mats = []
        for r, k in shapes:
            m = rng.standard_normal((max(r, 1), k)).astype(np.float32)
            mats.append(cp.asarray((m.view(np.uint32) >> 16).astype(np.uint16)))
        wbytes = sum(r * k * 2 for r, k in shapes)
        table = np.zeros(len(shapes), PHASE)
        empty = np.zeros(len(shapes), PHASE)
        for p, ((r, k), m) in enumerate(zip(shapes, mats, strict=True)):
            table[p] = (m.data.ptr, bufs[p % 2].data.ptr, bufs[(p + 1) % 2].data.ptr, r, k // 8)
            empty[p] = (m.data.ptr, bufs[p % 2].data.ptr, bufs[(p + 1) % 2].data.ptr, 0, k // 8)
        d_table, d_empty = cp.asarray(table.view(np.uint8)), cp.asarray(empty.view(np.uint8))
        bar = cp.zeros(4, cp.uint32)  # barrier 1: [0], [1]; barrier 2: [2:4] as one u64
        print(f"{name}: {len(shapes)} phases, {wbytes / 1e6:.1f} MB of weights, "
              f"{wbytes / copy / 1e3:.1f} us at copy speed")
        for warps, cpl, barrier in ((16, 8, 1), (16, 8, 2), (32, 4, 2)):
            mod = cp.RawModule(code=src, options=("-std=c++17", f"-I{kernels}", f"-DWARPS={warps}", f"-DCPL={cpl}",
                                                  f"-DBARRIER={barrier}"))
            fn = mod.get_function("persist")
            for variant in ("barriers", "plain", "prefetch"):
                tab = d_empty if variant == "barriers" else d_table
                argv = (tab, np.int32(len(shapes)), bar, np.int32(variant == "prefetch"), np.int32(1))
                for buf in bufs:
                    buf[:] = cp.asarray(rng.standard_normal(width).astype(np.float32))
                fn((sms,), (warps * 32,), argv)
                cp.cuda.Device().synchronize()
                if variant != "barriers":
                    r, k = shapes[-1]
                    last = len(shapes) - 1
                    x = cp.asnumpy(bufs[last % 2][:k])
                    w = (cp.asnumpy(mats[-1]).astype(np.uint32) << 16).view(np.float32)
                    want = (w @ x.astype(np.float64)) / 64
                    got = cp.asnumpy(bufs[(last + 1) % 2][:r])
                    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
                    assert err < 1e-4, f"{name} {variant}: relative error {err}"
                times = []
                for _ in range(7):
                    s.record()
                    for _ in range(args.reps):
                        fn((sms,), (warps * 32,), argv)
                    e.record()
                    e.synchronize()
                    times.append(cp.cuda.get_elapsed_time(s, e) * 1e3 / args.reps)
                us = float(np.median(times))
                gbs = "" if variant == "barriers" else f", {wbytes / us / 1e3:,.0f} GB/s"
                print(f"  warps {warps:2d} barrier {barrier} {variant:9s} {us:8.1f} us/launch, "
                      f"{us / len(shapes):.2f} us/phase{gbs}")


if __name__ == "__main__":
    main()
