"""What a kernel boundary costs inside a CUDA graph, against a grid barrier inside one kernel.

    PYTHONPATH=. python3 dev/boundary_probe.py [--hops N]

A graph of N launches of dev/boundary_probe.cu (each waits for the one before, bumps a counter per block and
lets the next start), with and without programmatic dependent launch, at the grids the step uses (one
block of 16 warps per SM, four of 4 warps per SM, one block); microseconds per launch, median of 7 timings
of 20 replays (CUDA events). The counters are checked: every launch of every replay ran. Compare with
dev/persistent_probe.py's `barriers` rows (a grid barrier per phase inside one launch).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np


def time_hops(stream, hops, count, reps: int = 20, rounds: int = 7) -> float:
    """Median microseconds per launch of `hops` captured into one graph (`rounds` timings of `reps` replays,
    CUDA events); every launch bumps count[block], and every launch of every replay is checked to have run."""
    import cupy as cp

    from graphs.graph import capture

    start, end = cp.cuda.Event(), cp.cuda.Event()
    with stream:
        graph = capture(stream, hops)
        graph.replay(stream)
        stream.synchronize()
        times = []
        for _ in range(rounds):
            start.record(stream)
            for _ in range(reps):
                graph.replay(stream)
            end.record(stream)
            end.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / reps / len(hops))
    got = cp.asnumpy(count)
    assert np.all(got == len(hops) * (1 + rounds * reps)), got[:4]
    return statistics.median(times)


def main():
    import cupy as cp

    from kernels.bandwidth import copy_bandwidth
    from kernels.launch import Module
    from kernels.ops import sm_count

    ap = argparse.ArgumentParser()
    ap.add_argument("--hops", type=int, default=150)
    args = ap.parse_args()
    print(f"copy bandwidth {copy_bandwidth(1 << 30, 5):,.0f} GB/s", flush=True)
    fn = Module.load(Path(__file__).with_suffix(".cu").resolve()).function("hop", "P")
    sms = sm_count()
    stream = cp.cuda.Stream(non_blocking=True)
    for grid, warps in ((sms, 16), (4 * sms, 4), (1, 1)):
        for pdl in (True, False):
            count = cp.zeros(grid, cp.uint32)
            hops = [fn.prepare(grid, 32 * warps, [count], pdl=pdl) for _ in range(args.hops)]
            us = time_hops(stream, hops, count)
            print(f"grid {grid:4d} x {warps:2d} warps, pdl {int(pdl)}: {us:.2f} us per launch", flush=True)


if __name__ == "__main__":
    main()
