"""The prefill's GEMMs over block-format matrices: each matrix is dequantized whole into a bf16 scratch,
then multiplied by cuBLAS. With `ahead`, two scratches alternate and a side stream dequantizes the
next matrix into one while the prefill's stream runs the GEMM over the other (and the kernels up to
the next GEMM), so the dequantization's memory traffic hides under the GEMMs' math. Either way each
GEMM is the same call over the same bf16 values: the results are bit-identical.
"""

from __future__ import annotations

from graphs.quant_weights import StackedWeight
from kernels import prefill_ops as pops
from kernels.launch import device_pointer

BF16 = 2
SPARE = 512 << 20  # device memory a second scratch must leave free (the decode step allocates after)


def ahead_plan(count: int, slots: int) -> tuple[list[int], list[int | None]]:
    """(slot of each GEMM, the GEMM whose dequantization each one starts ahead) for `count` GEMMs that
    run in order, wrapping around to the first, over `slots` scratches: GEMM i reads slot i % slots
    and starts GEMM i + 1's dequantization when that one's slot is another (None otherwise)."""
    slot = [i % slots for i in range(count)]
    nxt = [(i + 1) % count for i in range(count)]
    return slot, [j if slot[j] != slot[i] else None for i, j in enumerate(nxt)]


class DequantGemm:
    """y[T, n] (+)= x[T, k] W^T for a block-format W (QuantWeight or StackedWeight): each part
    dequantized into its rows of a scratch of `Ahead`, then the cuBLAS GEMM. Same call as
    kernels.prefill_ops.Gemm."""

    def __init__(self, w, ahead: Ahead, x, y, n: int, k: int, accumulate: bool = False):
        parts, offsets = (w.parts, w.offsets) if isinstance(w, StackedWeight) else ((w,), (0, w.rows))
        if offsets[-1] != n or parts[0].cols != k:
            raise ValueError(f"a [{offsets[-1]}, {parts[0].cols}] matrix for a GEMM of [{n}, {k}]")
        self.ahead, self.parts, self.offsets, self.k = ahead, parts, offsets, k
        self.x, self.y, self.n, self.accumulate = x, y, n, accumulate
        self.slot, self.fill, self.gemm = 0, [], None
        ahead.add(self)

    def bind(self, slot: int, scratch):
        """Prepare the dequantization into, and the GEMM from, scratch `slot`."""
        base = device_pointer(scratch)
        self.slot = slot
        self.fill = [pops.dequant_rows(p, base + BF16 * r0 * self.k, 0, p.rows)
                     for p, r0 in zip(self.parts, self.offsets, strict=False)]
        self.gemm = pops.Gemm(base, self.x, self.y, self.n, self.k, self.accumulate)

    def __call__(self, handle: int, t: int):
        self.ahead.run(self, handle, t)


class Ahead:
    """The scratches and the side stream of the DequantGemms of one prefill, in the order they run.

    `holder[s]` is the GEMM whose values scratch s holds (or will, in the side stream's order): a GEMM
    whose matrix is already there dequantizes nothing. Events: ready[s] after a dequantization into s,
    free[s] after a GEMM from s (the next dequantization into s waits for it).
    """

    def __init__(self, stream, ahead: bool):
        self.stream, self.use_side = stream, ahead
        self.gemms: list[DequantGemm] = []
        self.next: list[DequantGemm | None] = []

    def add(self, g: DequantGemm):
        self.gemms.append(g)

    def allocate(self):
        """Once every GEMM is added: scratches for the largest matrix, slots, events, the side stream.
        A second scratch only where it leaves SPARE bytes free (the KV cache may have taken the rest)."""
        import cupy as cp

        if not self.gemms:
            return
        elems = max(g.n * g.k for g in self.gemms)
        slots = 1
        if self.use_side and len(self.gemms) > 1:
            pool = cp.get_default_memory_pool()
            free = cp.cuda.runtime.memGetInfo()[0] + pool.free_bytes()
            slots = 2 if free >= 2 * BF16 * elems + SPARE else 1
        with self.stream:
            self.scratch = [cp.empty(elems, cp.uint16) for _ in range(slots)]
        self.side = cp.cuda.Stream(non_blocking=True) if slots > 1 else None
        self.ready = [cp.cuda.Event(disable_timing=True) for _ in range(slots)]
        self.free = [cp.cuda.Event(disable_timing=True) for _ in range(slots)]
        self.done = cp.cuda.Event(disable_timing=True)
        self.holder: list[DequantGemm | None] = [None] * slots
        slot, nxt = ahead_plan(len(self.gemms), slots)
        for g, s in zip(self.gemms, slot, strict=True):
            g.bind(s, self.scratch[s])
        self.next = [None if j is None else self.gemms[j] for j in nxt]
        self._index = {id(g): i for i, g in enumerate(self.gemms)}

    def _dequantize(self, g: DequantGemm):
        s = g.slot
        if self.holder[s] is g:
            return
        self.holder[s] = g
        if self.side is None:
            for launch in g.fill:
                launch(self.stream)
            return
        self.side.wait_event(self.free[s])
        for launch in g.fill:
            launch(self.side)
        self.ready[s].record(self.side)

    def run(self, g: DequantGemm, handle: int, t: int):
        self._dequantize(g)
        nxt = self.next[self._index[id(g)]]
        if nxt is not None:
            self._dequantize(nxt)
        if self.side is not None:
            self.stream.wait_event(self.ready[g.slot])
        g.gemm(handle, t)
        if self.side is not None:
            self.free[g.slot].record(self.stream)

    def join(self):
        """The prefill's stream waits for every dequantization started ahead."""
        if self.gemms and self.side is not None:
            self.done.record(self.side)
            self.stream.wait_event(self.done)
