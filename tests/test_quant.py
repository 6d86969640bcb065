"""ggml block formats: dequantize and quantize against the gguf package, bit for bit."""

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine.quant import QTYPES, QUANTIZERS, QuantMatrix, QuantStack, dequantize, permute_rows, quantize

# byte offsets of each format's fp16 scales: random bytes there could be inf or nan
FP16_AT = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q2_k": (80, 82),
           "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> QuantMatrix:
    """Any bytes with finite fp16 scales are a valid block."""
    q = QTYPES[qtype]
    b = rng.integers(0, 256, (rows, cols // q.block, q.type_size), dtype=np.uint8)
    for at in FP16_AT[qtype]:
        scale = (rng.standard_normal((rows, cols // q.block)) * 0.02).astype(np.float16)
        b[..., at : at + 2] = scale[..., None].view(np.uint8)
    return QuantMatrix(qtype, rows, cols, b.reshape(rows, -1))


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    same_kind = a.dtype == b.dtype == np.float32 and a.shape == b.shape
    return same_kind and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_qtypes_match_ggml_sizes():
    assert len(QTYPES) == 10
    for name, q in QTYPES.items():
        assert q.ggml.name.lower() == name
        assert GGML_QUANT_SIZES[q.ggml] == (q.block, q.type_size)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_dequantize_random_blocks_matches_gguf(qtype):
    rng = np.random.default_rng(sorted(QTYPES).index(qtype))
    q = QTYPES[qtype]
    qm = random_blocks(qtype, 37, 3 * 256, rng)
    got = dequantize(qm)
    want = gguf_dequantize(qm.data, q.ggml)
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    assert same_bits(got, want)


@pytest.mark.parametrize("qtype", QUANTIZERS)
def test_dequantize_quantized_matches_gguf(qtype):
    rng = np.random.default_rng(7)
    a = rng.standard_normal((19, 512)).astype(np.float32)
    data = gguf_quantize(a, QTYPES[qtype].ggml)
    qm = QuantMatrix(qtype, 19, 512, data)
    assert same_bits(dequantize(qm), gguf_dequantize(data, QTYPES[qtype].ggml))


def _awkward(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    a = rng.standard_normal((rows, cols)) * rng.uniform(1e-3, 4.0, (rows, 1))
    a[0, :32] = 0  # zero block: scale 0
    a[1, :32] = 0.75  # constant block: max == min
    a[2, :32] = np.linspace(-1, 1, 32)  # exact halves land on rounding ties
    a[3, 7] = -np.abs(a[3, :32]).max() * 2  # negative extreme
    a[4, :32] = np.arange(32) - 15.5
    return a


@pytest.mark.parametrize("qtype", QUANTIZERS)
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_quantize_bit_exact_with_gguf(qtype, dtype):
    rng = np.random.default_rng(QUANTIZERS.index(qtype) + 11)
    a = _awkward(rng, 67, 32 * 45).astype(dtype)
    qm = quantize(a, qtype)
    want = gguf_quantize(a.astype(np.float32), QTYPES[qtype].ggml)
    assert qm.shape == a.shape and qm.qtype == qtype
    assert qm.data.dtype == np.uint8 and np.array_equal(qm.data, want)
    # and the values round-trip within the format's step
    err = np.abs(dequantize(qm) - a.astype(np.float32)).max(axis=1)
    step = np.abs(a.astype(np.float32)).max(axis=1) / (7 if qtype != "q8_0" else 127)
    assert (err <= step * 1.01 + 1e-6).all()


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="block size"):
        quantize(np.ones((2, 48), np.float32), "q8_0")
    with pytest.raises(ValueError, match="cannot quantize"):
        quantize(np.ones((2, 256), np.float32), "q4_k")


def test_quant_matrix_checks_shape():
    with pytest.raises(ValueError, match="expected uint8"):
        QuantMatrix("q4_0", 2, 64, np.zeros((2, 35), np.uint8))
    with pytest.raises(ValueError, match="unknown"):
        QuantMatrix("iq4_nl", 2, 64, np.zeros((2, 36), np.uint8))
    qm = QuantMatrix("q4_0", 2, 64, np.zeros((2, 36), np.uint8))
    assert qm.nbytes == 72 and qm.shape == (2, 64) and qm.blocks.shape == (2, 2, 18)


def test_stack_concatenates_parts_of_mixed_types():
    rng = np.random.default_rng(3)
    parts = (random_blocks("q4_k", 8, 512, rng), random_blocks("q4_k", 4, 512, rng), random_blocks("q6_k", 4, 512, rng))
    s = QuantStack(parts)
    assert s.rows == 16 and s.cols == 512 and s.shape == (16, 512) and s.offsets == (0, 8, 12, 16)
    assert s.nbytes == sum(p.data.nbytes for p in parts)
    want = np.concatenate([gguf_dequantize(p.data, QTYPES[p.qtype].ggml) for p in parts])
    assert same_bits(dequantize(s), want)
    with pytest.raises(ValueError, match="columns"):
        QuantStack((parts[0], random_blocks("q8_0", 2, 256, rng)))


@pytest.mark.parametrize("qtype", ["q4_k", "q5_0"])
def test_permute_rows_moves_whole_rows(qtype):
    rng = np.random.default_rng(5)
    qm = random_blocks(qtype, 24, 256, rng)
    order = rng.permutation(24)
    out = permute_rows(qm, order)
    assert same_bits(dequantize(out), dequantize(qm)[order])
    with pytest.raises(ValueError, match="permutation"):
        permute_rows(qm, np.zeros(24, int))
