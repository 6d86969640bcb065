"""What cold instruction fetch adds to a kernel in a captured graph.

    PYTHONPATH=. python3 dev/icache_probe.py [--hops N]

dev/icache_probe.cu is a kernel of OPS straight-line FADDs (16 bytes of code each) after its PDL wait. For
each code size, a graph of N launches of one copy (its code stays in each SM's instruction caches), then
of COPIES copies in turn (separate modules: each launch fetches code that the last COPIES - 1 launches
pushed out, as a decode step's kernels do); microseconds per launch, median of 7 timings of 20 replays
(CUDA events), at one block of 4 warps per SM. The counters are checked: every launch of every replay ran.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

from boundary_probe import time_hops

SOURCE = Path(__file__).with_suffix(".cu").resolve()


def code_bytes(module) -> int:
    """.text bytes of the module's kernel (readelf over the cubin), 0 if that cannot be read."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(module.compiled.cubin)
        f.flush()
        try:
            out = subprocess.run(["readelf", "-S", "-W", f.name], capture_output=True, text=True).stdout
        except OSError:
            return 0
    m = re.search(r"\.text\.big\s+PROGBITS\s+\S+\s+\S+\s+(\S+)", out)
    return int(m.group(1), 16) if m else 0


def main():
    import cupy as cp

    from kernels.bandwidth import copy_bandwidth
    from kernels.launch import Module
    from kernels.ops import sm_count

    ap = argparse.ArgumentParser()
    ap.add_argument("--hops", type=int, default=60)
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--ops", default="64,512,1024,2048,4096")
    args = ap.parse_args()
    print(f"copy bandwidth {copy_bandwidth(1 << 30, 5):,.0f} GB/s", flush=True)
    sms = sm_count()
    stream = cp.cuda.Stream(non_blocking=True)
    grid, threads = sms, 128
    out = cp.zeros(threads, cp.float32)
    for ops in (int(v) for v in args.ops.split(",")):
        mods = [Module.load(SOURCE, dict(OPS=ops, SALT=c)) for c in range(args.copies)]
        fns = [m.function("big", "PP") for m in mods]
        row = []
        for copies in (1, args.copies):
            count = cp.zeros(grid, cp.uint32)
            hops = [fns[h % copies].prepare(grid, threads, [out, count], pdl=True) for h in range(args.hops)]
            row.append(time_hops(stream, hops, count))
        print(f"{ops:5d} FADDs, {code_bytes(mods[0]) / 1024:6.1f} KiB of code: one copy {row[0]:.2f} us per launch, "
              f"{args.copies} copies in turn {row[1]:.2f} us (+{row[1] - row[0]:.2f})", flush=True)
        for m in mods:
            m.unload()


if __name__ == "__main__":
    main()
