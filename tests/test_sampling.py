"""Sampling parameters and the counter-based RNG (the sampler itself: tests/test_sampler.py)."""

import numpy as np
import pytest

from engine.errors import GDecodeError
from engine.sampling import SamplingParams, resolve_seed, rng_bits, rng_uniform, uniform_from_bits

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
        {"max_new_tokens": True},
        {"max_new_tokens": 2.0},
        {"stop": "abc"},
        {"stop": ("",)},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"min_p": float("nan")},
        {"repeat_penalty": 0.0},
        {"repeat_penalty": -1.0},
        {"repeat_penalty": float("inf")},
        {"repeat_penalty": float("nan")},
        {"repeat_last_n": -2},
        {"repeat_last_n": 1.5},
        {"presence_penalty": float("inf")},
        {"presence_penalty": float("nan")},
        {"frequency_penalty": float("-inf")},
        {"frequency_penalty": "1"},
        {"repeat_penalty": 1e39},  # past float32, where both samplers apply it
        {"repeat_penalty": 1e-300},  # float32 0: l / penalty is Inf
        {"presence_penalty": 1e300},
        {"frequency_penalty": -1e39},
        {"temperature": 1e300},
        {"logprobs": -1},
        {"logprobs": 21},
        {"logprobs": 2.5},
        {"logprobs": True},
    ],
)
def test_bad_params_raise(kw):
    name = next(iter(kw))
    with pytest.raises(GDecodeError, match=f"^{name} must be"):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw",
    [{"seed": 0}, {"seed": 2**64 - 1}, {"max_new_tokens": 1}, {"min_p": 0.0}, {"min_p": 1.0},
     {"repeat_penalty": 0.5}, {"repeat_last_n": -1}, {"repeat_last_n": 0},
     {"presence_penalty": -2.0}, {"frequency_penalty": 2.0}, {"logprobs": 0}, {"logprobs": 20},
     {"repeat_penalty": 1e38}, {"repeat_penalty": 1e-37}, {"presence_penalty": -3e38}, {"temperature": 3e38}],
)
def test_edge_params_are_accepted(kw):
    assert getattr(SamplingParams(**kw), next(iter(kw))) == next(iter(kw.values()))


def test_penalty_switches_and_greedy_threshold():
    assert not SamplingParams().penalizes_repeats and not SamplingParams().penalizes_counts
    assert not SamplingParams(repeat_penalty=1.3, repeat_last_n=0).penalizes_repeats
    assert SamplingParams(repeat_penalty=1.3).penalizes_repeats
    assert SamplingParams(presence_penalty=0.1).penalizes_counts
    assert SamplingParams(frequency_penalty=-0.1).penalizes_counts
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    assert SamplingParams(min_p=0.0).min_p_log == -np.inf
    assert SamplingParams(min_p=0.25).min_p_log == np.float32(np.log(0.25))


def test_defaults_and_seed():
    p = SamplingParams(stop=["x"])
    assert (p.temperature, p.top_k, p.top_p, p.seed, p.max_new_tokens) == (0.8, 40, 0.95, None, 256)
    assert (p.min_p, p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty, p.logprobs) == (
        0.0, 1.0, 64, 0.0, 0.0, None)
    assert p.stop == ("x",)
    assert resolve_seed(SamplingParams(seed=5)) == 5
    assert all(0 <= resolve_seed(p) < 2**63 for _ in range(200))


@pytest.mark.parametrize("seed,step", [(2**64, 0), (0, 2**64), (-1, 0), (0, -1)])
def test_rng_refuses_out_of_range_counters(seed, step):
    with pytest.raises(GDecodeError, match="seed and step must be in"):
        rng_bits(seed, step, [0])


def test_uniform_from_plain_ints():
    np.testing.assert_array_equal(uniform_from_bits([0, 5 << 40]), np.float32([2.0**-25, 5.5 * 2.0**-24]))
