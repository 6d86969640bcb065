"""Open a GGUF file safely: every count, length and tensor range is bounded by the file size first."""

from __future__ import annotations

import math
import mmap
import os
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from engine.errors import GDecodeError

# value type -> struct format of one scalar
_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_DEPTH = 2  # an array of arrays is legal; deeper nesting occurs in no model
_DEFAULT_ALIGNMENT = 32


class _Scan:
    """A bounds-checked walk over the header: raises GDecodeError at the first value that cannot fit."""

    def __init__(self, data, size: int, source: str):
        self.data, self.size, self.source, self.pos = data, size, source, 0

    def fail(self, what: str):
        raise GDecodeError(f"{self.source}: corrupt GGUF header ({what})")

    def need(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            raise GDecodeError(
                f"{self.source}: truncated or corrupt GGUF file ({what} needs {n} bytes at offset {self.pos}, "
                f"the file has {self.size})"
            )

    def unpack(self, fmt: str, what: str):
        n = struct.calcsize("<" + fmt)
        self.need(n, what)
        v = struct.unpack_from("<" + fmt, self.data, self.pos)[0]
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.unpack("Q", what)
        self.need(n, what)
        raw = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")

    def value(self, vtype: int, what: str, depth: int = 0):
        try:
            vtype = GGUFValueType(vtype)
        except ValueError:
            self.fail(f"{what} has unknown value type {vtype}")
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype], what)
        if vtype == GGUFValueType.STRING:
            return self.string(what)
        if depth >= _MAX_DEPTH:
            self.fail(f"{what} nests arrays too deeply")
        itype = self.unpack("I", what)
        count = self.unpack("Q", what)
        scalar = _SCALARS.get(itype)
        # bound the count by the smallest encoding of one item before reading any
        self.need(count * (struct.calcsize("<" + scalar) if scalar else 8), f"{what} ({count} items)")
        if scalar:
            fmt = f"<{count}{scalar}"
            values = list(struct.unpack_from(fmt, self.data, self.pos))
            self.pos += struct.calcsize(fmt)
            return values
        return [self.value(itype, what, depth + 1) for _ in range(count)]


def scan_header(data, size: int, source: str) -> tuple[dict, list[tuple], int]:
    """Metadata, tensor infos (name, dims, type, offset) and the data start of a GGUF image of size bytes.

    Every length is checked against the bytes that remain, so a corrupt count fails at once instead
    of allocating; tensor data must be laid out as llama.cpp requires (in order, aligned, inside the file).
    """
    s = _Scan(data, size, source)
    if s.unpack("4s", "magic") != b"GGUF":
        s.fail("bad magic")
    version = s.unpack("I", "version")
    if version not in (2, 3):
        raise GDecodeError(f"{source}: GGUF version {version} is not supported (supported: 2, 3)")
    n_tensors = s.unpack("Q", "tensor count")
    n_kv = s.unpack("Q", "metadata count")
    s.need(n_kv * 13, f"{n_kv} metadata entries")  # key length, type, one byte of value
    meta: dict = {}
    for _ in range(n_kv):
        key = s.string("metadata key")
        if key in meta:
            s.fail(f"duplicate metadata key {key}")
        meta[key] = s.value(s.unpack("I", f"type of {key}"), key)
    s.need(n_tensors * 24, f"{n_tensors} tensor infos")  # name length, dims count, type, offset
    infos, names = [], set()
    for _ in range(n_tensors):
        name = s.string("tensor name")
        if name in names:
            s.fail(f"duplicate tensor {name}")
        names.add(name)
        n_dims = s.unpack("I", f"dimensions of {name}")
        if not 1 <= n_dims <= _MAX_DIMS:
            s.fail(f"tensor {name} has {n_dims} dimensions (at most {_MAX_DIMS})")
        dims = [s.unpack("Q", f"dimensions of {name}") for _ in range(n_dims)]
        raw_type = s.unpack("I", f"type of {name}")
        offset = s.unpack("Q", f"offset of {name}")
        infos.append((name, dims, raw_type, offset))
    alignment = meta.get("general.alignment", _DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        s.fail(f"general.alignment {alignment!r} is not a power of two")
    start = -(-s.pos // alignment) * alignment
    expected = 0
    for name, dims, raw_type, offset in infos:
        try:
            qtype = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            s.fail(f"tensor {name} has unknown type {raw_type}")
        if any(d < 1 for d in dims):
            s.fail(f"tensor {name} has a zero dimension {dims}")
        if dims[0] % block:
            s.fail(f"tensor {name}: row of {dims[0]} values is not a whole number of {qtype.name} blocks of {block}")
        n_bytes = math.prod(dims) // block * type_size
        if offset != expected:
            s.fail(f"tensor {name} data at offset {offset}, expected {expected} (tensors out of order or overlapping)")
        if start + offset + n_bytes > size:
            raise GDecodeError(
                f"{source}: truncated GGUF file (tensor {name} ends at byte {start + offset + n_bytes}, "
                f"the file has {size})"
            )
        expected = offset + -(-n_bytes // alignment) * alignment
    return meta, infos, start


def open_gguf(path: str | Path) -> GGUFReader:
    """A GGUFReader on path, or GDecodeError (one line) when the file is missing, not GGUF, cut short
    or corrupt; the header is validated against the file size before the reader allocates anything."""
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise GDecodeError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != b"GGUF":
                raise GDecodeError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
            size = os.fstat(f.fileno()).st_size
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                scan_header(m, size, source)
        reader = GGUFReader(path)
    except OSError as e:
        raise GDecodeError(f"{path}: cannot read ({e.strerror or e})") from None
    except GDecodeError:
        raise
    except Exception as e:  # the reader fails with assorted numpy errors on a damaged file
        raise GDecodeError(f"{path}: corrupt GGUF file ({type(e).__name__}: {str(e)[:120]})") from None
    return reader


def read_metadata(reader: GGUFReader) -> dict:
    """Key -> value (int, float, bool, str or list) of every metadata entry."""
    meta = {}
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            try:
                meta[key] = field.contents()
            except (UnicodeDecodeError, ValueError, IndexError):
                raise GDecodeError(f"corrupt GGUF metadata value {key}") from None
    return meta
