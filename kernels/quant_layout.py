"""The repacked layout the quantized GEMV kernels read, and its numpy emulation.

A ggml block stores its scales beside its quants, in blocks of 18 to 210 bytes that no 16-byte
load can follow. At load each row is repacked into four planes, one after the other:

    Q  16 bytes per chunk: the low bits of `chunk` weights (4-bit: 32, 2-bit: 64, 8-bit: 16)
    H  the high bits of the chunk's weights (Q5_*: 4 bytes, Q3_K: 8, Q6_K: 8, else none)
    S  the chunk's sub-block scales as whole bytes (K-quants only; the 6-bit ones unpacked)
    D  the ggml block's fp16 scale(s), as stored (d; or d and m; or d and dmin)

Each row is padded to 16 bytes, so a warp streams a row's chunks with coalesced 16-byte loads. A
row of whole groups of 4 passes of 32 chunks (a warp's 32 lanes take chunk 32 p + l in pass p) is
lane-major: in each group its H and S entries go by lane, then pass (chunk 32 p + l at entry
128 (p // 4) + 4 l + p % 4), and its D entries by lane group, then pass (the block of chunk 32 p + l
at entry (128 / c) (p // 4) + 4 (l // c) + p % 4, c chunks per block), so the side bytes of the
chunks that one lane streams in 2 or 4 passes lie together and come in one load.
Inside a chunk the weights are ordered for the unpacking the kernels do: in 32-bit word i of Q,
byte b holds, for 4-bit formats, weight 8i + b in its low nibble and 8i + 4 + b in its high
nibble; for 2-bit formats weight 16i + 4s + b at bits 2s; for Q8_0 weight 4i + b. The bits are
ggml's own, only moved, and every fp16 scale is kept as it was: the values the kernels multiply by
equal ggml's dequantization exactly (`dequantize` emulates the kernels' arithmetic).

Every function takes an array module `xp` (numpy or cupy), so the same code repacks on the host
and on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Format:
    name: str  # ggml type name in lower case: q4_k
    block: int  # weights per ggml block
    block_bytes: int  # bytes per ggml block
    chunk: int  # weights per 16-byte chunk of the Q plane
    bits: int  # low bits per weight in Q (2, 4 or 8)
    h_bytes: int  # H bytes per chunk
    s_bytes: int  # S bytes per chunk
    d_bytes: int  # D bytes per ggml block

    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block


FORMATS = {f.name: f for f in [
    Format("q8_0", 32, 34, 16, 8, 0, 0, 2),
    Format("q4_0", 32, 18, 32, 4, 0, 0, 2),
    Format("q4_1", 32, 20, 32, 4, 0, 0, 4),
    Format("q5_0", 32, 22, 32, 4, 4, 0, 2),
    Format("q5_1", 32, 24, 32, 4, 4, 0, 4),
    Format("q2_k", 256, 84, 64, 2, 0, 4, 4),
    Format("q3_k", 256, 110, 64, 2, 8, 4, 2),
    Format("q4_k", 256, 144, 32, 4, 0, 2, 4),
    Format("q5_k", 256, 176, 32, 4, 4, 2, 4),
    Format("q6_k", 256, 210, 32, 4, 8, 2, 2),
]}


def fmt_of(qtype) -> Format:
    """The Format of a ggml type given as a name ("Q4_K", "q4_k") or a GGMLQuantizationType."""
    name = getattr(qtype, "name", qtype)
    try:
        return FORMATS[str(name).lower()]
    except KeyError:
        raise ValueError(f"no GPU kernels for tensor type {name} (supported: {', '.join(FORMATS)})") from None


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


@dataclass(frozen=True)
class RowLayout:
    """Byte offsets of the planes inside one repacked row of `cols` weights."""

    fmt: Format
    cols: int
    chunks: int
    blocks: int
    h_off: int
    s_off: int
    d_off: int
    row_bytes: int

    @property
    def lane_major(self) -> bool:
        """Whole groups of 4 passes of 32 chunks: the side planes ordered by lane, then pass, per group."""
        return self.chunks % 128 == 0

    def side_order(self, xp=np):
        """entry[k]: where chunk k's H and S bytes sit in their planes."""
        k = np.arange(self.chunks)
        p, lane = k // 32, k % 32
        return xp.asarray(p // 4 * 128 + lane * 4 + p % 4 if self.lane_major else k)

    def d_order(self, xp=np):
        """entry[b]: where ggml block b's D bytes sit in its plane."""
        b = np.arange(self.blocks)
        if not self.lane_major:
            return xp.asarray(b)
        groups = 32 // (self.fmt.block // self.fmt.chunk)  # lane groups: a block's chunks share one
        p, g = b // groups, b % groups
        return xp.asarray(p // 4 * (4 * groups) + g * 4 + p % 4)


def row_layout(fmt: Format | str, cols: int) -> RowLayout:
    f = fmt_of(fmt) if not isinstance(fmt, Format) else fmt
    if cols % f.block:
        raise ValueError(f"{f.name} rows must be a multiple of {f.block} weights, got {cols}")
    ch, nb = cols // f.chunk, cols // f.block
    h_off = 16 * ch
    s_off = h_off + f.h_bytes * ch
    d_off = _align(s_off + f.s_bytes * ch, 4)
    return RowLayout(f, cols, ch, nb, h_off, s_off, d_off, _align(d_off + f.d_bytes * nb, 16))


def ggml_row_bytes(fmt: Format | str, cols: int) -> int:
    f = fmt_of(fmt) if not isinstance(fmt, Format) else fmt
    return cols // f.block * f.block_bytes


# --- ggml blocks -> fields ------------------------------------------------------------------------
# fields: q [rows, cols] low bits (uint8), h [rows, cols] high bits or None, s [rows, chunks, s_bytes]
# scale bytes or None, d [rows, blocks, d_bytes] fp16 scale bytes

def _bits(v, shifts, xp):
    """v [..., n] uint8 -> [..., len(shifts), n]: (v >> shift) for each shift."""
    sh = xp.asarray(np.asarray(shifts, np.uint8)).reshape(len(shifts), 1)
    return v[..., None, :] >> sh


def _kquant_scales(sc12, xp):
    """ggml's 12 packed bytes -> (scale [.., 8], min [.., 8]) 6-bit values (Q4_K, Q5_K)."""
    d, m, md = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    scale = xp.concatenate([d & 63, (md & 15) | ((d >> 6) << 4)], axis=-1)
    mins = xp.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=-1)
    return scale, mins


def _q3_scales(sc12, xp):
    """Q3_K's 12 packed bytes -> 16 signed scales (int8, already minus 32)."""
    lo = _bits(sc12[..., 0:8], [0, 4], xp).reshape(*sc12.shape[:-1], 16) & 15
    hi = _bits(sc12[..., 8:12], [0, 2, 4, 6], xp).reshape(*sc12.shape[:-1], 16) & 3
    return ((lo | (hi << 4)).astype(xp.int16) - 32).astype(xp.int8)


def ggml_fields(fmt: Format, raw, rows: int, cols: int, xp=np):
    """Split ggml blocks raw [rows, cols // block * block_bytes] (uint8) into their fields."""
    b = raw.reshape(rows, cols // fmt.block, fmt.block_bytes)
    n = fmt.name
    h = s = None
    if n == "q8_0":
        d, q = b[..., 0:2], b[..., 2:34]
    elif n in ("q4_0", "q4_1", "q5_0", "q5_1"):
        dn = 2 if n in ("q4_0", "q5_0") else 4
        hn = 4 if n.startswith("q5") else 0
        d, qs = b[..., 0:dn], b[..., dn + hn:dn + hn + 16]
        q = _bits(qs, [0, 4], xp) & 15  # weight 16 t + i
        if hn:
            qh = b[..., dn:dn + 4]
            h = _bits(qh, range(8), xp) & 1  # [.., 8 (bit j), 4 (byte)] -> weight 8 byte + j
            h = h.transpose(0, 1, 3, 2)
    elif n in ("q2_k", "q3_k"):
        if n == "q2_k":
            s, qs, d = b[..., 0:16], b[..., 16:80], b[..., 80:84]
        else:
            hm, qs, sc, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], b[..., 108:110]
            s = _q3_scales(sc, xp).view(xp.uint8)
            h = _bits(hm, range(8), xp) & 1  # weight 32 j + i
        q = _bits(qs.reshape(rows, -1, 2, 32), [0, 2, 4, 6], xp) & 3  # weight 128 half + 32 s + i
    elif n in ("q4_k", "q5_k"):
        d, sc = b[..., 0:4], b[..., 4:16]
        qs = b[..., 48:176] if n == "q5_k" else b[..., 16:144]
        scale, mins = _kquant_scales(sc, xp)
        s = xp.stack([scale, mins], axis=-1)  # (scale, min) per sub-block of 32
        q = _bits(qs.reshape(rows, -1, 4, 32), [0, 4], xp) & 15  # weight 64 g + 32 t + i
        if n == "q5_k":
            h = _bits(b[..., 16:48], range(8), xp) & 1  # weight 32 j + i
    elif n == "q6_k":
        ql, qh, s, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], b[..., 208:210]
        q = _bits(ql.reshape(rows, -1, 2, 64), [0, 4], xp) & 15  # weight 128 half + 64 t + i
        h = _bits(qh.reshape(rows, -1, 2, 32), [0, 2, 4, 6], xp) & 3  # weight 128 half + 32 s + i
    else:  # pragma: no cover - FORMATS lists the names above
        raise ValueError(n)
    q = q.reshape(rows, cols)
    h = None if h is None else h.reshape(rows, cols)
    lay = row_layout(fmt, cols)
    s = None if s is None else s.reshape(rows, lay.chunks, fmt.s_bytes)
    return q, h, s, d.reshape(rows, lay.blocks, fmt.d_bytes)


# --- fields <-> planes --------------------------------------------------------------------------

def _pack_q(fmt: Format, q, rows: int, ch: int, xp):
    if fmt.bits == 8:
        return q.reshape(rows, ch, 16)
    if fmt.bits == 4:
        v = q.reshape(rows, ch, 4, 2, 4)  # word i, half t, byte b: weight 8 i + 4 t + b
        return (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).astype(xp.uint8).reshape(rows, ch, 16)
    v = q.reshape(rows, ch, 4, 4, 4)  # word i, shift s, byte b: weight 16 i + 4 s + b
    packed = v[:, :, :, 0] | (v[:, :, :, 1] << 2) | (v[:, :, :, 2] << 4) | (v[:, :, :, 3] << 6)
    return packed.astype(xp.uint8).reshape(rows, ch, 16)


def _unpack_q(fmt: Format, qp, rows: int, ch: int, xp):
    v = qp.reshape(rows, ch, 4, 4)
    if fmt.bits == 8:
        return qp.reshape(rows, ch * 16)
    if fmt.bits == 4:
        return xp.stack([v & 15, v >> 4], axis=3).reshape(rows, ch * 32)
    return xp.stack([(v >> (2 * s)) & 3 for s in range(4)], axis=3).reshape(rows, ch * 64)


# H plane: where the high bit(s) of chunk weight (word i, half/shift t, byte b) go: (word of H, shift)
def _h_slots(fmt: Format):
    if fmt.name in ("q5_0", "q5_1", "q5_k"):  # 1 bit, 32 weights: bit 8 b + 2 i + t of one u32
        return [(i, t, 0, 2 * i + t) for i in range(4) for t in range(2)], 2, 1
    if fmt.name == "q6_k":  # 2 bits, 32 weights: u32 i // 2, bits 8 b + 2 (2 (i % 2) + t)
        return [(i, t, i // 2, 2 * (2 * (i % 2) + t)) for i in range(4) for t in range(2)], 2, 3
    if fmt.name == "q3_k":  # 1 bit, 64 weights: u32 i // 2, bit 8 b + 4 (i % 2) + s
        return [(i, s, i // 2, 4 * (i % 2) + s) for i in range(4) for s in range(4)], 4, 1
    return [], 0, 0


def _pack_h(fmt: Format, h, rows: int, ch: int, xp):
    slots, per_word, mask = _h_slots(fmt)
    v = h.reshape(rows, ch, 4, per_word, 4)
    out = xp.zeros((rows, ch, fmt.h_bytes // 4, 4), xp.uint8)
    for i, t, word, shift in slots:
        out[:, :, word] |= ((v[:, :, i, t] & mask) << shift).astype(xp.uint8)
    return out.reshape(rows, ch, fmt.h_bytes)


def _unpack_h(fmt: Format, hp, rows: int, ch: int, xp):
    slots, per_word, mask = _h_slots(fmt)
    v = hp.reshape(rows, ch, fmt.h_bytes // 4, 4)
    out = xp.zeros((rows, ch, 4, per_word, 4), xp.uint8)
    for i, t, word, shift in slots:
        out[:, :, i, t] = ((v[:, :, word] >> shift) & mask).astype(xp.uint8)
    return out.reshape(rows, ch * fmt.chunk)


def repack(fmt: Format | str, raw, rows: int, cols: int, xp=np):
    """ggml blocks raw [rows, cols // block * block_bytes] (uint8) -> repacked [rows, row_bytes] (uint8)."""
    f = fmt_of(fmt) if not isinstance(fmt, Format) else fmt
    lay = row_layout(f, cols)
    q, h, s, d = ggml_fields(f, xp.asarray(raw, dtype=xp.uint8), rows, cols, xp)
    out = xp.zeros((rows, lay.row_bytes), xp.uint8)
    ch = lay.chunks
    out[:, :lay.h_off] = _pack_q(f, q, rows, ch, xp).reshape(rows, -1)

    def place(plane, entry):  # plane [rows, n, bytes] -> entries in plane order, flat
        o = xp.empty_like(plane)
        o[:, entry] = plane
        return o.reshape(rows, -1)

    side = lay.side_order(xp)
    if f.h_bytes:
        out[:, lay.h_off:lay.s_off] = place(_pack_h(f, h, rows, ch, xp), side)
    if f.s_bytes:
        out[:, lay.s_off:lay.s_off + ch * f.s_bytes] = place(s, side)
    out[:, lay.d_off:lay.d_off + lay.blocks * f.d_bytes] = place(d, lay.d_order(xp))
    return out


def planes(fmt: Format | str, packed, rows: int, cols: int, xp=np):
    """The fields back out of a repacked matrix: (q, h, s, d) as `ggml_fields` gives them."""
    f = fmt_of(fmt) if not isinstance(fmt, Format) else fmt
    lay = row_layout(f, cols)
    p = xp.asarray(packed).reshape(rows, lay.row_bytes)
    ch = lay.chunks
    side = lay.side_order(xp)
    q = _unpack_q(f, p[:, :lay.h_off], rows, ch, xp)
    h = None
    if f.h_bytes:
        h = _unpack_h(f, p[:, lay.h_off:lay.s_off].reshape(rows, ch, f.h_bytes)[:, side], rows, ch, xp)
    s = p[:, lay.s_off:lay.s_off + ch * f.s_bytes].reshape(rows, ch, f.s_bytes)[:, side] if f.s_bytes else None
    d = p[:, lay.d_off:lay.d_off + lay.blocks * f.d_bytes].reshape(rows, lay.blocks, f.d_bytes)[:, lay.d_order(xp)]
    return q, h, s, d


def dequantize(fmt: Format | str, packed, rows: int, cols: int) -> np.ndarray:
    """float32 [rows, cols] from a repacked matrix, with the arithmetic of the kernels' dequantization.

    Each value is one exact product plus at most one rounding (what the kernels' fmaf gives): it
    equals gguf's dequantize bit for bit.
    """
    f = fmt_of(fmt) if not isinstance(fmt, Format) else fmt
    q, h, s, d = planes(f, np.asarray(packed), rows, cols)
    f32 = np.float32
    per_block = f.block
    half = np.ascontiguousarray(d).view(np.float16).astype(f32)  # [rows, blocks, 1 or 2]
    d0 = np.repeat(half[..., 0], per_block, axis=1)
    d1 = np.repeat(half[..., 1], per_block, axis=1) if half.shape[-1] > 1 else None
    n = f.name
    if n == "q8_0":
        return q.view(np.int8).astype(f32) * d0
    if n in ("q4_0", "q5_0"):
        v = q | (h << 4) if h is not None else q
        return (v.astype(np.int16) - (16 if h is not None else 8)).astype(f32) * d0
    if n in ("q4_1", "q5_1"):
        v = q | (h << 4) if h is not None else q
        return v.astype(f32) * d0 + d1
    sub = 16 if n in ("q2_k", "q3_k", "q6_k") else 32
    if n in ("q4_k", "q5_k"):
        sc = np.repeat(s[..., 0].astype(f32), sub, axis=1)
        mn = np.repeat(s[..., 1].astype(f32), sub, axis=1)
        v = q | (h << 4) if h is not None else q
        return (d0 * sc) * v.astype(f32) - d1 * mn
    if n == "q2_k":
        b = s.reshape(rows, -1)
        sc = np.repeat((b & 15).astype(f32), sub, axis=1)
        mn = np.repeat((b >> 4).astype(f32), sub, axis=1)
        return (d0 * sc) * q.astype(f32) - d1 * mn
    sc = np.repeat(s.reshape(rows, -1).view(np.int8).astype(f32), sub, axis=1)
    if n == "q3_k":
        return (d0 * sc) * ((q | (h << 2)).astype(np.int16) - 4).astype(f32)
    return (d0 * sc) * ((q | (h << 4)).astype(np.int16) - 32).astype(f32)  # q6_k


def random_blocks(fmt: Format | str, rows: int, cols: int, xp=np, seed: int = 0, scale: float = 1.0):
    """Random ggml blocks [rows, cols // block * block_bytes] (uint8): random bits, finite fp16 scales.

    Any bits with finite scales make a valid block of these formats; the scales are drawn so that
    the weights stay within about +-scale.
    """
    f = fmt_of(fmt) if not isinstance(fmt, Format) else fmt
    rng = xp.random.RandomState(seed)
    nb = cols // f.block
    raw = rng.randint(0, 256, size=(rows, nb, f.block_bytes)).astype(xp.uint8)
    levels = 2 ** (f.bits + (2 if f.name == "q6_k" else 1 if f.h_bytes else 0))
    sub = {"q2_k": 15, "q3_k": 32, "q4_k": 63, "q5_k": 63, "q6_k": 64}.get(f.name, 1)
    for off, kind in _SCALES[f.name]:
        u = 0.5 + rng.random_sample((rows, nb, 1))
        if kind == "d":
            v = scale * 2 / levels / sub * u
        elif kind == "dmin":
            v = scale / sub * u
        else:  # the min of q4_1 / q5_1: about -scale
            v = -scale * u
        raw[..., off:off + 2] = v.astype(xp.float16).view(xp.uint8)
    return raw.reshape(rows, nb * f.block_bytes)


# byte offset and role of each fp16 scale of a ggml block
_SCALES = {
    "q8_0": [(0, "d")], "q4_0": [(0, "d")], "q5_0": [(0, "d")],
    "q4_1": [(0, "d"), (2, "m")], "q5_1": [(0, "d"), (2, "m")],
    "q2_k": [(80, "d"), (82, "dmin")], "q3_k": [(108, "d")], "q4_k": [(0, "d"), (2, "dmin")],
    "q5_k": [(0, "d"), (2, "dmin")], "q6_k": [(208, "d")],
}
