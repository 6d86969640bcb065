"""The prefill's slicing of block-format matrices (graphs/dequant_gemm.py): slices cover the rows in
order within their byte budget, aligned to whole GEMM tiles where they can be, and each slice's
pieces name the right rows of the right parts of a stack."""

import math

import numpy as np
import pytest

from graphs.dequant_gemm import SLICE_ALIGN, pieces, slice_rows
from kernels.prefill_ops import dequant_items
from kernels.tuning import PrefillTuning


def cases(seed: int, count: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(1, 40000))
        k = int(rng.choice([96, 256, 896, 4096, 14336]))
        rows = int(rng.integers(1, 3 * n))
        yield n, k, 2 * k * rows + int(rng.integers(0, 2 * k)), int(rng.choice([1, 16, SLICE_ALIGN]))


@pytest.mark.parametrize("seed", range(4))
def test_slices_cover_the_rows_within_the_budget(seed):
    for n, k, nbytes, align in cases(seed, 500):
        got = slice_rows(n, k, nbytes, align)
        cap = nbytes // (2 * k)
        assert got[0][0] == 0 and got[-1][1] == n
        assert all(a1 == b0 for (_, a1), (b0, _) in zip(got, got[1:], strict=False))
        sizes = [b - a for a, b in got]
        assert min(sizes) >= 1 and max(sizes) <= max(cap, 1) or len(got) == 1
        if cap >= n:
            assert got == [(0, n)]
            continue
        aligned = cap - cap % align if cap >= align else max(cap, 1)
        assert len(got) == math.ceil(n / aligned), (n, k, nbytes, align)
        if cap >= align:
            assert all(s % align == 0 for s in sizes[:-1])
        assert sizes[-1] <= sizes[0]


def test_slices_of_zero_bytes_are_the_whole_matrix():
    assert slice_rows(28672, 4096, 0) == [(0, 28672)]
    assert slice_rows(5, 4096, 1) == [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]


def test_llama3_8b_slices_at_the_default_budget():
    budget = PrefillTuning().dequant_slice
    got = slice_rows(28672, 4096, budget)
    assert all(b - a == got[0][1] for a, b in got) and sum(b - a for a, b in got) == 28672
    assert 2 * got[0][1] * 4096 <= budget and got[0][1] % SLICE_ALIGN == 0


@pytest.mark.parametrize("seed", range(3))
def test_pieces_name_every_row_of_a_slice_once(seed):
    rng = np.random.default_rng(100 + seed)
    for _ in range(300):
        sizes = rng.integers(1, 300, int(rng.integers(1, 5)))
        offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)]))
        n = offsets[-1]
        a = int(rng.integers(0, n))
        b = int(rng.integers(a + 1, n + 1))
        rows, at = [], 0
        for part, r0, count, s in pieces(offsets, a, b):
            assert s == at and 0 <= r0 and r0 + count <= offsets[part + 1] - offsets[part]
            rows.extend(range(offsets[part] + r0, offsets[part] + r0 + count))
            at += count
        assert rows == list(range(a, b))


def test_items_scale_with_the_chunk():
    assert [dequant_items(f, 4) for f in ("q8_0", "q4_k", "q6_k", "q2_k", "q3_k")] == [8, 4, 4, 2, 2]
    assert dequant_items("q2_k", 1) == 1
