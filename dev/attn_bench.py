"""Decode attention alone on the llama3-8b shape: us per layer and K/V GB/s per variant and depth.

PYTHONPATH=. python3 dev/attn_bench.py

Each variant is a CUDA graph of one attn_decode launch per layer (16 layers, each with its own cache,
so nothing is served from L2), replayed after warm-up; the median of 5 timed replays.
"""

from __future__ import annotations

import statistics

import cupy as cp
import numpy as np

from graphs.buffers import STATE_DTYPE
from graphs.graph import capture
from kernels import ops
from kernels.attention import ATTN_MAX_SPLITS, attn_decode
from kernels.bandwidth import copy_bandwidth
from kernels.cuda import init, shared_stream
from kernels.tuning import AttnTuning

NH, KV_HEADS, HD, LAYERS = 32, 8, 128, 16
DEPTHS = (8192, 32768)
VARIANTS = {  # name: (tuning, splits)
    "w8 s33": (AttnTuning(warps=8), 33),
    "w4 s33": (AttnTuning(warps=4), 33),
    "w8 s66": (AttnTuning(warps=8), 66),
}


def main():
    init()
    s = shared_stream()
    copy_gbs = copy_bandwidth(4 << 30, 10)
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s", flush=True)
    ctx = max(DEPTHS) + 8
    with s:
        k = cp.empty((LAYERS, KV_HEADS * ctx * HD), cp.uint16)
        v = cp.empty_like(k)
        ops.fill_bf16(k, 1, 1.0, stream=s)
        ops.fill_bf16(v, 2, 1.0, stream=s)
        q = cp.asarray(np.random.default_rng(0).standard_normal(NH * HD).astype(np.float32))
        pm = cp.empty((NH, ATTN_MAX_SPLITS), cp.float32)
        pl, pacc = cp.empty_like(pm), cp.empty((NH, ATTN_MAX_SPLITS, HD), cp.float32)
        out = cp.empty(NH * HD, cp.float32)
        counters = cp.zeros((LAYERS, KV_HEADS), cp.uint32)
        st = cp.zeros(1, STATE_DTYPE)
    for depth in DEPTHS:
        row = np.zeros(1, STATE_DTYPE)
        row["pos"] = depth - 1
        st.set(row)
        nbytes = depth * KV_HEADS * HD * 2 * 2
        for name, (tuning, splits) in VARIANTS.items():
            launches = [attn_decode(q, k[i], v[i], st, pm, pl, pacc, out, counters[i], nh=NH, kv_heads=KV_HEADS,
                                    hd=HD, splits=splits, max_ctx=ctx, tuning=tuning, pdl=True)
                        for i in range(LAYERS)]
            g = capture(s, launches)
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
            print(f"rows={depth:<6} {name:<22} {1e3 * ms:7.2f} us/layer  {nbytes / ms / 1e6:7.0f} GB/s "
                  f"({100 * nbytes / ms / 1e6 / copy_gbs:4.1f}% copy)", flush=True)


if __name__ == "__main__":
    main()
