"""A/B of decode tunings in one process: tok/s per variant and depth, against the same copy bandwidth.

PYTHONPATH=. python3 dev/decode_ab.py [--profile] [--quant FORMAT] [--only V1,V2] [--sample CONFIG]
    [--depths D1,D2] [--rounds N] [shape ...]

Each variant is a Tuning; the step is rebuilt and captured again over the same weights and cache
(the buffers' split count stays the backend's, so variants differ in everything but splits). --profile
also prints, for each variant at each depth, the marginal cost of every launch kind inside the graph:
the step's replay time minus the replay time of the step without that kind (PDL overlap included),
and what the boundary between two replays costs (a step against half of a graph of two steps).
--quant makes the random weights in a block format (as `gdecode bench --quant`, e.g. q4_k_m) and runs
QUANT_VARIANTS, the block-format GEMVs' tunings, in place of VARIANTS, at depth 0. --depths replaces the
depths of PLAN (and the block formats' 0) for every shape. --rounds N times every variant N times in turn
(A B C A B C ...), so that a drift of the GPU's clocks over the run shows as the spread of each one's rows.
"""

from __future__ import annotations

import statistics
import sys

from engine import bench as B
from engine.backend_cuda import CudaBackend
from engine.shapes import shape as named_shape
from graphs.decode import DecodeStep, Launches, step_launches
from graphs.graph import capture
from kernels.bandwidth import copy_bandwidth
from kernels.quant_layout import FORMATS
from kernels.tuning import AttnTuning, GemvTuning, Tuning

GEMVS = ("qkv_proj", "o_proj", "gate_up", "down_proj", "lm_head")
TF_SETS = [()] + [(k,) for k in GEMVS + ("attn",)] + [("attn", "o_proj"), GEMVS, GEMVS + ("attn",),
                                               ("attn", "o_proj", "qkv_proj"), ("attn", "o_proj", "gate_up"),
                                               ("attn", "o_proj", "down_proj"), ("attn", "o_proj", "lm_head"),
                                               ("qkv_proj", "o_proj"), ("qkv_proj", "down_proj"),
                                               ("qkv_proj", "o_proj", "down_proj"),
                                               ("attn", "o_proj", "qkv_proj", "lm_head")]
VARIANTS = {
    "default": Tuning(),
    "attn w4": Tuning(attn=AttnTuning(warps=4)),
    # the split rule: min_chunk rows per split with no one-split rule, or one split up to N rows
    **{f"attn chunk {c}": Tuning(attn=AttnTuning(min_chunk=c, one_split_rows=0)) for c in (64, 128, 256, 512, 1024)},
    **{f"one split {n}": Tuning(attn=AttnTuning(one_split_rows=n)) for n in (0, 128, 256, 384, 512, 768, 1024)},
    # one split's blocks: the whole group of query heads each (one block per kv head), or 2 heads each
    **{f"heads {h}": Tuning(attn=AttnTuning(one_split_heads=h)) for h in (0, 2)},
    "w4 mb4": Tuning(gemv=GemvTuning(warps=4, min_blocks=4)),
    "w16 mb1": Tuning(gemv=GemvTuning(warps=16, min_blocks=1)),
    "w2 mb8": Tuning(gemv=GemvTuning(warps=2, min_blocks=8)),
    "balance 0": Tuning(gemv=GemvTuning(balance=0)),
    "balance 1": Tuning(gemv=GemvTuning(balance=1)),
    "balance 2": Tuning(gemv=GemvTuning(balance=2)),
    "late k<=4096": Tuning(gemv=GemvTuning(late_kmax=4096)),
    "w16 mb1 late": Tuning(gemv=GemvTuning(warps=16, min_blocks=1, late_kmax=4096)),
    "o whole": Tuning(gemv=GemvTuning(o_whole=True)),
    "o split": Tuning(gemv=GemvTuning(o_whole=False)),
    # the launches of these kinds let the next kernel launch before their own PDL wait (the GEMVs where their
    # grid leaves resident slots free); "tf none": none of them
    **{f"tf {'+'.join(k) or 'none'}": Tuning(trigger_first=k) for k in TF_SETS},
}
QUANT_VARIANTS = {
    "default": Tuning(),
    "few rows 2": Tuning(gemv=GemvTuning(quant_few_rows=2)),
    "no part overlap": Tuning(gemv=GemvTuning(parts_overlap=False)),
    "early all": Tuning(gemv=GemvTuning(quant_late_formats=())),
    "late all": Tuning(gemv=GemvTuning(quant_late_kmax=1 << 30)),
    "late any format": Tuning(gemv=GemvTuning(quant_late_formats=tuple(FORMATS))),
    "rows 4": Tuning(gemv=GemvTuning(quant_rows=4)),
    "units 6": Tuning(gemv=GemvTuning(quant_units_per_sm=6)),
    "w8 mb2": Tuning(gemv=GemvTuning(quant_warps=8, quant_min_blocks=2)),
    **{f"attn chunk {c}": Tuning(attn=AttnTuning(min_chunk=c, one_split_rows=0)) for c in (64, 256, 512)},
    **{f"one split {n}": Tuning(attn=AttnTuning(one_split_rows=n)) for n in (0, 128, 256, 512, 1024)},
    **{f"heads {h}": Tuning(attn=AttnTuning(one_split_heads=h)) for h in (0, 2)},
    **{f"tf {'+'.join(k) or 'none'}": Tuning(trigger_first=k) for k in TF_SETS},
}
PLAN = {
    "llama3-8b": [0, 8192, 32768],
    "qwen2.5-0.5b": [0, 8192],
}


def replay_ms(backend, graph, depth: int, n: int = 64) -> float:
    timer = B.Timer(backend.stream)
    times = []
    for _ in range(4):
        B.set_position(backend, depth)
        times.append(timer(lambda: [graph.replay(backend.stream) for _ in range(n)]))
    return statistics.median(times[1:]) / n


def profile(backend, tuning: Tuning, depth: int) -> str:
    """Marginal graph-replay cost of each launch kind (sample is always kept: it advances the position)."""
    s = backend.stream
    launches = step_launches(backend.cfg, backend.weights, backend.bufs, tuning)
    kinds = [Launches.kind(launch.name) for launch in launches]

    def graph_of(keep):
        g = capture(s, [launch for launch, kind in zip(launches, kinds, strict=True) if keep(kind)])
        s.synchronize()
        return g

    full = replay_ms(backend, graph_of(lambda k: True), depth)
    # two steps in one graph: what a step costs without the boundary between two replays
    pair = capture(s, launches + launches)
    s.synchronize()
    twice = replay_ms(backend, pair, depth, n=32) / 2
    out = [f"step {1e3 * full:.1f}us", f"between_replays={1e3 * (full - twice):.1f}"]
    for kind in dict.fromkeys(kinds):
        if kind == "sample":
            continue
        without = replay_ms(backend, graph_of(lambda k, kind=kind: k != kind), depth)
        out.append(f"{kind}={1e3 * (full - without):.1f}")
    return "  ".join(out)


def main(argv):
    do_profile = "--profile" in argv
    quant = argv[argv.index("--quant") + 1] if "--quant" in argv else "bf16"
    argv = [a for i, a in enumerate(argv) if a != quant or i == 0 or argv[i - 1] != "--quant"]
    variants = VARIANTS if quant == "bf16" else QUANT_VARIANTS
    if "--only" in argv:  # variants by name, comma-separated
        only = argv[argv.index("--only") + 1]
        variants = {v: variants[v] for v in only.split(",")}
        argv = [a for a in argv if a != only]
    params, sampling = None, "greedy"
    if "--sample" in argv:  # a configuration of engine.bench.SAMPLED instead of greedy
        sampling = argv[argv.index("--sample") + 1]
        params = B.SAMPLED[sampling]
        argv = [a for a in argv if a != sampling]
    depth_list = None
    if "--depths" in argv:
        given = argv[argv.index("--depths") + 1]
        depth_list = [int(d) for d in given.split(",")]
        argv = [a for a in argv if a != given]
    rounds = 1
    if "--rounds" in argv:
        given = argv[argv.index("--rounds") + 1]
        rounds = int(given)
        argv = [a for a in argv if a != given]
    shapes = [a for a in argv if not a.startswith("--")] or list(PLAN)
    copy_gbs = copy_bandwidth(4 << 30, 10)
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s", flush=True)
    for name in shapes:
        depths = depth_list or (PLAN.get(name, [0]) if quant == "bf16" else [0])
        cfg = named_shape(name)
        need = max(depths) + B.TG_TOKENS + B.WARMUP + 1
        backend = CudaBackend(cfg, None, max_context=need, random_quant=quant)
        B.fill_cache(backend)
        for d in depths:
            B.fill_depth(backend, d)
            for v, tuning in [item for _ in range(rounds) for item in variants.items()]:
                backend.step = DecodeStep(cfg, backend.weights, backend.bufs, backend.stream, tuning)
                r = B.bench_tg(backend, d, 5, True, copy_gbs, params, sampling)
                print(f"{name} {quant} {sampling} d={d:<6} {v:<12} {r.tok_s:8.1f} tok/s {r.ms_per_token:.4f} ms "
                      f"{r.pct_copy:5.1f}% copy", flush=True)
                if do_profile:
                    print("   " + profile(backend, tuning, d), flush=True)
        del backend


if __name__ == "__main__":
    main(sys.argv[1:])
