"""The numpy emulation of the block-format GEMVs' int8 x (kernels.gemv_ops.quantize_x): no GPU needed.

Per block of 32 values, d = amax / 127 and q = rint(x * (1 / d)) in float32, ties to even. The GPU
tests compare the kernels against this emulation; here it is held to its definition.
"""

import numpy as np
import pytest

from kernels.gemv_ops import dequantize_x, quantize_x, xq_bytes


def test_matches_its_definition_on_random_blocks():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 32 * 40)) * np.exp(rng.standard_normal((5, 1)))).astype(np.float32)
    q, d = quantize_x(x)
    assert q.dtype == np.int8 and q.shape == x.shape and d.dtype == np.float32 and d.shape == (5, 40)
    b = x.reshape(5, 40, 32).astype(np.float64)
    amax = np.abs(b).max(axis=-1)
    assert np.array_equal(d, (amax / 127).astype(np.float32))  # one float32 rounding of amax / 127
    v = b / d[..., None].astype(np.float64)  # the exact quotient: q is within one rounding step of it
    qb = q.reshape(5, 40, 32).astype(np.float64)
    assert np.abs(qb - v).max() <= 0.5 + 1e-5
    assert np.abs(qb).max() <= 127
    # the largest value of each block lands on +-127
    top = np.take_along_axis(qb, np.abs(b).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    assert np.array_equal(np.abs(top), np.full((5, 40), 127.0))
    err = dequantize_x(q, d) - x
    assert (np.abs(err).reshape(5, 40, 32) <= d[..., None].astype(np.float64) * (0.5 + 1e-5)).all()


def test_ties_round_to_even_and_zero_blocks_stay_zero():
    x = np.zeros(64, np.float32)
    x[:6] = [127, 2.5, 3.5, -2.5, -0.5, 1.5]  # amax 127: d = 1, 1 / d = 1, x * (1 / d) exact
    q, d = quantize_x(x)
    assert d[0] == 1 and d[1] == 0
    assert q[:6].tolist() == [127, 2, 4, -2, 0, 2]
    assert not q[32:].any() and not q[6:32].any()


def test_scaled_block_keeps_its_integers():
    """x = s q0 for integers q0 with a largest |q0| of 127 and a power-of-two s: every step is exact."""
    rng = np.random.default_rng(3)
    q0 = rng.integers(-127, 128, size=(4, 32))
    q0[:, 5] = 127 * np.array([1, -1, 1, -1])
    x = (q0 * 2.0 ** rng.integers(-20, 20, size=(4, 1))).astype(np.float32)
    q, d = quantize_x(x)
    assert np.array_equal(q.astype(np.int64), q0)
    assert np.array_equal(dequantize_x(q, d), x.astype(np.float64))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_makes_its_block_nan_and_leaves_the_others(bad):
    rng = np.random.default_rng(11)
    x = rng.standard_normal(32 * 4).astype(np.float32)
    clean_q, clean_d = quantize_x(x)
    x[32 + 17] = bad
    with np.errstate(all="raise"):  # and no numpy warning on the way
        q, d = quantize_x(x)
    assert np.isnan(d[1]) and not q[32:64].any()
    assert np.array_equal(np.delete(d, 1), np.delete(clean_d, 1))
    assert np.array_equal(np.delete(q, np.s_[32:64]), np.delete(clean_q, np.s_[32:64]))
    assert np.isnan(dequantize_x(q, d)[32:64]).all()  # every product with the block is NaN


@pytest.mark.parametrize("k", [32, 96, 4096, 14336])
def test_shared_memory_of_int8_x(k):
    assert xq_bytes(k) == k + k // 32 * 8
