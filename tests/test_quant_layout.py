"""The repacked layout the GPU kernels read (kernels/quant_layout.py), emulated in numpy: it must give
back gguf's dequantization bit for bit, from random blocks and from gguf's own quantizer. Also the
per-tensor types of the bench presets (llama.cpp's rules) and the planes' alignment."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from graphs.quant_weights import preset_type, use_more_bits
from kernels import quant_layout as L

FORMATS = list(L.FORMATS)
QUANTIZABLE = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


def same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (7, 3), (33, 5)])
def test_repacked_random_blocks_dequantize_exactly(name, rows, blocks):
    f = L.FORMATS[name]
    cols = f.block * blocks
    raw = L.random_blocks(f, rows, cols, seed=rows * 100 + blocks)
    ref = gguf_dequantize(raw, GT[name.upper()]).reshape(rows, cols)
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    packed = L.repack(f, raw, rows, cols)
    assert packed.shape == (rows, L.row_layout(f, cols).row_bytes)
    assert same_bits(L.dequantize(f, packed, rows, cols), ref)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("passes", [4, 12])
def test_lane_major_rows_dequantize_exactly(name, passes):
    """Rows of whole groups of 4 passes of 32 chunks order their side planes by lane, then pass."""
    f = L.FORMATS[name]
    rows, cols = 5, 32 * passes * f.chunk
    lay = L.row_layout(f, cols)
    assert lay.lane_major and not L.row_layout(f, cols - 32 * f.chunk).lane_major
    raw = L.random_blocks(f, rows, cols, seed=passes)
    ref = gguf_dequantize(raw, GT[name.upper()]).reshape(rows, cols)
    assert same_bits(L.dequantize(f, L.repack(f, raw, rows, cols), rows, cols), ref)


def test_lane_major_entries():
    """Where the kernels look (gemv_formats.cuh QuantRows::side_at, d_at), worked by hand."""
    f = L.FORMATS["q8_0"]  # 4096 weights: 256 chunks of 16, 8 passes (2 groups); 2 chunks per block, 16 lane groups
    raw = L.random_blocks(f, 2, 4096, seed=1)
    lay, packed = L.row_layout(f, 4096), L.repack(f, raw, 2, 4096)
    # block 81 holds chunks 162, 163: pass 5 (group 1, pass 1 in it), lanes 2 and 3 (lane group 1):
    # entry 64 * 1 + 4 * 1 + 1
    e = 64 + 4 + 1
    assert np.array_equal(packed[1, lay.d_off + 2 * e:lay.d_off + 2 * e + 2], raw[1, 34 * 81:34 * 81 + 2])
    assert np.array_equal(packed[1, lay.d_off:lay.d_off + 2], raw[1, 0:2])
    f = L.FORMATS["q4_k"]  # 4096 weights: 128 chunks of 32, 4 passes (1 group); 8 chunks per block, 4 lane groups
    raw = L.random_blocks(f, 2, 4096, seed=2)
    lay, packed = L.row_layout(f, 4096), L.repack(f, raw, 2, 4096)
    # block 5 (chunks 40..47: pass 1, lanes 8..15, lane group 1): entry 4 * 1 + 1
    assert np.array_equal(packed[0, lay.d_off + 4 * 5:lay.d_off + 4 * 6], raw[0, 144 * 5:144 * 5 + 4])
    # chunk 101 (pass 3, lane 5): entry 4 * 5 + 3 of S, its sub-block's (scale, min)
    s = L.ggml_fields(f, raw, 2, 4096)[2]
    assert np.array_equal(packed[0, lay.s_off + 2 * 23:lay.s_off + 2 * 24], s[0, 101])


@pytest.mark.parametrize("name", FORMATS)
def test_every_bit_reaches_its_weight(name):
    """Flipping one ggml byte changes the repacked dequantization exactly where gguf's changes."""
    f = L.FORMATS[name]
    rows, cols = 2, 2 * f.block
    raw = L.random_blocks(f, rows, cols, seed=5)
    rng = np.random.default_rng(0)
    for byte in rng.choice(raw.shape[1], size=min(40, raw.shape[1]), replace=False):
        flipped = raw.copy()
        flipped[1, byte] ^= np.uint8(1 << int(rng.integers(8)))
        ref = gguf_dequantize(flipped, GT[name.upper()]).reshape(rows, cols)
        if not np.isfinite(ref).all():
            continue  # a flipped fp16 exponent: not a block this test is about
        assert same_bits(L.dequantize(f, L.repack(f, flipped, rows, cols), rows, cols), ref), byte


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_repacked_gguf_quantized_dequantize_exactly(name):
    rng = np.random.default_rng(3)
    rows, cols = 9, 32 * 11
    a = (rng.standard_normal((rows, cols)) * np.exp(rng.standard_normal((rows, 1)))).astype(np.float32)
    a[0, :32] = 0  # an all-zero block
    raw = gguf_quantize(a, GT[name.upper()])
    ref = gguf_dequantize(raw, GT[name.upper()]).reshape(rows, cols)
    assert same_bits(L.dequantize(name, L.repack(name, raw, rows, cols), rows, cols), ref)


@pytest.mark.parametrize("name", FORMATS)
def test_planes_are_aligned_for_their_loads(name):
    f = L.FORMATS[name]
    for cols in (f.block, 3 * f.block, 4096 if f.block == 256 else 896):
        lay = L.row_layout(f, cols)
        assert lay.row_bytes % 16 == 0 and lay.h_off % 16 == 0
        assert lay.s_off % 4 == 0 and lay.d_off % 4 == 0
        assert lay.d_off + lay.blocks * f.d_bytes <= lay.row_bytes < lay.d_off + lay.blocks * f.d_bytes + 16
        # the planes cost at most 4 bytes per ggml block over the file's bytes, plus the row padding
        assert lay.row_bytes <= L.ggml_row_bytes(f, cols) + 4 * lay.blocks + 15


@pytest.mark.parametrize("cols", [512, 4096])  # 16 chunks; 128, lane-major
def test_fields_round_trip_through_planes(cols):
    f = L.FORMATS["q6_k"]
    raw = L.random_blocks(f, 3, cols, seed=9)
    fields = L.ggml_fields(f, raw, 3, cols)
    back = L.planes(f, L.repack(f, raw, 3, cols), 3, cols)
    for a, b in zip(fields, back, strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_unsupported_type_and_shape():
    with pytest.raises(ValueError, match="IQ4_XS"):
        L.fmt_of(GT.IQ4_XS)
    with pytest.raises(ValueError, match="multiple of 256"):
        L.row_layout("q4_k", 896)


def test_llama_cpp_q4_k_m_mix():
    layers = 32
    more = [i for i in range(layers) if use_more_bits(i, layers)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    t = [preset_type("q4_k_m", "attn_v", i, layers, 4096) for i in range(layers)]
    assert [i for i, x in enumerate(t) if x == "q6_k"] == more and set(t) == {"q4_k", "q6_k"}
    assert preset_type("q4_k_m", "ffn_down", 5, layers, 14336) == "q4_k"
    assert preset_type("q4_k_m", "ffn_down", 31, layers, 14336) == "q6_k"
    for tensor in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "token_embd"):
        assert preset_type("q4_k_m", tensor, 0, layers, 4096) == "q4_k"
    assert preset_type("q4_k_m", "output", 0, layers, 4096) == "q6_k"
    # rows of 896 (Qwen2.5-0.5B) cannot hold 256-blocks: llama.cpp falls back
    assert preset_type("q4_k_m", "attn_q", 3, 24, 896) == "q5_0"
    assert preset_type("q4_k_m", "attn_v", 0, 24, 896) == "q8_0"
    assert preset_type("q4_k_m", "ffn_down", 3, 24, 4864) == "q4_k"
    assert preset_type("q4_k_m", "output", 0, 24, 896) == "q8_0"
    # legacy and uniform presets: output in Q6_K unless the preset is Q8_0 or Q6_K
    assert preset_type("q4_0", "output", 0, layers, 4096) == "q6_k"
    assert preset_type("q4_0", "ffn_down", 0, layers, 14336) == "q4_0"
    assert preset_type("q8_0", "output", 0, layers, 4096) == "q8_0"
    assert preset_type("q6_k", "output", 0, layers, 4096) == "q6_k"
