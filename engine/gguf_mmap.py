"""A GGUF file's metadata and tensor table, read in one pass; tensor data stay memory-mapped.

The same values as gguf.GGUFReader gives (metadata as read_metadata returns it, tensors as
ReaderTensor), several times faster on large vocabularies: string arrays are decoded in one loop
rather than one numpy view per string.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, ReaderTensor
from gguf import GGMLQuantizationType as GT

from engine.errors import GDecodeError, not_a_file

# GGUF value type -> struct format (8: string, 9: array)
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_TYPED = {GT.F32: np.float32, GT.F16: np.float16}  # as GGUFReader: other types are bytes, rows first


class _Corrupt(Exception):
    pass


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.at = buf, 0

    def need(self, n: int, what: str):
        # every count is bounded by the bytes left before anything is allocated for it
        if self.at + n > len(self.buf):
            raise _Corrupt(f"{what} would need at least {n} bytes at offset {self.at}, past the end of the file")

    def take(self, fmt: str):
        v = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.take("Q")
        if self.at + n > len(self.buf):
            raise _Corrupt("a string runs past the end of the file")
        s = str(self.buf[self.at : self.at + n], "utf-8")
        self.at += n
        return s

    def value(self, kind: int):
        if kind in _SCALAR:
            return self.take(_SCALAR[kind])
        if kind == 8:
            return self.string()
        if kind != 9:
            raise _Corrupt(f"unknown metadata value type {kind}")
        sub, n = self.take("I"), self.take("Q")
        self.need(n * (np.dtype(_NUMPY[sub]).itemsize if sub in _NUMPY else 8), f"an array of {n} items")
        if sub in _NUMPY:
            size = np.dtype(_NUMPY[sub]).itemsize * n
            if self.at + size > len(self.buf):
                raise _Corrupt("an array runs past the end of the file")
            out = np.frombuffer(self.buf, _NUMPY[sub], n, self.at).tolist()
            self.at += size
            return out
        if sub == 8:
            return [self.string() for _ in range(n)]
        if sub == 9:
            raise _Corrupt("arrays of arrays are not supported")
        return [self.value(sub) for _ in range(n)]


@dataclass
class GGUFFile:
    path: Path
    meta: dict  # key -> value (str, int, float, bool or list)
    tensors: dict[str, ReaderTensor]  # in file order


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header; GDecodeError (one line, naming the file) on any problem."""
    path = Path(path)
    if not path.is_file():
        raise not_a_file(path, "GGUF") if path.exists() else GDecodeError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GDecodeError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    mm = np.memmap(path, mode="r")
    buf = memoryview(mm)
    try:
        return _parse(path, mm, buf, size)
    except (_Corrupt, struct.error, UnicodeDecodeError, ValueError, RecursionError) as e:
        why = f": {e}" if isinstance(e, _Corrupt) else ""
        raise GDecodeError(f"{path}: truncated or corrupt GGUF file ({size} bytes){why}") from None


def _parse(path: Path, mm: np.memmap, buf: memoryview, size: int) -> GGUFFile:
    c = _Cursor(buf)
    c.at = 4
    version = c.take("I")
    if version & 0xFFFF == 0:
        raise GDecodeError(f"{path}: big-endian GGUF files are not supported")
    if version not in (2, 3):
        raise GDecodeError(f"{path}: GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors, n_kv = c.take("Q"), c.take("Q")
    c.need(n_kv * 13, f"{n_kv} metadata entries")  # key length, value type, a one-byte value
    meta = {}
    for _ in range(n_kv):
        key = c.string()
        if key in meta:
            raise _Corrupt(f"metadata key {key} appears twice")
        meta[key] = c.value(c.take("I"))
    c.need(n_tensors * 32, f"{n_tensors} tensor infos")  # name length, one dimension, type, offset
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.take("I")
        if not 1 <= n_dims <= 4:  # GGML_MAX_DIMS
            raise _Corrupt(f"tensor {name} has {n_dims} dimensions")
        dims = [c.take("Q") for _ in range(n_dims)]
        if 0 in dims:
            raise _Corrupt(f"tensor {name} has an empty dimension {dims}")
        infos.append((name, dims, c.take("I"), c.take("Q")))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _Corrupt(f"general.alignment {align!r} is not a power of two")
    start = -(-c.at // align) * align
    tensors = {}
    expected = 0  # llama.cpp's rule: tensor data in order, each at the aligned end of the one before
    for name, dims, kind, offset in infos:
        try:
            qtype = GT(kind)
        except ValueError:
            raise GDecodeError(f"{path}: tensor {name} has unknown tensor type id {kind}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise GDecodeError(f"{path}: tensor {name} has rows of {dims[0]} values, not whole {qtype.name} "
                               f"blocks of {block}; its data does not match its shape")
        n = math.prod(dims)
        n_bytes = n // block * type_size
        begin = start + offset
        if offset != expected:
            raise _Corrupt(f"tensor {name} data at offset {offset}, expected {expected} (out of order or overlapping)")
        expected = offset + -(-n_bytes // align) * align
        if begin + n_bytes > size:
            raise GDecodeError(f"{path}: truncated GGUF file (tensor {name} runs past the end)")
        shape = tuple(reversed(dims))
        dtype = _TYPED.get(qtype)
        data = mm[begin : begin + n_bytes]
        if dtype is not None:
            data = data.view(dtype).reshape(shape)
        else:
            data = data.reshape(*shape[:-1], shape[-1] // block * type_size) if shape else data
        if name in tensors:
            raise _Corrupt(f"tensor {name} appears twice")
        tensors[name] = ReaderTensor(name, qtype, np.array(dims, np.uint64), n, n_bytes, begin, data, None)
    return GGUFFile(path, meta, tensors)
