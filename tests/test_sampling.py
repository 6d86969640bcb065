"""Sampling parameters, the counter-based RNG and the sampler."""

import numpy as np
import pytest

from engine.errors import GDecodeError
from engine.sampling import SamplingParams, candidates, resolve_seed, rng_bits, rng_uniform, sample, uniform_from_bits

MASK = 2**64 - 1


def py_bits(seed, step, i):
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + i) & MASK
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def py_uniform(seed, step, i):
    # float32 round-to-nearest-even of (k + 0.5), then an exact scale, then the clamp
    k = py_bits(seed, step, i) >> 40
    return np.float32(min(float(np.float32(k + 0.5)) * 2.0**-24, 1.0 - 2.0**-24))


@pytest.mark.parametrize("seed,step", [(0, 0), (1, 0), (12345, 7), (MASK, MASK), (2**63 + 5, 2**40 + 3)])
def test_rng_matches_python_ints(seed, step):
    idx = np.array([0, 1, 2, 1000, 151935, 2**32 + 1, MASK], np.uint64)
    bits = rng_bits(seed, step, idx)
    assert bits.dtype == np.uint64
    assert [int(b) for b in bits] == [py_bits(seed, step, int(i)) for i in idx]
    u = rng_uniform(seed, step, idx)
    assert u.dtype == np.float32
    np.testing.assert_array_equal(u, [py_uniform(seed, step, int(i)) for i in idx])


def test_rng_known_values():
    # seed 1 and 2 at step 0 start splitmix64's published sequence for state 0
    assert int(rng_bits(1, 0, [0])[0]) == 0xE220A8397B1DCDAF
    assert int(rng_bits(2, 0, [0])[0]) == 0x6E789E6AA1B965F4
    assert int(rng_bits(3, 0, [0])[0]) == 0x06C45D188009454F
    assert int(rng_bits(0, 0, [0])[0]) == 0


def test_rng_is_deterministic_and_in_open_interval():
    a = rng_uniform(42, 3, np.arange(100_000))
    np.testing.assert_array_equal(a, rng_uniform(42, 3, np.arange(100_000)))
    assert (a > 0).all() and (a < 1).all()
    assert abs(a.mean() - 0.5) < 0.005
    assert not np.array_equal(a, rng_uniform(42, 4, np.arange(100_000)))
    assert not np.array_equal(a, rng_uniform(43, 3, np.arange(100_000)))


def test_uniform_ends():
    u = uniform_from_bits(np.array([0, (2**24 - 1) << 40, MASK], np.uint64))
    # (2^24 - 1) + 0.5 rounds up to 2^24 in float32; the clamp keeps u below 1
    assert u[0] == np.float32(2.0**-25)
    assert u[1] == u[2] == np.float32(1.0 - 2.0**-24)


def logits(rng, v=50, scale=3.0):
    return (rng.standard_normal(v) * scale).astype(np.float32)


def test_greedy_is_argmax_lowest_index_on_ties():
    z = np.array([1.0, 5.0, 2.0, 5.0], np.float32)
    assert sample(z, SamplingParams(temperature=0), 0, 0) == 1


def test_same_seed_same_tokens():
    rng = np.random.default_rng(0)
    rows = [logits(rng) for _ in range(64)]
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    a = [sample(r, p, i, 7) for i, r in enumerate(rows)]
    assert a == [sample(r, p, i, 7) for i, r in enumerate(rows)]
    assert a != [sample(r, p, i, 8) for i, r in enumerate(rows)]


def test_top_k_one_and_tiny_top_p_are_greedy():
    rng = np.random.default_rng(1)
    for step in range(50):
        z = logits(rng)
        best = sample(z, SamplingParams(temperature=0), step, 0)
        assert sample(z, SamplingParams(temperature=1.5, top_k=1, top_p=1.0), step, 3) == best
        assert sample(z, SamplingParams(temperature=1.5, top_k=0, top_p=1e-6), step, 3) == best


def test_candidates_top_k_keeps_ties_and_top_p_prefix():
    z = np.array([0.0, 3.0, 1.0, 3.0, 2.0, -1.0], np.float32)
    assert candidates(z, 2, 1.0).tolist() == [1, 3]
    assert candidates(z, 3, 1.0).tolist() == [1, 3, 4]
    assert candidates(z, 0, 1.0).tolist() == list(range(6))
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    # the two 3.0 logits hold p[1] + p[3]; asking for just that much keeps exactly them
    assert candidates(z, 0, float(p[1] + p[3]) * 0.999).tolist() == [1, 3]
    assert candidates(z, 0, float(p[1]) * 0.5).tolist() == [1]


def test_filtered_tokens_are_never_sampled():
    rng = np.random.default_rng(2)
    z = logits(rng, v=100)
    top5 = set(np.argsort(-z)[:5].tolist())
    p = SamplingParams(temperature=2.0, top_k=5, top_p=1.0)
    assert {sample(z, p, s, 11) for s in range(500)} <= top5


def test_empirical_distribution_follows_softmax():
    z = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    t = 0.7
    p = np.exp(z / t - (z / t).max())
    p /= p.sum()
    n = 20_000
    params = SamplingParams(temperature=t, top_k=0, top_p=1.0)
    counts = np.bincount([sample(z, params, s, 1234) for s in range(n)], minlength=z.size)
    chi2 = (((counts - n * p) ** 2) / (n * p)).sum()
    # 5 degrees of freedom: the 99.9% quantile is 20.5
    assert chi2 < 20.5, (counts, n * p)


def test_top_p_renormalises_over_the_nucleus():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=0.8)
    n = 10_000
    counts = np.bincount([sample(z, params, s, 99) for s in range(n)], minlength=4)
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / n - 0.625) < 0.02


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"temperature": float("inf")},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": -1},
        {"seed": 2**64},
        {"max_new_tokens": 0},
        {"stop": "abc"},
        {"stop": ("",)},
    ],
)
def test_bad_params_raise(kw):
    with pytest.raises(GDecodeError):
        SamplingParams(**kw)


def test_defaults_and_seed():
    p = SamplingParams(stop=["x"])
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_new_tokens) == (0.8, 40, 0.95, None, 256)
    assert p.stop == ("x",)
    assert resolve_seed(SamplingParams(seed=5)) == 5
    assert 0 <= resolve_seed(p) < 2**63
