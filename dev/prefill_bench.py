"""Batched prefill on random weights: pp512, pp512 at a depth, time to first token, and where the time goes.

    PYTHONPATH=. python3 dev/prefill_bench.py [--shapes llama3-8b qwen2.5-0.5b] [--depth 8192] [--ttft 2048]

Times are CUDA-event medians after warm-up; TTFT is wall clock from the request to the first
sampled token on the host (state upload, prefill of n-1 tokens, one decode step, ring read).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections import defaultdict

import numpy as np

from engine.sampling import SamplingParams
from engine.shapes import shape

TARGETS = {"llama3-8b": (20000, 14000), "qwen2.5-0.5b": (70000, None)}


def median_ms(cp, stream, fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def gemm_flops(cfg, t: int) -> float:
    n_qkv = cfg.q_size + 2 * cfg.kv_size
    per_layer = cfg.hidden_size * (n_qkv + 2 * cfg.intermediate_size) + cfg.intermediate_size * cfg.hidden_size
    per_layer += cfg.q_size * cfg.hidden_size
    return 2.0 * t * per_layer * cfg.num_layers


def attn_flops(cfg, t: int, start: int) -> float:
    keys = t * start + t * (t + 1) / 2  # causal: token i sees start + i + 1 keys
    return 4.0 * keys * cfg.head_dim * cfg.num_heads * cfg.num_layers


def breakdown(cp, pf, pos0: int, t: int) -> dict:
    """Milliseconds per stage of one full chunk, from events between the launches."""
    s, h = pf.stream, pf._handle
    marks = []

    def mark(name):
        ev = cp.cuda.Event()
        ev.record(s)
        marks.append((name, ev))

    with s:
        mark("start")
        pf.embed(s, pos0, t)
        mark("embed")
        for ly in pf.layers:
            for name, op in [("rmsnorm", ly.norm1), ("gemm qkv", ly.qkv), ("rope+append", ly.rope),
                             ("attention", ly.attn), ("gemm o", ly.wo), ("rmsnorm", ly.norm2),
                             ("gemm gate_up", ly.gate_up), ("silu", ly.silu), ("gemm down", ly.down)]:
                if name.startswith("gemm"):
                    op(h, t)
                else:
                    op(s, pos0, t)
                mark(name)
    marks[-1][1].synchronize()
    out = defaultdict(float)
    for (_, a), (name, b) in zip(marks, marks[1:], strict=False):
        out[name] += cp.cuda.get_elapsed_time(a, b)
    return dict(out)


def attn_variants(cp, pf, pos0: int, t: int, reps: int) -> str:
    """The attention kernel alone over every layer's cache, for 4 and 8 warps per block."""
    from kernels import prefill_ops as pops

    cfg, b = pf.cfg, pf.bufs
    out = []
    for warps in (4, 8):
        launches = [pops.prefill_attn(pf.q, *b.layer_cache(i), pf.attn, chunk=pf.chunk, nh=cfg.num_heads,
                                      kv_heads=cfg.num_kv_heads, hd=cfg.head_dim, max_ctx=b.max_context, warps=warps)
                    for i in range(cfg.num_layers)]

        def all_layers(launches=launches):
            for la in launches:
                la(pf.stream, pos0, t)

        ms = median_ms(cp, pf.stream, all_layers, reps)
        out.append(f"{warps} warps {ms:.2f} ms = {attn_flops(cfg, t, pos0) / ms / 1e9:.0f} TFLOP/s")
    return "; ".join(out)


def bench_shape(name: str, depth: int, ttft_len: int, reps: int):
    import cupy as cp

    from engine.backend_cuda import CudaBackend
    from graphs.prefill import prefill_for, prefill_then_decode_ready

    cfg = shape(name)
    ctx = max(depth + 512, ttft_len) + 64
    t0 = time.perf_counter()
    be = CudaBackend(cfg, None, max_context=ctx)
    pf = prefill_for(be)
    print(f"\n{name}: backend + prefill ready in {time.perf_counter() - t0:.1f} s (context {ctx}, chunk {pf.chunk})",
          flush=True)
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(0, cfg.vocab_size, max(depth, ttft_len) + 512)]
    s = be.stream
    pp, pp_target = 512, TARGETS.get(name, (None, None))

    ms = median_ms(cp, s, lambda: pf.run(ids[:pp]), reps)
    ms_full = median_ms(cp, s, lambda: pf.run(ids[:pp], logits=True), reps)
    g = gemm_flops(cfg, pp) / ms / 1e9
    print(f"pp{pp}: {pp / ms * 1e3:,.0f} tok/s ({ms:.2f} ms; last layer stops after its K/V)"
          f"{f', target {pp_target[0]:,}' if pp_target[0] else ''}")
    print(f"pp{pp} full forward + last-token logits: {pp / ms_full * 1e3:,.0f} tok/s ({ms_full:.2f} ms), "
          f"{g:.0f} TFLOP/s of GEMM work over the whole pass")
    stages = breakdown(cp, pf, 0, pp)
    total = sum(stages.values())
    print("  stages at depth 0: " + ", ".join(f"{k} {v:.2f} ms" for k, v in stages.items()) + f" (sum {total:.2f})")
    print(f"  attention alone at depth 0: {attn_variants(cp, pf, 0, pp, reps)}", flush=True)

    if depth:
        pf.run(ids[:depth])
        s.synchronize()
        ms_d = median_ms(cp, s, lambda: pf.run(ids[depth : depth + pp], start=depth), reps)
        stages = breakdown(cp, pf, depth, pp)
        att = stages["attention"]
        print(f"pp{pp} @ depth {depth}: {pp / ms_d * 1e3:,.0f} tok/s ({ms_d:.2f} ms)"
              f"{f', target {pp_target[1]:,}' if pp_target[1] else ''}; attention {att:.2f} ms = "
              f"{attn_flops(cfg, pp, depth) / att / 1e9:.0f} TFLOP/s")
        print("  stages: " + ", ".join(f"{k} {v:.2f} ms" for k, v in stages.items()))
        print(f"  attention alone at depth {depth}: {attn_variants(cp, pf, depth, pp, reps)}", flush=True)

    if ttft_len:
        prompt = ids[:ttft_len]
        greedy = SamplingParams(temperature=0.0)
        ev = cp.cuda.Event(disable_timing=True)
        walls = []
        for i in range(reps + 2):
            w0 = time.perf_counter()
            prefill_then_decode_ready(be, prompt, greedy)
            be.step()
            ev.record(s)
            ev.synchronize()
            tok = int(be.bufs.ring[(ttft_len - 1) % be.bufs.ring_size])
            if i >= 2:
                walls.append((time.perf_counter() - w0) * 1e3)
        print(f"TTFT {ttft_len}-token prompt: {np.median(walls):.1f} ms median wall clock "
              f"(min {min(walls):.1f}; first token {tok})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama3-8b", "qwen2.5-0.5b"])
    ap.add_argument("--depth", type=int, default=8192)
    ap.add_argument("--ttft", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    from kernels.cuda import init

    init()
    import cupy as cp

    for name in args.shapes:
        bench_shape(name, args.depth, args.ttft, args.reps)
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
