"""Time to first token of the first request after load, and of the first at each new prompt length,
against the same requests repeated, on random weights of a shape.

    PYTHONPATH=. python dev/first_request.py --shape llama3-8b [--prompts 63,100,200,300,450] [--no-pad]
    PYTHONPATH=. python dev/first_request.py --shape smollm2-135m --chat models/smollm2-135m-instruct

--no-pad runs the prefill GEMMs on exactly the prompt's rows (PrefillTuning.pad_rows off), so that
each new length is a new cuBLAS problem shape. --chat DIR measures instead the whole path of a chat
request as dev/serve_bench.py's baseline does (DIR's tokenizer renders and tokenizes the messages, the
stream is detokenized; 512 tokens generated), first after load against later ones.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main():
    from engine.backend_cuda import CudaBackend
    from engine.sampling import SamplingParams
    from engine.shapes import SHAPES
    from kernels.tuning import PrefillTuning, Tuning

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--prompts", default="63,100,200,300,450", help="prompt lengths, each new in turn")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--no-pad", action="store_true")
    ap.add_argument("--chat", default=None, help="a model folder whose tokenizer the chat path uses")
    args = ap.parse_args()
    if args.chat:
        import dev.serve_bench as sb

        llm = sb.load(argparse.Namespace(model=args.chat, shape=args.shape, backend="cuda", max_context=8192))
        r = sb.baseline(llm, [{"role": "user", "content": sb.PROMPT}], 512, 5)
        print(f"{args.shape}, chat request: first {r['first_ttft_ms']:.2f} ms, later median {r['ttft_ms']:.2f} ms "
              f"({r['first_ttft_ms'] / r['ttft_ms']:.2f}x; target <= 2x)")
        return
    lengths = [int(n) for n in args.prompts.split(",")]
    t0 = time.perf_counter()
    tuning = Tuning(prefill=PrefillTuning(pad_rows=not args.no_pad))
    be = CudaBackend(SHAPES[args.shape], None, max_context=args.max_context, tuning=tuning)
    print(f"{args.shape}{' (no padding)' if args.no_pad else ''}: load with warm-up {time.perf_counter() - t0:.2f} s")

    def ttft(n: int, r: int) -> float:
        ids = [(7 * r + 3 * i) % 1000 + 1 for i in range(n)]
        t = time.perf_counter()
        next(be.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=1), 1))
        return 1e3 * (time.perf_counter() - t)

    for n in lengths:
        first = ttft(n, 0)
        later = statistics.median(ttft(n, r) for r in range(1, 6))
        print(f"  {n}-token prompt: first {first:.2f} ms, later median {later:.2f} ms ({first / later:.2f}x; "
              f"target <= 2x)", flush=True)


if __name__ == "__main__":
    main()
