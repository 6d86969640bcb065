"""The prefill's GEMMs over block-format matrices: the rows are dequantized a slice at a time into a
bf16 scratch and each slice's GEMM runs right after, so the slice's bf16 is still in L2 when the GEMM
reads it. Slices alternate over lanes (the prefill's stream and side streams, each with its own
scratch), so one slice's dequantization runs beside another's GEMM. Every output element is one
GEMM's dot product over the whole row, as with the matrix dequantized whole; the slices only split
the output's columns.
"""

from __future__ import annotations

import math

from graphs.quant_weights import StackedWeight, is_blocks
from kernels import prefill_ops as pops
from kernels.launch import device_pointer
from kernels.tuning import PrefillTuning

SLICE_ALIGN = 128  # slices of at least this many rows hold a multiple of it (whole GEMM tiles)
BF16, F32 = 2, 4


def slice_rows(n: int, k: int, slice_bytes: int, align: int = SLICE_ALIGN) -> list[tuple[int, int]]:
    """Row ranges [a, b) that cover 0..n in order, each of at most slice_bytes of bf16 (rows of k) and
    at least one row, as even as `align` allows; slice_bytes 0 gives the whole matrix."""
    rows = slice_bytes // (BF16 * k) if slice_bytes > 0 else n
    if rows >= n:
        return [(0, n)]
    rows = max(1, rows)
    if rows >= align:
        rows -= rows % align
    even = math.ceil(n / math.ceil(n / rows))
    if rows >= align:
        even = min(rows, math.ceil(even / align) * align)
    return [(a, min(n, a + even)) for a in range(0, n, even)]


def pieces(offsets, a: int, b: int) -> list[tuple[int, int, int, int]]:
    """The parts that rows a..b-1 of a stack (part i holds rows offsets[i]..offsets[i+1]-1) cross:
    (part, first row within the part, rows, first row within the slice)."""
    out = []
    for i, (p0, p1) in enumerate(zip(offsets, offsets[1:], strict=False)):
        lo, hi = max(a, p0), min(b, p1)
        if lo < hi:
            out.append((i, lo - p0, hi - lo, lo - a))
    return out


def _parts(w):
    return (w.parts, w.offsets) if isinstance(w, StackedWeight) else ((w,), (0, w.rows))


class Lanes:
    """The prefill's stream (lane 0, with the cuBLAS handle the caller passes) and side lanes, each
    with a bf16 scratch of `elems` elements. Allocated once."""

    def __init__(self, stream, count: int, elems: int):
        import cupy as cp

        self.stream = stream
        self.side = [pops.Lane() for _ in range(count - 1)]
        self.fork = cp.cuda.Event(disable_timing=True)
        with stream:
            self.scratch = [cp.empty(elems, cp.uint16) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.scratch)

    def begin(self, used: int):
        """Side lanes 1..used-1 wait for the work queued so far on the prefill's stream."""
        if used > 1:
            self.fork.record(self.stream)
            for lane in self.side[: used - 1]:
                lane.stream.wait_event(self.fork)

    def end(self, used: int):
        """The prefill's stream waits for side lanes 1..used-1."""
        for lane in self.side[: used - 1]:
            lane.done.record(lane.stream)
            self.stream.wait_event(lane.done)


class DequantGemm:
    """y[T, n] (+)= x[T, k] W^T for a block-format W (QuantWeight or StackedWeight): per slice of rows,
    dequantize into the lane's scratch, then the cuBLAS GEMM of those rows into their columns of y.
    Same call as kernels.prefill_ops.Gemm."""

    def __init__(self, w, lanes: Lanes, x, y, n: int, k: int, accumulate: bool = False,
                 tuning: PrefillTuning = PrefillTuning()):
        parts, offsets = _parts(w)
        if offsets[-1] != n:
            raise ValueError(f"a matrix of {offsets[-1]} rows for an output of {n}")
        self.lanes, y0 = lanes, device_pointer(y)
        self.slices = []
        for j, (a, b) in enumerate(slice_rows(n, k, tuning.dequant_slice)):
            lane = j % len(lanes)
            buf = device_pointer(lanes.scratch[lane])
            fill = [pops.dequant_rows(parts[i], buf + BF16 * s * k, r0, rows, items=tuning.dequant_items,
                                      stage=tuning.dequant_stage) for i, r0, rows, s in pieces(offsets, a, b)]
            self.slices.append((lane, fill, pops.Gemm(buf, x, y0 + F32 * a, b - a, k, accumulate, ld_y=n)))
        self.used = min(len(self.slices), len(lanes))

    def __call__(self, handle: int, t: int):
        lanes = self.lanes
        lanes.begin(self.used)
        for lane, fill, gemm in self.slices:
            s, h = (lanes.stream, handle) if lane == 0 else (lanes.side[lane - 1].stream, lanes.side[lane - 1].handle)
            for launch in fill:
                launch(s)
            gemm(h, t)
        lanes.end(self.used)


def lanes_for(weights, stream, tuning: PrefillTuning) -> Lanes | None:
    """Lanes for the block-format layer matrices of `weights` (None when there are none): as many as
    the most slices of one matrix, up to tuning.dequant_lanes, with scratch for the largest slice."""
    mats = [m for lw in weights.layers for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down) if is_blocks(m)]
    if not mats:
        return None
    plans = [(slice_rows(m.rows, m.cols, tuning.dequant_slice), m.cols) for m in mats]
    elems = max((b - a) * k for plan, k in plans for a, b in plan)
    return Lanes(stream, min(tuning.dequant_lanes, max(len(plan) for plan, _ in plans)), elems)
