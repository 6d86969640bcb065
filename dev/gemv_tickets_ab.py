"""The step with its bf16 GEMVs' last passes handed out from a counter (dev/gemv_tickets.cu) against the step as it
is: the same logits bit for bit, then time per step in turn.

PYTHONPATH=. python3 dev/gemv_tickets_ab.py [--tails 1,2] [--depth D] [--rounds N] [shape ...]

Every bf16 GEMV launch of the step (kernels/gemv.cu) is swapped for the same build of dev/gemv_tickets.cu with
TAIL set, and a counter of its own. Each unit is computed as before, by whichever warp takes it, so the logits
must equal the step's bit for bit: after one step, and after three in a row (the counters carried from launch to
launch). Then each graph is timed (64 replays, median of 4) in turn, round after round; tok/s beside the copy
bandwidth of the same run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import cupy as cp
import numpy as np

from dev.decode_ab import replay_ms
from dev.gemv_tail_probe import defines_of, is_bf16_gemv, relaunch, step_at
from engine import bench as B
from graphs.decode import Launches
from graphs.graph import capture
from kernels.bandwidth import copy_bandwidth
from kernels.compiler import KernelCompileError
from kernels.launch import Module

TICKETS = Path(__file__).resolve().parent / "gemv_tickets.cu"


def swapped(launches, tail: int):
    """A copy of the step's launches with each bf16 GEMV drawing its last `tail` passes; (launches, swapped
    count, kinds left as they were because the build spills)."""
    out, n, kept = list(launches), 0, set()
    for i, launch in enumerate(launches):
        if not is_bf16_gemv(launch):
            continue
        try:
            mod = Module.load(TICKETS, {**defines_of(launch.kernel.module), "TAIL": tail})
        except KernelCompileError:
            kept.add(Launches.kind(launch.name))
            continue
        rope = launch.kernel.name == "gemv_rope"
        counter = cp.zeros(1, cp.uint64)
        swap = relaunch(launch, mod.function("gemv_rope_tickets" if rope else "gemv_tickets", launch.sig + "P"),
                        [counter])
        swap.counter = counter  # kept alive with the launch
        out[i] = swap
        n += 1
    return out, n, kept


def logits_after(backend, graph, depth: int, steps: int) -> np.ndarray:
    B.set_position(backend, depth)
    for _ in range(steps):
        graph.replay(backend.stream)
    backend.stream.synchronize()
    return backend.bufs.logits.get().view(np.uint32)


def time_in_turn(label: str, backend, graphs: dict, depth: int, rounds: int, copy_gbs: float) -> None:
    """Each graph timed in turn (64 replays, median of 4), round after round; tok/s, share of the copy bandwidth,
    and the change against the first graph of the round."""
    nbytes = B.step_bytes(backend, depth + 1)
    for _ in range(rounds):
        base = None
        for v, g in graphs.items():
            ms = replay_ms(backend, g, depth)
            base = base or ms
            print(f"{label} {v:<8} {1e3 * ms:8.1f} us/step {1 / ms * 1e3:8.1f} tok/s "
                  f"{100 * nbytes / ms / 1e6 / copy_gbs:5.1f}% copy {100 * (base / ms - 1):+6.2f}%", flush=True)


def main(argv):
    opts = {a: argv[i + 1] for i, a in enumerate(argv) if a in ("--tails", "--depth", "--rounds")}
    tails = [int(t) for t in opts.get("--tails", "1,2").split(",")]
    depth, rounds = int(opts.get("--depth", 0)), int(opts.get("--rounds", 2))
    shapes = [a for a in argv if not a.startswith("--") and a not in opts.values()] or ["llama3-8b", "qwen2.5-0.5b"]
    copy_gbs = copy_bandwidth(4 << 30, 10)
    print(f"copy bandwidth {copy_gbs:,.0f} GB/s", flush=True)
    failed = False
    for name in shapes:
        backend, launches = step_at(name, depth)
        s = backend.stream
        graphs = {"stride": capture(s, launches)}
        for tail in tails:
            swap, n, kept = swapped(launches, tail)
            graphs[f"tail {tail}"] = capture(s, swap)
            print(f"{name}: tail {tail} swaps {n} GEMV launches" + (f"; kept (spills): {sorted(kept)}" if kept else ""))
        s.synchronize()
        want = {k: logits_after(backend, graphs["stride"], depth, k) for k in (1, 3)}
        for v, g in graphs.items():
            for k in (1, 3):
                got = logits_after(backend, g, depth, k)
                same = np.array_equal(got, want[k])
                failed |= not same
                print(f"{name} {v:<8} logits after {k} step(s): {'same bits' if same else 'DIFFER'} "
                      f"({int((got != want[k]).sum())} of {got.size} differ)", flush=True)
        time_in_turn(f"{name} d={depth}", backend, graphs, depth, rounds, copy_gbs)
        del backend, graphs
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
