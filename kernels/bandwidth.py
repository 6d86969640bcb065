"""Device copy bandwidth: the memory roofline that decode throughput is compared against."""

from __future__ import annotations

import argparse

from kernels.cuda import init, shared_stream


def copy_bandwidth(nbytes: int = 1 << 30, iters: int = 20, stream=None) -> float:
    """GB/s (1e9 B/s) of a device-to-device copy of `nbytes`, counting bytes read plus bytes written."""
    import cupy as cp

    init()
    s = stream if stream is not None else shared_stream()
    with s:
        src = cp.ones(nbytes, dtype=cp.uint8)
        dst = cp.empty_like(src)
        dst.data.copy_from_device_async(src.data, nbytes, s)  # warm-up
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(s)
        for _ in range(iters):
            dst.data.copy_from_device_async(src.data, nbytes, s)
        end.record(s)
        end.synchronize()
    ms = cp.cuda.get_elapsed_time(start, end)
    del src, dst
    return 2 * nbytes * iters / (ms * 1e-3) / 1e9


def main():
    p = argparse.ArgumentParser(description="Measure device-to-device copy bandwidth.")
    p.add_argument("--mib", type=int, default=1024, help="buffer size in MiB")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    gbs = copy_bandwidth(a.mib << 20, a.iters)
    print(f"device copy bandwidth: {gbs:.1f} GB/s ({a.mib} MiB D2D x{a.iters}, read+write)")


if __name__ == "__main__":
    main()
