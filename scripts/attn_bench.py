"""Decode attention alone on the llama3-8b shape: us per layer and K/V GB/s per variant and depth.

PYTHONPATH=. python3 scripts/attn_bench.py

Each variant is a CUDA graph of one attn_decode launch per layer (16 layers, each with its own cache,
so nothing is served from L2), replayed after warm-up; the median of 5 timed replays. "nomath" variants
stream the same rows and skip the arithmetic (NOCOMPUTE), which separates memory from math;
"prev" runs scripts/attention_prev.cu (an earlier kernel) when that file is present.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import cupy as cp
import numpy as np

from graphs.buffers import STATE_DTYPE
from graphs.graph import capture
from kernels import ops
from kernels.bandwidth import copy_bandwidth
from kernels.cuda import init, shared_stream

NH, NKV, HD, LAYERS = 32, 8, 128, 16
DEPTHS = (8192, 32768)
PREV = "scripts/attention_prev.cu"  # an earlier kernels/attention.cu, when present
VARIANTS = {  # name: (warps, splits, extra attention defines, attention source)
    "w8 s33": (8, 33, {}, "attention"),
    "w8 s33 prev": (8, 33, {}, PREV),
    "w8 s33 nomath": (8, 33, {"NOCOMPUTE": 1}, "attention"),
}
MODULE, WARPS = ops.module, ops.ATTN_WARPS


def main():
    init()
    s = shared_stream()
    copy_gbs = copy_bandwidth(4 << 30, 10)
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s", flush=True)
    ctx = max(DEPTHS) + 8
    with s:
        k = cp.empty((LAYERS, NKV * ctx * HD), cp.uint16)
        v = cp.empty_like(k)
        ops.fill_bf16(k, 1, 1.0, stream=s)
        ops.fill_bf16(v, 2, 1.0, stream=s)
        q = cp.asarray(np.random.default_rng(0).standard_normal(NH * HD).astype(np.float32))
        pm = cp.empty((NH, 128), cp.float32)
        pl, pacc = cp.empty_like(pm), cp.empty((NH, 128, HD), cp.float32)
        out = cp.empty(NH * HD, cp.float32)
        counters = cp.zeros((LAYERS, NKV), cp.uint32)
        st = cp.zeros(1, STATE_DTYPE)
    for depth in DEPTHS:
        row = np.zeros(1, STATE_DTYPE)
        row["pos"] = depth - 1
        st.set(row)
        nbytes = depth * NKV * HD * 2 * 2
        for name, (warps, splits, extra, source) in VARIANTS.items():
            if not Path(source).with_suffix(".cu").exists() and source != "attention":
                continue
            ops.ATTN_WARPS = warps

            def module(src, extra=extra, source=source, **d):
                return MODULE(source, **{**d, **extra}) if src == "attention" else MODULE(src, **d)

            ops.module = module
            launches = [ops.attn_decode(q, k[i], v[i], st, pm, pl, pacc, out, counters[i], nh=NH, nkv=NKV, hd=HD,
                                        splits=splits, max_ctx=ctx, pdl=True) for i in range(LAYERS)]
            g = capture(s, lambda launches=launches: [la(s) for la in launches])
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            times = []
            for rep in range(7):
                e0.record(s)
                for _ in range(4):
                    g.replay(s)
                e1.record(s)
                e1.synchronize()
                if rep >= 2:
                    times.append(cp.cuda.get_elapsed_time(e0, e1) / (4 * LAYERS))
            ms = statistics.median(times)
            print(f"nkv={depth:<6} {name:<22} {1e3 * ms:7.2f} us/layer  {nbytes / ms / 1e6:7.0f} GB/s "
                  f"({100 * nbytes / ms / 1e6 / copy_gbs:4.1f}% copy)", flush=True)
    ops.module, ops.ATTN_WARPS = MODULE, WARPS


if __name__ == "__main__":
    main()
