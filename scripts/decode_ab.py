"""A/B of decode-kernel settings in one process: tok/s per variant and depth, same copy bandwidth.

PYTHONPATH=. python3 scripts/decode_ab.py [--profile] [shape ...]

Each variant sets module attributes of kernels.ops (and optionally the attention split count), then
the step is rebuilt and captured again over the same weights and cache. --profile also prints, for
the PROFILE variants at each depth, the marginal cost of every kernel kind inside the graph:
the step's replay time minus the replay time of the step without that kind (PDL overlap included).
"""

from __future__ import annotations

import statistics
import sys

from engine import bench as B
from engine.backend_cuda import CudaBackend, default_splits
from engine.shapes import shape as named_shape
from graphs.decode import DecodeStep, step_launches
from graphs.graph import capture
from kernels import ops
from kernels.bandwidth import copy_bandwidth

KNOBS = ("GEMV_WAVES", "GEMV_WARPS", "GEMV_MINB", "ATTN_WARPS")
DEFAULTS = {k: getattr(ops, k) for k in KNOBS}
MODULE = ops.module
VARIANTS = {  # name: ops settings, + "splits" (default one wave), + "defines" {kernel: extra defines},
    # + "sources" {kernel: another .cu file, e.g. an earlier version}
    "default": {},
    "prev": {"sources": {"attention": "scripts/attention_prev.cu"}},
}
PROFILE = ("default", "prev")
PLAN = {
    "llama3-8b": ([0, 8192, 32768], list(VARIANTS)),
    "qwen2.5-0.5b": ([0, 8192], list(VARIANTS)),
}


def apply(settings: dict):
    for k, v in {**DEFAULTS, **settings}.items():
        if k in KNOBS:
            setattr(ops, k, v)
    extra, sources = settings.get("defines", {}), settings.get("sources", {})

    def module(source, **defines):
        return MODULE(sources.get(source, source), **{**defines, **extra.get(source, {})})

    ops.module = module if extra or sources else MODULE


def replay_ms(backend, graph, depth: int, n: int = 64) -> float:
    timer = B.Timer(backend.stream)
    times = []
    for _ in range(4):
        B.set_position(backend, depth)
        times.append(timer(lambda: [graph.replay(backend.stream) for _ in range(n)]))
    return statistics.median(times[1:]) / n


def profile(backend, depth: int):
    """Marginal graph-replay cost of each kernel kind (sample is always kept: it advances the position)."""
    cfg, s = backend.cfg, backend.stream
    launches = step_launches(cfg, backend.weights, backend.bufs)
    kinds = B.kernel_kinds(cfg, len(launches))

    def graph_of(keep):
        g = capture(s, lambda: [launch(s) for launch, kind in zip(launches, kinds, strict=True) if keep(kind)])
        s.synchronize()
        return g

    full = replay_ms(backend, graph_of(lambda k: True), depth)
    out = [f"step {1e3 * full:.1f}us"]
    for kind in dict.fromkeys(kinds):
        if kind == "sample":
            continue
        without = replay_ms(backend, graph_of(lambda k, kind=kind: k != kind), depth)
        out.append(f"{kind}={1e3 * (full - without):.1f}")
    return "  ".join(out)


def main(argv):
    do_profile = "--profile" in argv
    shapes = [a for a in argv if not a.startswith("--")] or list(PLAN)
    copy_gbs = copy_bandwidth(4 << 30, 10)
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s", flush=True)
    for name in shapes:
        depths, variants = PLAN[name]
        cfg = named_shape(name)
        need = max(depths) + B.TG_TOKENS + B.WARMUP + 1
        apply({})
        backend = CudaBackend(cfg, None, max_context=need, attn_splits=ops.ATTN_MAX_SPLITS)
        B.fill_cache(backend)
        for d in depths:
            B.fill_depth(backend, d)
            for v in variants:
                settings = VARIANTS[v]
                apply(settings)
                backend.bufs.attn_splits = settings.get("splits") or default_splits(cfg)
                backend.step = DecodeStep(cfg, backend.weights, backend.bufs, backend.stream)
                r = B.bench_tg(backend, d, 5, True, copy_gbs)
                print(f"{name} d={d:<6} {v:<12} {r.tok_s:8.1f} tok/s {r.ms_per_token:.4f} ms "
                      f"{r.pct_copy:5.1f}% copy", flush=True)
                if do_profile and v in PROFILE:
                    print("   " + profile(backend, d), flush=True)
        del backend
    apply({})


if __name__ == "__main__":
    main(sys.argv[1:])
