"""The host sampler (engine/sampling.py) against a plain sort-based reference: the kept sets, the token
distribution, penalties, ties at the top-p boundary, temperature before the filters, NaN, logprobs."""

import math
import re

import numpy as np
import pytest

from engine.errors import NonFiniteLogits
from engine.sampling import (
    MASS_FLOOR,
    Sampler,
    SamplingParams,
    exp_f32,
    float_keys,
    gumbel_scores,
    log_f32,
    mass_q,
    penalize,
    records,
    sample,
    token_logprobs,
)

Z_1E4 = 3.719  # the standard normal's 1 - 1e-4 quantile


def chi2_limit(df: int) -> float:
    """The chi-square quantile at 1 - 1e-4 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + Z_1E4 * math.sqrt(2 / (9 * df))) ** 3


def reference_probs(logits, params: SamplingParams, window=None, counts=None) -> np.ndarray:
    """The sampling distribution by sorting, in float64: penalties, then z = l / T, then keep token i when
    fewer than top_k tokens are larger, the mass of the larger ones is below top_p, and p_i >= min_p * p_max."""
    lg = np.asarray(logits, np.float64).copy()
    if params.penalizes_repeats and window is not None:
        for t in set(window):
            lg[t] = lg[t] / params.repeat_penalty if lg[t] > 0 else lg[t] * params.repeat_penalty
    if params.penalizes_counts and counts is not None:
        c = np.asarray(counts, np.float64)
        lg -= params.presence_penalty * (c > 0) + params.frequency_penalty * c
    z = lg / params.temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-z, kind="stable")
    zs, ps = z[order], p[order]
    before = np.cumsum(ps) - ps  # mass ahead in the sorted order
    start = np.searchsorted(-zs, -zs, side="left")  # where each tie group begins: fewer are larger
    ok = (start < params.top_k) if params.top_k else np.ones(z.size, bool)
    if params.top_p < 1:
        ok &= before[start] < params.top_p
    ok &= ps >= params.min_p * ps[0]
    keep = np.zeros(z.size, bool)
    keep[order] = ok
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def draws(logits, params, n, seed=1234, **kw) -> np.ndarray:
    return np.bincount([sample(logits, params, s, seed, **kw) for s in range(n)], minlength=len(logits))


def assert_follows(counts, probs):
    kept = probs > 0
    assert counts[~kept].sum() == 0, f"filtered tokens drawn: {np.flatnonzero(counts * ~kept)}"
    n = counts.sum()
    e = n * probs[kept]
    chi2 = ((counts[kept] - e) ** 2 / e).sum()
    assert chi2 < chi2_limit(max(1, kept.sum() - 1)), (counts[kept], e)


def rand_logits(seed, v=24, scale=2.0):
    return (np.random.default_rng(seed).standard_normal(v) * scale).astype(np.float32)


CONFIGS = {
    "defaults": dict(temperature=0.8, top_k=10, top_p=0.9),
    "top-p": dict(temperature=1.0, top_k=0, top_p=0.7),
    "top-k": dict(temperature=1.3, top_k=6, top_p=1.0),
    "min-p": dict(temperature=0.9, top_k=0, top_p=1.0, min_p=0.08),
    "none": dict(temperature=0.7, top_k=0, top_p=1.0),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_distribution_matches_the_sorting_reference(name):
    params = SamplingParams(**CONFIGS[name])
    z = rand_logits(7)
    probs = reference_probs(z, params)
    assert 2 < (probs > 0).sum() < z.size or name == "none"
    assert_follows(draws(z, params, 2500), probs)


def test_distribution_with_penalties():
    params = SamplingParams(temperature=0.9, top_k=0, top_p=0.95, repeat_penalty=1.5, presence_penalty=0.4,
                            frequency_penalty=0.3)
    z = rand_logits(8)
    window = [int(np.argmax(z)), 3, 5, 5]
    counts = np.zeros(z.size, np.int32)
    counts[[int(np.argmax(z)), 9]] = [2, 1]
    probs = reference_probs(z, params, window, counts)
    assert probs[np.argmax(z)] < reference_probs(z, SamplingParams(temperature=0.9, top_k=0, top_p=0.95))[np.argmax(z)]
    assert_follows(draws(z, params, 3000, window=window, counts=counts), probs)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["defaults", "top-p", "top-k", "min-p"])
def test_kept_sets_are_exact(name, seed):
    # at a high temperature every kept token is likely enough to show up within 1200 draws
    params = SamplingParams(**{**CONFIGS[name], "temperature": 2.5})
    z = rand_logits(100 + seed, v=16, scale=3.0)
    probs = reference_probs(z, params)
    seen = draws(z, params, 1200, seed=seed) > 0
    np.testing.assert_array_equal(seen, probs > 0)


def test_top_p_boundary_when_the_kept_mass_equals_top_p():
    # masses 2^40, 2^39, 2^39 exactly: the first token alone holds top_p = 1/2 of the total, so the tie
    # group below it is left out; just above 1/2 the whole tie group is kept, not a prefix of it
    near = (np.float32(-np.log(2)).view(np.int32) + np.arange(-64, 65, dtype=np.int32)).view(np.float32)
    x = near[exp_f32(near) == np.float32(0.5)][0]
    z = np.array([-40.0, 0.0, x, x], np.float32)  # token 0 has no mass: exp(-40) * 2^40 < 1
    assert list(mass_q(z)) == [0, 2**40, 2**39, 2**39]
    half = SamplingParams(temperature=1.0, top_k=0, top_p=0.5)
    assert set(np.flatnonzero(draws(z, half, 300))) == {1}
    more = SamplingParams(temperature=1.0, top_k=0, top_p=float(np.nextafter(np.float32(0.5), np.float32(1))))
    assert set(np.flatnonzero(draws(z, more, 300))) == {1, 2, 3}


def test_top_k_keeps_the_whole_tie_group():
    z = np.array([1.0, 3.0, 2.0, 2.0, 2.0, 0.0], np.float32)
    params = SamplingParams(temperature=2.0, top_k=2, top_p=1.0)
    assert set(np.flatnonzero(draws(z, params, 600))) == {1, 2, 3, 4}


def test_filters_act_on_tempered_logits():
    # at T = 0.5, z = 4, 2, 0, -2: the two largest hold 98% (> top_p), so token 2 is out; on the raw
    # logits (p = .64, .24, .09, .03) top-p 0.9 would keep it. min-p 0.1 likewise keeps 1 only when tempered.
    lg = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    top_p = SamplingParams(temperature=0.5, top_k=0, top_p=0.9)
    assert set(np.flatnonzero(draws(lg, top_p, 1000))) == {0, 1}
    min_p = SamplingParams(temperature=0.5, top_k=0, top_p=1.0, min_p=0.1)
    assert set(np.flatnonzero(draws(lg, min_p, 1000))) == {0, 1}
    hot = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1)
    assert set(np.flatnonzero(draws(lg, hot, 1000))) == {0, 1, 2}


def test_top_k_one_and_tiny_top_p_are_greedy():
    for step in range(40):
        z = rand_logits(step, v=50, scale=3.0)
        best = int(np.argmax(z))
        assert sample(z, SamplingParams(temperature=1.5, top_k=1, top_p=1.0), step, 3) == best
        assert sample(z, SamplingParams(temperature=1.5, top_k=0, top_p=1e-6), step, 3) == best
        assert sample(z, SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=1.0), step, 3) == best


def test_greedy_picks_the_largest_lowest_index_first():
    z = np.array([1.0, 5.0, 2.0, 5.0], np.float32)
    assert sample(z, SamplingParams(temperature=0), 0, 0) == 1
    big = np.array([-3.0, 1e30, 2e30, -1.0, 2e30], np.float32)
    for t in (0.0, 1e-38, 1e-6):  # 1/T would overflow every z to inf: treated as greedy
        assert sample(big, SamplingParams(temperature=t), 0, 0) == 2


def test_same_seed_same_tokens_and_seed_matters():
    rows = [rand_logits(s, v=40) for s in range(64)]
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    a = [sample(r, p, i, 7) for i, r in enumerate(rows)]
    assert a == [sample(r, p, i, 7) for i, r in enumerate(rows)]
    assert a != [sample(r, p, i, 8) for i, r in enumerate(rows)]
    assert a != [sample(r, p, i + 1, 7) for i, r in enumerate(rows)]


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_are_reported(bad, temperature):
    z = rand_logits(3, v=30)
    z[17] = bad
    with pytest.raises(NonFiniteLogits, match="step 5 on the numpy backend hold 1 non-finite") as e:
        sample(z, SamplingParams(temperature=temperature), 5, 1)
    assert (e.value.step, e.value.backend) == (5, "numpy")


@pytest.mark.parametrize("kw, named", [
    ({}, None),
    ({"repeat_penalty": 1.5, "repeat_last_n": 0, "presence_penalty": 0.5}, "presence_penalty 0.5"),
    ({"repeat_penalty": 3e38, "frequency_penalty": 2.0}, "repeat_penalty 3e+38, frequency_penalty 2"),
])
def test_non_finite_logits_name_the_penalties_in_use(kw, named):
    z = rand_logits(3, v=30)
    z[17] = np.nan
    with pytest.raises(NonFiniteLogits) as e:
        sample(z, SamplingParams(temperature=0, **kw), 0, 1, window=[17], counts=np.ones(30, np.int32))
    msg = str(e.value)
    assert msg.endswith(f"or the penalties ({named}) took a logit past the float32 range" if named else
                        "the weights hold NaN/Inf or the activations overflowed"), msg


def test_a_penalty_that_overflows_is_reported_without_a_warning():
    import warnings

    z = rand_logits(4, v=30)
    z[5] = -3e38
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow RuntimeWarning would raise here
        with pytest.raises(NonFiniteLogits) as e:
            sample(z, SamplingParams(temperature=0, repeat_penalty=3e38), 0, 1, window=[5])
    assert "hold 1 non-finite value (NaN or Inf)" in str(e.value), str(e.value)


def test_penalties_hand_worked():
    lg = np.array([2.0, -1.0, 0.5, 3.0, -2.0], np.float32)
    p = SamplingParams(repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    counts = np.array([0, 0, 2, 1, 0], np.int32)
    # 0: 2 / 2; 1: -1 * 2; 2: 0.5 - (0.5 + 0.25 * 2); 3: 3 - (0.5 + 0.25); 4: untouched
    np.testing.assert_array_equal(penalize(lg, p, [0, 1, 1], counts), [1.0, -2.0, -0.5, 2.25, -2.0])
    np.testing.assert_array_equal(penalize(lg, SamplingParams(), [0, 1], counts), lg)
    off = SamplingParams(repeat_penalty=2.0, repeat_last_n=0)
    np.testing.assert_array_equal(penalize(lg, off, [0, 1], None), lg)
    assert sample(np.array([3.0, 2.9], np.float32), SamplingParams(temperature=0, repeat_penalty=1.1), 0, 0,
                  window=[0]) == 1


def test_sampler_window_and_counts():
    p = SamplingParams(temperature=0, repeat_penalty=2.0, repeat_last_n=2, frequency_penalty=1.0)
    s = Sampler(p, 1, 8, [5, 6, 7])
    assert s.window() == [6, 7]
    assert Sampler(SamplingParams(repeat_last_n=-1), 1, 8, [5, 6, 7]).window() == [5, 6, 7]
    assert Sampler(SamplingParams(repeat_last_n=0), 1, 8, [5, 6, 7]).window() == []
    lg = np.array([0, 0, 0, 0, 0, 3.0, 2.5, 2.0], np.float32)
    assert s(lg) == 5  # 6 and 7 are halved, 5 left the window
    assert s.counts.tolist() == [0, 0, 0, 0, 0, 1, 0, 0] and s.step == 1 and s.context[-1] == 5
    assert s.window() == [7, 5]
    assert s(lg) == 6  # 5: 3 / 2 - 1 (its count); 6 left the window: 2.5


def test_sampler_matches_sample_step_by_step():
    p = SamplingParams(temperature=0.9, top_k=8, top_p=0.9, repeat_penalty=1.3, repeat_last_n=4,
                       presence_penalty=0.2, frequency_penalty=0.1, logprobs=3)
    rng = np.random.default_rng(5)
    s = Sampler(p, 99, 20, [1, 2, 3])
    ctx, counts = [1, 2, 3], np.zeros(20, np.int32)
    for step in range(30):
        lg = (rng.standard_normal(20) * 2).astype(np.float32)
        want = sample(lg, p, step, 99, window=ctx[-4:], counts=counts)
        assert s(lg) == want
        assert s.logprobs == token_logprobs(lg, want, 3)
        ctx.append(want)
        counts[want] += 1


def test_exp_and_log_f32_are_accurate():
    x = np.linspace(float(MASS_FLOOR), 0, 100_001).astype(np.float32)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(exp_f32(x) - ref) / ref) < 2e-7
    assert exp_f32(np.float32(0)) == 1
    u = np.concatenate([np.random.default_rng(0).random(50_000), [2.0**-25, 1 - 2.0**-24, 17.3, 0.5, 2.0]])
    u = u.astype(np.float32)
    ref = np.log(u.astype(np.float64))
    assert np.max(np.abs(log_f32(u) - ref) / np.maximum(np.abs(ref), 1e-30)) < 2e-7
    assert log_f32(np.float32(1)) == 0


def test_mass_q_is_a_floor_of_2_pow_40():
    x = np.array([0.0, -1.0, -10.0, -27.9, -28.0, -28.5, -100.0], np.float32)
    q = mass_q(x)
    assert q.dtype == np.uint64
    assert q[0] == 2**40 and q[-1] == q[-2] == 0
    assert mass_q(MASS_FLOOR) == 0 and mass_q(np.nextafter(MASS_FLOOR, F(0))) == 0 and mass_q(F(-27.7)) == 1
    want = np.floor(exp_f32(x[:5]).astype(np.float64) * 2.0**40)
    np.testing.assert_array_equal(q[:5].astype(np.float64), want)


def test_float_keys_preserve_order():
    v = np.array([-np.inf, -3.5, -1e-30, -0.0, 0.0, 1e-30, 2.0, np.inf], np.float32)
    k = float_keys(v)
    assert (np.diff(k.astype(np.int64)) >= 0).all() and k[3] == k[4]
    assert (np.diff(k.astype(np.int64))[[0, 1, 2, 4, 5, 6]] > 0).all()


def brute_records(zk, rk):
    out, low = [], 0
    while True:
        live = [j for j in range(len(zk)) if zk[j] > low]
        if not live:
            return out
        j = max(live, key=lambda j: rk[j])
        out.append(j)
        low = zk[j]


@pytest.mark.parametrize("seed", range(5))
def test_records_are_the_successive_round_winners(seed):
    rng = np.random.default_rng(seed)
    zk = rng.integers(1, 40, 300).astype(np.uint32)  # many ties in z
    rk = rng.permutation(10**6)[:300].astype(np.uint64) + np.uint64(1)
    assert records(zk, rk).tolist() == brute_records(zk.tolist(), rk.tolist())


def test_gumbel_scores_are_z_minus_log_of_minus_log_u():
    z = np.float32([0.0, 1.5, -2.0])
    idx = np.array([3, 10, 99])
    from engine.sampling import rng_uniform

    u = rng_uniform(5, 2, idx).astype(np.float64)
    np.testing.assert_allclose(gumbel_scores(z, idx, 5, 2), z - np.log(-np.log(u)), rtol=0, atol=3e-6)


def test_token_logprobs():
    lg = np.array([1.0, 3.0, 3.0, -2.0, 0.5], np.float32)
    ref = lg.astype(np.float64) - np.log(np.exp(lg.astype(np.float64)).sum())
    t = token_logprobs(lg, 4, 3)
    assert t.token == 4 and abs(t.logprob - ref[4]) < 1e-6
    assert [i for i, _ in t.top] == [1, 2, 0]
    np.testing.assert_allclose([lp for _, lp in t.top], ref[[1, 2, 0]], atol=1e-6)
    assert token_logprobs(lg, 0, 0).top == ()


def _cuda_function(text: str, name: str) -> str:
    start = text.index(f"float {name}(float x)")
    return text[start : text.index("\n}\n", start)]


def test_the_kernel_uses_the_same_constants():
    # kernels/sample.cu repeats exp_f32, log_f32 and the cut-offs operation for operation
    from pathlib import Path

    from engine.sampling import CUT, EXP_POLY, LN2_HI, LN2_LO, LOG2E_F, LOG_POLY, MASS_BITS, SQRT2_F

    text = (Path(__file__).resolve().parent.parent / "kernels" / "sample.cu").read_text()
    hexes = r"(-?0x[0-9a-f.]+p[-+]?\d+)f"

    def floats(body):
        return [np.float32(float.fromhex(h)) for h in re.findall(hexes, body)]

    assert floats(_cuda_function(text, "exp_f32")) == [LOG2E_F, LN2_HI, LN2_LO, *EXP_POLY]
    assert floats(_cuda_function(text, "log_f32")) == [SQRT2_F, *LOG_POLY, LN2_LO, LN2_HI]
    assert f"#define CUT {float(CUT)}f" in text
    assert f"#define MASS_FLOOR ({float(MASS_FLOOR)}f)" in text
    assert f"#define MASS_SCALE 0x1p{MASS_BITS}f" in text


F = np.float32


def _from_cuda(name: str):
    """kernels/sample.cu's `name` (exp_f32 or log_f32), evaluated operation by operation on float32 scalars."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "kernels" / "sample.cu").read_text()
    body = _cuda_function(text, name).split("{", 1)[1]
    code = re.sub(r"(-?)0x([0-9a-f.]+p[-+]?\d+)f", r'F(\1float.fromhex("0x\2"))', body)
    code = re.sub(r"\b(\d+\.\d+)f\b", r"F(\1)", code)
    code = re.sub(r"\b(0x[0-9a-f]+)u\b", r"\1", code)
    code = re.sub(r"\(int\)(\w+)", r"int(\1)", code).replace("(int)(", "int(")
    code = re.sub(r"\(float\)(\w+)", r"F(\1)", code)
    for cu, py in (("__fmul_rn", "MUL"), ("__fadd_rn", "ADD"), ("__fsub_rn", "SUB"), ("rintf", "np.rint"),
                   ("__int_as_float", "I2F"), ("__float_as_uint", "F2U"), ("__uint_as_float", "U2F")):
        code = code.replace(cu + "(", py + "(")
    lines, depth = [], 1
    for ln in code.splitlines():
        ln = re.sub(r"^(const )?(float|int|unsigned) ", "", ln.strip()).rstrip(";")
        if ln == "}":
            depth -= 1
        elif ln.startswith("if (") and ln.endswith("{"):
            lines.append("    " * depth + "if " + ln[4:-3] + ":")
            depth += 1
        elif ln:
            lines.append("    " * depth + ln)
    env = {"np": np, "F": F, "MUL": lambda a, b: F(F(a) * F(b)), "ADD": lambda a, b: F(F(a) + F(b)),
           "SUB": lambda a, b: F(F(a) - F(b)), "I2F": lambda i: np.array([i], np.int32).view(F)[0],
           "F2U": lambda x: int(np.array([x], F).view(np.uint32)[0]),
           "U2F": lambda u: np.array([u], np.uint32).view(F)[0]}
    exec("def f(x):\n" + "\n".join(lines), env)
    return env["f"]


def test_exp_and_log_f32_are_the_kernels_bit_for_bit():
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.uniform(float(MASS_FLOOR), 0, 1500), [0.0, -0.6931472, -27.999, -1e-7]]).astype(F)
    cuda = _from_cuda("exp_f32")
    np.testing.assert_array_equal(exp_f32(x), [cuda(v) for v in x])
    u = np.concatenate([rng.random(1500), rng.uniform(0, 18, 500), [2.0**-25, 1 - 2.0**-24, float(np.sqrt(2))]])
    u = u.astype(F)
    cuda = _from_cuda("log_f32")
    np.testing.assert_array_equal(log_f32(u), [cuda(v) for v in u])


def test_numerics_take_plain_lists_and_stay_float32():
    xs = [-0.1, -3.3, -20.7, 0.0]
    for fn, arg in ((exp_f32, xs), (log_f32, [0.1, 2.7, 17.0]), (float_keys, xs), (mass_q, xs)):
        got = fn(arg)
        np.testing.assert_array_equal(got, fn(np.array(arg, F)))
        assert got.dtype == {float_keys: np.uint32, mass_q: np.uint64}.get(fn, F), fn.__name__
    g = gumbel_scores(np.array(xs, F), np.arange(4), 3, 9)
    assert g.dtype == F
    lp = token_logprobs([0.1, 0.7, -1.3], 1, 2)
    assert lp == token_logprobs(np.array([0.1, 0.7, -1.3], F), 1, 2)


def test_mass_q_never_evaluates_below_the_floor():
    with np.errstate(all="raise"):
        np.testing.assert_array_equal(mass_q(F([-np.inf, -1e30, -100.0, -28.5])), [0, 0, 0, 0])


def test_float_keys_are_the_kernels():
    # key_of: the bits with the sign bit set for x >= 0, all bits flipped for x < 0
    assert float_keys(F([0.0, 1.0, -1.0, -0.0])).tolist() == [0x80000000, 0xBF800000, 0x407FFFFF, 0x80000000]


def test_score_keys_break_ties_by_the_lower_index():
    from engine.sampling import score_keys

    for s in (1.0, float(np.nextafter(F(1.0), F(2.0))), -2.5):  # keys of both parities
        k = score_keys(F([s, s, s]), np.array([0, 5, 2**31]))
        assert k[0] > k[1] > k[2]
        assert score_keys(F([np.nextafter(F(s), F(9))]), np.array([7]))[0] > k[0]


def test_records_when_scores_tie_and_only_the_index_differs():
    rng = np.random.default_rng(4)
    zk = rng.integers(1, 6, 200).astype(np.uint32)
    rk = (np.uint64(0xABCDEF12) << np.uint64(32)) | rng.permutation(2**20)[:200].astype(np.uint64)
    assert records(zk, rk).tolist() == brute_records(zk.tolist(), rk.tolist())


def test_penalties_in_float32_step_by_step():
    rng = np.random.default_rng(2)
    lg = rng.uniform(-1, 1, 500).astype(F)
    counts = rng.integers(0, 5, 500).astype(np.int32)
    p = SamplingParams(repeat_penalty=1.37, presence_penalty=0.31, frequency_penalty=0.113)
    win = rng.integers(0, 500, 80).tolist()
    want = lg.copy()
    for i in set(win):
        want[i] = want[i] / F(1.37) if want[i] > 0 else want[i] * F(1.37)
    for i in np.flatnonzero(counts):
        want[i] = want[i] - (F(0.31) + F(0.113) * F(counts[i]))
    got = penalize(list(map(float, lg)), p, win, counts)
    assert got.dtype == F
    np.testing.assert_array_equal(got, want)
    on = SamplingParams(presence_penalty=0.5)
    np.testing.assert_array_equal(penalize(lg, on, None, None), lg)


def test_distribution_does_not_depend_on_a_shift_of_the_logits():
    # masses are taken against the largest z: +40 neither overflows them nor moves the floor
    params = SamplingParams(temperature=0.9, top_k=0, top_p=0.7)
    z = rand_logits(7)
    assert_follows(draws(z + F(40), params, 2500), reference_probs(z, params))
    np.testing.assert_array_equal(draws(z + F(40), params, 300), draws(z, params, 300))


def test_logprobs_top_ties_lowest_index_first():
    lg = np.random.default_rng(0).integers(0, 3, 2000).astype(F)
    t = token_logprobs(lg, 0, 20)
    assert [i for i, _ in t.top] == sorted(range(2000), key=lambda i: (-lg[i], i))[:20]


def test_sampler_state_starts_empty():
    s = Sampler(SamplingParams(), 1, 10, [1, 2])
    assert s.logprobs is None and s.counts.dtype == np.int32 and not s.counts.any() and s.step == 0


def test_min_p_keeps_the_token_exactly_at_the_threshold():
    # p_i = min_p * p_max exactly (z_i - max z = log(min_p) in float32) is kept, as llama.cpp keeps it
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.25)
    z = np.array([0.0, params.min_p_log, np.nextafter(params.min_p_log, F(-2)), -50.0], F)
    assert set(np.flatnonzero(draws(z, params, 400))) == {0, 1}


@pytest.mark.parametrize("n,length", [(16, 13), (16, 16), (16, 20), (4, 3), (0, 5), (-1, 7)])
def test_repeat_window_is_the_last_n_tokens_of_a_short_context(n, length):
    params = SamplingParams(repeat_penalty=1.3, repeat_last_n=n)
    context = list(range(100, 100 + length))
    s = Sampler(params, 1, 1000, context)
    want = context if n < 0 else context[len(context) - min(n, len(context)):] if n else []
    assert s.window() == want
