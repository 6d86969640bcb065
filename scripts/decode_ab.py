"""A/B of decode-kernel settings in one process: tok/s per variant and depth, same copy bandwidth.

PYTHONPATH=. python3 scripts/decode_ab.py [shape ...]
With scripts/gemv_head.cu present (an earlier kernels/gemv.cu), variant "head" runs it on a full grid.
"""

from __future__ import annotations

import sys
from pathlib import Path

from engine import bench as B
from engine.backend_cuda import CudaBackend
from engine.shapes import shape as named_shape
from graphs.decode import DecodeStep
from kernels import ops
from kernels.bandwidth import copy_bandwidth

MODULE = ops.module
HEAD = Path(__file__).with_name("gemv_head.cu")


def head_module(source, **defines):
    return MODULE(str(HEAD) if source == "gemv" else source, **defines)


DEFAULTS = dict(GEMV_WAVES=ops.GEMV_WAVES, GEMV_WARPS=ops.GEMV_WARPS, GEMV_MINB=ops.GEMV_MINB,
                ATTN_WARPS=ops.ATTN_WARPS, module=MODULE)
VARIANTS = {  # name: ops settings
    "head": dict(GEMV_WAVES=0, module=head_module),
    "waves0": dict(GEMV_WAVES=0),
    "waves1": dict(GEMV_WAVES=1),
    "waves1/w8": dict(GEMV_WAVES=1, GEMV_WARPS=8, GEMV_MINB=2),
    "waves1/attn4": dict(GEMV_WAVES=1, ATTN_WARPS=4),
}
PLAN = {
    "llama3-8b": ([0, 8192, 32768], list(VARIANTS)),
    "qwen2.5-0.5b": ([0, 8192], ["head", "waves1", "waves1/attn4"]),
}
BREAKDOWN = ("head", "waves1")


def apply(settings: dict):
    for k, v in {**DEFAULTS, **settings}.items():
        setattr(ops, k, v)


def main(shapes):
    copy_gbs = copy_bandwidth(4 << 30, 10)
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s", flush=True)
    for name in shapes:
        depths, variants = PLAN[name]
        cfg = named_shape(name)
        need = max(depths) + B.TG_TOKENS + B.WARMUP + 1
        apply({})
        backend = CudaBackend(cfg, None, max_context=need)
        B.fill_cache(backend)
        for d in depths:
            B.fill_depth(backend, d)
            for v in variants:
                if v == "head" and not HEAD.exists():
                    continue
                apply(VARIANTS[v])
                backend.step = DecodeStep(cfg, backend.weights, backend.bufs, backend.stream)
                r = B.bench_tg(backend, d, 3, True, copy_gbs)
                print(f"{name} d={d:<6} {v:<18} {r.tok_s:8.1f} tok/s {r.ms_per_token:.4f} ms "
                      f"{r.pct_copy:5.1f}% copy", flush=True)
                if name == "llama3-8b" and v in BREAKDOWN and d in (0, 32768):
                    rows = B.breakdown(backend, d, 3)
                    print("   " + "  ".join(f"{k['kernel']}={k['us_per_launch']:.1f}us/{k['gb_s']:.0f}"
                                            for k in rows), flush=True)
        del backend
    apply({})


if __name__ == "__main__":
    main(sys.argv[1:] or list(PLAN))
