"""Time to first token of the first request after load against later ones, on random weights of a shape.

    PYTHONPATH=. python dev/first_request.py --shape llama3-8b
"""

from __future__ import annotations

import argparse
import statistics
import time


def main():
    from engine.backend_cuda import CudaBackend
    from engine.sampling import SamplingParams
    from engine.shapes import SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--prompt", type=int, default=63, help="prompt tokens")
    ap.add_argument("--max-context", type=int, default=4096)
    args = ap.parse_args()
    t0 = time.perf_counter()
    be = CudaBackend(SHAPES[args.shape], None, max_context=args.max_context)
    print(f"load with warm-up: {time.perf_counter() - t0:.2f} s")
    ttfts = []
    for r in range(6):
        ids = [(7 * r + 3 * i) % 1000 + 1 for i in range(args.prompt)]
        t = time.perf_counter()
        next(be.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=1), 1))
        ttfts.append(1e3 * (time.perf_counter() - t))
    later = statistics.median(ttfts[1:])
    print(f"{args.shape}, {args.prompt}-token prompt: first request {ttfts[0]:.2f} ms, later median {later:.2f} ms "
          f"({ttfts[0] / later:.2f}x; target <= 2x)")


if __name__ == "__main__":
    main()
