"""ggml's block formats decoded to float32, with ggml's own float operations in ggml's order.

Each decoder takes blocks [n, type_size] uint8 and returns [n, block] float32. Every product
and difference is one float32 operation as in ggml-quants.c's dequantize_row_* (no fused
multiply-add), so the values equal gguf.quants.dequantize bit for bit. The layouts, in bytes:

  q8_0  d:f16 | q:int8[32]                              x = q * d
  q4_0  d:f16 | q:u4[32]                                x = (q - 8) * d
  q4_1  d:f16 m:f16 | q:u4[32]                          x = q * d + m
  q5_0  d:f16 | qh:u32 | ql:u4[32]                      x = (q - 16) * d
  q5_1  d:f16 m:f16 | qh:u32 | ql:u4[32]                x = q * d + m
  q2_k  sc:u4u4[16] | q:u2[256] | d:f16 dmin:f16        x = (d * sc) * q - dmin * m   per 16
  q3_k  hmask[32] | q:u2[256] | sc:6bit[16] | d:f16     x = (d * (sc - 32)) * (q - 4 * !h)   per 16
  q4_k  d:f16 dmin:f16 | sc,m:6bit[8+8] | q:u4[256]     x = (d * sc) * q - dmin * m   per 32
  q5_k  d:f16 dmin:f16 | sc,m:6bit[8+8] | qh[32] | ql:u4[256]
  q6_k  ql:u4[256] | qh:u2[256] | sc:int8[16] | d:f16   x = (d * sc) * (q - 32)   per 16

4-bit codes come in runs of r bytes: the run's low nibbles are r values, its high nibbles the next
r (r = 16 for q4_0..q5_1, 32 for q4_k and q5_k, 64 for q6_k). 2-bit codes (q2_k and q3_k, the high
bits of q6_k) come in runs of 32 bytes, 4 consecutive groups of 32 values, low bits first. Bit
planes (q3_k's hmask, q5_k's qh) hold value 32 j + l in bit j of byte l; q5_0/q5_1's qh is a u32
whose bit j is value j. Scales apply to consecutive groups of 16 or 32 values.
"""

from __future__ import annotations

import numpy as np

from engine.quant import QTYPES

_CHUNK = 1 << 16  # blocks decoded at a time: bounds the temporaries


def fields(x: np.ndarray, width: int) -> np.ndarray:
    """The 8/width bit fields of each byte of x [..., m], low bits first: [..., 8/width, m] uint8."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)
    return (x[..., None, :] >> shifts[:, None]) & np.uint8((1 << width) - 1)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 at byte `at` of each block, as float32 [n, 1]."""
    return np.ascontiguousarray(b[:, at : at + 2]).view(np.float16).astype(np.float32)


def _f(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32)


def _nibbles(b: np.ndarray, run: int = 16) -> np.ndarray:
    # [n, run * g] bytes -> [n, 2 * run * g] codes: each run's low nibbles, then its high nibbles
    n = b.shape[0]
    return fields(b.reshape(n, -1, run), 4).reshape(n, -1)


def _q8_0(b):
    return _f(b[:, 2:].view(np.int8)) * _f16(b, 0)


def _q4_0(b):
    return _f(_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)) * _f16(b, 0)


def _q4_1(b):
    return _f(_nibbles(b[:, 4:])) * _f16(b, 0) + _f16(b, 2)


def _five_bit(b, at):
    # qh (u32 little-endian, bit j -> value j) above the nibbles that follow it
    high = np.unpackbits(b[:, at : at + 4], axis=1, bitorder="little")
    return _nibbles(b[:, at + 4 :]) | (high << np.uint8(4))


def _q5_0(b):
    return _f(_five_bit(b, 2).astype(np.int8) - np.int8(16)) * _f16(b, 0)


def _q5_1(b):
    return _f(_five_bit(b, 4)) * _f16(b, 0) + _f16(b, 2)


def _crumbs(b: np.ndarray) -> np.ndarray:
    # [n, 64] bytes -> [n, 256] 2-bit codes: 2 runs of 32 bytes, each 4 groups of 32 values
    n = b.shape[0]
    return fields(b.reshape(n, 2, 32), 2).reshape(n, 256)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # q4_k/q5_k: 12 bytes -> 8 six-bit scales and 8 six-bit mins
    lo_sc, lo_m, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo_sc & 63, (mix & 15) | ((lo_sc >> 6) << 4)], axis=1)
    m = np.concatenate([lo_m & 63, (mix >> 4) | ((lo_m >> 6) << 4)], axis=1)
    return sc, m


def _per(x: np.ndarray, n: int, groups: int) -> np.ndarray:
    # [n, groups] -> [n, groups, 1] to scale groups of 256/groups values
    return x.reshape(n, groups, 1)


def _q2_k(b):
    n = b.shape[0]
    sc = b[:, 0:16]
    scale = _per(_f16(b, 80) * _f(sc & 15), n, 16)
    low = _per(_f16(b, 82) * _f(sc >> 4), n, 16)
    q = _f(_crumbs(b[:, 16:80])).reshape(n, 16, 16)
    return (scale * q - low).reshape(n, 256)


def _q3_k(b):
    n = b.shape[0]
    s = b[:, 96:108]
    six = fields(s[:, 0:8], 4).reshape(n, 16) | (fields(s[:, 8:12], 2).reshape(n, 16) << np.uint8(4))
    scale = _per(_f16(b, 108) * _f(six.astype(np.int8) - np.int8(32)), n, 16)
    h = fields(b[:, 0:32], 1).reshape(n, 256)  # bit j of byte l -> value 32 j + l
    q = _crumbs(b[:, 32:96]).astype(np.int8) - ((h ^ np.uint8(1)) << np.uint8(2)).astype(np.int8)
    return (scale * _f(q).reshape(n, 16, 16)).reshape(n, 256)


def _k_affine(b, q):
    n = b.shape[0]
    sc, m = _k_scales(b[:, 4:16])
    scale = _per(_f16(b, 0) * _f(sc), n, 8)
    low = _per(_f16(b, 2) * _f(m), n, 8)
    return (scale * _f(q).reshape(n, 8, 32) - low).reshape(n, 256)


def _q4_k(b):
    return _k_affine(b, _nibbles(b[:, 16:144], 32))


def _q5_k(b):
    n = b.shape[0]
    high = fields(b[:, 16:48], 1).reshape(n, 256)
    return _k_affine(b, _nibbles(b[:, 48:176], 32) | (high << np.uint8(4)))


def _q6_k(b):
    n = b.shape[0]
    low = _nibbles(b[:, 0:128], 64)
    high = fields(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 256)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    scale = _per(_f16(b, 208) * _f(b[:, 192:208].view(np.int8)), n, 16)
    return (scale * _f(q).reshape(n, 16, 16)).reshape(n, 256)


DECODERS = {
    "q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1,
    "q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k,
}


def dequantize_blocks(data: np.ndarray, qtype: str) -> np.ndarray:
    """float32 [rows, cols] of one matrix's uint8 blocks [rows, cols // block * type_size]."""
    q = QTYPES[qtype]
    rows = data.shape[0]
    blocks = data.reshape(-1, q.type_size)
    out = np.empty((blocks.shape[0], q.block), np.float32)
    decode = DECODERS[qtype]
    for i in range(0, len(blocks), _CHUNK):
        out[i : i + _CHUNK] = decode(blocks[i : i + _CHUNK])
    return out.reshape(rows, -1)
