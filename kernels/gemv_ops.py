"""Launch builders of the GEMV family (bf16 and the ggml block formats), the quantized embedding row,
the prefill's dequantization and the --quantize encoders.

A weight matrix on the device is a bf16 CuPy array [rows, cols] (uint16 bits) or a QuantWeight: one
ggml format, repacked (kernels/quant_layout.py). Each format's GEMV is kernels/gemv_<format>.cu,
the same streaming loop and epilogues as the bf16 kernels/gemv.cu.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace

from kernels.launch import Launch
from kernels.ops import module, sm_count
from kernels.quant_layout import fmt_of, row_layout
from kernels.tuning import GemvTuning


class Epilogue(enum.IntEnum):
    """What the GEMV does with each row's dot product (the EPI_* names of gemv_epilogue.cuh)."""

    STORE = 0  # y = Wx + b
    ADD = 1  # y += Wx + b
    SILU = 2  # y = silu(gate + b) * (up + b'), W = [gate; up]
    ROPE = 3  # the fused QKV with RoPE and the K/V append (gemv_rope)
    GATE = 4  # y = silu(Wx + b) * y (the gate of a gate/up pair stored apart)

    @property
    def define(self) -> str:
        return f"EPI_{self.name}"


EPI_STORE, EPI_ADD, EPI_SILU, EPI_GATE = Epilogue.STORE, Epilogue.ADD, Epilogue.SILU, Epilogue.GATE
SHORT_ROW = 1024  # bf16 rows at most this long, and many of them: ROWS rows per warp
WARP_TARGET = 48  # rows (bf16) in flight per SM that the split over K aims for
ENCODE_BLOCK = 128  # threads per block of the quantize / dequantize kernels
SMEM_PER_SM = 220 * 1024  # shared memory the x copies of one SM's resident blocks may take
GEMV_WARPS = GemvTuning().warps


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A [rows, cols] matrix in one ggml block format, repacked on the device: data uint8 [rows, row_bytes]."""

    fmt: str
    rows: int
    cols: int
    data: object

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def row_bytes(self) -> int:
        return row_layout(self.fmt, self.cols).row_bytes

    def rows_from(self, row: int) -> int:
        """Device address of row `row`."""
        return int(self.data.data.ptr) + row * self.row_bytes


def is_quant(w) -> bool:
    return isinstance(w, QuantWeight)


def _source(w) -> tuple[str, str, int]:
    """(kernel file, kernel name suffix, weights per chunk) of a weight's format."""
    if is_quant(w):
        f = fmt_of(w.fmt)
        return f"gemv_{f.name}", f"_{f.name}", f.chunk
    return "gemv", "", 8


def _format_name(w) -> str:
    return fmt_of(w.fmt).name.upper() if is_quant(w) else "Bf16"


def split_k(units: int, chunks: int, quant: bool, tuning: GemvTuning, sms: int | None = None) -> int:
    """Warps per unit: enough warps to keep every SM streaming, each with enough loads per unit
    (sms: the device's SM count by default)."""
    sms = sms or sm_count()
    s = 1
    if quant:
        while s < tuning.warps and units * s < tuning.quant_units_per_sm * sms and chunks // (64 * s) >= 1:
            s *= 2
    else:
        while s < tuning.warps and units * s < WARP_TARGET * sms and chunks // (64 * s) >= 4:
            s *= 2
        if tuning.balance:
            s = _balanced(units, chunks, s, tuning, sms)
    return s


def _balanced(units: int, chunks: int, s: int, tuning: GemvTuning, sms: int) -> int:
    """More warps per unit while that fills the last pass over the resident warps better by over a tenth,
    each warp still with two chunks per lane at least; balance 1: only where every warp has a unit already."""
    slots = tuning.warps * tuning.min_blocks * sms

    def filled(split):
        return units * split / (math.ceil(units * split / slots) * slots)

    if tuning.balance == 1 and units * s < slots:
        return s
    while s < tuning.warps and chunks // (64 * 2 * s) >= 1 and filled(2 * s) > filled(s) + 0.1:
        s *= 2
    return s


def rows_per_unit(w, n_out: int, k: int, epi: Epilogue, tuning: GemvTuning, pair: bool) -> int:
    """Rows one warp streams together, sharing each x load."""
    if is_quant(w):
        if k <= SHORT_ROW:
            return tuning.quant_short_rows
        slots = tuning.warps * tuning.quant_min_blocks * sm_count()
        few = math.ceil(n_out / tuning.quant_rows) <= slots and fmt_of(w.fmt).bits_per_weight() < 8
        return tuning.quant_few_rows if few and epi in (EPI_STORE, EPI_ADD, EPI_GATE) else tuning.quant_rows
    if epi in (EPI_SILU, Epilogue.ROPE):
        return 2
    if epi == EPI_STORE and k <= SHORT_ROW and n_out >= 8 * WARP_TARGET * sm_count():
        return tuning.rows
    return 2 if pair and epi in (EPI_STORE, EPI_ADD) else 1


def grid_for(groups: int, min_blocks: int, tuning: GemvTuning, blocks: int | None = None) -> int:
    """Blocks for `groups` blocks' worth of units: at most `blocks` (default tuning.waves per resident
    slot); units stride over the grid."""
    if blocks is None:
        if not tuning.waves:
            return groups
        blocks = tuning.waves * min_blocks * sm_count()
    return max(1, min(groups, blocks))


def quantize_x(x):
    """The int8 x of the block-format GEMVs (gemv_core.cuh stage_xq) in numpy: x [..., K] (times gamma,
    K a multiple of 32) -> (q int8 [..., K], d float32 [..., K / 32]), x ~ d q per block of 32.

    As ggml's q8_1: d = amax / 127; q = rint(x * (1 / d)), ties to even (ggml's CUDA rounds them away
    from zero; a tie needs x / d to land exactly on a half, which 1 / d's rounding makes rare either
    way); every step in float32 round-to-nearest; q = 0 where the block is all zeros. A block holding a
    NaN or an Inf gets d = NaN and q = 0, so every product with it is NaN.
    """
    import numpy as np

    x = np.asarray(x, np.float32)
    b = x.reshape(*x.shape[:-1], -1, 32)
    with np.errstate(invalid="ignore"):
        d = np.where(np.isfinite(b).all(axis=-1), np.abs(b).max(axis=-1) / np.float32(127), np.float32(np.nan))
    inv = np.zeros_like(d)
    np.divide(np.float32(1), d, out=inv, where=d > 0)
    finite = np.isfinite(d)[..., None]
    with np.errstate(invalid="ignore"):
        q = np.where(finite, np.rint(np.where(finite, b, 0) * inv[..., None]), 0)
    return q.astype(np.int8).reshape(x.shape), d


def dequantize_x(q, d):
    """float64 d q: the x that the int8 GEMVs multiply by, exactly."""
    import numpy as np

    b = np.asarray(q).reshape(*d.shape, 32).astype(np.float64) * np.asarray(d, np.float64)[..., None]
    return b.reshape(np.shape(q))


def xq_bytes(k: int) -> int:
    """Shared memory of x quantized to int8 per 32 values: k bytes, then (scale, sums) 8 bytes per 32."""
    return k + k // 32 * 8


def x_smem_bytes(w, k: int, tuning: GemvTuning) -> int:
    """Shared memory for a block's copy of x: int8 with tuning.quant_int8_x, else one padded row of
    float4s per chunk, or 0 when x is read from global memory (bf16 rows, tuning.quant_x_smem off, or a
    row too long to fit)."""
    if not is_quant(w):
        return 0
    if tuning.quant_int8_x:
        return xq_bytes(k)
    if not tuning.quant_x_smem:
        return 0
    chunk = fmt_of(w.fmt).chunk
    nbytes = k // chunk * (chunk // 4 + 1) * 16
    return nbytes if nbytes * tuning.quant_min_blocks <= SMEM_PER_SM else 0


def _launch_shape(w, units: int, k: int, tuning: GemvTuning, splitk: int | None, blocks: int | None):
    _, _, chunk = _source(w)
    quant = is_quant(w)
    min_blocks = tuning.quant_min_blocks if quant else tuning.min_blocks
    s = splitk or split_k(units, k // chunk, quant, tuning)
    if s > tuning.warps or tuning.warps % s:
        raise ValueError(f"split_k {s} does not divide {tuning.warps} warps")
    grid = grid_for(math.ceil(units / (tuning.warps // s)), min_blocks, tuning, blocks)
    return s, min_blocks, grid, x_smem_bytes(w, k, tuning)


def _own_shape(w, k: int, tuning: GemvTuning) -> GemvTuning:
    """The block formats' warps per block and register cap (for rows of k weights) in place of the
    bf16 kernels' warps."""
    if not is_quant(w):
        return tuning
    short = k <= SHORT_ROW
    return replace(tuning, warps=tuning.quant_short_warps if short else tuning.quant_warps,
                   quant_min_blocks=tuning.quant_short_min_blocks if short else tuning.quant_min_blocks)


def _quant_defines(w, k: int, tuning: GemvTuning, smem: int) -> dict:
    """How a block format reads x: int8 (XQ) or fp32 from shared memory (X_SMEM); and whether the first
    batch of weights is loaded before the PDL wait (EARLY_BATCH; GemvTuning.late_kmax for bf16, else
    quant_late_formats and quant_late_kmax)."""
    if not is_quant(w):
        return {"X_SMEM": 0, **({"EARLY_BATCH": 0} if k <= tuning.late_kmax else {})}
    late = fmt_of(w.fmt).name in tuning.quant_late_formats and tuning.quant_min_blocks == 1 and \
        k <= tuning.quant_late_kmax
    early = {"EARLY_BATCH": 0} if late else {}
    return {"XQ": 1, **early} if tuning.quant_int8_x else {"X_SMEM": int(smem > 0), **early}


def _late(late_wait: bool) -> dict:
    return {"LATE_WAIT": 1} if late_wait else {}


def trigger_defines(first: bool, grid: int, min_blocks: int, sms: int | None = None) -> dict:
    """PDL_TRIGGER_FIRST where this GEMV lets the next kernel launch before its own wait: asked for, and its grid
    leaves resident slots where the next kernel's blocks can wait beside it."""
    return {"PDL_TRIGGER_FIRST": 1} if first and grid < min_blocks * (sms or sm_count()) else {}


def _unroll(w, rows: int, tuning: GemvTuning) -> int:
    """Chunk loads per row and batch (0: the kernel's own choice)."""
    if not is_quant(w):
        return 0
    if tuning.quant_unroll or not tuning.quant_int8_x:
        return tuning.quant_unroll
    return max(1, 8 // rows)


def _quant_module(source: str, rows: int, unroll: int, **defines):
    """(module, rows) for these defines. A block format whose ROWS rows and UNROLL loads per warp do not
    fit the register cap without local memory (ptxas decides per shape) takes one load per batch fewer
    at a time, then 2 rows per warp."""
    from kernels.compiler import KernelCompileError

    tries = [(rows, u) for u in range(unroll, 0, -1)] or [(rows, 0)]
    if rows > 2:
        tries.append((2, unroll))
    for i, (r, u) in enumerate(tries):
        try:
            return module(source, ROWS=r, **({"UNROLL": u} if u else {}), **defines), r
        except KernelCompileError as e:
            if i + 1 == len(tries) or "local memory" not in str(e):
                raise
    raise AssertionError("unreachable")


def whole_first_batch(w, units: int, k: int, rows: int, tuning: GemvTuning, sms: int | None = None) -> bool:
    """Whether a bf16 GEMV without a split over K puts all its weights in the warps' first batch: a unit for
    each resident warp at most, and a row's chunks per lane within the batch that ROWS rows allow."""
    if is_quant(w):
        return False
    slots = tuning.warps * tuning.min_blocks * (sms or sm_count())
    return units <= slots and math.ceil(k // 8 / 32) <= max(1, 32 // (rows * 4))


def gemv(w, x, y, n_out: int, k: int, *, gamma=None, bias=None, epi: Epilogue = EPI_STORE, eps: float = 0.0,
         amax=None, tuning: GemvTuning = GemvTuning(), splitk: int | None = None, rows: int | None = None,
         blocks: int | None = None, pair: bool = False, minb: int | None = None, pdl: bool = False,
         late_wait: bool = False, whole: bool = False, trigger_first: bool = False) -> Launch:
    """y[n_out] (=, += or silu-gated) W x with W [n_out, k] (2 n_out rows for EPI_SILU: gate, then up)
    in bf16 or a QuantWeight's format; gamma fuses the RMSNorm of x, bias is added in every epilogue.

    amax (a uint64 device word, EPI_STORE only) also receives the packed argmax of y.
    rows: rows per warp (default rows_per_unit; pair asks bf16 for two). blocks caps the grid.
    minb overrides the tuning's register cap (blocks per SM). late_wait: the previous launch writes
    nothing this one touches; it waits for it only at its end (gemv_core.cuh LATE_WAIT). whole: no split over
    K where all the weights then load in the first batch, before the PDL wait (whole_first_batch).
    trigger_first: the next kernel may launch before this one's PDL wait, where the grid leaves resident slots
    free (trigger_defines).
    """
    tuning = _own_shape(w, k, tuning)
    if minb is not None:
        tuning = replace(tuning, min_blocks=minb, quant_min_blocks=minb)
    epi = Epilogue(epi)
    if epi == Epilogue.ROPE:
        raise ValueError("the rope epilogue is gemv_rope")
    if amax is not None and epi != EPI_STORE:
        raise ValueError("the argmax folds stored rows (EPI_STORE)")
    rows = rows or rows_per_unit(w, n_out, k, epi, tuning, pair)
    source, suffix, _ = _source(w)
    for _ in range(2):
        per_unit = rows // 2 if epi == EPI_SILU else rows
        units = math.ceil(n_out / per_unit)
        if whole and splitk is None and whole_first_batch(w, units, k, rows, tuning):
            splitk = 1
        s, min_blocks, grid, smem = _launch_shape(w, units, k, tuning, splitk, blocks)
        mod, got = _quant_module(source, rows, _unroll(w, rows, tuning), K=k, EPILOGUE=epi.define,
                                 NORM=int(gamma is not None),
                                 BIAS=int(bias is not None), SPLIT_K=s, MIN_BLOCKS=min_blocks,
                                 ARGMAX=int(amax is not None), WARPS=tuning.warps,
                                 **_quant_defines(w, k, tuning, smem), **_late(late_wait),
                                 **trigger_defines(trigger_first, grid, min_blocks))
        if got == rows:
            break
        rows = got  # fewer rows per warp: the grid and split follow
    data = w.data if is_quant(w) else w
    return mod.function("gemv" + suffix, "PPPPPifP").prepare(
        grid, tuning.warps * 32, [data, x, gamma, bias, y, n_out, eps, amax], smem=smem, pdl=pdl)


def gemv_rope(w, x, gamma, bias, y, state, cos, sin, k_cache, v_cache, *, nh: int, nkv: int, hd: int, k: int,
              max_ctx: int, eps: float, head0: int = 0, heads: int | None = None,
              tuning: GemvTuning = GemvTuning(), splitk: int | None = None, blocks: int | None = None,
              pdl: bool = False, late_wait: bool = False, trigger_first: bool = False) -> Launch:
    """The QKV projection with RoPE and the K/V append fused into its epilogue (no per-head norm).

    w holds the rows of heads [head0, head0 + heads) of q | k | v (default: all nh + 2 nkv); y and
    bias [(nh + 2 nkv) hd] are indexed by absolute row. y gets q and k rotated at the state's
    position and v; k and v also go to the cache row min(pos, max_ctx - 1) as bf16. late_wait, trigger_first: as
    gemv's.
    """
    heads = nh + 2 * nkv - head0 if heads is None else heads
    tuning = _own_shape(w, k, tuning)
    n_pairs = heads * hd // 2
    rows = rows_per_unit(w, n_pairs, k, Epilogue.ROPE, tuning, False)
    if (hd // 2) % (rows // 2):
        rows = 2
    source, suffix, _ = _source(w)
    for _ in range(2):
        s, min_blocks, grid, smem = _launch_shape(w, n_pairs // (rows // 2), k, tuning, splitk, blocks)
        mod, got = _quant_module(source, rows, _unroll(w, rows, tuning), K=k, EPILOGUE=Epilogue.ROPE.define,
                                 NORM=int(gamma is not None),
                                 BIAS=int(bias is not None), SPLIT_K=s, MIN_BLOCKS=min_blocks, HEAD_DIM=hd,
                                 WARPS=tuning.warps, **_quant_defines(w, k, tuning, smem), **_late(late_wait),
                                 **trigger_defines(trigger_first, grid, min_blocks))
        if got == rows:
            break
        rows = got
    data = w.data if is_quant(w) else w
    return mod.function("gemv_rope" + suffix, "PPPPPifPPPPPiiii").prepare(
        grid, tuning.warps * 32, [data, x, gamma, bias, y, n_pairs, eps, state, cos, sin, k_cache, v_cache, nh, nkv,
                                  max_ctx, head0], smem=smem, pdl=pdl)


def _dequant_module(w: QuantWeight):
    return module("dequant", FORMAT=_format_name(w), K=w.cols)


def embed_quant(table: QuantWeight, state, x, pdl: bool = False) -> Launch:
    """x [cols] f32 = row state.token of a quantized table (clamped into its rows), dequantized."""
    chunks = table.cols // fmt_of(table.fmt).chunk
    block = min(ENCODE_BLOCK, chunks)
    return _dequant_module(table).function("embed_quant", "PPPi").prepare(
        math.ceil(chunks / block), block, [table.data, state, x, table.rows], pdl=pdl)


def dequant_rows(w: QuantWeight, out, rows: int | None = None) -> Launch:
    """out [rows, cols] bf16 bits = the first `rows` rows of w, dequantized and rounded to bf16."""
    rows = w.rows if rows is None else rows
    n = rows * (w.cols // fmt_of(w.fmt).chunk)
    return _dequant_module(w).function("dequant_rows", "PPi").prepare(
        max(1, math.ceil(n / ENCODE_BLOCK)), ENCODE_BLOCK, [w.data, out, rows])


def embed_rows_quant(table: QuantWeight, prompt, x, *, chunk: int) -> Launch:
    """The prefill's x[t] = dequantized table[prompt[pos0 + t]] for t < T (arguments 0, 1: pos0, T)."""
    chunks = table.cols // fmt_of(table.fmt).chunk
    block = min(ENCODE_BLOCK, chunks)
    return _dequant_module(table).function("embed_rows_quant", "iiPPPi").prepare(
        (chunk, math.ceil(chunks / block)), block, [0, 0, table.data, prompt, x, table.rows])


def quantize_bf16(src, out, fmt: str, stream=None) -> None:
    """ggml blocks of a bf16 matrix, bit-exact with the gguf quantizer: src bf16 bits [rows, cols]
    (cols a multiple of 32), out uint8 [rows, cols // 32 * block_bytes]."""
    f = fmt_of(fmt)
    if f.name not in ("q8_0", "q4_0"):
        raise ValueError(f"no GPU quantizer for {fmt} (q8_0, q4_0)")
    n_blocks = src.size // 32
    module("quantize", NONE=0).function(f"quantize_{f.name}", "PPq").launch(
        max(1, math.ceil(n_blocks / ENCODE_BLOCK)), ENCODE_BLOCK, [src, out, n_blocks], stream=stream)
