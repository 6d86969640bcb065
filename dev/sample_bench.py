"""Time the sampler kernel alone, per configuration, at the vocabularies of the bench shapes.

    python3 dev/sample_bench.py [--launches N] [--prev] [--one-level]

Each configuration: N launches back to back (no graph, no PDL) on flat random logits (every token a
candidate), microseconds per launch from CUDA events; then one launch of the PROFILE_AT build, whose block
0 leaves clock64 and globaltimer at its phase boundaries: start, Gumbel scores done, warp records, block
records, the overall records released by the merging block, loaded, counts added; and the finishing block's
end.
--prev also times kernels/sample_prev.cu (an older kernel with the same arguments and scratch layout)
when it is there;
--one-level also times the kernel whose final merge is one warp over every block's list (MERGE_GROUPS=1)
against the default two levels (16 warps over a few lists each, then one warp over their 16 lists).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from engine.bench import SAMPLED
from engine.sampling import SamplingParams
from graphs.buffers import STATE_DTYPE, state_record

CONFIGS = {"greedy": SamplingParams(temperature=0.0), **SAMPLED, "logprobs5": SamplingParams(logprobs=5)}
PHASES = ("scores", "warp recs", "block recs", "merged", "recs in", "counts", "end")
MERGER = ("gather", "level 1", "level 2")  # the merging block's phases, from its arrival (marks 8 to 11)
MARKS = 2 * 12


def run(cp, source: str, vocab: int, params: SamplingParams, launches: int, profile: bool, **extra):
    from kernels import ops

    grid, per = ops.sample_shape(vocab, ops.sm_count())
    words = ops.sample_work_words(grid)
    defines = dict(BLOCK=ops.SAMPLE_BLOCK, PER_THREAD=per, BLOCKS=grid, MAX_RECORDS=ops.SAMPLE_MAX_RECORDS,
                   MAX_LOGPROBS=ops.SAMPLE_MAX_LOGPROBS, LP_WORDS=ops.SAMPLE_LP_WORDS, WORK_WORDS=words, **extra)
    if profile:
        defines["PROFILE_AT"] = words
    max_ctx = launches + 16
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal(vocab).astype(np.float32)
    logits = cp.asarray(x)
    amax = cp.zeros(1, cp.uint64)
    state = cp.asarray(state_record(params, 7, token=0, pos=0, prompt_len=1, ring_mask=7).view(np.uint8))
    tokens = cp.zeros(max_ctx, cp.int32)
    ring = cp.zeros(8, cp.int32)
    lp_ring = cp.zeros((8, ops.SAMPLE_LP_WORDS), cp.int32)
    counts = cp.zeros(vocab, cp.int32)
    window = cp.zeros(vocab, cp.int32)
    work = cp.zeros(words + MARKS, cp.uint64)
    fn = ops.module(source, **defines).function("sample", "PPPPPPPPPii")
    args = [logits, amax, state, tokens, ring, lp_ring, counts, window, work, vocab, max_ctx]
    launch = fn.prepare(grid, ops.SAMPLE_BLOCK, args)
    s = cp.cuda.get_current_stream()
    for _ in range(3):
        launch(None)
    s.synchronize()
    if profile:
        launch(None)
        s.synchronize()
        return work[words:].get().reshape(-1, 2)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(s)
    for _ in range(launches):
        launch(None)
    end.record(s)
    end.synchronize()
    assert state.get().view(STATE_DTYPE)[0]["flags"] & 4 == 0
    return 1e3 * cp.cuda.get_elapsed_time(start, end) / launches


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--launches", type=int, default=400)
    ap.add_argument("--prev", action="store_true")
    ap.add_argument("--one-level", action="store_true")
    a = ap.parse_args()
    import cupy as cp

    from kernels.cuda import init

    init()
    sources = [("sample", {})] + ([("sample_prev", {})] if a.prev and Path("kernels/sample_prev.cu").exists() else [])
    if a.one_level:
        sources.append(("sample", {"MERGE_GROUPS": 1}))
    for vocab in (128256, 151936):
        for name, params in CONFIGS.items():
            times = "  ".join(f"{src}{'/1' if ex else ''} {run(cp, src, vocab, params, a.launches, False, **ex):6.1f}"
                              " us" for src, ex in sources)
            marks = run(cp, "sample", vocab, params, a.launches, True)
            clk, ns = marks[:, 0].astype(np.int64), marks[:, 1].astype(np.int64)
            steps = "  ".join(f"{p} {clk[k + 1] - clk[k]:>6}" if clk[k + 1] and clk[k] else f"{p} -"
                              for k, p in enumerate(PHASES[:-1]))
            total = f"{(ns[-1] - ns[0]) / 1e3:.1f}" if ns[-1] and ns[0] else "-"
            last = max((k for k in range(len(PHASES)) if ns[k]), default=0)
            tail = f"{(ns[-1] - ns[last]) / 1e3:.1f}" if ns[-1] and last else "-"
            merger = "  ".join(f"{p} {clk[9 + k] - clk[8 + k]:>6}" if clk[9 + k] and clk[8 + k] else f"{p} -"
                               for k, p in enumerate(MERGER))
            late = f"{(ns[8] - ns[3]) / 1e3:.1f}" if ns[8] and ns[3] else "-"
            seen = f"{(ns[4] - ns[11]) / 1e3:.1f}" if ns[4] and ns[11] else "-"
            print(f"vocab {vocab} {name:10s} {times}  | block 0 cycles: {steps} | start->end {total} us, "
                  f"last phase->end {tail} us | merging block cycles: {merger}; it arrived {late} us after "
                  f"block 0, whose wait ended {seen} us after the records were out", flush=True)


if __name__ == "__main__":
    main()
