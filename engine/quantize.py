"""float32 to ggml blocks, as ggml-quants.c's quantize_row_*_ref does it (bit-exact with gguf.quants).

Each encoder takes float32 blocks [n, 32] and returns uint8 blocks [n, type_size] in the layouts
of engine/dequant.py. All arithmetic is float32, one rounding per operation, as in the C code.
"""

from __future__ import annotations

import numpy as np

from engine.quant import QTYPES

_CHUNK = 1 << 15  # blocks encoded at a time


def _inverse(d: np.ndarray) -> np.ndarray:
    # 1/d, and 0 where d is 0 (an all-zero block stores zero codes)
    out = np.zeros_like(d)
    np.divide(np.float32(1), d, out=out, where=d != 0)
    return out


def _round_away(x: np.ndarray) -> np.ndarray:
    # C roundf: halves away from zero; floor(|x| + 0.5) would round 0.49999997 up
    a = np.abs(x)
    f = np.floor(a)
    return np.copysign(f + (a - f >= np.float32(0.5)), x)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8)


def _signed_max(x: np.ndarray) -> np.ndarray:
    # the value of largest magnitude, first one on ties, sign kept: [n, 1]
    i = np.abs(x).argmax(axis=1)[:, None]
    return np.take_along_axis(x, i, axis=1)


def _pack4(q: np.ndarray) -> np.ndarray:
    # 32 codes -> 16 bytes: value j in the low nibble of byte j, value j + 16 in its high nibble
    return (q[:, :16] & np.uint8(15)) | (q[:, 16:] << np.uint8(4))


def _codes(x: np.ndarray, top: int) -> np.ndarray:
    # C: MIN(top, (int)(x)) for x >= 0; truncation toward zero
    return np.minimum(np.trunc(x), np.float32(top)).astype(np.uint8)


def _q8_0(x):
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    q = _round_away(x * _inverse(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_fp16_bytes(d), q], axis=1)


def _q4_0(x):
    d = _signed_max(x) / np.float32(-8)
    q = _codes(x * _inverse(d) + np.float32(8.5), 15)
    return np.concatenate([_fp16_bytes(d), _pack4(q)], axis=1)


def _q4_1(x):
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    q = _codes((x - lo) * _inverse(d) + np.float32(0.5), 15)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _pack4(q)], axis=1)


def _qh(q: np.ndarray) -> np.ndarray:
    # bit 4 of value j -> bit j of a little-endian u32
    return np.packbits(q >> np.uint8(4), axis=1, bitorder="little")


def _q5_0(x):
    d = _signed_max(x) / np.float32(-16)
    q = _codes(x * _inverse(d) + np.float32(16.5), 31)
    return np.concatenate([_fp16_bytes(d), _qh(q), _pack4(q)], axis=1)


def _q5_1(x):
    lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
    d = (hi - lo) / np.float32(31)
    q = _codes((x - lo) * _inverse(d) + np.float32(0.5), 31)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(lo), _qh(q), _pack4(q)], axis=1)


ENCODERS = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1}


def quantize_blocks(a: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 blocks [rows, cols // block * type_size] of a float [rows, cols] array."""
    q = QTYPES[qtype]
    rows, cols = a.shape
    encode = ENCODERS[qtype]
    flat = a.reshape(-1, q.block)
    out = np.empty((flat.shape[0], q.type_size), np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(0, len(flat), _CHUNK):
            out[i : i + _CHUNK] = encode(np.asarray(flat[i : i + _CHUNK], dtype=np.float32))
    return out.reshape(rows, cols // q.block * q.type_size)
