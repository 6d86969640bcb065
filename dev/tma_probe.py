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
# name: (kernel, warps, stages, batch[, d plane]); batch must divide K / 512 for every K above (8 and 28)
VARIANTS = {
    "reg": ("gemv_reg", 16, 0, 4),
    "reg d per chunk": ("gemv_reg", 16, 0, 4, 1),
    "reg d per batch": ("gemv_reg", 16, 0, 4, 2),
    "tma w16 s3 b2": ("gemv_tma", 16, 3, 2),
    "tma w16 s2 b2": ("gemv_tma", 16, 2, 2),
    "tma w16 s4 b2": ("gemv_tma", 16, 4, 2),
    "tma w16 s6 b2": ("gemv_tma", 16, 6, 2),
    "tma w16 s3 b4": ("gemv_tma", 16, 3, 4),
    "tma w8 s6 b4": ("gemv_tma", 8, 6, 4),
    "tma w8 s12 b2": ("gemv_tma", 8, 12, 2),
    "tma w4 s12 b4": ("gemv_tma", 4, 12, 4),
    "tma w16 s4 b1": ("gemv_tma", 16, 4, 1),
    "tma w8 s3 b4": ("gemv_tma", 8, 3, 4),
    "tma w8 s6 b2": ("gemv_tma", 8, 6, 2),
}
MAXN = 28672


def time_graph(graph, stream) -> float:
    """Median us per replay of 7 timings of 10 replays (CUDA events)."""
    import cupy as cp

    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    with stream:
        for _ in range(7):
            start.record(stream)
            for _ in range(10):
                graph.replay(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / 10)
    return statistics.median(times)


def step_chain(fmt: str, layers: int, bufs, stream):
    """(graph, bytes per layer) of the step's own block-format GEMV (kernels/gemv_ops.gemv, plain stores, no
    norm) over the same chain of shapes, random ggml blocks of `fmt` repacked as the loader does"""

    from graphs.graph import capture
    from graphs.quant_weights import random_quant
    from kernels.gemv_ops import gemv

    launches, nbytes, i = [], 0, 0
    for layer in range(layers):
        for j, (_, n, k) in enumerate(LAYER):
            w = random_quant(fmt, n, k, seed=100 * layer + j)
            nbytes += int(w.data.nbytes) if layer == 0 else 0
            launches.append(gemv(w, bufs[i % 2], bufs[(i + 1) % 2], n, k, pdl=True))
            i += 1
    with stream:  # timing only: the values (which grow over the chain) are the GPU tests' business
        graph = capture(stream, launches)
        graph.replay(stream)
        stream.synchronize()
    return graph, nbytes


def main():
    import cupy as cp
    from cuda.bindings import driver

    from graphs.graph import capture
    from kernels.bandwidth import copy_bandwidth
    from kernels.launch import Module
    from kernels.ops import sm_count

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--step", nargs="*", default=[], help="block formats to run through the step's own GEMV")
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
    ref_out = d_out = None
    d_nbytes = sum(n * k // 16 for _, n, k in LAYER)

    def with_d(mat, dplane):
        """mat's quants with an fp16 d per 32 weights after each row (d's made from the quants, in [0.5, 1)),
        ordered per chunk (dplane 1) or per batch of 4 chunk steps and lane pair (2)"""
        w, rs = mat
        n, k = w.shape
        d = (0.5 + (cp.arange(n * (k // 32), dtype=cp.float32).reshape(n, k // 32) % 61) / 122).astype(cp.float16)
        if dplane == 2:  # block it * 16 + p, it = 4b + v, at (b * 16 + p) * 4 + v
            blk = cp.arange(k // 32)
            it, p = blk // 16, blk % 16
            pos = ((it // 4) * 16 + p) * 4 + it % 4
            d2 = cp.empty_like(d)
            d2[:, pos] = d
            d = d2
        return cp.concatenate([w.view(cp.uint8), d.view(cp.uint8)], axis=1), rs

    names = [v for v in VARIANTS if args.only is None or v in args.only or v == "reg"]
    for name in names:
        kname, warps, stages, batch, *dplane = VARIANTS[name]
        dplane = dplane[0] if dplane else 0
        launches = []
        fns = {}
        for _, n, k in LAYER:
            mod = Module.load(
                src, {"KX": k, "NROWS": n, "WARPS": warps, "STAGES": stages, "BATCH": batch, "DPLANE": dplane}
            )
            fn = mod.function(kname, "PPPP")
            smem = 0
            if kname == "gemv_tma":
                out = cp.zeros(1, cp.int32)
                mod.function("tma_smem", "P").launch(1, 1, [out])
                smem = int(out.get()[0])
            st = mod.stats[kname]
            fns[(n, k)] = (fn, smem)
            fn.set_max_dynamic_smem(smem) if smem else None
            per_sm = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn.func, 32 * warps, smem)[1]
            if name == names[0] or kname == "gemv_tma":
                print(
                    f"  {name} {n}x{k}: {st.registers} regs, smem {smem}, spills {st.spill_stores}, "
                    f"{per_sm} blocks per SM",
                    flush=True,
                )
        i = 0
        for layer in weights if not dplane else [[with_d(w, dplane) for w in layer] for layer in weights]:
            for (_, n, k), (w, rs) in zip(LAYER, layer, strict=True):
                fn, smem = fns[(n, k)]
                launches.append(
                    fn.prepare(sms, 32 * warps, [w, rs, bufs[i % 2], bufs[(i + 1) % 2]], smem=smem, pdl=True)
                )
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
            if dplane:
                if d_out is None:
                    d_out = out
                else:
                    same = np.array_equal(out[:4096].view(np.uint32), d_out[:4096].view(np.uint32))
                    print(f"  {name}: output {'equals' if same else 'DIFFERS FROM'} d per chunk's", flush=True)
            elif ref_out is None:
                ref_out = out
                assert np.all(np.isfinite(out[:4096])), out[:8]
            else:
                same = np.array_equal(out[:4096].view(np.uint32), ref_out[:4096].view(np.uint32))
                print(f"  {name}: output {'equals' if same else 'DIFFERS FROM'} reg's bit for bit", flush=True)
        us = time_graph(graph, stream) / args.layers
        nb = nbytes + (d_nbytes if dplane else 0)
        print(f"{name:16s} {us:8.2f} us per layer, {nb / us / 1e3:8.1f} GB/s", flush=True)
        del launches, graph
    for fmt in args.step:
        with stream:
            bufs[0][:] = x0
        graph, nb = step_chain(fmt, args.layers, bufs, stream)
        us = time_graph(graph, stream) / args.layers
        print(f"{'step ' + fmt:16s} {us:8.2f} us per layer, {nb / us / 1e3:8.1f} GB/s", flush=True)
        del graph


if __name__ == "__main__":
    main()
