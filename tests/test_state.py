"""The decode state: the C struct and STATE_DTYPE agree field for field, and one host function writes it."""

import re
from pathlib import Path

import numpy as np
import pytest

from engine.sampling import SamplingParams
from graphs.buffers import STATE_COUNTS, STATE_DTYPE, STATE_REPEAT, repeat_window, state_record

ROOT = Path(__file__).resolve().parent.parent
C_TYPES = {"int": "<i4", "unsigned": "<u4", "float": "<f4", "unsigned long long": "<u8"}


def c_layout(text: str) -> list[tuple[str, str, int]]:
    """(name, numpy type, offset) of each DecodeState field, with C's natural alignment."""
    body = re.search(r"struct DecodeState \{(.*?)\};", text, re.S).group(1)
    fields, at = [], 0
    for ctype, name in re.findall(r"^\s*([a-z ]+?)\s+(\w+);", body, re.M):
        dt = np.dtype(C_TYPES[ctype])
        at = -(-at // dt.itemsize) * dt.itemsize
        fields.append((name, dt.str, at))
        at += dt.itemsize
    return fields


def test_struct_and_dtype_agree():
    text = (ROOT / "kernels" / "common.cuh").read_text()
    fields = c_layout(text)
    assert [(n, STATE_DTYPE.fields[n][0].str, STATE_DTYPE.fields[n][1]) for n in STATE_DTYPE.names] == fields
    size = int(re.search(r"static_assert\(sizeof\(DecodeState\) == (\d+)", text).group(1))
    assert size == STATE_DTYPE.itemsize == fields[-1][2] + 4
    for name, value in (("STATE_REPEAT", STATE_REPEAT), ("STATE_COUNTS", STATE_COUNTS)):
        assert re.search(rf"#define {name} {value}u", text)


def test_sizeof_is_checked_by_the_compiler():
    from kernels.compiler import compile_kernel, declared_defines

    compile_kernel("sample", declared_defines("sample")[0], "sm_90")  # raises if the static_asserts fail


def test_no_raw_state_writes_outside_the_writer():
    # the state is written whole by DecodeBuffers.write_state; nobody slices it by byte offset
    for path in [*ROOT.glob("engine/**/*.py"), *ROOT.glob("graphs/*.py"), *ROOT.glob("cli/*.py")]:
        text = path.read_text()
        assert not re.search(r"\.state\[", text), path
        if path.name != "buffers.py":
            assert "STATE_DTYPE" not in text, path


def test_state_record_from_params():
    p = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.25, repeat_penalty=1.2, repeat_last_n=-1,
                       presence_penalty=0.5, frequency_penalty=-0.25, logprobs=3)
    st = state_record(p, 2**64 + 7, token=11, pos=3, prompt_len=9, ring_mask=63)[0]
    assert (st["token"], st["pos"], st["prompt_len"], st["ring_mask"], st["seed"], st["step"]) == (11, 3, 9, 63, 7, 0)
    assert st["temperature"] == np.float32(0.7) and st["top_k"] == 5 and st["top_p"] == np.float32(0.9)
    assert st["min_p_log"] == np.float32(np.log(0.25))
    assert (st["repeat_penalty"], st["repeat_last_n"]) == (np.float32(1.2), -1)
    assert (st["presence_penalty"], st["frequency_penalty"], st["logprobs"]) == (0.5, -0.25, 3)
    assert st["flags"] == STATE_REPEAT | STATE_COUNTS


@pytest.mark.parametrize("params,want", [
    (None, dict(temperature=0, logprobs=-1, flags=0)),
    (SamplingParams(temperature=1e-9, top_k=2**40), dict(temperature=0, top_k=2**31 - 1, flags=0)),
    (SamplingParams(min_p=0.0), dict(min_p_log=-np.inf, repeat_penalty=1, repeat_last_n=64)),
    (SamplingParams(repeat_penalty=1.5, repeat_last_n=0), dict(flags=0)),
    (SamplingParams(frequency_penalty=0.1), dict(flags=STATE_COUNTS)),
])
def test_state_record_defaults(params, want):
    st = state_record(params, 0, token=1, pos=0, prompt_len=1, ring_mask=0)[0]
    for k, v in want.items():
        assert st[k] == v, k


def test_repeat_window():
    ids = np.arange(10, 20, dtype=np.int32)
    assert repeat_window(ids, 4, 3).tolist() == [12, 13, 14]
    assert repeat_window(ids, 1, 3).tolist() == [10, 11]
    assert repeat_window(ids, 4, -1).tolist() == [10, 11, 12, 13, 14]
    assert repeat_window(ids, 4, 0).tolist() == []


def test_sampler_shape_and_scratch():
    from engine.sampling import MAX_LOGPROBS
    from kernels import ops

    assert ops.SAMPLE_MAX_LOGPROBS == MAX_LOGPROBS
    assert ops.sample_shape(151936, 132) == (99, 3)
    assert ops.sample_shape(320, 132) == (1, 1)
    assert ops.sample_shape(262144, 132) == (128, 4)
    blocks, per = ops.sample_shape(520000, 132)
    assert blocks <= 128 and blocks * per * ops.SAMPLE_BLOCK >= 520000
    with pytest.raises(ValueError):
        ops.sample_shape(10**6, 132)
    for vocab in (320, 4097, 49152, 128256, 151936):
        blocks, per = ops.sample_shape(vocab, 78)
        assert blocks <= 78 and (blocks - 1) * per * ops.SAMPLE_BLOCK < vocab <= blocks * per * ops.SAMPLE_BLOCK
