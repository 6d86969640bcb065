"""Block-quantized weight matrices in ggml's formats: the data model every backend reads.

A QuantMatrix holds ggml blocks exactly as a GGUF file stores them: row by row, each row
`cols // block` blocks of `type_size` bytes, blocks running along the columns. Values are
ggml's dequantization of those bytes (engine/dequant.py), bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as GT


@dataclass(frozen=True)
class QType:
    name: str  # q4_k, ...
    block: int  # elements per block
    type_size: int  # bytes per block
    ggml: GT

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.type_size / self.block


def _qt(name: str, block: int, type_size: int) -> QType:
    return QType(name, block, type_size, GT[name.upper()])


QTYPES: dict[str, QType] = {
    q.name: q
    for q in (
        _qt("q8_0", 32, 34),
        _qt("q4_0", 32, 18),
        _qt("q4_1", 32, 20),
        _qt("q5_0", 32, 22),
        _qt("q5_1", 32, 24),
        _qt("q2_k", 256, 84),
        _qt("q3_k", 256, 110),
        _qt("q4_k", 256, 144),
        _qt("q5_k", 256, 176),
        _qt("q6_k", 256, 210),
    )
}
# dense tensor types a GGUF may hold beside the block formats: they stay numpy arrays
DENSE: dict[GT, np.dtype] = {GT.F32: np.dtype(np.float32), GT.F16: np.dtype(np.float16)}
try:
    import ml_dtypes

    DENSE[GT.BF16] = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    pass
BY_GGML: dict[GT, QType] = {q.ggml: q for q in QTYPES.values()}
QUANTIZERS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # quantize() writes these, bit-exact with gguf's
QUANTIZE_AT_LOAD = ("q8_0", "q4_0")  # --quantize for bf16/fp16/fp32 checkpoints


def supported_names() -> str:
    """The tensor types a GGUF may use, as one comma-separated string for error messages."""
    return ", ".join([t.name for t in DENSE] + [q.ggml.name for q in QTYPES.values()])


@dataclass(frozen=True, eq=False)
class QuantMatrix:
    """A [rows, cols] matrix as raw ggml blocks: data is uint8 [rows, cols // block * type_size]."""

    qtype: str
    rows: int
    cols: int
    data: np.ndarray

    def __post_init__(self):
        q = QTYPES.get(self.qtype)
        if q is None:
            raise ValueError(f"unknown quantization type {self.qtype!r}")
        if self.cols % q.block:
            raise ValueError(f"{self.qtype}: {self.cols} columns is not a multiple of the block size {q.block}")
        want = (self.rows, self.cols // q.block * q.type_size)
        if self.data.dtype != np.uint8 or self.data.shape != want:
            got = f"{self.data.dtype}{list(self.data.shape)}"
            raise ValueError(f"{self.qtype} [{self.rows}, {self.cols}]: data is {got}, expected uint8{list(want)}")

    @property
    def spec(self) -> QType:
        return QTYPES[self.qtype]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def blocks(self) -> np.ndarray:
        """The same bytes as [rows, cols // block, type_size]."""
        q = self.spec
        return self.data.reshape(self.rows, self.cols // q.block, q.type_size)


@dataclass(frozen=True, eq=False)
class QuantStack:
    """Several QuantMatrix parts whose rows are concatenated (fused QKV: q, k, v; gate_up: gate, up).

    Each part has one format; parts may differ (Q4_K_M stores attn_v as Q6_K beside Q4_K q and k).
    """

    parts: tuple[QuantMatrix, ...]

    def __post_init__(self):
        if not self.parts:
            raise ValueError("a QuantStack needs at least one part")
        cols = {p.cols for p in self.parts}
        if len(cols) != 1:
            raise ValueError(f"QuantStack parts differ in columns: {sorted(cols)}")

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.parts)

    @property
    def cols(self) -> int:
        return self.parts[0].cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def offsets(self) -> tuple[int, ...]:
        """First row of each part, then the total: len(parts) + 1 values."""
        out = [0]
        for p in self.parts:
            out.append(out[-1] + p.rows)
        return tuple(out)


Quantized = QuantMatrix | QuantStack


def is_quantized(w) -> bool:
    return isinstance(w, (QuantMatrix, QuantStack))


def dequantize(w: Quantized) -> np.ndarray:
    """float32 [rows, cols]: ggml's dequantized values (equal to gguf.quants.dequantize bit for bit)."""
    from engine.dequant import dequantize_blocks

    if isinstance(w, QuantStack):
        return np.concatenate([dequantize(p) for p in w.parts], axis=0)
    return dequantize_blocks(w.data, w.qtype).reshape(w.rows, w.cols)


def quantize(a: np.ndarray, qtype: str) -> QuantMatrix:
    """Quantize a [rows, cols] array (any float dtype; taken as float32) into ggml blocks.

    Bit-exact with gguf.quants.quantize on the same float32 input. qtype: one of QUANTIZERS.
    """
    from engine.quantize import quantize_blocks

    if qtype not in QUANTIZERS:
        raise ValueError(f"cannot quantize to {qtype!r} (supported: {', '.join(QUANTIZERS)})")
    if a.ndim != 2:
        raise ValueError(f"quantize takes a 2-D matrix, got shape {list(a.shape)}")
    rows, cols = a.shape
    q = QTYPES[qtype]
    if cols % q.block:
        raise ValueError(f"{qtype}: {cols} columns is not a multiple of the block size {q.block}")
    return QuantMatrix(qtype, rows, cols, quantize_blocks(a, qtype))


def permute_rows(qm: QuantMatrix, order: np.ndarray) -> QuantMatrix:
    """Rows of qm in the given order (blocks run along columns, so rows move whole); a copy."""
    order = np.asarray(order)
    if order.shape != (qm.rows,) or not np.array_equal(np.sort(order), np.arange(qm.rows)):
        raise ValueError(f"order is not a permutation of {qm.rows} rows")
    return QuantMatrix(qm.qtype, qm.rows, qm.cols, np.ascontiguousarray(qm.data[order]))
